"""Where the scripts run outside this process are: `remote/`, the
stdlib-only scripts (worker, control, proctree, sandbox, hints, manifest,
gpus, env, runfiles) shipped to the machines a run uses, Python 3.8+.

This side imports them as the package `substrax_tasks._remote` (control,
env, manifest, runfiles, ...): the very files that run over there.
(SkyPilot's SDK helper is the SkyPilot backend's own: skypilot/client.py.)

`substrax_tasks/_remote` is a symbolic link to the repository's `remote/`,
so the same path holds the scripts in a source checkout (the editable
install) and in a wheel (which packs the files through the link). A link,
rather than a package whose `__path__` is pointed at `remote/` when it
runs: mypy, and every other tool that reads the tree, sees the real
modules under their real name, so the client's calls into them are checked
against their code.
"""

from __future__ import annotations

import shutil
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]  # substrax_tasks/, two up from backends/scripts.py
_REMOTE = _PACKAGE / "_remote"
# What a host needs in its bin folder to run the worker (and what its
# digest covers): every module of remote/, so a new one is shipped and
# checked (remote_run.CHECKED_RUN) without a list to keep in step.
REMOTE_SCRIPTS = tuple(sorted(path.name for path in _REMOTE.glob("*.py")))


def remote_dir() -> Path:
    if not (_REMOTE / "worker.py").is_file():
        raise FileNotFoundError(
            f"substrax_tasks is installed without its remote/ scripts (looked in {_REMOTE}); "
            "reinstall the package"
        )
    return _REMOTE


def remote_script(name: str) -> Path:
    return remote_dir() / name


def staged_scripts(into: Path) -> Path:
    """A fresh folder `into` holding the scripts and nothing else, for a
    copy that takes a whole folder (SkyPilot's file mount): remote/ itself
    also holds the byte code the install compiled, which a host must never
    be sent (its scripts' check refuses any there, as a host's own)."""
    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(parents=True)
    for name in REMOTE_SCRIPTS:
        shutil.copyfile(remote_script(name), into / name)
    return into
