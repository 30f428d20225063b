"""Special files (a FIFO, a socket, a device) planted in a tree and found again."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

PLANT = """
import os, socket, stat
os.mkfifo("pipe")
with socket.socket(socket.AF_UNIX) as sock:
    sock.bind("sock")
os.mknod("node", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
"""


def plant_specials(folder: Path) -> None:
    """A fifo, a Unix socket's file and a world-writable char device (the
    null device's numbers), as a host could put them. Made from inside the
    folder: a socket's path is limited to 107 bytes, a run's folder is not."""
    subprocess.run([sys.executable, "-c", PLANT], cwd=folder, check=True, timeout=30)


def specials_under(root: Path) -> list[str]:
    found = []
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            mode = os.lstat(os.path.join(folder, name)).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
                found.append(os.path.relpath(os.path.join(folder, name), root))
    return found
