"""The copy transport: rsync over OpenSSH (multiplexed, fast cipher).

Progress goes to a rich bar when stderr is a terminal, and to one summary
line otherwise.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, cast

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from substrax_tasks._output import emit
from substrax_tasks.errors import BackendError
from substrax_tasks.transports.base import TransferStats, Transport

# "  1,234,567  45%  12.34MB/s  0:00:10 (xfr#5, to-chk=10/20)"
_PROGRESS = re.compile(r"^\s*([\d,]+)\s+(\d+)%\s+\S+\s+\S+(?:\s+\(xfr#(\d+), (?:to|ir)-chk=(\d+)/(\d+)\))?")
_STAT_FILES = re.compile(r"Number of regular files transferred: ([\d,]+)")
_STAT_BYTES = re.compile(r"Total transferred file size: ([\d,]+)")
# rsync's output is read at most every READ_PAUSE seconds: a pause's worth of
# lines (some 10 KB at 20,000 small files a second) is far below what the
# pipe holds, so rsync never waits for it, and the hasher is never far behind.
READ_BLOCK = 1 << 16
READ_PAUSE = 0.01
# --out-format line of each item a download has received: a prefix no
# --stats or progress line starts with, then the name (a folder's ends in /)
_DONE = b"~"
# rsync writes a byte it would not print (and a backslash before "#ddd") as
# \#ooo, in octal
_ESCAPED = re.compile(rb"\\#([0-7]{3})")


def _number(text: str) -> int:
    return int(text.replace(",", ""))


class SshEndpoint(Protocol):
    """Where rsync's ssh goes: an SSH host, or a SkyPilot cluster's config."""

    @property
    def host(self) -> str: ...

    def ssh_argv(self) -> list[str]: ...


def _unescape(name: bytes) -> str:
    """The name rsync printed, as the file system has it."""
    if b"\\#" in name:
        name = _ESCAPED.sub(lambda m: bytes([int(m.group(1), 8)]), name)
    return os.fsdecode(name)


class RsyncTransport(Transport):
    name = "copy"

    def __init__(
        self, target: SshEndpoint, excludes: list[str] | None = None, show_progress: bool | None = None
    ) -> None:
        self.target = target
        self.excludes = list(excludes or [])
        self.show_progress = sys.stderr.isatty() if show_progress is None else show_progress
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopped = threading.Event()

    def _argv(self, source: str, dest: str) -> list[str]:
        argv = [
            # --no-owner/--no-group: files are ours on arrival, whoever ran rsync
            "rsync", "--archive", "--no-owner", "--no-group", "--recursive", "--from0", "--files-from=-",
            "--stats",
            "-e", shlex.join(self.target.ssh_argv()),
        ]  # fmt: skip
        if self.show_progress:  # parsed for the bar; nobody reads it otherwise
            # The whole file list first, so the bar's total is right from the
            # start; otherwise rsync's incremental recursion (~5% faster on
            # 20,000 small files here) lists folders as it goes.
            argv += ["--info=progress2", "--no-inc-recursive"]
        for pattern in self.excludes:
            argv.append(f"--exclude={pattern}")
        return [*argv, source, dest]

    def upload(self, local_root: Path, rel_paths: list[str], remote_root: str) -> TransferStats:
        dest = f"{self.target.host}:{remote_root.rstrip('/')}/"
        # remote_root exists (made at launch): no --mkpath, which needs rsync 3.2.3+
        return self._rsync(self._argv(f"{local_root}/", dest), rel_paths, "upload")

    def download(
        self,
        remote_root: str,
        rel_paths: list[str],
        local_root: Path,
        on_file: Callable[[str], None] | None = None,
    ) -> TransferStats:
        local_root.mkdir(parents=True, exist_ok=True)
        source = f"{self.target.host}:{remote_root.rstrip('/')}/"
        # An output the run did not make is skipped (its manifest says so).
        # Outputs hold only files, folders and symlinks: a device or fifo
        # there is refused by the manifest, so it is never made here either.
        extra = ["--ignore-missing-args", "--no-devices", "--no-specials"]
        if on_file is not None:
            extra.append(f"--out-format={_DONE.decode()}%n")
        return self._rsync(self._argv(source, f"{local_root}/"), rel_paths, "fetch", *extra, on_file=on_file)

    def stop(self) -> None:
        """Kill the copy under way, from another thread: it then raises
        BackendError. Nothing happens if no copy is running."""
        self._stopped.set()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()

    def _rsync(
        self,
        argv: list[str],
        rel_paths: list[str],
        what: str,
        *extra: str,
        on_file: Callable[[str], None] | None = None,
    ) -> TransferStats:
        argv = [argv[0], *extra, *argv[1:]]
        listing = b"".join(p.rstrip("/").encode() + b"\0" for p in rel_paths)
        started = time.monotonic()
        # stderr to a file: a pipe read only at the end could fill up and
        # stall rsync; `with` closes stdout and reaps rsync on any error.
        with (
            tempfile.TemporaryFile() as errfile,
            subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errfile) as proc,
        ):
            assert proc.stdin is not None and proc.stdout is not None
            self._proc = proc
            if self._stopped.is_set():
                proc.kill()
            stdout = cast(io.BufferedReader, proc.stdout)  # Popen's pipes are buffered readers
            try:
                with contextlib.suppress(BrokenPipeError):  # rsync ended early: its exit says why
                    proc.stdin.write(listing)
                    proc.stdin.close()
                with self._progress(what) as (progress, task):
                    reader = _OutputReader(on_file, progress, task)
                    while chunk := stdout.read1(READ_BLOCK):
                        reader.feed(chunk)
                        if len(chunk) < READ_BLOCK // 2:
                            # rsync writes a line per file: read what gathered
                            # in a pause, not each line as it comes (20,000
                            # reads, waking this process up 20,000 times).
                            time.sleep(READ_PAUSE)
                    reader.feed(b"\n")  # the last line, if unterminated
            except BaseException:
                proc.kill()
                raise
            finally:
                self._proc = None
            code = proc.wait()
            errfile.seek(0)
            errors = errfile.read().decode(errors="replace")
        text = reader.output.decode(errors="replace")
        if code != 0:
            raise BackendError(
                f"rsync {what} with {self.target.host} failed (exit {code}): {errors.strip()[-1500:]}"
            )
        files = _STAT_FILES.search(text)
        size = _STAT_BYTES.search(text)
        stats = TransferStats(
            files=_number(files.group(1)) if files else 0,
            bytes=_number(size.group(1)) if size else 0,
            seconds=time.monotonic() - started,
        )
        if not self.show_progress:
            emit(stats.summary(what), err=True)
        return stats

    def _progress(self, what: str) -> _ProgressContext:
        return _ProgressContext(what, self.show_progress)


class _OutputReader:
    """rsync's stdout, line by line: names of received files go to
    `on_file`, progress lines to the bar, the rest (--stats) is kept."""

    def __init__(
        self, on_file: Callable[[str], None] | None, progress: Progress | None, task: TaskID | None
    ) -> None:
        self.on_file = on_file
        self.progress = progress
        self.task = task
        self.output = bytearray()
        self._buffer = b""

    def feed(self, chunk: bytes) -> None:
        *lines, self._buffer = re.split(rb"[\r\n]", self._buffer + chunk)
        for line in lines:
            if line.startswith(_DONE):
                if self.on_file is not None and not line.endswith(b"/"):  # a folder's ends in /
                    self.on_file(_unescape(line[len(_DONE) :]))
                continue
            self.output += line + b"\n"
            if self.progress is not None and self.task is not None:
                self._show(line)

    def _show(self, line: bytes) -> None:
        match = _PROGRESS.match(line.decode(errors="replace"))
        if match is None or self.progress is None or self.task is None:
            return
        done = _number(match.group(1))
        percent = int(match.group(2))
        total = done * 100 // percent if percent else None
        count = ""
        if match.group(4) is not None:  # to-chk=LEFT/ALL: files done
            left, every = int(match.group(4)), int(match.group(5))
            count = f" {every - left}/{every} files"
        self.progress.update(self.task, completed=done, total=total, files=count)


class _ProgressContext:
    def __init__(self, what: str, enabled: bool) -> None:
        self.what = what
        self.progress: Progress | None = None
        if enabled:
            self.progress = Progress(
                TextColumn(f"{what}{{task.fields[files]}}"), BarColumn(), DownloadColumn(),
                TransferSpeedColumn(), TimeRemainingColumn(), transient=False, console=Console(stderr=True),
            )  # fmt: skip

    def __enter__(self) -> tuple[Progress | None, TaskID | None]:
        if self.progress is None:
            return None, None
        self.progress.start()
        return self.progress, self.progress.add_task(self.what, total=None, files="")

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()


_ = Path
