"""A damaged checkpoints folder in the store (issue 28, item 9, over the
records added since): a file where the store keeps a step's checkpoints
(`.substrax/checkpoints/<step>/<key>/live`, or a folder above it) made
every later launch of the step end in a traceback. It is moved aside,
kept and said, and the step runs, its checkpoints starting afresh.
Real doit, a real worker on this machine; the store damaged by hand."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from dodo_helpers import doit, make_project, show

# Fails while the file FAIL exists (outside the project: not part of the
# step's key, so the rerun has the same key and the same checkpoints folder),
# after writing a checkpoint. Unsandboxed, to see it.
BODY = """
def task_step():
    yield from remote_step(
        "step", outputs=["out.txt"], checkpoints="ckpt/",
        command=["sh", "-c", "mkdir -p ckpt && echo 1 > ckpt/state && "
                             "if [ -e {fail} ]; then exit 1; fi; echo ok > out.txt"],
    )
"""


@pytest.mark.parametrize("damaged", ["live", "key", "step", "checkpoints"])
def test_a_file_in_the_way_of_a_steps_checkpoints_is_moved_aside_and_the_step_runs(
    tmp_path: Path, damaged: str
) -> None:
    fail = tmp_path / "fail"
    fail.touch()
    root = make_project(tmp_path, BODY.format(fail=fail), default_tasks=["step"], sandbox="none")
    failed = doit(root)
    assert failed.returncode == 1, show(failed)
    (live,) = (root / ".substrax" / "checkpoints").glob("step/*/live")
    assert (live / "state").read_text() == "1\n"
    path = {"live": live, "key": live.parent, "step": live.parent.parent,
            "checkpoints": live.parent.parent.parent}[damaged]  # fmt: skip
    assert path.is_dir()
    shutil.rmtree(path)
    path.write_text("not a folder\n")

    again = doit(root)  # the command fails again: the checkpoints stay, the one moved aside too
    said = again.stdout + again.stderr
    assert again.returncode == 1 and "Traceback" not in said, show(again)
    assert "failed (exit code 1)" in said, show(again)
    (aside,) = path.parent.glob(f"{path.name}.damaged-*")
    assert aside.read_text() == "not a folder\n"  # kept as it was
    assert f"{path} in the store was not a folder (damaged): moved aside to {aside}" in said, show(again)
    assert (live / "state").read_text() == "1\n"  # the step ran, its checkpoints afresh where they belong

    fail.unlink()
    done = doit(root)
    assert done.returncode == 0, show(done)
    assert (root / "out.txt").read_text() == "ok\n"
