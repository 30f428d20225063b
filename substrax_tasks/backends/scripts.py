"""Where the scripts run outside this process are: `remote/`, the
stdlib-only scripts (worker, control, proctree, sandbox, hints, manifest,
gpus, env) shipped to the machines a run uses, Python 3.8+; the local
backend loads control.py and env.py into this process (`remote_module`).

In a wheel they are packed inside the package as `substrax_tasks/_remote/`;
in a source checkout (editable install) they are the repo's `remote/`.
(SkyPilot's SDK helper is the SkyPilot backend's own: skypilot/client.py.)
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:
    from collections.abc import Sequence

_PACKAGE = Path(__file__).resolve().parents[1]  # substrax_tasks/, two up from backends/scripts.py
# What a host needs in its bin folder to run the worker (and what its digest covers).
REMOTE_SCRIPTS = ("worker.py", "control.py", "proctree.py", "sandbox.py", "manifest.py", "gpus.py", "env.py",
                  "hints.py")  # fmt: skip


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


_load_lock = threading.Lock()
# Modules whose loading has finished: sys.modules holds a module while it
# loads (dataclasses look it up there), which another thread must not take.
_loaded: dict[str, ModuleType] = {}


def remote_module(name: str) -> ModuleType:
    """`remote/<name>.py` loaded into this process once, as the module
    `substrax_remote_<name>`: the very file that runs over there. Only for
    the scripts that import no sibling (control, sandbox, manifest, gpus)."""
    module_name = f"substrax_remote_{name}"
    module = _loaded.get(module_name)
    if module is not None:  # the common case, without the lock
        return module
    with _load_lock:
        module = sys.modules.get(module_name)
        if module is None:
            path = remote_script(f"{name}.py")
            spec = importlib.util.spec_from_file_location(module_name, path)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {path}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[module_name]
                raise
        _loaded[module_name] = module
    return module


if TYPE_CHECKING:

    class Control(Protocol):
        """The parts of `remote/control.py` used on this side (see there)."""

        def read_json(self, path: str) -> dict[str, Any] | None: ...
        def start_ticks(self, pid: object) -> int | None: ...
        def alive(self, pid: object, ticks: object) -> bool: ...
        def status(self, run_dir: str) -> dict[str, Any]: ...
        def cancel(self, run_dir: str, wait: float) -> dict[str, Any]: ...

    class Env(Protocol):
        """The parts of `remote/env.py` used on this side (see there)."""

        BuildFailed: type[Exception]

        def lock_file(self, project: str) -> str | None: ...
        def digest(self, project: str, lock: str, python: str, pip_args: Sequence[str]) -> str: ...
        def ensure(
            self, project: str, envs_dir: str, python: str, pip_args: Sequence[str]
        ) -> dict[str, str | bool]: ...


def control() -> Control:
    """`remote/control.py`: the one status and cancel of a run (the local
    backend calls it here, the others run it on their host)."""
    return cast("Control", remote_module("control"))


def env() -> Env:
    """`remote/env.py`: the one recipe of the locked environment."""
    return cast("Env", remote_module("env"))

