"""A damaged handle or step record of a run still going (issue 18, item 8):
the rerun refuses with an error naming the file and the fix, and never
starts a second run beside the first. Of a run provably over (issue 28),
the file is moved aside, kept, and the step runs. Real doit (killed -9 mid-run, as a
crash leaves it), a real worker; the file is damaged by hand.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from dodo_helpers import (
    compute,
    doit,
    make_project,
    pid_alive,
    popen_doit,
    run_count,
    run_dirs,
    show,
    status_records,
    stop,
    wait_for,
)

BODY = """
def task_step():
    yield from remote_step(
        "step", outputs=["out.txt"],
        command=["sh", "-c", "sleep 60; echo ok > out.txt", {marker!r}],
    )
"""


@pytest.mark.parametrize("damaged", ["handle", "step record"])
def test_a_damaged_record_of_a_run_still_going_refuses_a_second_run(
    tmp_path: Path, marker: str, damaged: str
) -> None:
    root = make_project(tmp_path, BODY.format(marker=marker), default_tasks=["step"])
    client = popen_doit(root)
    try:
        running = lambda: any(r.get("state") == "running" for r in status_records(root))  # noqa: E731
        wait_for(running, "the run to be running")
    finally:
        client.send_signal(signal.SIGKILL)  # a client that crashed: the run goes on
        stop(client)
    (run_dir,) = run_dirs(root)
    worker = json.loads((run_dir / "status.json").read_text())["worker_pid"]
    path = run_dir / "handle.json" if damaged == "handle" else root / ".substrax" / "steps" / "step.json"
    assert path.is_file()
    path.write_text(path.read_text()[:20])

    rerun = doit(root)
    said = rerun.stdout + rerun.stderr
    assert rerun.returncode == 1, show(rerun)
    assert str(path) in said and "may still be going" in said and "Traceback" not in said, show(rerun)
    assert run_count(root) == 1  # no second run beside the first
    assert pid_alive(worker)  # the first goes on, left to the user as the message says


GATED = """
def task_step():
    yield from remote_step(
        "step", outputs=["out.txt"],
        command=["sh", "-c", "while [ -e gate ]; do sleep 0.05; done; echo ok > out.txt", {marker!r}],
    )
"""


@pytest.mark.parametrize("damaged", ["handle", "step record"])
def test_a_damaged_record_of_a_run_that_ended_is_moved_aside_and_the_step_runs(
    tmp_path: Path, marker: str, damaged: str
) -> None:
    # unsandboxed: the sandbox shows the command the project as it was when the run started
    root = make_project(tmp_path, GATED.format(marker=marker), ["step"], sandbox="none", files={"gate": ""})
    client = popen_doit(root)
    try:
        running = lambda: any(r.get("state") == "running" for r in status_records(root))  # noqa: E731
        wait_for(running, "the run to be running")
    finally:
        client.send_signal(signal.SIGKILL)  # a client that crashed: the run goes on, and ends
        stop(client)
    (root / "gate").unlink()
    wait_for(lambda: [r.get("state") for r in status_records(root)] == ["succeeded"], "the run to end")
    (run_dir,) = run_dirs(root)
    path = run_dir / "handle.json" if damaged == "handle" else root / ".substrax" / "steps" / "step.json"
    text = path.read_text()[:20]
    path.write_text(text)

    rerun = doit(root)  # before the fix: refused until the file was removed by hand
    said = rerun.stdout + rerun.stderr
    assert rerun.returncode == 0, show(rerun)
    (aside,) = path.parent.glob(path.name + ".damaged-*")
    assert "was damaged and " in said and f"moved aside to {aside}; going on" in said, show(rerun)
    assert aside.read_text() == text  # kept as it was
    assert (root / "out.txt").read_text() == "ok\n"
    listed = compute(root, "status", "--all")
    assert listed.returncode == 0, show(listed)  # a handle moved aside is not an unreadable record
