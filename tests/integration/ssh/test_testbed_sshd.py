"""The throwaway SSH host of tests/support/testbeds/sshd_host.py, with real sshd, ssh,
rsync and ip: it starts, lets us in, moves files both ways, has its own
address, survives a crash-and-restart of sshd, and leaves nothing behind."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pwd
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from testbeds.sshd_host import (
    SshHost,
    is_alive,
    kill_sshd,
    load_host,
    missing_tools,
    restart_sshd,
    rsync_e,
    rsync_remote,
    ssh_argv,
    ssh_config_text,
    start_host,
    start_ticks,
    stop_host,
)

SCRIPT = Path(__file__).resolve().parents[2] / "support" / "testbeds" / "sshd_host.py"
ROOT = os.geteuid() == 0
MISSING = missing_tools(netns=ROOT) + ([] if shutil.which("rsync") else ["rsync"])
needs_tools = pytest.mark.skipif(
    bool(MISSING),
    reason=f"SSH TEST BED NOT TESTED: missing {', '.join(MISSING)} "
    "(apt-get install openssh-server openssh-client rsync iproute2)",
)
needs_root = pytest.mark.skipif(
    not ROOT, reason="SSH TEST BED IN A NETWORK NAMESPACE / FOR A TEST USER NOT TESTED: needs root"
)
TEST_USER = "sxtest"
# A remote task that double-forks and calls setsid: its parent becomes pid 1.
ESCAPEE = "(setsid sleep 600 </dev/null >/dev/null 2>&1 & echo $!)"


def ssh(host: SshHost, command: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ssh_argv(host, command), capture_output=True, text=True, timeout=timeout, check=False
    )


def ssh_ok(host: SshHost, command: str) -> str:
    done = ssh(host, command)
    assert done.returncode == 0, f"ssh {command!r}: {done.returncode} {done.stderr}"
    return done.stdout


REACH = """
import socket, sys
for target in sys.argv[1:]:
    address, port = target.rsplit(":", 1)
    try:
        socket.create_connection((address, int(port)), 3).close()
        print("yes")
    except OSError as exc:
        print(type(exc).__name__)
"""


def remote_reaches(host: SshHost, *targets: tuple[str, int]) -> list[str]:
    """For each address:port, "yes" if a process on the host can open a TCP
    connection to it, else the error's name. One ssh command for all."""
    argv = [host.python, "-c", REACH, *(f"{address}:{port}" for address, port in targets)]
    return ssh_ok(host, shlex.join(argv)).split()


@contextlib.contextmanager
def listener(address: str) -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        sock.listen(4)
        yield sock.getsockname()[1]


def ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=True).stdout


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def assert_all_gone(host: SshHost, escapees: list[tuple[int, int]]) -> None:
    assert not is_alive(host.pid, host.pid_start_ticks), f"sshd {host.pid} still runs"
    for pid, ticks in escapees:
        assert not is_alive(pid, ticks), f"remote escapee {pid} still runs"
    if host.netns is not None:
        assert not Path(f"/run/netns/{host.netns}").exists()
        assert host.netns not in ip("netns", "list")
    if host.veth is not None:
        assert not Path(f"/sys/class/net/{host.veth}").exists()
    if host.user_dir is not None:
        assert not host.user_dir.exists()
    assert not host.root_dir.exists(), sorted(os.listdir(host.root_dir))


CASES = [
    pytest.param(False, None, id="loopback"),  # root logs in as root; others as themselves
    pytest.param(True, None, id="netns-root", marks=needs_root),
    pytest.param(True, TEST_USER, id="netns-user", marks=needs_root),
]


