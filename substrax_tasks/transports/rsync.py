"""The copy transport: rsync over OpenSSH (multiplexed, fast cipher)."""

from __future__ import annotations

import contextlib
import errno
import io
import re
import shlex
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

from substrax_tasks.console import emit, marking, stderr
from substrax_tasks.errors import BackendError
from substrax_tasks.run.promote import RSYNC_SAFE_CHMOD
from substrax_tasks.transports.base import DiskFullHere, TransferStats, Transport, progress
from substrax_tasks.transports.openssh import master_in_use

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

# "  1,234,567  45%  12.34MB/s  0:00:10 (xfr#5, to-chk=10/20)"
_PROGRESS = re.compile(r"^\s*([\d,]+)\s+(\d+)%\s+\S+\s+\S+(?:\s+\(xfr#\d+, (?:to|ir)-chk=(\d+)/(\d+)\))?")
_STAT_FILES = re.compile(r"Number of regular files transferred: ([\d,]+)")
_STAT_BYTES = re.compile(r"Total transferred file size: ([\d,]+)")
_SKIPPED = re.compile(r'^skipping non-regular file "(.*)"$', re.MULTILINE)
# What rsync's receiver says of a write a full disk (or quota) refused:
# `rsync: [receiver] write failed on "PATH": No space left on device (28)`.
_FULL = re.compile(r'"([^"\n]+)"[^\n]*: (?:No space left on device|Disk quota exceeded) \((\d+)\)')
READ_BLOCK = 1 << 16

# What a copy says when ssh's multiplexing master died under it: ssh's own
# words, or only rsync's (exit 12 or 255, by which side noticed first). A
# new master then works where the old one cannot.
DEAD_MASTER_SIGNS = (
    "read from master failed",
    "mux_client_request_session",
    "Control socket connect",
    "connection unexpectedly closed",
)


def _number(text: str) -> int:
    return int(text.replace(",", ""))


class SshEndpoint(Protocol):
    """Where rsync's ssh goes: an SSH host, or a SkyPilot cluster's config."""

    @property
    def host(self) -> str: ...

    def ssh_argv(self) -> list[str]: ...

    def control_path(self) -> str: ...

    def drop_master(self) -> None: ...


