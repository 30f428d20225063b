"""Where the stdlib-only scripts of `remote/` are.

In a wheel they are packed inside the package as `substrax_tasks/_remote/`;
in a source checkout (editable install) they are the repo's `remote/`.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
_CANDIDATES = (_PACKAGE / "_remote", _PACKAGE.parent / "remote")


def remote_dir() -> Path:
    for candidate in _CANDIDATES:
        if (candidate / "worker.py").is_file():
            return candidate
    raise FileNotFoundError(
        "substrax_tasks is installed without its remote scripts (looked in "
        + ", ".join(str(c) for c in _CANDIDATES)
        + "); reinstall the package"
    )


def remote_script(name: str) -> Path:
    return remote_dir() / name