@needs_tools
@pytest.mark.parametrize(("netns", "user"), CASES)
def test_host_lets_in_moves_files_and_leaves_nothing(tmp_path: Path, netns: bool, user: str | None) -> None:
    user_existed = user is not None and user_exists(user)
    began = time.monotonic()
    host = start_host(tmp_path / "sshd", netns=netns, user=user)
    started = time.monotonic() - began
    escapees: list[tuple[int, int]] = []
    try:
        assert load_host(host.root_dir) == host
        assert (host.netns is not None) == netns
        assert ssh_ok(host, "echo ok") == "ok\n"
        # who logs in, with which home and python; and a remote task that
        # escapes sshd's tree (double fork + setsid), which stop_host stops
        # too when it runs as root
        python = shlex.join([host.python, "-c", "import sys; print(sys.version_info[0])"])
        escape = ESCAPEE if host.marker is not None else "echo none"
        login, home, version, escapee = ssh_ok(host, f'id -un; echo "$HOME"; {python}; {escape}').split()
        assert [login, home, version] == [
            user or pwd.getpwuid(os.geteuid()).pw_name,
            str(host.remote_home),
            "3",
        ]
        assert host.created_user == (user is not None and not user_existed)
        if escapee != "none":
            ticks = start_ticks(int(escapee))
            assert ticks is not None, "the escapee runs in this machine's pid space"
            escapees.append((int(escapee), ticks))

        # rsync to the host's scratch folder and back, as the login user
        source = tmp_path / "source"
        (source / "sub dir").mkdir(parents=True)
        (source / "a.txt").write_text("alpha\n")
        (source / "sub dir" / "b.bin").write_bytes(os.urandom(70_000))
        remote = host.scratch / "copy"
        for src, dst in (
            (f"{source}/", rsync_remote(host, f"{remote}/")),
            (rsync_remote(host, f"{remote}/"), f"{tmp_path / 'back'}/"),
        ):
            done = subprocess.run(
                ["rsync", "-a", "-e", rsync_e(host), src, dst],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert done.returncode == 0, done.stderr
        assert tree(tmp_path / "back") == tree(source)
        assert (remote / "a.txt").stat().st_uid == host.uid  # same disk; written by the login user

        # the host key is pinned: another key for the same name is refused
        other = dataclasses.replace(host, known_hosts=tmp_path / "wrong_known_hosts")
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True
        )
        fake = " ".join((tmp_path / "other.pub").read_text().split()[:2])
        other.known_hosts.write_text(f"{host.known_hosts_name} {fake}\n")
        refused = ssh(other, "true")
        assert refused.returncode == 255 and "verification failed" in refused.stderr, refused.stderr

        if netns:
            # its own address, reached through the veth pair; this machine's
            # loopback is not the host's
            assert host.address not in ip("-o", "addr")
            assert host.peer_address is not None
            with listener(host.peer_address) as peer_port, listener("127.0.0.1") as loopback_port:
                reached = remote_reaches(host, (host.peer_address, peer_port), ("127.0.0.1", loopback_port))
            assert reached == ["yes", "ConnectionRefusedError"]
    finally:
        began = time.monotonic()
        stop_host(host)
        stopped = time.monotonic() - began
    print(f"\n[{host.name} netns={netns} user={host.user}] start {started:.3f} s, stop {stopped:.3f} s")
    assert_all_gone(host, escapees)
    if user is not None:
        assert user_exists(user) == user_existed
    stop_host(host)  # again: nothing to do, no error


