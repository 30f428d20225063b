"""The store: the state folder (`state_dir`, `.substrax/` by default) and its layout.

    runs/<run-id>/handle.json     the run's handle (handle.py), the one durable record
    runs/<run-id>/handle.lock     taken by every write of the handle
    runs/<run-id>/manifest.json   the manifest of its outputs as verified here
    runs/<run-id>/...             the run's own files: job, status, log, fetched outputs
    steps/<step>.json             each step's record: its run, its verified manifest
    manifests/<step>.json         the manifest of a step's outputs restored from the run cache
    cache/<step>.outputs.json     hash caches of a step's outputs and of its inputs
    cache/<step>.inputs.json
    cache/up-to-date.json         the project's proofs
    cache/run-cache.json          the run cache's hit and miss counts (cache.py)
    cache/home/<path>             the local backend's kept `cache_dirs` (~/<path> in the sandbox)
    envs/                         the local backend's environments, one per lock digest
    restore/<step>-<token>/       outputs restored from the run cache, staged to be verified
    locks/<step>.lock             one driver per step (steplock.py), and who holds it
    slots/<pool>/<i>.lock         the max_parallel slots of a backend's pool (slots.py)
    client-id, client-id.stamp    this state folder's random id: marks what it makes on shared machines,
                                  and where it was made, which a copy of the folder is not (client.py)

where <step> is `spec.safe_name(step)`. Every module asks here for these
paths. A no-op doit asks too, so pydantic (handle.py) is imported only by
the methods that read or write a handle.
"""

from __future__ import annotations

import datetime
import functools
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from substrax_tasks.atomic import write_json_atomic
from substrax_tasks.errors import HandleError, NoSuchRun, RunFolderDeleted
from substrax_tasks.step.spec import StepSpec, canonical_digest, safe_name, settings_in_key
from substrax_tasks.store import client
from substrax_tasks.store.client import CLIENT_ID_FILE
from substrax_tasks.store.phase import Phase, moved_to

if TYPE_CHECKING:
    from pydantic import BaseModel

    from substrax_tasks.store.handle import RunHandle

HANDLE_FILE = "handle.json"
# A damaged record, kept under this suffix and a time once its run was
# proved over (see _earlier_run.set_aside).
SET_ASIDE = ".damaged-"
SET_ASIDE_HANDLES = f"{HANDLE_FILE}{SET_ASIDE}*"
PROOFS_FILE = "up-to-date.json"
PHASE_KEYS = frozenset({"phase", "refetches"})


@dataclass(frozen=True)
class Unreadable:
    """A run record that could not be read, and why."""

    path: Path
    reason: str


def run_digest(spec: StepSpec, backend: str, settings: dict[str, Any]) -> str:
    """What decides a run's result: the spec plus the backend and its settings."""
    return canonical_digest(
        {"spec": spec.model_dump(mode="json"), "backend": backend, "settings": settings_in_key(settings)}
    )


class RunStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.runs_dir = root / "runs"

    # -- the layout
    def run_dir(self, run_id: str) -> Path:
        return self.runs_dir / run_id

    def handle_path(self, run_id: str) -> Path:
        return self.run_dir(run_id) / HANDLE_FILE

    def manifest_file(self, run_id: str) -> Path:
        """The manifest of the run's outputs as fetched and verified here."""
        return self.run_dir(run_id) / "manifest.json"

    def step_record(self, step: str) -> Path:
        return self.root / "steps" / f"{safe_name(step)}.json"

    def step_records(self) -> list[Path]:
        """Every step's record, in name order."""
        return sorted((self.root / "steps").glob("*.json"))

    def restored_manifest(self, step: str) -> Path:
        # A folder of its own: beside the records, as steps/<step>.manifest.json,
        # it was the record of a step named "<step>.manifest".
        return self.root / "manifests" / f"{safe_name(step)}.json"

    def outputs_cache(self, step: str) -> Path:
        return self.root / "cache" / f"{safe_name(step)}.outputs.json"

    @property
    def home_cache(self) -> Path:
        """Where the local backend keeps the `cache_dirs` of the sandbox's home."""
        return self.root / "cache" / "home"

    def inputs_cache(self, step: str) -> Path:
        return self.root / "cache" / f"{safe_name(step)}.inputs.json"

    @functools.cached_property
    def proofs_file(self) -> Path:  # asked by every step of a no-op
        return self.root / "cache" / PROOFS_FILE

    @property
    def run_cache_stats(self) -> Path:
        return self.root / "cache" / "run-cache.json"

    @property
    def run_cache_introduced(self) -> Path:
        """Made when `doit` first said where the run cache is (once per project)."""
        return self.root / "cache" / "run-cache-introduced"

    def checkpoints_dir(self, step: str, key: str | None = None) -> Path:
        """Where a step's checkpoints are kept: a folder per key of the
        step, so that a changed command or input starts afresh."""
        folder = self.root / "checkpoints" / safe_name(step)
        return folder if key is None else folder / key[:16]

    def remove_checkpoints(self, step: str) -> None:
        """Every checkpoint kept for `step` (its outputs are home)."""
        self.remove_checkpoints_folder(self.checkpoints_dir(step))

    def remove_checkpoints_folder(self, folder: Path) -> None:
        """A step's (or one key's) checkpoints folder. Renamed away first: a
        folder half removed is never taken for checkpoints."""
        if folder.exists():
            gone = folder.with_name(f".{folder.name}.removed-{os.getpid()}")
            folder.rename(gone)
            shutil.rmtree(gone, ignore_errors=True)

    @property
    def envs_dir(self) -> Path:
        return self.root / "envs"

    @property
    def restore_dir(self) -> Path:
        return self.root / "restore"

    def step_lock(self, step: str) -> Path:
        return self.root / "locks" / f"{safe_name(step)}.lock"

    def slots_dir(self, pool: str) -> Path:
        return self.root / "slots" / safe_name(pool)

    def machine_life(self, machine: str) -> Path:
        """The record of a machine runs used in turn (store/shared_machine.py),
        kept after it is gone: its runs' costs are read from it."""
        return self.root / "machines" / f"{safe_name(machine)}.json"

    @property
    def client_id_file(self) -> Path:
        return self.root / CLIENT_ID_FILE

    def client_id(self) -> str:
        """This state folder's own random id (128 bits, hex), made on first
        use, and made anew in a copy of the folder (store/client.py): what
        marks the run folders and clusters it makes on machines other
        clients share, so gc never takes another's for its own (two clients
        may well share a project path: CI jobs, containers, a copied project)."""
        return client.identity(self.root).id

    def owns(self, handle: RunHandle) -> bool:
        """The run was launched by this client, not by the one this state
        folder was copied from: only its own runs does it reattach, fetch,
        cancel, tear down or count as live."""
        return client.identity(self.root).owns(handle.state.client_id)

    # -- handles
    def new_run(self, spec: StepSpec, backend: str, settings: dict[str, Any], **state: Any) -> RunHandle:
        """Create the run's folder and write its handle (with `state`): the
        first durable record, made before anything slow or paid happens."""
        from substrax_tasks.store.handle import CoreState, RunHandle

        now = datetime.datetime.now(datetime.timezone.utc)
        run_id = f"{safe_name(spec.step)}-{now:%Y%m%dT%H%M%S}-{os.urandom(3).hex()}"
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
            state=CoreState.model_validate({**state, "phase": Phase.CREATED, "client_id": self.client_id()}),
        )
        write_json_atomic(self.handle_path(run_id), handle.model_dump(mode="json"))
        return handle

    def update_state(self, handle: RunHandle, **changes: Any) -> RunHandle:
        """Merge `changes` into the handle's core state (CoreState: an
        unknown key is refused) and write it at once. The state on disk is
        the base (another process, `doit` or `substrax-compute cancel`, may
        have recorded something since `handle` was read), the given handle's
        state the fallback. The handle's lock makes the read-merge-write one
        step for every process. The phase is not among the changes: `advance`
        records it, checked against the one on disk."""
        if PHASE_KEYS & changes.keys():
            raise ValueError(f"run {handle.run_id}: its phase is recorded by RunStore.advance alone")
        return self._merge(handle, core=lambda current: {**current, **changes})

    def advance(self, handle: RunHandle, phase: Phase, **changes: Any) -> RunHandle:
        """Record that the chain reached `phase` (with `changes`), never going
        back from the phase on disk (PhaseError). Only the chain calls it."""
        return self._merge(
            handle, core=lambda current: {**current, **changes, **moved_to(current, phase, handle.run_id)}
        )

    def update_backend_state(self, handle: RunHandle, model: type[BaseModel], **changes: Any) -> RunHandle:
        """Merge `changes` into the backend's part of the handle, as
        `update_state` does the core's; `model` (the backend's `State`) checks
        the result, so a key the backend does not declare is refused. The
        store carries the backend's state and reads nothing of it."""

        def merged(current: dict[str, Any]) -> dict[str, Any]:
            return model.model_validate({**current, **changes}).model_dump(mode="json")

        return self._merge(handle, backend=merged)

    def _merge(
        self,
        handle: RunHandle,
        core: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        backend: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> RunHandle:
        """Write the handle with its core state `core`-merged and its
        backend state `backend`-merged from those on disk (the given handle's
        filling in what the disk lacks), under its lock."""
        from filelock import FileLock

        from substrax_tasks.store.handle import CoreState

        path = self.handle_path(handle.run_id)
        gone = RunFolderDeleted(
            f"run {handle.run_id}: its folder {path.parent} was deleted; the run is lost "
            f"(`doit {handle.step}` launches it again)"
        )
        if not path.parent.is_dir():  # the lock would wait for a folder that is gone
            raise gone
        try:
            with FileLock(path.with_name("handle.lock"), mode=0o600):
                try:
                    on_disk: RunHandle | None = _read(path)
                except HandleError:
                    on_disk = None
                state = handle.state.model_dump(mode="json")
                own = dict(handle.backend_state)
                if on_disk is not None:
                    state.update(on_disk.state.model_dump(mode="json"))
                    own.update(on_disk.backend_state)
                updated = handle.model_copy(update={
                    "state": CoreState.model_validate(core(state) if core else state),
                    "backend_state": backend(own) if backend else own,
                })  # fmt: skip
                write_json_atomic(path, updated.model_dump(mode="json"))
        except FileNotFoundError:  # deleted meanwhile
            raise gone from None
        return updated

    def read(self, run_ref: str) -> RunHandle:
        return _read(self.handle_path(self.resolve(run_ref)))

    def exists(self, run_id: str) -> bool:
        """There is a run with exactly this id."""
        return _id_shaped(run_id) and self.run_dir(run_id).is_dir()

    def resolve(self, run_ref: str) -> str:
        """A run id from the id itself or a unique prefix of it."""
        if not _id_shaped(run_ref):
            raise NoSuchRun(f"{run_ref!r} is not a run id; see `substrax-compute status`")
        if self.run_dir(run_ref).is_dir():
            return run_ref
        matches = sorted(p.name for p in self._run_dirs() if p.name.startswith(run_ref))
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise NoSuchRun(
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
                handles.append(_read(path))
            except HandleError as exc:
                if not path.exists() and any(run_dir.glob(SET_ASIDE_HANDLES)):
                    continue  # an ended run whose damaged handle a launch moved aside, and said so
                unreadable.append(Unreadable(path, str(exc)))
        handles.sort(key=lambda h: (h.created_at, h.run_id))
        unreadable.sort(key=lambda u: str(u.path))
        return handles, unreadable


def _id_shaped(run_ref: str) -> bool:
    """Could name a folder under runs/ (and nothing outside it)."""
    return "/" not in run_ref and run_ref not in ("", ".", "..")


def _read(path: Path) -> RunHandle:
    from substrax_tasks.store.handle import read_handle

    return read_handle(path)
