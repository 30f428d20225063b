"""The store: `<state_dir>/runs/<run-id>/` holds each run's handle and files."""

from __future__ import annotations

import datetime
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from substrax_tasks.errors import HandleError
from substrax_tasks.handle import HANDLE_FILE, RunHandle, read_handle, write_handle
from substrax_tasks.spec import StepSpec, canonical_digest, safe_name


@dataclass(frozen=True)
class Unreadable:
    """A run record that could not be read, and why."""

    path: Path
    reason: str


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def run_digest(spec: StepSpec, backend: str, settings: dict[str, Any]) -> str:
    """What decides a run's result: the spec plus the backend and its settings."""
    return canonical_digest(
        {"spec": spec.model_dump(mode="json"), "backend": backend, "settings": settings}
    )


class RunStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.runs_dir = root / "runs"

    def run_dir(self, run_id: str) -> Path:
        return self.runs_dir / run_id

    def handle_path(self, run_id: str) -> Path:
        return self.run_dir(run_id) / HANDLE_FILE

    def new_run(self, spec: StepSpec, backend: str, settings: dict[str, Any]) -> RunHandle:
        """Create the run's folder and write its handle: the first durable
        record, made before anything slow or paid happens."""
        now = utc_now()
        run_id = f"{safe_name(spec.step)}-{now:%Y%m%dT%H%M%S}-{secrets.token_hex(3)}"
        self.runs_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.run_dir(run_id).mkdir(mode=0o700)
        handle = RunHandle(
            run_id=run_id,
            step=spec.step,
            backend=backend,
            settings=settings,
            spec=spec,
            spec_digest=run_digest(spec, backend, settings),
            created_at=now.isoformat(timespec="milliseconds"),
        )
        self.write(handle)
        return handle

    def write(self, handle: RunHandle) -> None:
        write_handle(self.handle_path(handle.run_id), handle)

    def update_state(self, handle: RunHandle, **changes: Any) -> RunHandle:
        """Merge `changes` into the backend state and write it at once. The
        state on disk is the base (a backend may have recorded something
        since `handle` was read), the given handle's state the fallback."""
        try:
            current = read_handle(self.handle_path(handle.run_id)).state
        except HandleError:
            current = {}
        updated = handle.model_copy(update={"state": {**handle.state, **current, **changes}})
        self.write(updated)
        return updated

    def read(self, run_ref: str) -> RunHandle:
        return read_handle(self.handle_path(self.resolve(run_ref)))

    def resolve(self, run_ref: str) -> str:
        """A run id from the id itself or a unique prefix of it."""
        if "/" in run_ref or run_ref in ("", ".", ".."):
            raise HandleError(f"{run_ref!r} is not a run id; see `substrax-compute status`")
        if self.run_dir(run_ref).is_dir():
            return run_ref
        matches = sorted(p.name for p in self._run_dirs() if p.name.startswith(run_ref))
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise HandleError(
                f"no run {run_ref!r} in {self.runs_dir}; `substrax-compute status` lists the runs"
            )
        raise HandleError(f"{run_ref!r} matches several runs ({', '.join(matches)}); give more of the id")

    def _run_dirs(self) -> list[Path]:
        try:
            with os.scandir(self.runs_dir) as entries:
                return [Path(e.path) for e in entries if e.is_dir()]
        except FileNotFoundError:
            return []

    def read_all(self) -> tuple[list[RunHandle], list[Unreadable]]:
        """Every readable handle (oldest first) and each unreadable record
        with its reason, so that one damaged record hides nothing."""
        handles: list[RunHandle] = []
        unreadable: list[Unreadable] = []
        for run_dir in self._run_dirs():
            path = run_dir / HANDLE_FILE
            try:
                handles.append(read_handle(path))
            except HandleError as exc:
                unreadable.append(Unreadable(path, str(exc)))
        handles.sort(key=lambda h: (h.created_at, h.run_id))
        unreadable.sort(key=lambda u: str(u.path))
        return handles, unreadable