@needs_tools
def test_kill_sshd_mid_session_then_restart(tmp_path: Path) -> None:
    host = start_host(tmp_path / "sshd")  # in a namespace as root
    try:
        first_pid, port = host.pid, host.port
        flag = host.scratch / "session.started"
        session = subprocess.Popen(
            ssh_argv(host, f"touch {shlex.quote(str(flag))} && sleep 60"),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 30
            while not flag.exists():
                assert session.poll() is None and time.monotonic() < deadline, "the session did not start"
                time.sleep(0.01)
            detached = int(ssh_ok(host, ESCAPEE)) if host.marker is not None else None
            detached_ticks = None if detached is None else start_ticks(detached)
            began = time.monotonic()
            kill_sshd(host)
            # the live connection drops at once, like a crash of the host's sshd
            assert session.wait(timeout=10) == 255
            killed = time.monotonic() - began
        finally:
            if session.poll() is None:
                session.kill()
                session.wait()
        assert not is_alive(first_pid, host.pid_start_ticks)
        assert ssh(host, "true").returncode == 255  # nobody listens
        if detached is not None:  # a crash of sshd leaves detached tasks running
            assert detached_ticks is not None and is_alive(detached, detached_ticks)
        began = time.monotonic()
        restart_sshd(host)
        restarted = time.monotonic() - began
        assert host.pid != first_pid and host.port == port
        assert load_host(host.root_dir) == host
        assert ssh_ok(host, "echo back") == "back\n"  # same host key, same known_hosts
        print(f"\n[{host.name}] kill_sshd {killed:.3f} s, restart_sshd {restarted:.3f} s")
    finally:
        stop_host(host)
    assert_all_gone(host, [] if detached is None or detached_ticks is None else [(detached, detached_ticks)])


def run_cli(*args: str, as_user: str | None = None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, str(SCRIPT), *args]
    if as_user is not None:  # the system python: what a user without /root's pyenv has
        argv = ["runuser", "-u", as_user, "--", "/usr/bin/python3", str(SCRIPT), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


@needs_tools
def test_cli_start_status_ssh_config_stop(tmp_path: Path) -> None:
    folder = tmp_path / "cli-host"
    started = run_cli("start", "--dir", str(folder))
    assert started.returncode == 0, started.stderr
    host = SshHost.from_json(json.loads(started.stdout))
    try:
        assert load_host(folder) == host
        status = run_cli("status", "--dir", str(folder))
        assert status.returncode == 0 and json.loads(status.stdout)["sshd_running"] is True
        config = tmp_path / "ssh_config"
        config.write_text(run_cli("ssh-config", "--dir", str(folder)).stdout)
        assert config.read_text() == ssh_config_text(host)
        assert run_cli("get", "--dir", str(folder), "port").stdout == f"{host.port}\n"
        done = subprocess.run(
            ["ssh", "-F", str(config), host.name, "echo", "via-config"],
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.stdout == "via-config\n", done.stderr
        again = run_cli("start", "--dir", str(folder))
        assert again.returncode == 1 and "stop that host first" in again.stderr
    finally:
        stopped = run_cli("stop", "--dir", str(folder))
    assert stopped.returncode == 0, stopped.stderr
    assert_all_gone(host, [])
    assert run_cli("status", "--dir", str(folder)).returncode == 1
    assert run_cli("stop", "--dir", str(folder)).returncode == 0


@needs_tools
@needs_root
@pytest.mark.skipif(
    shutil.which("runuser") is None or not Path("/usr/bin/python3").exists(),
    reason="NON-ROOT SSH TEST BED NOT TESTED: needs runuser and /usr/bin/python3",
)
def test_cli_as_a_user_without_root(tmp_path: Path) -> None:
    """What `make remote-run` does for a non-root user: its own sshd on
    127.0.0.1, logging in as itself, started and stopped by the CLI."""
    name = f"sxrun{secrets.token_hex(3)}"
    base = Path(f"/tmp/{name}")  # tmp_path's parents are mode 700
    base.mkdir(mode=0o755)
    subprocess.run(["useradd", "-M", "-d", str(base), "-s", "/bin/sh", name], check=True)
    try:
        entry = pwd.getpwnam(name)
        os.chown(base, entry.pw_uid, entry.pw_gid)
        folder = base / "sshd"
        started = run_cli("start", "--dir", str(folder), as_user=name)
        assert started.returncode == 0, started.stderr
        host = SshHost.from_json(json.loads(started.stdout))
        try:
            assert host.netns is None and host.marker is None and host.address == "127.0.0.1"
            assert host.user == name and host.uid == entry.pw_uid
            assert ssh_ok(host, "id -un") == f"{name}\n"
            with listener("127.0.0.1") as port:  # no namespace: this machine's loopback
                assert remote_reaches(host, ("127.0.0.1", port)) == ["yes"]
            other = run_cli("start", "--dir", str(base / "x"), "--user", "root", as_user=name)
            assert other.returncode == 1 and "only root" in other.stderr
            netns = run_cli("start", "--dir", str(base / "y"), "--netns", as_user=name)
            assert netns.returncode == 1 and "needs root" in netns.stderr
        finally:
            stopped = run_cli("stop", "--dir", str(folder), as_user=name)
        assert stopped.returncode == 0, stopped.stderr
        assert_all_gone(host, [])
    finally:
        subprocess.run(["userdel", name], check=False)
        shutil.rmtree(base, ignore_errors=True)
