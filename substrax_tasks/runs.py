"""Submitting and reaching runs from Python (the doit chain and tests use this).

    from substrax_tasks.runs import Project
    project = Project.open(".")
    handle = project.submit(spec)
    status = project.backend_for(handle).wait(handle)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from substrax_tasks.backends import backend_class, settings_model
from substrax_tasks.backends.base import Backend
from substrax_tasks.config import ResolvedProject, load_config
from substrax_tasks.handle import RunHandle
from substrax_tasks.settings import ComputeConfig
from substrax_tasks.spec import StepSpec
from substrax_tasks.store import RunStore


@dataclass(frozen=True)
class Project:
    root: Path
    config: ComputeConfig
    store: RunStore

    @classmethod
    def open(cls, root: str | Path = ".") -> Project:
        path = Path(root).resolve()
        config = load_config(path)
        return cls(path, config, RunStore(config.state_path(path)))

    @classmethod
    def of(cls, resolved: ResolvedProject) -> Project:
        """The project a no-op's resolution stands for, validated now."""
        return cls(resolved.root, resolved.config(), resolved.store)

    def settings_for(self, backend: str | None = None) -> tuple[str, dict[str, Any]]:
        """The backend's name and its validated settings, as pinned into handles."""
        name = backend or self.config.default_backend
        return name, self.config.pinned(name, self.root)

    def new_run(
        self, spec: StepSpec, backend: str | None = None, settings: dict[str, Any] | None = None, **state: Any
    ) -> RunHandle:
        """Write a new run's handle (nothing started yet) with `state`.
        `settings` overrides the configured ones, validated by the backend's model."""
        name, configured = self.settings_for(backend)
        if settings is not None:
            model = settings_model(name)
            configured = model.model_validate(settings).model_dump(mode="json", by_alias=True)
        return self.store.new_run(spec, name, configured, project=str(self.root), **state)

    def backend_for(self, handle: RunHandle) -> Backend:
        """The run's backend, rebuilt from the handle's pinned settings."""
        return backend_class(handle.backend).from_handle(handle, self.store)

    def submit(
        self, spec: StepSpec, backend: str | None = None, settings: dict[str, Any] | None = None
    ) -> RunHandle:
        """Create the handle, then launch, set up, sync and start the run.
        Returns once the command has started; the run is detached."""
        handle = self.new_run(spec, backend, settings)
        runner = self.backend_for(handle)
        for phase in (runner.launch, runner.setup, runner.sync, runner.start):
            handle = phase(handle)
        return handle

