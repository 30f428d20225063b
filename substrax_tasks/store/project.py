"""The project: its root, store, configuration, and runs submitted and
reached from Python (the doit chain, the CLI and tests use this).

    from substrax_tasks.store.project import Project
    project = Project.open(".")
    handle = project.submit(spec)
    status = project.backend_for(handle).wait(handle)

`Project.open` reads the cached resolution (config.py) when the
configuration is unchanged: a no-op `doit` builds a project per dodo load
and must neither validate nor import pydantic. The validated configuration
(`config`) is made when asked, by the phases that act.
"""

from __future__ import annotations

import contextlib
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from substrax_tasks.atomic import write_json_atomic
from substrax_tasks.config.pyproject import (
    cache_file,
    config_stamp,
    load_config,
    read_pyproject_table,
)
from substrax_tasks.constants import CACHE_FOLDER
from substrax_tasks.errors import ConfigError
from substrax_tasks.private import private_dir, trusted_file
from substrax_tasks.store.run_store import RunStore

if TYPE_CHECKING:  # pydantic models: not imported by a no-op doit
    from substrax_tasks.backends.base import Backend
    from substrax_tasks.config.settings import ComputeConfig
    from substrax_tasks.step.spec import StepSpec
    from substrax_tasks.store.handle import RunHandle


@dataclass
class Project:
    """A project: its store, each backend's settings as pinned in handles,
    the run cache's options (cache.CacheOptions). `config_error` is set
    only by `open(..., invalid_ok=True)`."""

    root: Path
    store: RunStore
    default_backend: str
    settings: dict[str, dict[str, Any]]  # backend name -> settings as pinned in handles
    cache: dict[str, Any]
    config_error: ConfigError | None = None
    _config: ComputeConfig | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def open(
        cls, root: str | Path = ".", *, stamp: list[Any] | None = None, invalid_ok: bool = False
    ) -> Project:
        """The project at `root`, from the cached resolution when it is
        current (`stamp`: config.config_stamp, when already taken). An
        invalid configuration raises ConfigError; with `invalid_ok` the
        project still finds its store (through `state_dir`), knows no
        settings and keeps the error: the CLI reaches runs through their
        handles' pinned settings, so an edited pyproject must not stop a
        cancel. Unreadable TOML stays an error."""
        path = Path(root).resolve()
        stamp = config_stamp(path) if stamp is None else stamp
        private_dir(CACHE_FOLDER)  # made, or refused when not ours alone
        cached = cache_file(path)
        try:
            data = json.loads(trusted_file(cached) or b"null")  # not ours alone: validate again
            if data.get("stamp") == stamp:
                return cls(path, RunStore(Path(data["state_dir"])), str(data["default_backend"]),
                           dict(data["settings"]), dict(data["cache"]))  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
        try:
            config = load_config(path)
        except ConfigError as exc:
            state_dir = read_pyproject_table(path).get("state_dir", ".substrax")
            if not invalid_ok or not isinstance(state_dir, str):
                raise
            from substrax_tasks.config.settings import CacheSettings

            store = RunStore((path / state_dir).resolve())
            return cls(path, store, "local", {}, CacheSettings().options(), exc)
        default = config.default_backend
        # load_config validated every configured backend: pinned() reuses those
        settings = {name: config.pinned(name, path) for name in sorted({default, *config.backends})}
        store, cache = RunStore(config.state_path(path)), config.cache.options()
        record = {"stamp": stamp, "state_dir": str(store.root), "default_backend": default,
                  "settings": settings, "cache": cache}  # fmt: skip
        with contextlib.suppress(OSError):  # a cache: the next doit validates again
            write_json_atomic(cached, record)
        return cls(path, store, default, settings, cache, None, config)

    @property
    def config(self) -> ComputeConfig:
        """The validated configuration (imports pydantic)."""
        with self._lock:
            if self._config is None:
                self._config = load_config(self.root)
            return self._config

    def settings_for(self, backend: str | None = None) -> tuple[str, dict[str, Any]]:
        """The backend's name and its validated settings, as pinned into handles."""
        name = backend or self.default_backend
        if name not in self.settings:  # a backend only some step names: validate it now
            self.settings[name] = self.config.pinned(name, self.root)
        return name, self.settings[name]

    def new_run(
        self, spec: StepSpec, backend: str | None = None, settings: dict[str, Any] | None = None, **state: Any
    ) -> RunHandle:
        """Write a new run's handle (nothing started yet) with `state`.
        `settings` overrides the configured ones, validated by the backend's model."""
        name, configured = self.settings_for(backend)
        if settings is not None:
            from substrax_tasks.backends.registry import settings_model

            model = settings_model(name)
            configured = model.model_validate(settings).model_dump(mode="json", by_alias=True)
        return self.store.new_run(spec, name, configured, project=str(self.root), **state)

    def backend_for(self, handle: RunHandle) -> Backend:
        """The run's backend, rebuilt from the handle's pinned settings."""
        from substrax_tasks.backends.registry import backend_class  # no backend is imported by a no-op doit

        return backend_class(handle.backend).from_handle(handle, self.store)

    def submit(
        self, spec: StepSpec, backend: str | None = None, settings: dict[str, Any] | None = None
    ) -> RunHandle:
        """Create the handle, then launch, set up, sync and start the run.
        Returns once the command has started; the run is detached."""
        from substrax_tasks.store.phase import Phase

        handle = self.new_run(spec, backend, settings)
        runner = self.backend_for(handle)
        for act, reached in ((runner.launch, Phase.LAUNCHED), (runner.setup, Phase.SET_UP),
                             (runner.sync, Phase.SYNCED), (runner.start, Phase.STARTED)):  # fmt: skip
            handle = self.store.advance(act(handle), reached)
        return handle
