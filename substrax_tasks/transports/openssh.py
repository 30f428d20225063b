"""OpenSSH: its command lines, the multiplexing masters, and commands run
through it. rsync's ssh (every copy) and SkyPilot clusters (whose ssh config
may hold what paramiko cannot) go this way; commands to an SSH host go
through paramiko (`_ssh.py`).

Host keys are always verified against a known_hosts file that both paramiko
and OpenSSH read. An unknown key is refused unless the settings opt in to
trusting a new host on first use; a changed key is always refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import hashlib
import os
import selectors
import shlex
import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from substrax_tasks.errors import BackendError
from substrax_tasks.private import UnsafeFolder, private_dir

# Preference list: OpenSSH picks the first cipher both ends support;
# aes128-gcm made a 1 GiB copy 1.9x faster than chacha20 here.
CIPHERS = "aes128-gcm@openssh.com,chacha20-poly1305@openssh.com,aes256-gcm@openssh.com,aes128-ctr,aes256-ctr"
CONTROL_PERSIST_SECONDS = 30
# A SkyPilot cluster's ssh may start a process per connection (its proxy
# through the API server into a Slurm job or a pod): its banner took 12-19 s
# on the loaded Slurm test bed. So a longer wait for it, and a master kept
# for the next step on a warm cluster, of this doit or the next.
CLUSTER_CONNECT_TIMEOUT = 60
CLUSTER_PERSIST_SECONDS = 600
# A master whose connection died (a host gone, a network dropped) is noticed
# within about a minute and exits, rather than holding its clients stalled.
SERVER_ALIVE = ("-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=4")
# The most a host may answer to one command, on stdout or stderr. A host we
# do not control (a rented box, someone else's root) could otherwise send
# without end and exhaust this machine's memory; the biggest real answer,
# a manifest, stays far below it (about 300,000 entries).
MAX_ANSWER_BYTES = 64 << 20
STREAM_TICK = 0.2  # seconds between a streaming command's checks (Ctrl-C in a doit thread)
# How long a streaming command is given to end once its stdin is closed
# (the remote follower sees that within a tick), before its ssh is killed.
STREAM_STOP_SECONDS = 5.0
# The longest control folder: a socket's path is at most 107 bytes (108 with
# its NUL), below it go "/" and a 16-character digest, and ssh adds a
# 17-character suffix to that name while it binds.
CONTROL_DIR_MAX = 107 - 1 - 16 - 17


def control_dir() -> Path:
    """A private folder for ssh's multiplexing sockets. Unix socket paths
    are short (108 bytes, and ssh adds a 17-character suffix while it binds):
    under $XDG_RUNTIME_DIR or TMPDIR when that is short, else under /tmp.
    Private and checked (_private.py): a socket planted there by someone
    else would be a master that ssh hands our commands to."""
    return private_dir("substrax-ssh", max_length=CONTROL_DIR_MAX)


class Multiplexed(ABC):
    """A target reached through OpenSSH's multiplexing master: what both
    kinds share (stopping or giving up that master)."""

    host: str

    @abstractmethod
    def control_path(self) -> str: ...

    @abstractmethod
    def ssh_argv(self) -> list[str]: ...

    def stop_master(self) -> None:
        """Stop the multiplexing master, so no local ssh outlives the run;
        left up while another uses it (its last user, or ControlPersist, ends it)."""
        with contextlib.suppress(UnsafeFolder):  # a folder refused holds no master of ours
            control_path = self.control_path()
            if not Path(control_path).exists():
                return
            fd = os.open(control_path + ".users", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return
            try:  # held while it exits: no new user starts on a master going away
                self._exit_master()
            finally:
                os.close(fd)

    def drop_master(self) -> None:
        """Give up a master whose connection died: asked to exit (it answers on
        its socket even with its connection gone), and its socket removed if it
        could not be, so the next ssh starts a new master there."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._exit_master()  # even while in use: it serves no one any more
        with contextlib.suppress(FileNotFoundError):
            Path(self.control_path()).unlink()

    def _exit_master(self) -> None:
        subprocess.run(
            [*self.ssh_argv(), "-O", "exit", self.host],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            timeout=10, check=False,
        )  # fmt: skip


