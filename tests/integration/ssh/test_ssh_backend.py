"""The ssh backend's own guarantees against a real sshd in a network
namespace (tests/support/testbeds/sshd_host.py): host keys are verified (an unknown
key is refused unless trusting it on first use is opted in, a changed key is
always refused, and each message names the command that fixes it), settings
are parsed as documented, and a run cancelled before its command started
never starts it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from dodo_helpers import doit, doit_ok, run_count, show
from local_runs import describe, marked_pids, on_a_terminal, wait_for
from ssh_helpers import (
    every_session_held,
    held_sessions,
    make_ssh_project,
    needs_root,
    needs_sshd,
    one_step,
    only_handle,
    remote_run_dir,
    ssh_settings,
    user_pids,
    write_ssh_pyproject,
)
from testbeds.sshd_host import SshHost

from substrax_tasks.backends.ssh.settings import SshSettings
from substrax_tasks.step.spec import make_spec
from substrax_tasks.store.project import Project
from substrax_tasks.transports.openssh import SshTarget

STEP = one_step(shell="mkdir -p out && echo made-remotely > out/x.txt", outputs=["out/"], retries=2)


def key_project(tmp_path: Path, host: SshHost, known_hosts: Path, trust_new: bool = False) -> Path:
    return make_ssh_project(
        tmp_path, host, STEP, known_hosts=str(known_hosts), trust_new_host_key=trust_new,
        remote_root=str(host.scratch / f"keys-{tmp_path.name}"),
    )  # fmt: skip


def quoted_command(text: str, program: str) -> str:
    """The `program ...` command a message tells the user to run."""
    match = re.search(rf"`({program} [^`]+)`", text)
    assert match, f"no `{program} ...` command in:\n{text}"
    return match.group(1)


def run_advice(command: str) -> None:
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, f"{command}: {done.stderr}"


def assert_refused(done: subprocess.CompletedProcess[str], *needles: str) -> str:
    """doit failed on the host key: the message, no traceback, no retry."""
    text = done.stdout + done.stderr
    assert done.returncode == 1, show(done)
    for needle in needles:
        assert needle in text, show(done)
    assert "Traceback" not in text, show(done)
    assert "retry" not in text, "a host key error must not be retried:\n" + show(done)
    return text


def host_key_lines(known_hosts: Path, host: SshHost) -> list[str]:
    key = host.host_pubkey_line.split()[1]
    return [
        line for line in known_hosts.read_text().splitlines()
        if line.startswith(host.known_hosts_name + " ") and key in line
    ]  # fmt: skip


@needs_sshd
@needs_root
def test_unknown_host_key_is_refused_unless_trust_on_first_use_is_opted_in(
    tmp_path: Path, host: SshHost
) -> None:
    known = tmp_path / "ssh" / "known_hosts"  # not there yet
    root = key_project(tmp_path, host, known)
    text = assert_refused(doit(root), f"the host key of {host.known_hosts_name} is not in {known}",
                          "ssh-keyscan", "trust_new_host_key = true")  # fmt: skip
    assert not known.exists()
    assert not (root / "out").exists()

    remote_root = str(host.scratch / f"keys-{tmp_path.name}")
    settings = ssh_settings(host, known_hosts=str(known), trust_new_host_key=True, remote_root=remote_root)
    write_ssh_pyproject(root, settings)
    doit_ok(root)
    assert (root / "out" / "x.txt").read_text() == "made-remotely\n"
    # saved where paramiko and OpenSSH (rsync) both read it
    assert len(host_key_lines(known, host)) == 1, known.read_text()
    assert "ssh-keyscan" in text


@needs_sshd
@needs_root
@pytest.mark.parametrize("trust_new", [False, True], ids=["strict", "trust-new"])
def test_changed_host_key_is_refused_even_when_trusting_new_keys(
    tmp_path: Path, host: SshHost, trust_new: bool
) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "impostor")], check=True
    )
    impostor = " ".join((tmp_path / "impostor.pub").read_text().split()[:2])
    known = tmp_path / "known_hosts"
    known.write_text(f"{host.known_hosts_name} {impostor}\n")
    root = key_project(tmp_path, host, known, trust_new)
    text = assert_refused(doit(root), f"the host key of {host.known_hosts_name} CHANGED", "ssh-keygen -R")
    assert known.read_text() == f"{host.known_hosts_name} {impostor}\n"  # nothing saved over it
    assert not (root / "out").exists()
    run = only_handle(root)
    assert run["backend_state"].get("remote_run_dir") is None  # nothing was made on the host

    # the advice works: remove the old key ...
    run_advice(quoted_command(text, "ssh-keygen"))
    assert host.known_hosts_name not in known.read_text()
    if not trust_new:
        # ... then the host is unknown: add its key as the next message says
        unknown = assert_refused(doit(root), "is not in")
        run_advice(quoted_command(unknown, "ssh-keyscan"))
    doit_ok(root)
    assert (root / "out" / "x.txt").read_text() == "made-remotely\n"
    assert len(host_key_lines(known, host)) == 1
    assert run_count(root) == 1  # the run that never got in was picked up again


# ------------------------------------------------------------------ settings


# ----------------------------------------------------------------- cancel


@contextlib.contextmanager
def resetting_listener() -> Any:
    """A loopback port whose every connection is reset before a byte is
    sent, as a host that is going down or coming up does: the port."""
    import socket
    import struct

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.2)
    going = threading.Event()

    def accept() -> None:
        while not going.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()  # with a zero linger: a reset

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        going.set()
        thread.join(timeout=5)
        server.close()


@needs_sshd
@needs_root
def test_a_host_that_resets_the_connection_is_said_in_words_without_paramikos_traceback(
    tmp_path: Path, host: SshHost
) -> None:
    """paramiko's transport thread logs a handshake cut short at ERROR, with
    its traceback; with no logging configured, Python's last-resort handler
    printed that in the middle of doit's output (seen as a host rebooted
    under a run). The failure is said once, in words."""
    with resetting_listener() as port:
        root = make_ssh_project(tmp_path, host, STEP, host="127.0.0.1", port=port, connect_timeout=5)
        done = doit(root)
    text = done.stdout + done.stderr
    assert done.returncode == 2, show(done)  # the machinery failed: doit's TaskError (docs/steps.md)
    assert "Error reading SSH protocol banner" in text, show(done)
    assert "Traceback" not in text and "Exception (client)" not in text, show(done)


@needs_sshd
@needs_root
def test_cancel_before_the_command_started_keeps_it_from_starting(
    tmp_path: Path, host: SshHost, marker: str
) -> None:
    """A cancel that lands between sync and start (a `substrax-compute
    cancel` while doit is still syncing) wins: the worker, started after
    it, refuses to run the command."""
    root = make_ssh_project(tmp_path, host, "")
    project = Project.open(root)
    spec = make_spec(
        "step", ["/bin/sh", "-c", "echo ran > out/x.txt; sleep 60", marker], root, outputs=["out/"]
    )
    handle = project.new_run(spec)
    backend = project.backend_for(handle)
    for phase in (backend.launch, backend.setup, backend.sync):
        handle = phase(handle)
    assert backend.poll(handle).state == "pending"
    assert backend.cancel(handle) is True
    assert backend.poll(handle).state == "cancelled"
    handle = backend.start(project.store.read(handle.run_id))  # a client that did not notice
    assert backend.poll(handle).state == "cancelled"
    assert not marked_pids(marker)
    assert b"cancelled before it started" in backend.read_log(handle, 0)
    assert not list(remote_run_dir(handle.model_dump(mode="json")).rglob("x.txt"))
    assert backend.cancel(handle) is False  # finished: left alone
    backend.teardown(handle)
    assert not remote_run_dir(handle.model_dump(mode="json")).exists()


@needs_sshd
@needs_root
def test_cancel_after_the_worker_was_killed_stops_the_orphaned_tree(
    tmp_path: Path, host: SshHost, marker: str
) -> None:
    """Without a sandbox the task outlives a killed worker (OOM killer, a
    reboot of the worker alone): the run reads as lost, and cancel still
    stops what is left of it."""
    root = make_ssh_project(tmp_path, host, "", sandbox="none")
    project = Project.open(root)
    spec = make_spec("step", ["/bin/sh", "-c", "while :; do sleep 0.1; done", marker], root, outputs=["out/"])
    handle = project.submit(spec)
    backend = project.backend_for(handle)
    status_file = remote_run_dir(handle.model_dump(mode="json")) / "status.json"
    wait_for(lambda: backend.poll(handle).state == "running", "the run to start")
    record = json.loads(status_file.read_text())
    os.kill(record["worker_pid"], signal.SIGKILL)
    wait_for(lambda: backend.poll(handle).state == "lost", "the run to read as lost")
    assert marked_pids(marker), "the task should outlive its worker without a sandbox"
    assert backend.cancel(handle) is True
    assert not marked_pids(marker), describe(marked_pids(marker))
    assert backend.poll(handle).state == "cancelled"
    assert json.loads(status_file.read_text())["message"] == "cancelled after its worker was lost"
    assert backend.cancel(handle) is False
    backend.teardown(project.store.read(handle.run_id))
    assert not status_file.parent.exists()


# --------------------------------------------------------------- progress

PROGRESS_SCRIPT = """
import json, sys
from pathlib import Path
from substrax_tasks.transports.openssh import SshTarget
from substrax_tasks.transports.rsync import RsyncTransport
target = SshTarget(**json.loads(sys.argv[1]))
try:
    RsyncTransport(target).download(sys.argv[2], ["big.bin"], Path(sys.argv[3]))
