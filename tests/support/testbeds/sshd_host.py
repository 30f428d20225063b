"""A throwaway SSH host on this machine, for the SSH backend's tests and `make remote-run`.

`start_host(root_dir)` makes fresh ed25519 host and client keys, writes an
sshd_config and starts `/usr/sbin/sshd -D -e` as a child it tracks by pid:

* as root (the default there): in a network namespace of its own (`sx-<hex>`),
  joined to this machine by a veth pair with a free 169.254.x.y/30, so the
  host has an address of its own and the namespace no route out. sshd runs
  under `unshare -m` with a private tmpfs on /run (Debian's sshd needs
  /run/sshd; nothing is left on the machine's /run). `netns=False` gives the
  same on 127.0.0.1.
* as another user: sshd runs as that user on 127.0.0.1, and only that user
  can log in.

As root, `user="sxtest"` logs in as that user instead of root, creating it
when missing (`useradd -M`, shell /bin/sh, removed again by `stop_host`). Its
home and scratch folder live in a fresh `/tmp/sx-sshd-*` folder rather than
under root_dir, because root_dir usually sits under a mode-700 folder (pytest's
tmp_path) the user could not reach. Neither login reads a ~/.bashrc: the
test user has none, and root's (here it runs `pyenv init`, ~250 ms a
command) is hidden in sshd's mount namespace. Either user runs
`host.python` (/usr/bin/python3; root's pyenv builds live under mode-700
/root).

`stop_host(host)` stops everything by pid and leaves nothing behind: sshd
(SIGTERM, then SIGKILL), its sessions and their descendants, and, as root,
every process still in the namespace or still seeing the private /run (so a
double-forked `setsid` escapee goes too), then the veth pair, the namespace,
the user it created and the files it made. `kill_sshd` / `restart_sshd`
simulate an sshd crash (listener and live connections) and bring it back on
the same address, port and keys; `reboot` a whole restart of the host (its
network down, every process of it killed, its scratch folder emptied, then
sshd back with the same key at the same address).

Limits: the private /run also hides this machine's /run (its sockets) from
remote sessions. Two hosts sharing one created user is not supported: the
first `stop_host` deletes it. Without root only sshd's own process tree is
stopped; a task that double-forks out of it is the caller's to stop.

Command line (the Makefile's `make remote-run` uses it)::

    python tests/support/testbeds/sshd_host.py start --dir DIR [--no-netns] [--user NAME]
    python tests/support/testbeds/sshd_host.py status --dir DIR
    python tests/support/testbeds/sshd_host.py ssh-config --dir DIR
    python tests/support/testbeds/sshd_host.py get --dir DIR port
    python tests/support/testbeds/sshd_host.py stop --dir DIR

`start` prints the host record as JSON and writes it to DIR/host.json, which
the other commands read. Standard library only, Python >= 3.10.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import ipaddress
import json
import os
import pwd
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

SSHD = "/usr/sbin/sshd"
REMOTE_PYTHON = "/usr/bin/python3"
RECORD_NAME = "host.json"
START_TIMEOUT = 10.0  # seconds for sshd to listen and let us in
STOP_TIMEOUT = 10.0  # seconds for the processes to go
TERM_GRACE = 0.5  # seconds sshd gets after SIGTERM before SIGKILL
USER_DIR_BASE = Path("/tmp")  # world-traversable, unlike pytest's tmp_path
# Files start_host makes in root_dir, removed by stop_host.
MADE_FILES = (
    "host_ed25519",
    "host_ed25519.pub",
    "client_ed25519",
    "client_ed25519.pub",
    "authorized_keys",
    "known_hosts",
    "sshd_config",
    "sshd.pid",
    "sshd.log",
    RECORD_NAME,
)
# Run as root under `unshare -m`: a private /run holding /run/sshd and a
# marker file that tells which processes still see this mount namespace.
# Root's own ~/.bashrc is hidden there too (bash reads it for every command
# sshd runs): this machine's runs `pyenv init`, ~250 ms a command, a cost of
# the image the tests should not pay nor depend on. "$1" is the marker's
# name, "$2" sshd, "$3" its config.
ROOT_SSHD_SCRIPT = (
    'mount -t tmpfs -o mode=0755 sx-run /run && mkdir -m 0755 /run/sshd && : > "/run/$1" '
    '&& { [ ! -f "$HOME/.bashrc" ] || mount --bind /dev/null "$HOME/.bashrc"; } '
    '&& exec "$2" -D -e -f "$3"'
)

# sshd processes this process started, reaped when they are stopped.
_SPAWNED: dict[int, subprocess.Popen[bytes]] = {}


class TestbedError(RuntimeError):
    """The test bed could not be set up or used."""

    __test__ = False  # not a pytest test class


@dataclasses.dataclass
class SshHost:
    """A running throwaway SSH host: where it is, how to log in, what to stop."""

    name: str  # sx-<hex>; also the network namespace's name when there is one
    address: str  # where sshd listens (the namespace's veth address, or 127.0.0.1)
    port: int
    user: str  # the login user
    client_key: Path  # private key that logs in as `user`
    known_hosts: Path  # holds the host key for "[address]:port"
    host_pubkey_line: str  # "ssh-ed25519 AAAA..." as in known_hosts
    root_dir: Path  # keys, config, log, pid file, host.json
    remote_home: Path  # the login user's home as sshd sees it (passwd)
    scratch: Path  # an empty folder the login user owns: put remote roots here
    python: str  # a python3 the login user can run on the host
    pid: int  # the sshd listener
    pid_start_ticks: int  # its start time, so a reused pid is never signalled
    netns: str | None  # network namespace name, or None on loopback
    peer_address: str | None  # this machine's end of the veth pair, seen from the namespace
    veth: str | None  # this machine's end of the veth pair
    marker: str | None  # file in the private /run of sshd's mount namespace (as root)
    uid: int  # the login user's uid
    created_user: bool  # stop_host deletes the user
    user_dir: Path | None  # /tmp/sx-sshd-* (home, scratch, authorized_keys) of another user
    created_root_dir: bool  # stop_host removes root_dir once empty

    @property
    def config(self) -> Path:
        return self.root_dir / "sshd_config"

    @property
    def log(self) -> Path:
        return self.root_dir / "sshd.log"

    @property
    def pid_file(self) -> Path:
        return self.root_dir / "sshd.pid"

    @property
    def host_key(self) -> Path:
        return self.root_dir / "host_ed25519"

    @property
    def known_hosts_name(self) -> str:
        """The host's name in known_hosts: "[address]:port" (plain address on 22)."""
        return self.address if self.port == 22 else f"[{self.address}]:{self.port}"

    @property
    def destination(self) -> str:
        return f"{self.user}@{self.address}"

    def to_json(self) -> dict[str, Any]:
        return {
            field.name: (str(value) if isinstance(value, Path) else value)
            for field in dataclasses.fields(self)
            for value in [getattr(self, field.name)]
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SshHost:
        def path(key: str) -> Path:
            return Path(data[key])

        return cls(
            name=str(data["name"]),
            address=str(data["address"]),
            port=int(data["port"]),
            user=str(data["user"]),
            client_key=path("client_key"),
            known_hosts=path("known_hosts"),
            host_pubkey_line=str(data["host_pubkey_line"]),
            root_dir=path("root_dir"),
            remote_home=path("remote_home"),
            scratch=path("scratch"),
            python=str(data["python"]),
            pid=int(data["pid"]),
            pid_start_ticks=int(data["pid_start_ticks"]),
            netns=data.get("netns"),
            peer_address=data.get("peer_address"),
            veth=data.get("veth"),
            marker=data.get("marker"),
            uid=int(data["uid"]),
            created_user=bool(data["created_user"]),
            user_dir=None if data.get("user_dir") is None else path("user_dir"),
            created_root_dir=bool(data["created_root_dir"]),
        )

    def save(self) -> Path:
        target = self.root_dir / RECORD_NAME
        partial = target.with_name(RECORD_NAME + ".partial")
        partial.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        partial.replace(target)
        return target


# ------------------------------------------------------------------ commands


def _run(argv: Sequence[str], *, input: str | None = None, timeout: float = 30.0) -> str:
    try:
        done = subprocess.run(
            list(argv), input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TestbedError(f"{shlex.join(argv)}: {exc}") from exc
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip()
        raise TestbedError(f"{shlex.join(argv)} failed ({done.returncode}): {detail}")
    return done.stdout


def missing_tools(netns: bool = False) -> list[str]:
    """What this machine lacks to run a host (empty when all is there)."""
    missing = [] if Path(SSHD).exists() else [SSHD]
    tools = ["ssh", "ssh-keygen"] + (["ip", "unshare", "mount"] if netns or os.geteuid() == 0 else [])
    missing += [tool for tool in tools if shutil.which(tool) is None]
    return missing


# ----------------------------------------------------------------- processes


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat from the state on (state, ppid, ...)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes().decode(errors="replace")
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split()


def start_ticks(pid: int) -> int | None:
    """A live process's start time in clock ticks; None if gone or a zombie."""
    fields = _stat(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def is_alive(pid: int, ticks: int) -> bool:
    return pid > 0 and start_ticks(pid) == ticks


def _live_pids() -> dict[int, int]:
    """pid -> ppid of every live process but this one."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        fields = _stat(int(entry))
        if fields is not None and fields[0] not in ("Z", "X"):
            table[int(entry)] = int(fields[1])
    return table


def descendants(pid: int, table: dict[int, int] | None = None) -> set[int]:
    """Live descendants of `pid` (not `pid` itself), by parent pid."""
    table = _live_pids() if table is None else table
    children: dict[int, list[int]] = {}
    for child, parent in table.items():
        children.setdefault(parent, []).append(child)
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _same_file(a: str | Path, b: os.stat_result) -> bool:
    try:
        st = os.stat(a)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (b.st_dev, b.st_ino)


def _exists(path: str) -> bool:
    """Path.exists that says False, not PermissionError, for /proc/1/root/... here."""
    try:
        Path(path).stat()
    except OSError:
        return False
    return True


def _real_uid(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def host_processes(host: SshHost) -> set[int]:
    """Every live process that belongs to the host: sshd and its descendants
    and, as root, whatever runs in its network namespace, still sees its
    private /run, or runs as the user it created (escapees included)."""
    table = _live_pids()
    found: set[int] = set()
    if is_alive(host.pid, host.pid_start_ticks):
        found |= {host.pid} | descendants(host.pid, table)
    netns_stat = None
    if host.netns is not None:
        with contextlib.suppress(OSError):
            netns_stat = os.stat(f"/run/netns/{host.netns}")
    for pid in table:
        if (
            (netns_stat is not None and _same_file(f"/proc/{pid}/ns/net", netns_stat))
            or (host.marker is not None and _exists(f"/proc/{pid}/root/run/{host.marker}"))
            or (host.created_user and _real_uid(pid) == host.uid)
        ):
            found.add(pid)
    return found


def _reap() -> None:
    """Wait for the sshds this process started that have ended."""
    for pid, proc in list(_SPAWNED.items()):
        if proc.poll() is not None:
            del _SPAWNED[pid]


def _wait_spawned(pid: int) -> None:
    """Reap `pid` if this process started it (after it was killed)."""
    proc = _SPAWNED.pop(pid, None)
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=STOP_TIMEOUT)


def _kill_until_gone(collect: Callable[[], Iterable[int]], timeout: float) -> set[int]:
    """SIGKILL what `collect` finds until it finds nothing; what is left after
    `timeout` (empty on success)."""
    deadline = time.monotonic() + timeout
    while True:
        pids = set(collect()) - {os.getpid()}
        if not pids:
            return pids
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _reap()
        if time.monotonic() > deadline:
            return pids
        time.sleep(0.01)


def _terminate_sshd(host: SshHost) -> None:
    """SIGTERM the sshd listener, SIGKILL after TERM_GRACE."""
    if not is_alive(host.pid, host.pid_start_ticks):
        _wait_spawned(host.pid)
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(host.pid, signal.SIGTERM)
    deadline = time.monotonic() + TERM_GRACE
    while is_alive(host.pid, host.pid_start_ticks) and time.monotonic() < deadline:
        _reap()
        time.sleep(0.005)
    if is_alive(host.pid, host.pid_start_ticks):
        with contextlib.suppress(ProcessLookupError):
            os.kill(host.pid, signal.SIGKILL)
    _wait_spawned(host.pid)
    _reap()


# ------------------------------------------------------------------- network


def _used_networks() -> list[ipaddress.IPv4Interface]:
    found = []
    for line in _run(["ip", "-o", "-4", "addr", "show"]).splitlines():
        words = line.split()
        if "inet" in words:
            found.append(ipaddress.IPv4Interface(words[words.index("inet") + 1]))
    return found


def _pick_link_local_pair() -> tuple[str, str]:
    """(this machine's end, the namespace's end) of a 169.254.x.y/30 that
    no address on this machine falls in or overlaps."""
    used = _used_networks()
    for _ in range(200):
        third = 1 + secrets.randbelow(254)
        if third == 169:  # 169.254.169.254 is the cloud metadata address
            continue
        net = ipaddress.IPv4Network(f"169.254.{third}.{4 * secrets.randbelow(64)}/30")
        if any(
            iface.ip in net or (iface.network.prefixlen >= 30 and iface.network.overlaps(net))
            for iface in used
        ):
            continue
        first, second = list(net.hosts())
        return str(first), str(second)
    raise TestbedError("no free 169.254.x.y/30 found for the veth pair")


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _make_netns(host: SshHost, name: str) -> None:
    """Create network namespace `name` with an eth0 joined to host.veth, and
    fill in the addresses. Records each part on `host` once it exists."""
    veth = f"{name.replace('-', '')}h"  # sxabcdefh: <= 15 characters
    if Path(f"/run/netns/{name}").exists() or Path(f"/sys/class/net/{veth}").exists():
        raise TestbedError(f"network namespace {name} or link {veth} exists already")
    mine, theirs = _pick_link_local_pair()
    # Two `ip -batch` runs rather than seven: one here, one in the namespace.
    here = (
        f"netns add {name}\n"
        f"link add {veth} type veth peer name eth0 netns {name}\n"
        f"addr add {mine}/30 dev {veth}\n"
        f"link set {veth} up\n"
    )
    there = f"addr add {theirs}/30 dev eth0\nlink set eth0 up\nlink set lo up\n"
    try:
        _run(["ip", "-batch", "-"], input=here)
    finally:  # what exists was made here: both names were free just before
        if Path(f"/run/netns/{name}").exists():
            host.netns = name
        if Path(f"/sys/class/net/{veth}").exists():
            host.veth = veth
    _run(["ip", "-n", name, "-batch", "-"], input=there)
    host.peer_address, host.address = mine, theirs


def _remove_netns(host: SshHost) -> None:
    # Deleting one end removes both, at once; a namespace's own clean-up
    # would do it later, asynchronously.
    if host.veth is not None and Path(f"/sys/class/net/{host.veth}").exists():
        _run(["ip", "link", "del", host.veth])
    if host.netns is not None and Path(f"/run/netns/{host.netns}").exists():
        _run(["ip", "netns", "del", host.netns])


# ---------------------------------------------------------------------- sshd


def _sshd_config(host: SshHost, authorized_keys: Path, accept_env: str | None = None) -> str:
    lines = [
        f"Port {host.port}",
        f"ListenAddress {host.address}",
        f"HostKey {host.host_key}",
        f"PidFile {host.pid_file}",
        f"AuthorizedKeysFile {authorized_keys}",
        f"AllowUsers {host.user}",
        "AuthenticationMethods publickey",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "StrictModes no",
        "PermitRootLogin prohibit-password",
        "Subsystem sftp internal-sftp",
        "UseDNS no",
        "PrintMotd no",
        "PrintLastLog no",
        "X11Forwarding no",
        "MaxStartups 64",
        "MaxSessions 64",
    ]
    if accept_env is not None:  # e.g. Debian's stock "LANG LC_*"; none at all otherwise
        lines.append(f"AcceptEnv {accept_env}")
    return "\n".join(lines) + "\n"


def _sshd_argv(host: SshHost) -> list[str]:
    if host.marker is None:  # not root: this user's own sshd, no /run/sshd needed
        return [SSHD, "-D", "-e", "-f", str(host.config)]
    argv = ["ip", "netns", "exec", host.netns] if host.netns is not None else []
    # ip netns exec, unshare and `sh -c exec` all exec: the pid we spawn is sshd's.
    return [
        *argv,
        "unshare", "-m", "--propagation", "private",
        "sh", "-c", ROOT_SSHD_SCRIPT, "sx-sshd", host.marker, SSHD, str(host.config),
    ]  # fmt: skip


def _log_tail(host: SshHost, lines: int = 20) -> str:
    try:
        text = host.log.read_text(errors="replace")
    except OSError:
        return "(no sshd log)"
    return "\n".join(text.splitlines()[-lines:])


def _launch_sshd(host: SshHost, timeout: float = START_TIMEOUT) -> None:
    """Start sshd and wait until it listens; sets host.pid and its start ticks."""
    with contextlib.suppress(FileNotFoundError):
        host.pid_file.unlink()
    with host.log.open("ab") as log:
        proc = subprocess.Popen(
            _sshd_argv(host),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C meant for the caller leaves it to stop_host
        )
    _SPAWNED[proc.pid] = proc
    host.pid = proc.pid
    ticks = start_ticks(proc.pid)
    host.pid_start_ticks = -1 if ticks is None else ticks
    # sshd writes its PidFile once its sockets listen.
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            _SPAWNED.pop(proc.pid, None)
            raise TestbedError(f"sshd exited with {proc.returncode}:\n{_log_tail(host)}")
        with contextlib.suppress(OSError, ValueError):
            if int(host.pid_file.read_text().strip()) == proc.pid:
                break
        if time.monotonic() > deadline:
            raise TestbedError(f"sshd did not listen within {timeout:.0f} s:\n{_log_tail(host)}")
        time.sleep(0.002)
    # The pid file names the pid we spawned: the exec chain held.
    ticks = start_ticks(proc.pid)
    if ticks is None:
        raise TestbedError(f"sshd {proc.pid} vanished after start:\n{_log_tail(host)}")
    host.pid_start_ticks = ticks
    while True:
        try:
            with socket.create_connection((host.address, host.port), timeout=1.0):
                return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise TestbedError(
                    f"sshd {host.pid} does not accept connections on {host.address}:{host.port}: {exc}"
                ) from exc
            time.sleep(0.01)


def _check_login(host: SshHost, timeout: float = START_TIMEOUT) -> None:
    argv = [*ssh_argv(host), "true"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise TestbedError(f"{shlex.join(argv)} timed out:\n{_log_tail(host)}") from exc
    if done.returncode != 0:
        raise TestbedError(
            f"{shlex.join(argv)} failed ({done.returncode}): {done.stderr.strip()}\n"
            f"sshd log:\n{_log_tail(host)}"
        )


def _keygen(path: Path, comment: str) -> None:
    for old in (path, path.with_name(path.name + ".pub")):
        with contextlib.suppress(FileNotFoundError):
            old.unlink()
    _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)])


# ---------------------------------------------------------------- public API


def ssh_options(host: SshHost) -> list[str]:
    """`ssh` and the options that log in to `host` with its keys only, no
    ~/.ssh/config, no agent and strict host key checking."""
    return [
        "ssh",
        "-F", "/dev/null",
        "-p", str(host.port),
        "-i", str(host.client_key),
        "-o", "IdentitiesOnly=yes",
        "-o", "IdentityAgent=none",
        "-o", "BatchMode=yes",
        "-o", f"UserKnownHostsFile={host.known_hosts}",
        "-o", "GlobalKnownHostsFile=/dev/null",
        "-o", "StrictHostKeyChecking=yes",
        "-o", "ConnectTimeout=10",
        "-o", "LogLevel=ERROR",
    ]  # fmt: skip


def ssh_argv(host: SshHost, *command: str) -> list[str]:
    """argv that runs `command` (joined by spaces, as ssh does, and run by
    the remote shell) on `host`; with no command, append your own."""
    return [*ssh_options(host), host.destination, *command]


def rsync_ssh_command(host: SshHost) -> list[str]:
    """The ssh command for rsync, as argv; pass `rsync_e(host)` to `-e`."""
    return ssh_options(host)


def rsync_e(host: SshHost) -> str:
    """The value of rsync's `-e` (its own quoting: spaces and quotes)."""
    return shlex.join(rsync_ssh_command(host))


def rsync_remote(host: SshHost, path: str | Path) -> str:
    """An rsync remote path on `host`: user@address:path."""
    return f"{host.destination}:{path}"


def ssh_config_text(host: SshHost, alias: str | None = None) -> str:
    """A ~/.ssh/config Host block for `host` (named `alias`, default host.name)."""
    return (
        f"Host {alias or host.name}\n"
        f"  HostName {host.address}\n"
        f"  Port {host.port}\n"
        f"  User {host.user}\n"
        f"  IdentityFile {host.client_key}\n"
        f"  IdentitiesOnly yes\n"
        f"  UserKnownHostsFile {host.known_hosts}\n"
        f"  StrictHostKeyChecking yes\n"
        f"  BatchMode yes\n"
    )


def _prepare_user(host: SshHost, token: str) -> Path:
    """Set up the login user's side; returns the authorized_keys path."""
    me = pwd.getpwuid(os.geteuid())
    if host.user == me.pw_name:
        host.uid, host.remote_home = me.pw_uid, Path(me.pw_dir)
        host.scratch.mkdir(exist_ok=True)
        return host.root_dir / "authorized_keys"
    if os.geteuid() != 0:
        raise TestbedError(f"only root can let another user ({host.user}) log in; this is {me.pw_name}")
    user_dir = Path(tempfile.mkdtemp(prefix=f"sx-sshd-{token}-", dir=USER_DIR_BASE))
    host.user_dir = user_dir
    user_dir.chmod(0o755)
    try:
        entry = pwd.getpwnam(host.user)
    except KeyError:
        home = user_dir / "home"
        # -p "*": no password, yet not locked ("!"), which sshd refuses without PAM
        useradd = ["useradd", "-M", "-d", str(home), "-s", "/bin/sh", "-p", "*", "-c", "substrax test bed"]
        _run([*useradd, host.user])
        host.created_user = True
        entry = pwd.getpwnam(host.user)
        home.mkdir(mode=0o755)
        os.chown(home, entry.pw_uid, entry.pw_gid)
    host.uid, host.remote_home = entry.pw_uid, Path(entry.pw_dir)
    host.scratch = user_dir / "scratch"
    host.scratch.mkdir(mode=0o755)
    os.chown(host.scratch, entry.pw_uid, entry.pw_gid)
    return user_dir / "authorized_keys"  # root-owned, world-readable: sshd reads it as the user


def start_host(
    root_dir: Path, *, netns: bool | None = None, user: str | None = None, accept_env: str | None = None
) -> SshHost:
    """Start a throwaway SSH host whose files live in `root_dir`.

    netns: None = a network namespace when root, loopback otherwise; True
    requires root. user: the login user (default: whoever runs this); as
    root another name is created when missing. accept_env: sshd's AcceptEnv
    (none by default). Raises TestbedError, with nothing left behind, when
    the host cannot be started.
    """
    root = os.geteuid() == 0
    use_netns = root if netns is None else netns
    if use_netns and not root:
        raise TestbedError("a host in its own network namespace needs root")
    root_dir = Path(root_dir).absolute()
    if root and (root_dir == Path("/run") or Path("/run") in root_dir.parents):
        raise TestbedError(f"{root_dir}: sshd gets a private /run, so root_dir must not be under /run")
    if missing := missing_tools(use_netns):
        raise TestbedError(f"missing: {', '.join(missing)} (apt-get install openssh-server openssh-client)")
    created_root_dir = not root_dir.exists()
    root_dir.mkdir(parents=True, exist_ok=True)
    if (root_dir / RECORD_NAME).exists():
        raise TestbedError(f"{root_dir / RECORD_NAME} exists: stop that host first")
    token = secrets.token_hex(3)
    name = f"sx-{token}"
    host = SshHost(
        name=name,
        address="127.0.0.1",
        port=0,
        user=user or pwd.getpwuid(os.geteuid()).pw_name,
        client_key=root_dir / "client_ed25519",
        known_hosts=root_dir / "known_hosts",
        host_pubkey_line="",
        root_dir=root_dir,
        remote_home=Path("/"),
        scratch=root_dir / "scratch",
        python=REMOTE_PYTHON,
        pid=0,
        pid_start_ticks=-1,
        netns=None,
        peer_address=None,
        veth=None,
        marker=f"substrax-testbed-{token}" if root else None,
        uid=-1,
        created_user=False,
        user_dir=None,
        created_root_dir=created_root_dir,
    )
    try:
        authorized_keys = _prepare_user(host, token)
        _keygen(host.host_key, f"{name} host key")
        _keygen(host.client_key, f"{name} client key")
        pub = host.client_key.with_name("client_ed25519.pub").read_text()
        authorized_keys.write_text(pub)
        authorized_keys.chmod(0o644)
        host.host_pubkey_line = " ".join(host.host_key.with_name("host_ed25519.pub").read_text().split()[:2])
        if use_netns:
            _make_netns(host, name)
            # A fresh namespace has every port free; a high random one
            # catches callers that forget to pass the port.
            host.port = 20000 + secrets.randbelow(40000)
        else:
            host.port = _free_loopback_port()
        host.known_hosts.write_text(f"{host.known_hosts_name} {host.host_pubkey_line}\n")
        host.config.write_text(_sshd_config(host, authorized_keys, accept_env))
        _launch_sshd(host)
        host.save()
        _check_login(host)
    except BaseException:
        with contextlib.suppress(Exception):
            stop_host(host)
        raise
    return host


def kill_sshd(host: SshHost) -> None:
    """Crash sshd: SIGKILL the listener and its descendants (the live
    connections and what they run). Detached processes, the namespace and
    the files stay; `restart_sshd` brings it back on the same port."""

    def tree() -> set[int]:
        if not is_alive(host.pid, host.pid_start_ticks):
            return set()
        return {host.pid} | descendants(host.pid)

    # Taken before the kill: once sshd is gone its sessions have a new parent.
    sessions = {pid: t for pid in tree() if (t := start_ticks(pid)) is not None}
    left = _kill_until_gone(lambda: tree() | {p for p, t in sessions.items() if is_alive(p, t)}, STOP_TIMEOUT)
    if left:
        raise TestbedError(f"sshd processes survived SIGKILL: {sorted(left)}")
    _wait_spawned(host.pid)
    _reap()


def restart_sshd(host: SshHost) -> None:
    """Start sshd again with the same address, port, keys and config (after
    `kill_sshd`, or killing it first). Updates host.pid and host.json."""
    kill_sshd(host)
    _launch_sshd(host)
    if (host.root_dir / RECORD_NAME).exists():
        host.save()


def reboot(host: SshHost, wipe: Iterable[Path] = ()) -> None:
    """Simulate the host restarting: its network goes first (the namespace's
    link down, so no connection of it sends a reset), then every process of
    it is SIGKILLed by pid, its scratch folder (a tmpfs on a real host) and
    the folders in `wipe` are emptied, and the network and sshd come back on
    the same address, port and host key. On loopback there is no link to
    take down. Updates host.pid and host.json."""
    link = ["ip", "-n", host.netns, "link", "set", "eth0"] if host.netns is not None else None
    if link is not None:
        _run([*link, "down"])
    try:
        first = {pid: t for pid in host_processes(host) if (t := start_ticks(pid)) is not None}
        left = _kill_until_gone(
            lambda: host_processes(host) | {p for p, t in first.items() if is_alive(p, t)}, STOP_TIMEOUT
        )
        if left:
            raise TestbedError(f"processes of {host.name} survived SIGKILL: {sorted(left)}")
        _wait_spawned(host.pid)
        _reap()
        for folder in (host.scratch, *wipe):
            for entry in list(folder.iterdir()) if folder.is_dir() else []:
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
    finally:
        if link is not None:
            _run([*link, "up"])
    _launch_sshd(host)
    if (host.root_dir / RECORD_NAME).exists():
        host.save()


def stop_host(host: SshHost) -> None:
    """Stop the host and remove all it made. Safe to call again, and on a
    host that only half started."""
    # Taken before sshd goes: then its sessions get a new parent.
    first = {pid: t for pid in host_processes(host) if (t := start_ticks(pid)) is not None}
    _terminate_sshd(host)
    left = _kill_until_gone(
        lambda: host_processes(host) | {p for p, t in first.items() if is_alive(p, t)}, STOP_TIMEOUT
    )
    if left:
        raise TestbedError(f"processes of {host.name} survived SIGKILL: {sorted(left)}")
    _remove_netns(host)
    if host.created_user:
        with contextlib.suppress(KeyError):
            if pwd.getpwnam(host.user).pw_uid == host.uid:
                _run(["userdel", host.user])
        host.created_user = False
    if host.user_dir is not None:
        shutil.rmtree(host.user_dir, ignore_errors=True)
    else:
        shutil.rmtree(host.scratch, ignore_errors=True)
    for name in (*MADE_FILES, RECORD_NAME + ".partial"):
        with contextlib.suppress(FileNotFoundError):
            (host.root_dir / name).unlink()
    if host.created_root_dir:
        with contextlib.suppress(OSError):
            host.root_dir.rmdir()


@contextlib.contextmanager
def running_host(
    root_dir: Path, *, netns: bool | None = None, user: str | None = None, accept_env: str | None = None
) -> Iterator[SshHost]:
    """start_host, then stop_host on the way out. For a fixture:
    `with running_host(tmp_path / "sshd") as host: yield host`."""
    host = start_host(root_dir, netns=netns, user=user, accept_env=accept_env)
    try:
        yield host
    finally:
        stop_host(host)


def load_host(root_dir: Path) -> SshHost | None:
    """The host recorded in root_dir/host.json, or None."""
    try:
        data = json.loads((Path(root_dir) / RECORD_NAME).read_text())
    except FileNotFoundError:
        return None
    return SshHost.from_json(data)


def host_status(host: SshHost) -> dict[str, Any]:
    return {
        "sshd_running": is_alive(host.pid, host.pid_start_ticks),
        "netns_present": host.netns is not None and Path(f"/run/netns/{host.netns}").exists(),
        "processes": len(host_processes(host)),
    }


# ------------------------------------------------------------------------ CLI


def _cli_start(args: argparse.Namespace) -> int:
    started = time.monotonic()
    try:
        host = start_host(args.dir, netns=args.netns, user=args.user)
    except TestbedError as exc:
        print(f"sshd_host: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(host.to_json(), indent=2))
    took = time.monotonic() - started
    print(f"sshd_host: {host.destination} port {host.port} up in {took:.2f} s", file=sys.stderr)
    return 0


def _cli_recorded(args: argparse.Namespace) -> int:
    host = load_host(args.dir)
    if host is None:
        print(f"sshd_host: no host recorded in {args.dir}", file=sys.stderr)
        return 0 if args.command == "stop" else 1
    if args.command == "stop":
        try:
            stop_host(host)
        except TestbedError as exc:
            print(f"sshd_host: {exc}", file=sys.stderr)
            return 1
    elif args.command == "ssh-config":
        print(ssh_config_text(host), end="")
    elif args.command == "get":
        print(host.to_json()[args.field])
    else:
        status = host_status(host)
        print(json.dumps({**host.to_json(), **status}, indent=2))
        return 0 if status["sshd_running"] else 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Start and stop a throwaway SSH host on this machine.")
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("start", help="start a host; print its record as JSON")
    others = [
        commands.add_parser("stop", help="stop the host recorded in DIR and remove what it made"),
        commands.add_parser("status", help="print the record and whether sshd runs (exit 1 if not)"),
        commands.add_parser("ssh-config", help="print a ~/.ssh/config Host block"),
        get := commands.add_parser("get", help="print one field of the record (address, port, ...)"),
    ]
    for sub in (start, *others):
        sub.add_argument("--dir", type=Path, required=True, help="the host's folder (holds host.json)")
    mode = start.add_mutually_exclusive_group()
    mode.add_argument("--no-netns", dest="netns", action="store_false", default=None, help="on 127.0.0.1")
    mode.add_argument("--netns", dest="netns", action="store_true", help="own network namespace (root)")
    start.add_argument("--user", help="login user (as root: created when missing)")
    get.add_argument("field", choices=[field.name for field in dataclasses.fields(SshHost)])
    args = parser.parse_args(argv)
    return _cli_start(args) if args.command == "start" else _cli_recorded(args)


if __name__ == "__main__":
    sys.exit(main())