@dataclass(frozen=True)
class SshTarget(Multiplexed):
    """Where to connect and how to check who answers."""

    host: str
    port: int
    user: str | None
    identity_file: str | None
    known_hosts: str
    trust_new_host_key: bool = False
    connect_timeout: float = 15.0

    @property
    def login(self) -> str:
        return self.user or getpass.getuser()

    @property
    def address(self) -> str:
        return f"{self.login}@{self.host}"

    @property
    def known_hosts_name(self) -> str:
        return self.host if self.port == 22 else f"[{self.host}]:{self.port}"

    def control_path(self) -> str:
        digest = hashlib.sha256(repr(self).encode()).hexdigest()[:16]
        return str(control_dir() / digest)

    def ssh_argv(self) -> list[str]:
        """OpenSSH with the same identity and known_hosts as paramiko."""
        argv = [
            "ssh", "-p", str(self.port),
            "-o", "BatchMode=yes",
            "-o", f"UserKnownHostsFile={self.known_hosts}",
            "-o", "StrictHostKeyChecking=yes",
            "-o", f"ConnectTimeout={int(self.connect_timeout)}",
            "-o", f"Ciphers={CIPHERS}",
            "-l", self.login,
        ]  # fmt: skip
        if self.identity_file:
            argv += ["-i", self.identity_file, "-o", "IdentitiesOnly=yes"]
        return argv + multiplexing(self.control_path())


def multiplexing(control_path: str, persist: int = CONTROL_PERSIST_SECONDS) -> list[str]:
    """ssh options for one shared connection per target (ControlMaster)."""
    return [
        "-o", "ControlMaster=auto",
        "-o", f"ControlPath={control_path}",
        "-o", f"ControlPersist={persist}",
        *SERVER_ALIVE,
    ]  # fmt: skip


@contextlib.contextmanager
def master_in_use(control_path: str) -> Iterator[None]:
    """A shared lock on the master's `.users` file while a copy uses it.
    Every process (and thread) on one host shares one master; a teardown
    ends it only if it can take that lock alone, so one doit's teardown
    never cuts another's fetch. A killed user's lock goes
    with it."""
    fd = os.open(control_path + ".users", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


class ClusterTarget(Multiplexed):
    """ssh to a SkyPilot cluster through the config SkyPilot wrote for it
    (OpenSSH for commands too: the config may hold what paramiko cannot)."""

    def __init__(self, cluster: str, config_file: Path) -> None:
        self.host = cluster
        self.config_file = config_file

    def control_path(self) -> str:
        digest = hashlib.sha256(f"{self.config_file}:{self.host}".encode()).hexdigest()[:16]
        return str(control_dir() / digest)

    def ssh_argv(self) -> list[str]:
        argv = ["ssh", "-F", str(self.config_file), "-o", "BatchMode=yes",
                "-o", f"ConnectTimeout={CLUSTER_CONNECT_TIMEOUT}"]  # fmt: skip
        argv += [arg for key in self.home_identities() for arg in ("-i", str(key))]
        return argv + multiplexing(self.control_path(), CLUSTER_PERSIST_SECONDS)

    def home_identities(self) -> list[Path]:
        """The config's `IdentityFile ~/...` keys, under SkyPilot's HOME.

        SkyPilot means its own HOME by `~` (it writes the key there), but
        ssh expands `~` to the home in the password database: with HOME set
        elsewhere (a container, CI, a test) ssh would not find the key."""
        try:
            text = self.config_file.read_text()
        except OSError:
            return []
        found = []
        for line in text.splitlines():
            words = line.replace("=", " ", 1).split()
            if len(words) == 2 and words[0].lower() == "identityfile" and words[1].startswith("~/"):
                key = Path.home() / words[1][2:]
                if key.is_file():
                    found.append(key)
        return found

    def run(
        self, argv: list[str], *, stdin: bytes | None = None, timeout: float | None = 120,
        limit: int = MAX_ANSWER_BYTES, moving: bool = False, longest: float | None = None,
    ) -> RemoteResult:
        """Run argv there (quoted for its shell) and wait for it; each of its
        stdout and stderr held to `limit` bytes, the whole within `timeout`
        seconds (`moving`: of the last bytes it sent, and `longest` in all),
        else AnswerOverdue."""
        command = [*self.ssh_argv(), self.host, shlex.join(argv)]
        with subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        ) as proc:
            try:
                out, err = _bounded_answer(proc, stdin or b"", timeout, self.host, limit, moving, longest)
            except BaseException:
                proc.kill()
                raise
            return RemoteResult(proc.wait(), out, err)

    def stream(self, argv: list[str], out: Callable[[bytes], None], tick: Callable[[], None]) -> RemoteResult:
        """Run argv there for as long as it goes, as `_ssh.SshConnection.stream`
        does: its stdout handed to `out` as it comes, `tick` called at least
        every STREAM_TICK seconds (it may raise, e.g. KeyboardInterrupt), its
        stdin open meanwhile and closed at the end, which ends a follower
        there. The result's stdout is empty (it went to `out`)."""
        command = [*self.ssh_argv(), self.host, shlex.join(argv)]
        with subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        ) as proc:
            try:
                err = _relay(proc, out, tick, self.host)
            finally:
                _stop(proc)
            return RemoteResult(proc.wait(), b"", err)