finally:
    target.stop_master()
"""


@needs_sshd
@needs_root
def test_fetch_on_a_terminal_shows_a_progress_bar_not_the_summary_line(tmp_path: Path, host: SshHost) -> None:
    source = host.scratch / f"progress-{tmp_path.name}"
    source.mkdir()
    (source / "big.bin").write_bytes(b"\0" * (8 << 20))
    target = dataclasses.asdict(target_of(host))
    text = on_a_terminal(
        [sys.executable, "-c", PROGRESS_SCRIPT, json.dumps(target), str(source), str(tmp_path / "got")]
    )
    assert (tmp_path / "got" / "big.bin").stat().st_size == 8 << 20
    assert "fetch 1/1 files" in text and "━" in text and "8.4/8.4 MB" in text, text  # the bar: files, bytes
    assert "fetch: 1 files" not in text, text  # no summary line on a terminal


def target_of(host: SshHost) -> SshTarget:
    return SshTarget(
        host=host.address, port=host.port, user=host.user,
        identity_file=str(host.client_key), known_hosts=str(host.known_hosts),
    )  # fmt: skip


def test_a_copy_whose_master_dies_under_it_is_tried_once_more_on_a_new_master(
    tmp_path: Path, host: SshHost, capsys: pytest.CaptureFixture[str]
) -> None:
    from substrax_tasks.transports.rsync import RsyncTransport

    target = SshSettings.model_validate(ssh_settings(host)).target()
    started = subprocess.run([*target.ssh_argv(), target.host, "true"], capture_output=True, check=False)
    assert started.returncode == 0, started.stderr
    (master,) = [pid for pid in marked_pids(Path(target.control_path()).name)
                 if b"[mux]" in Path(f"/proc/{pid}/cmdline").read_bytes()]  # fmt: skip
    source = host.scratch / "dead-master"
    source.mkdir()
    (source / "a.txt").write_text("payload\n")
    # sshd runs ~/.ssh/rc before each session's command: it holds the copy's
    # session on the host until the hold file goes.
    rc = host.remote_home / ".ssh" / "rc"
    rc.parent.mkdir(exist_ok=True)
    hold = host.remote_home / "hold"
    rc.write_text(f"while [ -e {hold} ]; do sleep 0.05; done\n")
    hold.touch()
    done: list[Any] = []
    transport = RsyncTransport(target, show_progress=False)
    got = tmp_path / "got"
    copy = threading.Thread(target=lambda: done.append(transport.download(str(source), ["a.txt"], got)))
    copy.start()
    try:
        wait_for(lambda: held_sessions(host), "the copy's session to be held on the host")
        os.kill(master, signal.SIGKILL)  # the master dies mid-copy (its timeout, a network gone)
    finally:
        hold.unlink()
        copy.join(timeout=60)
        rc.unlink()
    assert done and (got / "a.txt").read_text() == "payload\n"
    assert "had died; again on a new one" in capsys.readouterr().err
    target.stop_master()


def cats(uid: int) -> list[int]:
    """The user's `cat` processes on the host."""
    found = []
    for pid in user_pids(uid):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_bytes() == b"cat\0":
                found.append(pid)
    return found


