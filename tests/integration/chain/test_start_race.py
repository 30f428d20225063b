"""A client killed while its worker is still `starting` (issue 18, item 8):
the rerun at once reattaches to that worker and never starts a second one.

The window is the worker's sandbox probe, made slow by a `bwrap` wrapper
first on the host's PATH (it sleeps, then execs the real one). Real sshd in
a network namespace, real doit killed with -9, real bubblewrap.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

from dodo_helpers import doit, popen_doit, run_count, show, stop, wait_for
from ssh_helpers import (
    launched_status,
    make_ssh_project,
    needs_bwrap,
    needs_root,
    needs_sshd,
    only_handle,
)
from testbeds.sshd_host import SshHost

BODY = """
def task_step():
    yield from remote_step(
        "step", outputs=["out.txt"],
        command=["sh", "-c", "echo COMMAND-RAN; echo ok > out.txt", {marker!r}],
    )
"""


def slow_probe_python(host: SshHost) -> str:
    """A python for the host whose PATH starts with a `bwrap` that sleeps
    2 s before it execs the real one: the worker's probe (and so its
    `starting` state) lasts that long."""
    assert host.user_dir is not None
    folder = host.user_dir / "slow-bwrap"
    folder.mkdir(mode=0o755, exist_ok=True)
    real = shutil.which("bwrap")
    # Each call is noted (the test user writes the note, so it owns the folder).
    (folder / "bwrap").write_text(f'#!/bin/sh\necho "$*" >> {folder}/calls\nsleep 2\nexec {real} "$@"\n')
    python = folder / "python3"
    python.write_text(f'#!/bin/sh\nPATH={folder}:$PATH exec {host.python} "$@"\n')
    for script in (folder / "bwrap", python):
        script.chmod(0o755)
    (folder / "calls").write_text("")
    os.chown(folder / "calls", host.uid, -1)
    return str(python)


def calls(host: SshHost) -> str:
    assert host.user_dir is not None
    return (host.user_dir / "slow-bwrap" / "calls").read_text()


@needs_sshd
@needs_root
@needs_bwrap
def test_a_rerun_while_the_worker_is_starting_reattaches_and_the_command_runs_once(
    tmp_path: Path, host: SshHost, marker: str
) -> None:
    root = make_ssh_project(tmp_path, host, BODY.format(marker=marker), python=slow_probe_python(host))
    client = popen_doit(root)
    try:
        starting = lambda: (launched_status(root) or {}).get("state") == "starting"  # noqa: E731
        wait_for(starting, "the worker to be starting")
    finally:
        client.send_signal(signal.SIGKILL)
        stop(client)

    rerun = doit(root)  # at once: the worker is still in its probe
    assert rerun.returncode == 0, show(rerun)
    assert "reattaching to run" in rerun.stdout, show(rerun)
    assert (root / "out.txt").read_text() == "ok\n"
    assert run_count(root) == 1
    handle = only_handle(root)
    assert handle["backend_state"].get("torn_down"), handle
    sandboxed = [line for line in calls(host).splitlines() if marker in line]
    assert len(sandboxed) == 1, sandboxed  # one sandbox, one command: one worker started it
