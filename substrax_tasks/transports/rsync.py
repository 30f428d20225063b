"""The copy transport: rsync over OpenSSH (multiplexed, fast cipher).

Progress goes to a rich bar when stderr is a terminal, and to one summary
line otherwise.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
import sys
import tempfile
import time
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


def _number(text: str) -> int:
    return int(text.replace(",", ""))


class SshEndpoint(Protocol):
    """Where rsync's ssh goes: an SSH host, or a SkyPilot cluster's config."""

    @property
    def host(self) -> str: ...

    def ssh_argv(self) -> list[str]: ...


class RsyncTransport(Transport):
    name = "copy"

    def __init__(
        self, target: SshEndpoint, excludes: list[str] | None = None, show_progress: bool | None = None
    ) -> None:
        self.target = target
        self.excludes = list(excludes or [])
        self.show_progress = sys.stderr.isatty() if show_progress is None else show_progress

    def _argv(self, source: str, dest: str) -> list[str]:
        argv = [
            # --no-owner/--no-group: files are ours on arrival, whoever ran rsync
            "rsync", "--archive", "--no-owner", "--no-group", "--recursive", "--from0", "--files-from=-",
            "--info=progress2", "--stats", "--no-inc-recursive",
            "-e", shlex.join(self.target.ssh_argv()),
        ]  # fmt: skip
        for pattern in self.excludes:
            argv.append(f"--exclude={pattern}")
        return [*argv, source, dest]

    def upload(self, local_root: Path, rel_paths: list[str], remote_root: str) -> TransferStats:
        dest = f"{self.target.host}:{remote_root.rstrip('/')}/"
        # remote_root exists (made at launch): no --mkpath, which needs rsync 3.2.3+
        return self._rsync(self._argv(f"{local_root}/", dest), rel_paths, "upload")

    def download(self, remote_root: str, rel_paths: list[str], local_root: Path) -> TransferStats:
        local_root.mkdir(parents=True, exist_ok=True)
        source = f"{self.target.host}:{remote_root.rstrip('/')}/"
        return self._rsync(self._argv(source, f"{local_root}/"), rel_paths, "fetch")

    def _rsync(self, argv: list[str], rel_paths: list[str], what: str, *extra: str) -> TransferStats:
        argv = [argv[0], *extra, *argv[1:]]
        listing = b"".join(p.rstrip("/").encode() + b"\0" for p in rel_paths)
        started = time.monotonic()
        output = bytearray()
        # stderr to a file: a pipe read only at the end could fill up and
        # stall rsync; `with` closes stdout and reaps rsync on any error.
        with (
            tempfile.TemporaryFile() as errfile,
            subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errfile) as proc,
        ):
            assert proc.stdin is not None and proc.stdout is not None
            stdout = cast(io.BufferedReader, proc.stdout)  # Popen's pipes are buffered readers
            try:
                with contextlib.suppress(BrokenPipeError):  # rsync ended early: its exit says why
                    proc.stdin.write(listing)
                    proc.stdin.close()
                with self._progress(what) as (progress, task):
                    buffer = b""
                    while True:
                        chunk = stdout.read1(1 << 14)
                        if not chunk:
                            break
                        output += chunk
                        buffer += chunk
                        *lines, buffer = re.split(rb"[\r\n]", buffer)
                        for line in lines:
                            match = _PROGRESS.match(line.decode(errors="replace"))
                            if match and progress is not None and task is not None:
                                done = _number(match.group(1))
                                percent = int(match.group(2))
                                total = done * 100 // percent if percent else None
                                count = ""
                                if match.group(4) is not None:  # to-chk=LEFT/ALL: files done
                                    left, every = int(match.group(4)), int(match.group(5))
                                    count = f" {every - left}/{every} files"
                                progress.update(task, completed=done, total=total, files=count)
            except BaseException:
                proc.kill()
                raise
            code = proc.wait()
            errfile.seek(0)
            errors = errfile.read().decode(errors="replace")
        text = output.decode(errors="replace")
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
