"""The project's configuration as a no-op `doit` needs it, without pydantic.

A dodo file is loaded on every `doit`, and each remote step needs its
backend's validated settings for its up-to-date key. Validating means
importing pydantic (~60 ms), which was most of a no-op run's own cost. So
the validated result is kept in a small JSON file, valid while
pyproject.toml, the SUBSTRAX_CONFIG overlay, SUBSTRAX_BACKEND, $HOME and
this package's version are unchanged; the phases that act open the full,
validated Project as before.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from substrax_tasks import __version__
from substrax_tasks._atomic import write_json_atomic

if TYPE_CHECKING:
    from substrax_tasks.runs import Project

# Defined here, not in config.py (which imports pydantic), and used by both.
BACKEND_ENV = "SUBSTRAX_BACKEND"  # names the default backend
# A TOML file whose [tool.substrax.compute] is laid over the project's: for
# machine-specific settings (hosts, keys) kept out of the repository.
CONFIG_ENV = "SUBSTRAX_CONFIG"
# The lock files a backend builds the run's environment from, first found
# wins; part of every step's key. Here, not in worker_job.py, so that a
# no-op doit does not import that module's dataclass.
ENV_LOCK_FILES = ("uv.lock", "requirements.lock", "requirements.txt")


def _file_stamp(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)  # noqa: PTH116 - a str, no Path: every step of every doit
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


_PYPROJECTS: dict[Path, tuple[str, str]] = {}  # root -> (its text, its pyproject.toml)


def config_key(root: Path) -> tuple[Any, ...]:
    """Everything the validated configuration depends on, hashable (taken
    for every step a dodo declares: the paths are made once per root)."""
    overlay = os.environ.get(CONFIG_ENV)
    known = _PYPROJECTS.get(root)
    if known is None:
        known = _PYPROJECTS[root] = (str(root), str(root / "pyproject.toml"))
    return (
        __version__,
        known[0],
        _file_stamp(known[1]),
        overlay,
        _file_stamp(overlay) if overlay else None,
        os.environ.get(BACKEND_ENV),
        os.environ.get("HOME"),  # `~` in settings paths
    )


def config_stamp(root: Path, key: tuple[Any, ...] | None = None) -> list[Any]:
    """`config_key` as the cache file keeps it (JSON: lists, not tuples)."""
    return json.loads(json.dumps(config_key(root) if key is None else key))  # type: ignore[no-any-return]


def cache_file(root: Path) -> Path:
    # Outside the project: its state_dir is itself part of what is cached.
    folder = Path(tempfile.gettempdir()) / f"substrax-{os.getuid()}"
    return folder / f"config-{hashlib.sha256(str(root).encode()).hexdigest()[:16]}.json"


class ResolvedProject:
    """The settings a no-op needs. A plain class: as a @dataclass it cost
    every doit ~0.4 ms at import (Python 3.11 compiles its methods then)."""

    def __init__(
        self,
        root: Path,
        state_dir: Path,
        default_backend: str,
        settings: dict[str, dict[str, Any]],  # backend name -> settings as pinned in handles
        _full: Project | None = None,
    ) -> None:
        self.root = root
        self.state_dir = state_dir
        self.root_text = str(root)  # paths a no-op checks for every step start with these
        self.state_dir_text = str(state_dir)
        self.default_backend = default_backend
        self.settings = settings
        self._full = _full
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ResolvedProject(root={self.root!r}, default_backend={self.default_backend!r})"

    def full(self) -> Project:
        """The validated Project (imports pydantic): for the phases that act."""
        with self._lock:
            if self._full is None:
                from substrax_tasks.runs import Project

                self._full = Project.open(self.root)
            return self._full

    def settings_for(self, backend: str | None = None) -> tuple[str, dict[str, Any]]:
        name = backend or self.default_backend
        if name not in self.settings:  # a backend only some step names: validate it now
            self.settings[name] = self.full().settings_for(name)[1]
        return name, self.settings[name]


def resolve(root: Path, stamp: list[Any] | None = None) -> ResolvedProject:
    """The project's configuration, from the cache when it is current."""
    stamp = config_stamp(root) if stamp is None else stamp
    path = cache_file(root)
    try:
        data = json.loads(path.read_text())
        if data.get("stamp") == stamp:
            return ResolvedProject(
                root, Path(data["state_dir"]), str(data["default_backend"]), dict(data["settings"])
            )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    from substrax_tasks.runs import Project

    project = Project.open(root)
    names = {project.config.default_backend, *project.config.backends}
    settings = {name: project.settings_for(name)[1] for name in sorted(names)}
    resolved = ResolvedProject(
        root, project.store.root, project.config.default_backend, settings, _full=project
    )
    try:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        write_json_atomic(
            path,
            {
                "stamp": stamp,
                "state_dir": str(resolved.state_dir),
                "default_backend": resolved.default_backend,
                "settings": settings,
            },
        )
    except OSError:
        pass  # a cache: the next doit validates again
    return resolved
