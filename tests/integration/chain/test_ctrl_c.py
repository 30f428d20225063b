"""Ctrl-C of a doit whose local runs are going: the whole process group
gets SIGINT (`kill -INT -PGID`, as a terminal sends it), serially and under
`-n 2 -P thread`. Each step says it was interrupted on one line, doit ends
with one closing line and exit 130, no traceback, no failure listed, each
run cancelled and nothing of it left running; the same when doit was
started as a script's background job, which a shell without job control
starts with SIGINT ignored."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from dodo_helpers import (
    DOIT,
    EXEC_WITH_DEFAULT_SIGNALS,
    clean_env,
    make_project,
    pids_with,
    status_records,
    wait_for,
)

GATED = """
def task_fit():
    for n in "ab":
        yield from remote_step(f"fit:{{n}}", outputs=[f"out{{n}}.txt"], command=[
            "/bin/sh", "-c", "while [ ! -e gate ]; do sleep 0.05; done", {marker!r}])
"""

# A script that starts doit in the background and waits for it: bash starts
# it with SIGINT and SIGQUIT ignored (no job control). The trap keeps the
# script itself alive through the Ctrl-C, to say how doit exited.
SCRIPT = 'trap "echo the script saw SIGINT" INT; "$@" & wait $!; wait $!; echo "doit exited $?"'


def start(root: Path, how: str, threads: list[str]) -> subprocess.Popen[str]:
    """doit in a process group of its own, with SIGINT at its default as a
    terminal gives it: directly, or as the background job of a script."""
    doit = [str(DOIT), *threads]
    argv = [sys.executable, "-c", EXEC_WITH_DEFAULT_SIGNALS]
    argv += ["/bin/bash", "-c", SCRIPT, "script", *doit] if how == "background" else doit
    out = (root.parent / "doit.out").open("w")
    with out:
        return subprocess.Popen(argv, cwd=root, env=clean_env(), stdout=out, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)  # fmt: skip


def running(root: Path) -> int:
    return sum(record.get("state") == "running" for record in status_records(root))


@pytest.mark.parametrize("threads", [[], ["-n", "2", "-P", "thread"]], ids=["serial", "threads"])
@pytest.mark.parametrize("how", ["direct", "background"])
def test_ctrl_c_to_the_group_says_one_line_exits_130_and_cancels_the_runs(
    tmp_path: Path, marker: str, how: str, threads: list[str]
) -> None:
    root = make_project(tmp_path, GATED.format(marker=marker), ["fit"])
    proc = start(root, how, threads)
    going = 2 if threads else 1
    try:
        wait_for(lambda: running(root) == going and len(pids_with(marker)) >= going, "the runs to be going",
                 timeout=90)  # fmt: skip
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    said = (root.parent / "doit.out").read_text()
    if how == "background":
        assert code == 0 and "the script saw SIGINT" in said, said
        assert said.rstrip().endswith("doit exited 130"), said
    else:
        assert code == 130, said
    assert "interrupted: ran 0 of 2 tasks, 2 not done" in said.splitlines(), said
    assert "Traceback" not in said and "TaskError" not in said and "KeyboardInterrupt" not in said, said
    assert len([line for line in said.splitlines() if "interrupted on local in" in line]) == going, said
    assert [r["state"] for r in status_records(root)] == ["cancelled"] * going, said
    assert pids_with(marker) == [], "the runs' commands were left running"