def _relay(
    proc: subprocess.Popen[bytes], out: Callable[[bytes], None], tick: Callable[[], None], host: str
) -> bytes:
    """Hand proc's stdout to `out` until it and stderr close; its stderr,
    held to MAX_ANSWER_BYTES."""
    assert proc.stdout is not None and proc.stderr is not None
    stdout, stderr = proc.stdout.fileno(), proc.stderr.fileno()
    err = bytearray()
    with selectors.DefaultSelector() as selector:
        selector.register(stdout, selectors.EVENT_READ)
        selector.register(stderr, selectors.EVENT_READ)
        while selector.get_map():
            tick()
            for key, _ in selector.select(STREAM_TICK):
                fd = cast(int, key.fileobj)
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    selector.unregister(fd)
                elif fd == stdout:
                    out(chunk)
                else:
                    err += chunk
                    if len(err) > MAX_ANSWER_BYTES:
                        raise answer_too_big(host)
    return bytes(err)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Close its stdin (the follower there ends on that, and ssh with it),
    then kill the ssh if it has not gone; reaped by the caller's wait."""
    assert proc.stdin is not None
    with contextlib.suppress(OSError):
        proc.stdin.close()
    try:
        proc.wait(timeout=STREAM_STOP_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()


def _bounded_answer(  # noqa: PLR0917
    proc: subprocess.Popen[bytes], stdin: bytes, timeout: float | None, host: str, limit: int, moving: bool,
    longest: float | None = None,
) -> tuple[bytes, bytes]:
    """What `communicate` does, with each stream held to `limit` bytes and
    the whole to `timeout` seconds (`moving`: after the last bytes read,
    and to `longest` seconds in all)."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    answers = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    ceiling = None if longest is None else time.monotonic() + longest
    deadline = _deadline(timeout, ceiling)
    with selectors.DefaultSelector() as selector:
        for fd in answers:
            selector.register(fd, selectors.EVENT_READ)
        if stdin:
            selector.register(proc.stdin, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        sent = 0
        while selector.get_map():
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                past_ceiling = ceiling is not None and time.monotonic() >= ceiling
                raise AnswerOverdue(host, *((longest, False) if past_ceiling else (timeout, moving)))
            for key, _ in selector.select(wait):
                if key.fileobj is proc.stdin:
                    try:
                        sent += os.write(proc.stdin.fileno(), stdin[sent : sent + (1 << 16)])
                    except BrokenPipeError:
                        sent = len(stdin)
                    if sent == len(stdin):
                        selector.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                fd = cast(int, key.fileobj)
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    selector.unregister(fd)
                elif moving:
                    deadline = _deadline(timeout, ceiling)
                answers[fd] += chunk
                if len(answers[fd]) > limit:
                    raise answer_too_big(host, limit)
    return bytes(answers[proc.stdout.fileno()]), bytes(answers[proc.stderr.fileno()])


class AnswerTooBig(BackendError):
    """A host answered one command with more than it may: refused unread."""


def _deadline(timeout: float | None, ceiling: float | None) -> float | None:
    """`timeout` seconds from now, but not past `ceiling` (monotonic)."""
    if timeout is None:
        return ceiling
    return time.monotonic() + timeout if ceiling is None else min(time.monotonic() + timeout, ceiling)


class AnswerOverdue(BackendError):
    """A host did not end its answer to one command in time: given up on,
    the command's channel closed (the caller names the command)."""

    def __init__(self, host: str, seconds: float | None, moving: bool) -> None:
        self.host, self.seconds, self.moving = host, seconds, moving
        said = "nothing more" if moving else "no whole answer"
        super().__init__(f"{host} sent {said} within {seconds:g} s")


def answer_too_big(host: str, limit: int = MAX_ANSWER_BYTES) -> AnswerTooBig:
    return AnswerTooBig(
        f"{host} answered with more than {limit >> 20} MiB to one command: refused, "
        "nothing of it was kept (a host that sends without end is broken or hostile)"
    )


@dataclass(frozen=True)
class RemoteResult:
    returncode: int
    stdout: bytes
    stderr: bytes

    def text(self) -> str:
        return self.stdout.decode(errors="replace")

    def failure(self, what: str, host: str) -> BackendError:
        said = (self.stderr + self.stdout).decode(errors="replace").strip()[-1500:]
        return BackendError(f"{what} on {host} failed (exit {self.returncode}): {said}")
