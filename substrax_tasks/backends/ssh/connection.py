"""SSH to a host with paramiko: commands and their answers, on one
connection per host shared by the threads of a doit run. Host keys are
checked as `_openssh.py` says; rsync goes through OpenSSH.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import secrets
import shlex
import threading
import time
from collections.abc import Callable
from pathlib import Path

import paramiko

from substrax_tasks.errors import BackendError, SubstraxError
from substrax_tasks.poll import wait_readable
from substrax_tasks.transports.openssh import (
    MAX_ANSWER_BYTES,
    STREAM_TICK,
    AnswerOverdue,
    RemoteResult,
    SshTarget,
    answer_too_big,
)

# Long-lived commands (followers) at once on one connection: sshd lets one
# connection hold MaxSessions (10 by default) sessions, and the short
# commands of the other threads need some of them.
MAX_STREAMS = 6
SESSION_WAIT_SECONDS = 30.0  # a short command waits this long for a free session
# As OpenSSH's ServerAliveInterval for rsync (transports/openssh.py): seconds between keepalives
KEEPALIVE_SECONDS = 15

# paramiko's transport thread logs a failed handshake (a host rebooting
# resets the connection during the banner) at ERROR with its traceback; with
# no handler of the user's, Python's last-resort handler prints that on
# stderr, in the middle of doit's output. Every failure reaches the caller
# as an exception, which says it in words: paramiko's log is not for users.
# A handler of the user's own (logging configured by them) still gets it.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


class NoSession(BackendError):
    """No session for one more long-lived command on the connection
    (MAX_STREAMS, or sshd's MaxSessions, reached): the connection itself is
    fine."""


class HostKeyError(SubstraxError):
    """The host's key is unknown or changed: never retried."""


class SshConnection:
    """One paramiko connection to a target, opened on first use."""

    def __init__(self, target: SshTarget) -> None:
        self.target = target
        self._client: paramiko.SSHClient | None = None
        self._lock = threading.Lock()
        self._streams = threading.BoundedSemaphore(MAX_STREAMS)
        # One session opened at a time (see _open_session).
        self._opening = threading.Lock()

    @property
    def host(self) -> str:
        return self.target.host

    def client(self) -> paramiko.SSHClient:
        with self._lock:
            if self._client is not None and self._client.get_transport() is not None:
                transport = self._client.get_transport()
                if transport is not None and transport.is_active():
                    return self._client
            self._client = self._connect()
            return self._client

    def _connect(self) -> paramiko.SSHClient:
        target = self.target
        client = paramiko.SSHClient()
        known = Path(target.known_hosts)
        if known.is_file():
            client.load_host_keys(str(known))
        if target.trust_new_host_key:
            known.parent.mkdir(parents=True, exist_ok=True)
            known.touch(mode=0o600, exist_ok=True)
            client.load_host_keys(str(known))  # new keys are saved there
            # trust_new_host_key is an explicit opt-in (first use only; a changed key is refused)
            client.set_missing_host_key_policy(paramiko.AutoAddPolicy())  # noqa: S507
        else:
            client.set_missing_host_key_policy(paramiko.RejectPolicy())
        try:
            client.connect(
                target.host,
                port=target.port,
                username=target.login,
                key_filename=target.identity_file,
                look_for_keys=target.identity_file is None,
                allow_agent=target.identity_file is None,
                timeout=target.connect_timeout,
                banner_timeout=target.connect_timeout,
                auth_timeout=target.connect_timeout,
            )
        except paramiko.BadHostKeyException as exc:
            client.close()
            raise HostKeyError(
                f"the host key of {target.known_hosts_name} CHANGED (now {exc.key.get_name()} "
                f"{exc.key.get_fingerprint().hex()}); it does not match {target.known_hosts}. "
                "If the host was really reinstalled, remove the old key with "
                f"`ssh-keygen -R '{target.known_hosts_name}' -f {target.known_hosts}` and connect again"
            ) from None
        except paramiko.SSHException as exc:
            client.close()
            if "not found in known_hosts" in str(exc):
                raise HostKeyError(
                    f"the host key of {target.known_hosts_name} is not in {target.known_hosts}; "
                    "check the key, then add it with "
                    f"`ssh-keyscan -p {target.port} {target.host} >> {target.known_hosts}`, "
                    "or set trust_new_host_key = true to accept it on first use"
                ) from None
            raise BackendError(f"ssh to {target.address}:{target.port} failed: {exc}") from None
        except (TimeoutError, OSError) as exc:
            client.close()
            raise BackendError(f"cannot reach {target.address}:{target.port}: {exc}") from None
        # A host that restarted while a run's log was followed forgot the
        # connection: only a packet sent to it brings back the reset that
        # ends the follower, and the run is then seen lost (preemptions).
        client.get_transport().set_keepalive(KEEPALIVE_SECONDS)  # type: ignore[union-attr]
        return client

    def run(
        self, argv: list[str], *, stdin: bytes | None = None, timeout: float | None = 120,
        limit: int = MAX_ANSWER_BYTES, moving: bool = False, longest: float | None = None,
    ) -> RemoteResult:
        """Run argv on the host (quoted for its shell) and wait for it; each
        of its stdout and stderr held to `limit` bytes, the whole within
        `timeout` seconds (`moving`: of the last bytes it sent, and
        `longest` seconds in all). One that
        misses it is AnswerOverdue, its channel closed and the connection
        kept: the other threads' commands on it go on."""
        command = shlex.join(argv)
        channel = self._session(command)
        try:
            channel.settimeout(timeout)
            if stdin is None:
                # Its stdin closed there, not by an end of input sent from
                # here: a command done before that end is sent lets sshd
                # close the channel, and paramiko can put the end of input
                # on the wire after its own close (it sends it outside the
                # channel's lock). sshd then drops the whole connection
                # ("ieof packet referred to nonexistent channel"), and
                # every thread's command on it failed with exit -1 (seen
                # under `doit -n 4 -P thread` on a loaded machine).
                channel.exec_command(command + " </dev/null")
            else:  # a command given input reads it to its end, so ends after it
                channel.exec_command(command)
                channel.sendall(stdin)
                channel.shutdown_write()
            out, err = bytearray(), bytearray()
            deadline = None if timeout is None else time.monotonic() + timeout
            seen = (0, 0)  # bytes read when the deadline was last set
            ceiling = None if longest is None else time.monotonic() + longest
            while True:
                if ceiling is not None and time.monotonic() > ceiling:
                    channel.close()  # as below: this channel only
                    raise AnswerOverdue(self.host, longest, False)
                if len(out) > limit or len(err) > limit:
                    channel.close()
                    raise answer_too_big(self.host, limit)
                if channel.recv_ready():
                    out += channel.recv(1 << 16)
                elif channel.recv_stderr_ready():
                    err += channel.recv_stderr(1 << 16)
                elif channel.closed or (channel.eof_received and channel.exit_status_ready()):
                    # Not exit status alone: sshd may send it before the last
                    # of the output (2 in 100 runs cut a 3 MB answer short).
                    break
                elif deadline is not None and time.monotonic() > deadline:
                    # This command's channel only: closing the connection
                    # (as a broken one is) would break off every other
                    # thread's command on it, for one slow answer.
                    channel.close()
                    raise AnswerOverdue(self.host, timeout, moving)
                else:
                    if moving and timeout is not None and (len(out), len(err)) != seen:
                        seen, deadline = (len(out), len(err)), time.monotonic() + timeout
                    wait_readable(channel, 0.1)  # wakes on data or close
            code = channel.recv_exit_status()
            channel.close()
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise self._broke_off(command, exc) from None
        return RemoteResult(code, bytes(out), bytes(err))

    def _broke_off(self, command: str, exc: BaseException) -> BackendError:
        """The connection failed under `command`: closed, so the next command opens a new one."""
        self.close()
        return BackendError(f"ssh to {self.target.address}: `{command[:80]}` broke off: {exc}")

    def _session(self, command: str) -> paramiko.Channel:
        """A new session for a short command. sshd refuses one beyond
        MaxSessions while other threads' commands, followers and transfers
        hold them: wait for one of those to end rather than give up, and never
        close the connection they share (their commands would break off)."""
        deadline = time.monotonic() + SESSION_WAIT_SECONDS
        while True:
            try:
                return self._open_session()
            except paramiko.ChannelException as exc:
                if time.monotonic() > deadline:
                    raise NoSession(f"{self.host} opened no session for `{command[:80]}`: {exc}") from None
                time.sleep(0.1)
            except (paramiko.SSHException, OSError, EOFError) as exc:
                raise self._broke_off(command, exc) from None

    def _open_session(self) -> paramiko.Channel:
        """A new session channel, opened while no other thread opens one.
        paramiko keeps the reason sshd refused an open (MaxSessions: a
        ChannelException) in one slot of the transport, which the opening
        thread reads and clears: two threads refused at once, the first took
        both reasons and the second, finding none, raised SSHException
        "Unable to open channel.", which reads as a broken connection. That
        thread then closed the connection the others share, and every
        command under way on it failed with exit -1 (a step of a sweep under
        `doit -n 4 -P thread` failed with a loaded host). An open is one
        round trip: taking turns costs the threads nothing they notice."""
        with self._opening:
            return self.client().get_transport().open_session()  # type: ignore[union-attr]

    def stream(self, argv: list[str], out: Callable[[bytes], None], tick: Callable[[], None]) -> RemoteResult:
        """Run argv on the host for as long as it goes, handing its stdout to
        `out` as it comes and calling `tick` at least every STREAM_TICK
        seconds (it may raise, e.g. KeyboardInterrupt: the channel is then
        closed, which closes the command's stdin there). Its stdin stays
        open meanwhile: a command there can take its close for the client's
        end. The result's stdout is empty (it went to `out`)."""
        command = shlex.join(argv)
        if not self._streams.acquire(blocking=False):
            raise NoSession(f"{MAX_STREAMS} long-lived commands run on {self.host} already")
        channel = None
        try:
            try:
                channel = self._open_session()
            except paramiko.ChannelException as exc:  # the connection stays: other threads use it
                raise NoSession(f"{self.host} opened no session for `{command[:80]}`: {exc}") from None
            channel.exec_command(command)
            err = bytearray()
            while True:
                tick()
                if channel.recv_ready():
                    out(channel.recv(1 << 16))
                elif channel.recv_stderr_ready():
                    if len(err) > MAX_ANSWER_BYTES:
                        raise answer_too_big(self.host)
                    err += channel.recv_stderr(1 << 16)
                elif channel.closed or (channel.eof_received and channel.exit_status_ready()):
                    break
                else:
                    wait_readable(channel, STREAM_TICK)
            return RemoteResult(channel.recv_exit_status(), b"", bytes(err))
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise self._broke_off(command, exc) from None
        finally:
            if channel is not None:
                channel.close()
            self._streams.release()

    def check(self, argv: list[str], what: str, stdin: bytes | None = None) -> RemoteResult:
        result = self.run(argv, stdin=stdin)
        if result.returncode != 0:
            raise result.failure(what, self.host)
        return result

    def write_bytes(self, path: str, data: bytes, mode: int = 0o600) -> None:
        """Write a file there whole: beside it, then renamed over it. The
        temp name is this write's own: threads (or clients) installing the
        same file at once must not write into one temp file."""
        write = 'umask 077 && cat > "$1.$3" && chmod "$2" "$1.$3" && mv "$1.$3" "$1"'
        temp = f"{secrets.token_hex(6)}.tmp"
        self.check(["sh", "-c", write, "sh", path, f"{mode:o}", temp], f"writing {path}", stdin=data)

    def close(self) -> None:
        with self._lock:
            with contextlib.suppress(Exception):
                if self._client is not None:
                    self._client.close()
            self._client = None


_CONNECTIONS: dict[SshTarget, SshConnection] = {}
_CONNECTIONS_LOCK = threading.Lock()


def connection(target: SshTarget) -> SshConnection:
    """One shared connection per target in this process (doit threads too)."""
    with _CONNECTIONS_LOCK:
        conn = _CONNECTIONS.get(target)
        if conn is None:
            if not _CONNECTIONS:  # the first: only a process that connects closes at exit
                atexit.register(_close_all)
            conn = _CONNECTIONS[target] = SshConnection(target)
        return conn


def _close_all() -> None:
    for conn in list(_CONNECTIONS.values()):
        conn.close()
        with contextlib.suppress(Exception):
            conn.target.stop_master()
