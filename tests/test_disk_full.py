"""A command that fills the disk (issue 18, item 8): the run ends failed
with the reason, doit ends without a traceback (sqlite included), and the
next doit recovers with nothing deleted by hand.

The project (store and doit's DB with it) lives on a small tmpfs mounted
in a private mount namespace the test makes (as root); doit runs there
through nsenter. Real doit, real worker.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from dodo_helpers import COMPUTE, DOIT, clean_env, make_project

BODY = """
def task_step():
    yield from remote_step(
        "step", inputs=["flags/"], outputs=["big"],  # a run sees its inputs only: the flag's folder
        command=["sh", "-c",
                 "if [ -e flags/fill ]; then dd if=/dev/zero of=big bs=1M; exit 1; fi; echo ok > big"],
    )
"""
DISK_MB = 24


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """(the project on a tmpfs of DISK_MB, the pid whose namespace holds it)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("nsenter") is None:
        pytest.skip("DISK FULL NOT TESTED: needs root, unshare and nsenter")
    (tmp_path / "src").mkdir()
    source = make_project(tmp_path / "src", BODY, default_tasks=["step"], files={"flags/fill": ""})
    root = tmp_path / "proj"
    root.mkdir()
    script = (
        f"mount -t tmpfs -o size={DISK_MB}m none {root} && cp -a {source}/. {root}/ "
        "&& echo ready && exec sleep 3600"
    )
    holder = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
        yield root, holder.pid
    finally:
        holder.kill()  # the namespace, and its tmpfs, go with it
        holder.wait()
        assert holder.stdout is not None
        holder.stdout.close()


def inside(pid: int, root: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["nsenter", "-t", str(pid), "-m", f"--wd={root}", "--", *argv],
        env=clean_env(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_a_command_that_fills_the_disk_fails_with_the_reason_and_the_next_doit_recovers(
    small_disk: tuple[Path, int],
) -> None:
    root, pid = small_disk
    seen = Path(f"/proc/{pid}/root") / str(root).lstrip("/")
    full = inside(pid, root, str(DOIT))
    said = full.stdout + full.stderr
    assert full.returncode == 1, said
    assert "Traceback" not in said and "sqlite" not in said.lower(), said
    assert "failed (exit code 1): no space left on device where its outputs go" in said, said
    listed = inside(pid, root, str(COMPUTE), "status", "--all", "--json")
    assert listed.returncode == 0, listed.stderr
    (run,) = json.loads(listed.stdout)["runs"]
    assert run["state"] == "failed" and "no space left on device" in run["message"], run

    (seen / "flags" / "fill").unlink()
    again = inside(pid, root, str(DOIT))
    assert again.returncode == 0, again.stdout + again.stderr
    assert (seen / "big").read_text() == "ok\n"
