"""What the ssh preemption tests share (test_ssh_preemptions.py, and the
cost of a preempted run in test_ssh_preempted_cost.py): a counting step's
project on the namespace host's scratch disk, which a restart empties, and
how to read its snapshots and attempts, and the sshd sessions a host
silent for a while must lose.

Not collected by pytest (the name does not start with test_).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from checkpoint_parts import COUNT_PY, kept_state
from dodo_helpers import popen_doit, popen_output, stop, wait_for
from progress import wait_exit
from ssh_helpers import make_ssh_project, only_handle
from testbeds.sshd_host import SshHost, host_processes, reboot

PAUSE = 1.0  # one count a second
EVERY = 0.5  # checkpoint_seconds: a snapshot at most one count behind


def counting_project(tmp_path: Path, host: SshHost, body: str, **settings: Any) -> Path:
    """`body` (count_step lines) as task_all; `settings`: more of the ssh backend's (hourly_cost=...)."""
    # The remote root on the scratch disk, which a restart empties (a tmpfs, a spot VM's disk)
    remote_root = str(host.scratch / f"remote-{tmp_path.name}")
    return make_ssh_project(tmp_path, host, "def task_all():\n" + body, ["all"],
                            files={"count.py": COUNT_PY, "data.txt": "one\n"},
                            checkpoint_seconds=EVERY, remote_root=remote_root, **settings)  # fmt: skip


def counted(root: Path, step: str, at_least: int) -> None:
    wait_for(lambda: (kept_state(root, step) or {}).get("i", 0) >= at_least,
             f"a snapshot of {at_least} counts brought home", timeout=120)  # fmt: skip


def doit_through_a_restart(root: Path, host: SshHost, step: str, after_counts: int) -> tuple[int, str]:
    """`doit STEP` with the host restarted once a snapshot of `after_counts`
    counts is home: doit's exit code and what it said."""
    proc = popen_doit(root, step)
    try:
        counted(root, step, after_counts)
        reboot(host)
        code = wait_exit(proc, "the doit to end", 300)
    finally:
        stop(proc)
    return code, popen_output(root)


def attempts_of(root: Path, step: str) -> list[dict[str, Any]]:
    attempts: list[dict[str, Any]] = only_handle(root, step)["state"]["attempts"]
    return attempts


def sshd_sessions(host: SshHost) -> list[int]:
    """The sshd processes left of the host (its connections: one forked as
    the listener died is no longer its child)."""
    found = []
    for pid in host_processes(host):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if name.startswith("sshd"):
            found.append(pid)
    return found
