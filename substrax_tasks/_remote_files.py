"""Where the scripts run outside this process are.

* `remote/`: the stdlib-only scripts (worker, manifest, control) shipped to
  the machines a run uses, Python 3.8+.
* `sky_helper/`: `sky_sdk.py`, run here in SkyPilot's own interpreter (it
  imports `sky`, so it is neither stdlib-only nor shipped to a host).

In a wheel they are packed inside the package as `substrax_tasks/_remote/`
and `substrax_tasks/_sky_helper/`; in a source checkout (editable install)
they are the repo's folders of those names.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _folder(packed: str, checkout: str, marker: str) -> Path:
    candidates = (_PACKAGE / packed, _PACKAGE.parent / checkout)
    for candidate in candidates:
        if (candidate / marker).is_file():
            return candidate
    raise FileNotFoundError(
        f"substrax_tasks is installed without its {checkout}/ scripts (looked in "
        + ", ".join(str(c) for c in candidates)
        + "); reinstall the package"
    )


def remote_dir() -> Path:
    return _folder("_remote", "remote", "worker.py")


def remote_script(name: str) -> Path:
    return remote_dir() / name


def sky_helper_script() -> Path:
    """`sky_sdk.py`, SkyPilot's SDK one call per process (see _sky.py)."""
    return _folder("_sky_helper", "sky_helper", "sky_sdk.py") / "sky_sdk.py"