class RsyncTransport(Transport):
    writes_safe_modes = True  # --chmod (RSYNC_SAFE_CHMOD) on every download

    def __init__(
        self, target: SshEndpoint, excludes: list[str] | None = None, show_progress: bool | None = None,
        *, quiet: bool = False,
    ) -> None:
        """`quiet`: no bar and no start or summary line (the checkpoints'
        copies, every few minutes while a run goes, say one line of their own)."""
        self.target = target
        self.excludes = list(excludes or [])
        self.quiet = quiet
        self.show_progress = not quiet and (stderr().isatty() if show_progress is None else show_progress)

    def _argv(self, source: str, dest: str, *extra: str) -> list[str]:
        argv = [
            # --no-owner/--no-group: files are ours on arrival, whoever ran rsync
            "rsync", "--archive", "--no-owner", "--no-group", "--recursive", "--from0", "--files-from=-",
            "--stats", *extra,
            "-e", shlex.join(self.target.ssh_argv()),
        ]  # fmt: skip
        if self.show_progress:  # parsed for the bar; nobody reads it otherwise
            # The whole file list first, so the bar's total is right from the
            # start; otherwise rsync's incremental recursion (~5% faster on
            # 20,000 small files here) lists folders as it goes.
            argv += ["--info=progress2", "--no-inc-recursive"]
        argv += [f"--exclude={pattern}" for pattern in self.excludes]
        return [*argv, source, dest]

    def upload(self, local_root: Path, rel_paths: list[str], remote_root: str) -> TransferStats:
        dest = f"{self.target.host}:{remote_root.rstrip('/')}/"
        # remote_root exists (made at launch): no --mkpath, which needs rsync 3.2.3+
        return self._rsync(self._argv(f"{local_root}/", dest), rel_paths, "upload")[0]

    def download(self, remote_root: str, rel_paths: list[str], local_root: Path) -> TransferStats:
        local_root.mkdir(parents=True, exist_ok=True)
        source = f"{self.target.host}:{remote_root.rstrip('/')}/"
        # An output the run did not make is skipped (its manifest says so).
        # Outputs hold only files, folders and symlinks (the worker's
        # manifest refuses anything else): a device, fifo or socket there now
        # was put in after the run, and is never made here (after --archive,
        # which would turn them back on), and the copy is refused. No copy
        # keeps a setuid, setgid or sticky bit or is world-writable here
        # (promote.safe_mode; the promotion checks it again). Runs of zeros
        # are written as holes (--sparse): a sparse file there (a checkpoint
        # made with truncate, a preallocated one) takes no more disk here.
        # A copy into a staging folder an earlier fetch left brings only what
        # differs, and --delete makes each folder output hold only what is
        # there (not a file deleted since, nor a killed copy's temp files), as
        # a fresh copy would: a second fetch costs a no-op rsync, not a full copy.
        extra: tuple[str, ...] = ("--ignore-missing-args", "--no-devices", "--no-specials", "--sparse")
        extra += ("--delete", RSYNC_SAFE_CHMOD)
        try:
            stats, said = self._rsync(self._argv(source, f"{local_root}/", *extra), rel_paths, "fetch")
        except BackendError as exc:
            full = _FULL.search(str(exc))
            if full is not None and full.group(1).startswith(str(local_root)):
                code = errno.ENOSPC if full.group(2) == str(errno.ENOSPC) else errno.EDQUOT
                raise DiskFullHere(str(exc), code, full.group(1)) from None
            raise
        skipped = _SKIPPED.findall(said)
        if skipped:
            raise BackendError(
                f"the outputs on {self.target.host} hold {', '.join(skipped[:5])}, which "
                f"{'is' if len(skipped) == 1 else 'are'} not a file, folder or symlink: the copy is "
                "refused (they were not copied here); the run's outputs were changed on the host"
            )
        return stats

    def _rsync(self, argv: list[str], rel_paths: list[str], what: str) -> tuple[TransferStats, str]:
        """rsync's figures and what it said on stdout. A copy that failed
        because ssh's multiplexing master had died under it (its connection
        gone without a reset: the network dropped, the host restarted) is
        tried once more on a new master (the master's own timeout, or a
        network gone for longer than it, ends a copy on it that way)."""
        shared = Path(self.target.control_path()).exists()
        with master_in_use(self.target.control_path()):  # no other teardown ends it meanwhile
            try:
                return self._rsync_once(argv, rel_paths, what)
            except BackendError as exc:
                # 255: ssh's own failure. Another cause of the same words
                # (rsync missing on the host) fails the second try the same way.
                said = str(exc)
                if not shared or not (" (exit 255)" in said or any(s in said for s in DEAD_MASTER_SIGNS)):
                    raise
            emit(f"{what}: ssh's shared connection to {self.target.host} had died; again on a new one",
                 err=True)
            self.target.drop_master()
            return self._rsync_once(argv, rel_paths, what)

    def _rsync_once(self, argv: list[str], rel_paths: list[str], what: str) -> tuple[TransferStats, str]:
        listing = b"".join(p.rstrip("/").encode() + b"\0" for p in rel_paths)
        started = time.monotonic()
        output = bytearray()
        # No bar while steps run beside each other: bars redrawn from several
        # threads garble the terminal; a start and an end line, marked, instead.
        bar = progress(what) if self.show_progress and not marking() else None
        if bar is None and not self.quiet:  # a long copy says when it starts, not only when it ends
            where = f"{len(rel_paths)} files to" if what == "upload" else f"{len(rel_paths)} outputs from"
            emit(f"{what}: started, {where} {self.target.host}", err=True)
        # stderr to a file: a pipe read only at the end could fill up and
        # stall rsync; `with` closes stdout and reaps rsync on any error.
        with (
            tempfile.TemporaryFile() as errfile,
            subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errfile) as proc,
            bar if bar is not None else contextlib.nullcontext(),
        ):
            assert proc.stdin is not None and proc.stdout is not None
            task = bar.add_task(what, total=None, files="") if bar is not None else None
            stdout = cast(io.BufferedReader, proc.stdout)  # Popen's pipes are buffered readers
            try:
                with contextlib.suppress(BrokenPipeError):  # rsync ended early: its exit says why
                    proc.stdin.write(listing)
                    proc.stdin.close()
                pending = b""
                while chunk := stdout.read1(READ_BLOCK):
                    *lines, pending = re.split(rb"[\r\n]", pending + chunk)
                    for line in lines:
                        output += line + b"\n"
                        if bar is not None and task is not None:
                            _show(bar, task, line)
                output += pending
            except BaseException:
                proc.kill()
                raise
            code = proc.wait()
            errfile.seek(0)
            errors = errfile.read().decode(errors="replace")
        if code != 0:
            raise BackendError(
                f"rsync {what} with {self.target.host} failed (exit {code}): {errors.strip()[-1500:]}"
            )
        text = output.decode(errors="replace")
        files, size = _STAT_FILES.search(text), _STAT_BYTES.search(text)
        stats = TransferStats(
            files=_number(files.group(1)) if files else 0,
            bytes=_number(size.group(1)) if size else 0,
            seconds=time.monotonic() - started,
        )
        if bar is None and not self.quiet:
            emit(stats.summary(what), err=True)
        return stats, text


def _show(bar: Progress, task: TaskID, line: bytes) -> None:
    """One of rsync's --info=progress2 lines, on the bar."""
    match = _PROGRESS.match(line.decode(errors="replace"))
    if match is None:
        return
    done, percent = _number(match.group(1)), int(match.group(2))
    count = ""
    if match.group(3) is not None:  # to-chk=LEFT/ALL: files done
        left, every = int(match.group(3)), int(match.group(4))
        count = f" {every - left}/{every} files"
    bar.update(task, completed=done, total=done * 100 // percent if percent else None, files=count)