def test_followers_beyond_the_sessions_one_connection_may_hold_are_refused_and_the_connection_stays(
    host: SshHost,
) -> None:
    from substrax_tasks.backends.ssh.connection import MAX_STREAMS, NoSession, connection

    conn = connection(SshSettings.model_validate(ssh_settings(host)).target())
    with every_session_held(conn):
        wait_for(lambda: len(cats(host.uid)) >= MAX_STREAMS, "the long-lived commands to hold their sessions")
        with pytest.raises(NoSession):
            conn.stream(["true"], lambda chunk: None, lambda: None)
        assert conn.run(["echo", "still here"]).text() == "still here\n"  # short commands go on
    done = bytearray()
    assert conn.stream(["echo", "again"], done.extend, lambda: None).returncode == 0
    assert bytes(done) == b"again\n"


def test_a_command_given_no_input_reads_dev_null_there_and_one_given_input_reads_it_whole(
    host: SshHost,
) -> None:
    """No end of input is sent for a command with none: paramiko could put
    it on the wire after the channel's close when the command ended at
    once, and sshd then dropped the connection every thread shares ("ieof
    packet referred to nonexistent channel"). Its stdin is /dev/null there
    instead; a command given input still reads it to its end."""
    from substrax_tasks.backends.ssh.connection import SshConnection

    conn = SshConnection(SshSettings.model_validate(ssh_settings(host)).target())
    try:
        assert conn.run(["readlink", "/proc/self/fd/0"]).text() == "/dev/null\n"
        assert conn.run(["sh", "-c", "cat; echo end"]).text() == "end\n"  # not left waiting
        assert conn.run(["cat"], stdin=b"given\n").text() == "given\n"
    finally:
        conn.close()
