"""The Python a step's command runs, as part of what its run sees.

A step whose argv names a Python (`python3 train.py`) runs whichever
interpreter that name finds on PATH; without a lock file nothing else in
its key says which. Another Python first on PATH (a pyenv version, a venv
activated) can make other outputs from the same inputs, so the key holds
the interpreter the command would run: its path and version
(`described`, asked of it once per process and binary), and the proof of
a no-op holds the path found and the binary's stat (`stamp`: no process is
started on that path), so a PATH that now finds another Python, or the
binary replaced, makes the step checked in full.

Only for backends whose command's program is found on this machine's PATH
(constants.PROGRAM_FOUND_HERE): over ssh and SkyPilot the
argv runs on a machine whose PATH this process does not know.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from pathlib import Path

PYTHON = re.compile(r"python[0-9.]*")  # the names a Python goes by (as backends/local/program.py)
ASK = "import sys; print(sys.executable); print(sys.version.split()[0])"
ASK_SECONDS = 60


def python_named(argv0: str, root: str, env: dict[str, str]) -> str | None:
    """The path of the Python `argv0` names, as the command would find it
    (on PATH, the step's `env` over this process's as the local backend
    looks it up, or a path from the project folder); None when `argv0` is
    no Python. Found once per process for each name, folder and PATH."""
    if not PYTHON.fullmatch(Path(argv0).name):
        return None
    return _found(argv0, root, env.get("PATH") or os.environ.get("PATH", os.defpath))


@functools.lru_cache(maxsize=64)
def _found(argv0: str, root: str, path: str) -> str:
    if "/" in argv0:
        return os.path.normpath(Path(root, argv0))  # an absolute argv0 stays itself
    found = shutil.which(argv0, path=path)
    return str(Path(found).absolute()) if found else f"{argv0} (not found on PATH)"


def stamp(found: str) -> tuple[str, str, int, int, int]:
    """What the proof holds of the Python found: its path, the binary it
    leads to and that binary's stat (another binary, or this one
    replaced, changes it). A stat, never a process."""
    real = os.path.realpath(found)
    try:
        st = Path(real).stat()
    except OSError:
        return found, real, 0, 0, 0
    return found, real, st.st_mtime_ns, st.st_size, st.st_ino


def described(found: str, root: str) -> str:
    """The interpreter as the key holds it and `why` names it: the
    executable it runs (a pyenv shim or a venv's link named as what it
    runs) and its version, e.g. "/usr/bin/python3.11 (3.11.2)"."""
    _, real, mtime, size, inode = stamp(found)
    return _asked(found, root, real, mtime, size, inode, os.environ.get("PATH", os.defpath))


@functools.lru_cache(maxsize=64)
def _asked(found: str, root: str, real: str, mtime: int, size: int, inode: int, path: str) -> str:  # noqa: PLR0917
    """Asked once per process for each binary (its stat in the arguments:
    one replaced is asked again) and PATH (what a shim reads)."""
    del real, mtime, size, inode, path  # the cache's key only
    try:
        done = subprocess.run(
            [found, "-c", ASK], cwd=root, stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=ASK_SECONDS, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{found} (does not run here: {type(exc).__name__})"
    lines = done.stdout.splitlines()
    if done.returncode != 0 or len(lines) != 2:
        return f"{found} (not a Python that answers: exit {done.returncode})"
    return f"{lines[0]} ({lines[1]})"
