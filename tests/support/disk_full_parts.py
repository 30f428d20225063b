"""A project on a small disk of its own (issue 18 and 28, item 8): a tmpfs
mounted in a private mount namespace the test makes (as root), where doit
and `substrax-compute` run through nsenter; and a disk filled to its last
byte."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from dodo_helpers import clean_env

DISK_MB = 24


@contextlib.contextmanager
def small_disk(source: Path, root: Path, megabytes: int = DISK_MB) -> Iterator[int]:
    """The project `source` copied onto a tmpfs of `megabytes` mounted at
    `root` (made if missing; what it holds is hidden in the namespace only);
    yields the pid whose mount namespace holds it, killed at the end (the
    namespace and its tmpfs go with it)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("nsenter") is None:
        pytest.skip("DISK FULL NOT TESTED: needs root, unshare and nsenter")
    root.mkdir(exist_ok=True)
    script = (
        f"mount -t tmpfs -o size={megabytes}m none {root} && cp -a {source}/. {root}/ "
        "&& echo ready && exec sleep 3600"
    )
    holder = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
        yield holder.pid
    finally:
        holder.kill()
        holder.wait()
        assert holder.stdout is not None
        holder.stdout.close()


def seen_from_here(pid: int, root: Path) -> Path:
    """`root` inside the namespace, as this process reaches it."""
    return Path(f"/proc/{pid}/root") / str(root).lstrip("/")


def inside(
    pid: int, root: Path, *argv: str, env: Mapping[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`argv` run in the mount namespace of `pid`, in `root`."""
    return subprocess.run(
        ["nsenter", "-t", str(pid), "-m", f"--wd={root}", "--", *argv],
        env=clean_env(env), capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


# A doit task's action (in a dodo.py) that fills the disk of the project to
# its last byte while the flag file `fill-now` exists.
FILL_ACTION = """
import os

def fill_the_disk():
    if not os.path.exists("fill-now"):
        return
    for size in (1 << 20, 4096, 1):  # to the last byte
        try:  # the last files may find no room even to be made
            with open("filler-%d" % size, "wb") as f:
                while True:
                    f.write(b"\\0" * size)
                    f.flush()
        except OSError:
            pass
"""


def free_the_disk(seen: Path) -> None:
    """Undo FILL_ACTION: its fillers and its flag."""
    for made in [*seen.glob("filler-*"), seen / "fill-now"]:
        made.unlink(missing_ok=True)
