"""A step whose worker dies by SIGKILL (as by the OOM killer) while its
command runs with descendants that escape its process group: what is left
must be found and stopped before anything else runs for the step.

The command (sandbox = "none") checks, as it starts, whether any process an
earlier copy recorded is alive (at that moment: `overlap.txt`), records its
own pid, starts a grandchild that double-forks and calls setsid and a child
that scrubs its environment (each records its pid), then, if it is the
first copy, waits for ever; a later copy writes its output and ends.
`frozen` makes one of its processes one that no SIGKILL ends for a while.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from dodo_helpers import pid_alive, run_dirs, wait_for

SLEEPER = "import os, sys, time; open(sys.argv[1], 'a').write('%d\\n' % os.getpid()); time.sleep(300)"

COMMAND = f"""
import os, subprocess, sys, time
flags, marker, out = sys.argv[1], sys.argv[2], sys.argv[3]
pids = os.path.join(flags, "pids.txt")

def alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

try:
    with open(pids) as f:
        earlier = [int(line) for line in f if line.strip()]
except FileNotFoundError:
    earlier = []
with open(os.path.join(flags, "overlap.txt"), "a") as f:
    f.write("".join("%d\\n" % pid for pid in earlier if alive(pid)))
with open(pids, "a") as f:
    f.write("%d\\n" % os.getpid())
sleeper = [sys.executable, "-c", {SLEEPER!r}, pids, marker]
if os.fork() == 0:  # a grandchild that double-forks and leaves the session
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, sleeper)
    os._exit(0)
os.wait()
subprocess.Popen(["env", "-i", *sleeper])  # a child with no environment at all
if earlier:
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        f.write("done\\n")
else:
    while True:
        time.sleep(1)
"""


def write_command(flags: Path) -> Path:
    flags.mkdir(exist_ok=True)
    script = flags / "command.py"
    script.write_text(COMMAND)
    return script


def step_argv(flags: Path, marker: str, out: str, python: str = sys.executable) -> list[str]:
    """The step's command; `python` as the machine that runs it has one."""
    return [python, str(flags / "command.py"), str(flags), marker, out]


def recorded_pids(flags: Path) -> list[int]:
    try:
        return [int(line) for line in (flags / "pids.txt").read_text().split()]
    except FileNotFoundError:
        return []


def overlap(flags: Path) -> list[int]:
    try:
        return [int(line) for line in (flags / "overlap.txt").read_text().split()]
    except FileNotFoundError:
        return []


def wait_tree_up(flags: Path) -> list[int]:
    """The first copy's three pids (itself, its setsid grandchild, its scrubbed child)."""
    wait_for(lambda: len(recorded_pids(flags)) >= 3, "the command and its two descendants", timeout=60)
    return recorded_pids(flags)[:3]


def status_of(root: Path, step_run_dir: Path | None = None) -> dict[str, object]:
    """The worker's status record of the project's only (or given) run."""
    found = [step_run_dir] if step_run_dir is not None else run_dirs(root)
    assert len(found) == 1, found
    record: dict[str, object] = json.loads((found[0] / "status.json").read_text())
    return record


def kill_worker(record: dict[str, object]) -> None:
    """SIGKILL the run's worker, found from its status file, and wait for it to go."""
    pid = record["worker_pid"]
    assert isinstance(pid, int) and pid_alive(pid), record
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(pid), "the worker to die")


def kill_recorded(flags: Path, marker: str) -> None:
    """Stop, by pid, whatever of the test's trees is left (pids the tree
    recorded whose argv still carries the test's marker)."""
    for pid in recorded_pids(flags):
        with contextlib.suppress(OSError):
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)


FREEZER = Path("/sys/fs/cgroup/freezer")


@contextlib.contextmanager
def frozen(pid: int, name: str) -> Iterator[None]:
    """`pid` frozen in a cgroup v1 freezer the test makes: a SIGKILL does
    not end it while it is frozen, as one hung on a dead NFS mount. Thawed
    (a SIGKILL sent meanwhile ends it then) and the cgroup removed after."""
    if not (FREEZER / "cgroup.procs").is_file():
        pytest.skip(f"NO CGROUP V1 FREEZER AT {FREEZER}: a process no SIGKILL ends cannot be made here")
    group = FREEZER / name
    group.mkdir()
    try:
        (group / "cgroup.procs").write_text(str(pid))
        (group / "freezer.state").write_text("FROZEN")
        wait_for(lambda: (group / "freezer.state").read_text().strip() == "FROZEN", f"{pid} frozen")
        yield
    finally:
        (group / "freezer.state").write_text("THAWED")
        for left in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):  # gone meanwhile
                (FREEZER / "cgroup.procs").write_text(left)
        group.rmdir()
