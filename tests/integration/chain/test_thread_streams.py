"""doit's stdout and stderr swapping under `doit -n N -P thread`, many steps.

doit puts a `Writer` of its own in `sys.stdout` and `sys.stderr` around each
Python action it captures, and puts back the stream it found there after;
under `-P thread` the actions of several tasks interleave their swaps, a
`Writer` of an action already ended is put back, and the next action wraps
it: the chain grew by one every few remote steps until a step's first line
(`isatty()` down ~1,000 Writers) raised RecursionError, 6,193 steps into a
sweep of 10,000 (issue 40). The steps' own tasks must swap nothing, and what
doit leaves in `sys.stdout` must not break the run's exit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dodo_helpers import doit, make_project, show
from ssh_helpers import make_ssh_project
from testbeds.sshd_host import SshHost

# Hundreds of steps: minutes on a loaded machine.
pytestmark = pytest.mark.timeout(1500)

# The depth of doit's Writers in sys.stdout and sys.stderr as the last task
# finds them, once every step has run; that task swaps nothing itself
# (`io` not captured, verbosity 0: doit hands its action no stream).
DEPTH = """
from doit.action import Writer

STEPS = ["s%03d" % i for i in range({steps})]


def task_steps():
    for name in STEPS:
        yield from remote_step(name, command=["/bin/sh", "-c", "echo " + name + "; echo x > out/" + name],
                               outputs=["out/" + name])


def writers(stream):
    depth = 0
    while isinstance(stream, Writer):
        depth, stream = depth + 1, stream.orig_stream
    return depth


def record_depth():
    import sys
    Path("depth.txt").write_text("%d %d" % (writers(sys.stdout), writers(sys.stderr)))


def task_depth():
    return {{"actions": [record_depth], "task_dep": STEPS, "io": {{"capture": False}}, "verbosity": 0}}
"""

STEP_COUNT = 120  # the code before the fix left a chain ~9 Writers deep here (one every 6-15 steps)
SSH_STEP_COUNT = 60  # each ssh step costs ~4 s of a loaded machine; 200 took 13 min at load 27


def test_many_steps_under_threads_leave_no_chain_of_doit_writers(tmp_path: Path) -> None:
    root = make_project(tmp_path, DEPTH.format(steps=STEP_COUNT), default_tasks=["depth"])
    assert_no_chain(root, STEP_COUNT)


def test_many_ssh_steps_under_threads_leave_no_chain_of_doit_writers(tmp_path: Path, host: SshHost) -> None:
    root = make_ssh_project(tmp_path, host, DEPTH.format(steps=SSH_STEP_COUNT), ["depth"])
    assert_no_chain(root, SSH_STEP_COUNT)


def assert_no_chain(root: Path, steps: int) -> None:
    done = doit(root, "-n", "4", "-P", "thread", timeout=1200)
    assert done.returncode == 0, show(done)
    assert (root / "depth.txt").read_text() == "0 0", show(done)
    # every step's lines reached the console, marked with its name, and the closing line too
    for i in range(steps):
        assert f"s{i:03d} | s{i:03d}" in done.stdout, show(done)
    assert f"ran {steps + 1} of {steps + 1} tasks" in done.stdout, show(done)


# A user's task leaves sys.stdout and sys.stderr as ~1,000 interleaved
# swaps of doit's leave them: a chain of its Writers, each wrapping the
# last (its action is not captured and is handed no stream, so doit puts
# nothing back after it). Python flushes both at exit, down the chain.
CHAINED = """
def task_step():
    yield from remote_step("step", command=["/bin/sh", "-c", "echo x > out/res.txt"], outputs=["out/res.txt"])


def leave_a_chain():
    import sys
    from doit.action import Writer
    for _ in range(5000):
        out, err = Writer(), Writer()
        out.add_writer(sys.stdout, is_original=True)
        err.add_writer(sys.stderr, is_original=True)
        sys.stdout, sys.stderr = out, err


def task_chain():
    return {"actions": [leave_a_chain], "task_dep": ["step"], "io": {"capture": False}, "verbosity": 0}
"""


def test_a_chain_of_doit_writers_left_in_sys_stdout_does_not_fail_the_exit(tmp_path: Path) -> None:
    root = make_project(tmp_path, CHAINED, default_tasks=["chain"])
    done = doit(root)
    assert done.returncode == 0, show(done)
    assert "ran 2 of 2 tasks" in done.stdout, show(done)
    assert "Exception ignored" not in done.stderr, show(done)
