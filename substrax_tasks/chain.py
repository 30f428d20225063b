"""The phases of one step, as doit actions: launch, setup, sync, run, fetch,
verify/promote, teardown.

Each phase writes its durable record (the handle's state, the step record)
the moment it finishes, because doit saves its own DB only at the end of a
run and loses it on SIGKILL. A rerun reads those records to reattach to a
run that is still going, or to fetch a finished one again, instead of
starting a second run.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import inspect
import json
import marshal
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar, cast

from doit.dependency import UptodateCalculator
from doit.exceptions import TaskError, TaskFailed

from substrax_tasks import __version__, manifest_cache, stamp_prefetch
from substrax_tasks._atomic import write_json_atomic
from substrax_tasks._output import OUTPUT_LOCK, emit
from substrax_tasks.errors import BackendError, HandleError, SubstraxError
from substrax_tasks.proofs import proof_file
from substrax_tasks.resolved import ENV_LOCK_FILES, ResolvedProject, config_key, config_stamp, resolve
from substrax_tasks.spec import StepSpec, canonical_digest, check_inputs_exist, safe_name

if TYPE_CHECKING:  # pydantic models: imported by the phases that act, not by a no-op doit
    from substrax_tasks.backends.base import Backend, Fetched
    from substrax_tasks.handle import RunHandle
    from substrax_tasks.runs import Project
    from substrax_tasks.steplock import StepLock

PHASES = ("created", "launched", "set_up", "synced", "started", "fetched", "promoted")
RETRY_BACKOFF_SECONDS = 2.0
DOIT_VALUE = "substrax_run"  # saved by doit with the public task's values
_T = TypeVar("_T")
_LOCK_DIGESTS: dict[tuple[str, int, int, int], str] = {}
_LOCK_CANDIDATES: dict[Path, list[tuple[str, Path]]] = {}
# Part of every proof (proofs.py): a release that changes what the key or
# the check means must not take an older release's proofs.
PROOF_VERSION = f"{__version__}/3"


class _TextSink:
    """Log bytes to doit's (possibly captured, text-only) stdout."""

    def write(self, data: bytes) -> int:
        with OUTPUT_LOCK:
            sys.stdout.write(data.decode(errors="replace"))
        return len(data)

    def flush(self) -> None:
        with OUTPUT_LOCK:
            sys.stdout.flush()


def phase_index(phase: str | None) -> int:
    return PHASES.index(phase) if phase in PHASES else -1


class StepRunner:
    """One remote step in one doit process: its check and its phases."""

    def __init__(
        self,
        spec: StepSpec,
        project: ResolvedProject,
        backend: str | None,
        *,
        retries: int = 0,
        tracked: list[str] | None = None,
        user_uptodate: list[Any] | None = None,
    ) -> None:
        self.spec = spec
        self.view = project
        self.root = project.root
        self.backend_name, self.settings = project.settings_for(backend)
        self.retries = retries
        self.tracked = list(tracked or [])
        self.user_uptodate = list(user_uptodate or [])
        self._user_checks_normalized = [_uptodate_item(spec.step, item) for item in self.user_uptodate]
        self.safe = safe_name(spec.step)
        # as text: a no-op only stats it (the Path is made on first use)
        self._record_path = f"{project.state_dir_text}/steps/{self.safe}.json"
        # what the proof walks: the inputs, then the extra tracked files
        self._stamped_inputs = [*spec.inputs, *self.tracked]
        # where stamp_prefetch keeps this step's outputs, walked ahead
        self._outputs_job = stamp_prefetch.register(project.root_text, spec.step, list(spec.outputs))
        self.proofs = proof_file(project.state_dir)
        self._static_part: bytes | None = None
        # What this process learned; doit runs the phases in order.
        self.needs_run: bool | None = None
        self.handle: RunHandle | None = None
        self.fetched: Fetched | None = None
        self.interrupted = False
        self.torn_down = False
        # Between an acting launch and the end of verify (or a failed phase):
        # teardown must then wait (doit -P thread calls it from idle threads).
        self.chain_open = False
        # doit's saved values of the public task, when known (`why` reads them)
        self.doit_values: dict[str, Any] | None = None
        self._teardown_lock = threading.Lock()
        self.pid = os.getpid()

    # Paths and the lock made on first use: a no-op doit of many steps needs
    # only the record's path.
    @functools.cached_property
    def record_file(self) -> Path:
        return Path(self._record_path)

    @functools.cached_property
    def outputs_cache(self) -> Path:
        return self.view.state_dir.joinpath("cache", f"{self.safe}.outputs.json")

    @functools.cached_property
    def inputs_cache(self) -> Path:
        return self.view.state_dir.joinpath("cache", f"{self.safe}.inputs.json")

    @functools.cached_property
    def lock(self) -> StepLock:
        from substrax_tasks.steplock import StepLock  # the phases that act only

        return StepLock(self.view.state_dir / "locks", self.safe, self.spec.step)

    @property
    def project(self) -> Project:
        """The validated project (pydantic): only the phases that act need it."""
        return self.view.full()

    # ------------------------------------------------------------ records
    def read_record(self) -> dict[str, Any]:
        try:
            data = json.loads(self.record_file.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def write_record(self, **changes: Any) -> None:
        self.record_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_json_atomic(self.record_file, {**self.read_record(), "step": self.spec.step, **changes})

    # ---------------------------------------------------- the up-to-date key
    def key_parts(self) -> dict[str, Any]:
        """Everything that decides the outputs, split so `why` can name
        what changed. Input contents are hashed (cached by size, mtime, inode)."""
        spec = self.spec
        cache = manifest_cache.HashCache.load(self.inputs_cache)
        try:
            manifest = manifest_cache.build_manifest(self.root, self._input_paths(), cache.entries)
        except manifest_cache.ManifestError as exc:
            raise SubstraxError(f"step {spec.step!r}: inputs refused: {exc}") from None
        finally:
            cache.save()
        files = {e["path"]: e.get("sha256") or e.get("target") or e["type"] for e in manifest["entries"]}
        return {
            "command": spec.command,
            "env": spec.env,
            "timeout": spec.timeout,
            "outputs": spec.outputs,
            "resources": spec.resources,
            "secrets": spec.forward_env,
            "backend": self.backend_name,
            "settings": canonical_digest(self.settings),
            "inputs": files,
            "missing_inputs": manifest["missing"],
            "environment": self._environment_lock(),
        }

    def _input_paths(self) -> list[str]:
        """The inputs as the key sees them (a folder given without its "/"
        gets one), then the tracked files that exist."""
        # os.path on strings: no Path object per input of every step, each no-op.
        isdir, exists, join = os.path.isdir, os.path.exists, os.path.join
        root = os.fspath(self.root)
        inputs = [i if not isdir(join(root, i)) else i.rstrip("/") + "/" for i in self.spec.inputs]
        return inputs + [t for t in self.tracked if exists(join(root, t))]

    def _environment_lock(self) -> dict[str, str]:
        """The lock file the environment is built from: a new lock, a new env."""
        candidates = _LOCK_CANDIDATES.get(self.root)
        if candidates is None:  # the paths made once per project, not per step
            candidates = _LOCK_CANDIDATES[self.root] = [(n, self.root / n) for n in ENV_LOCK_FILES]
        for name, path in candidates:
            try:
                st = path.stat()
            except OSError:
                continue
            # Hashed once per process and version of the file, not per step:
            # a uv.lock is often hundreds of KB.
            stamp = (str(path), st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp not in _LOCK_DIGESTS:
                _LOCK_DIGESTS[stamp] = hashlib.sha256(path.read_bytes()).hexdigest()
            return {name: _LOCK_DIGESTS[stamp]}
        return {}

    def key(self, parts: dict[str, Any] | None = None) -> str:
        return canonical_digest(parts if parts is not None else self.key_parts())

    def up_to_date(
        self,
        values: dict[str, Any] | None = None,
        task: Any = None,
        doit_state: tuple[Any, Any] | None = None,
    ) -> bool:
        """Verified outputs of a run with today's key, still intact here.

        `values` are doit's saved values of the public task. Without one,
        doit either forgot the task (`doit forget`: rerun, as doit users
        expect) or was killed before it saved its DB (trust our own record:
        never pay twice for a run whose outputs are home). The record tells
        them apart: a verified run is `acknowledged` only once the doit
        process that verified it has exited normally, its DB saved.
        `task` and `doit_state` (doit's task and its dependency manager and
        tasks) let the proof use outputs walked ahead (stamp_prefetch)."""
        proof = self._proof(task, doit_state)
        trusting = values is None or bool(values.get(DOIT_VALUE))
        if proof is not None and trusting and self.proofs.holds(self.spec.step, proof[0]):
            return True
        result = self._checked_in_full(values)
        if result and proof is not None:
            racy_limit = time.time_ns() - manifest_cache.manifest_module().RACY_SECONDS * 1_000_000_000
            # Kept only if all it covers was older than the racy window (a
            # later change cannot hide in its timestamps) and held still
            # while it was checked.
            if proof[1] < racy_limit and self._proof() == proof:
                self.proofs.record(self.spec.step, proof[0])
        return result

    def _checked_in_full(self, values: dict[str, Any] | None) -> bool:
        record = self.read_record()
        verified = record.get("verified")
        if not isinstance(verified, dict) or verified.get("key") != self.key():
            return False
        if not manifest_cache.outputs_match(
            self.root, list(self.spec.outputs), str(verified.get("digest")), self.outputs_cache
        ):
            return False
        if values is not None and not values.get(DOIT_VALUE):
            return verified.get("run_id") != record.get("acknowledged")
        return True

    def _proof(self, task: Any = None, doit_state: tuple[Any, Any] | None = None) -> tuple[str, int] | None:
        """The step's proof (proofs.py) as things stand now, and the newest
        ctime it covers; None if it has no record (never up to date) or its
        paths are refused. It reads no file: a stat of the record, one
        stat-only walk of the inputs, the outputs and the environment's lock
        files (which moves with any change, as manifests.md explains), and
        what the step declares, all hashed at once."""
        try:
            st = os.stat(self._record_path)  # noqa: PTH116 - a str, no Path: every step, every no-op
        except OSError:
            return None
        mod = manifest_cache.manifest_module()
        items: list[Any] = [
            self._declared(), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
        ]
        root = self.view.root_text
        try:
            # inputs as declared, folders walked whether or not they end in "/"
            newest = mod.stat_walk(root, self._stamped_inputs, items, True)
            # the outputs by their own digest: they may have been walked ahead
            outputs, outputs_newest = stamp_prefetch.outputs_stamp(self._outputs_job, task, doit_state)
            items.append(outputs)
            newest = max(newest, outputs_newest)
            # The environment's lock files, by stat like the inputs (the key
            # hashes the one in use). Usually absent: access() asks without
            # the exception a failed lstat raises (a third of the cost).
            locks = [n for n in ENV_LOCK_FILES if os.access(f"{root}/{n}", os.F_OK, follow_symlinks=False)]
            items.append(len(locks))
            newest = max(newest, mod.stat_walk(root, locks, items))
        except mod.ManifestError:
            return None
        return mod.stamp_of(items), max(newest, st.st_ctime_ns)

    def _declared(self) -> bytes:
        """What the step declares and its backend settings, fixed in a
        process, as bytes for the proof. marshal, not canonical JSON (5x
        dearer, for 100 steps ~1 ms of each no-op), with the dicts' items
        sorted: equal declarations give equal bytes (a nested dict in another
        order would give other bytes: one more full check, never a wrong
        answer). JSON is the fallback for a value marshal cannot write."""
        if self._static_part is None:
            spec = self.spec
            declared = [
                PROOF_VERSION, str(self.root), spec.step, spec.command, sorted(spec.env.items()),
                spec.timeout, spec.inputs, spec.outputs, sorted(spec.resources.items()),
                spec.forward_env, self.tracked, self.backend_name, sorted(self.settings.items()),
            ]
            try:
                self._static_part = marshal.dumps(declared, 2)
            except ValueError:
                self._static_part = canonical_digest(declared).encode()
        return self._static_part

    def _acknowledge(self, run_id: str) -> None:
        """At interpreter exit (after doit saved its DB; never after SIGKILL)."""
        with contextlib.suppress(OSError):
            if (self.read_record().get("verified") or {}).get("run_id") == run_id:
                self.write_record(acknowledged=run_id)

    def explain(self) -> list[str]:
        """Why the step would run: each changed part, naming the paths.
        Empty when it is up to date (as far as the step's own check goes)."""
        record = self.read_record()
        verified = record.get("verified")
        if not isinstance(verified, dict):
            return ["no verified run yet: the step has never completed (or its record was removed)"]
        reasons: list[str] = []
        old: dict[str, Any] = verified.get("key_parts") or {}
        new = self.key_parts()
        fields = ("command", "env", "timeout", "outputs", "resources", "secrets", "backend", "environment")
        for field in fields:
            if old.get(field) != new.get(field):
                reasons.append(f"{field} changed: was {old.get(field)!r}, now {new.get(field)!r}")
        if old.get("settings") != new.get("settings"):
            reasons.append(self._settings_change(str(verified.get("run_id"))))
        old_inputs: dict[str, Any] = old.get("inputs") or {}
        new_inputs: dict[str, Any] = new["inputs"]
        for path in sorted(set(old_inputs) | set(new_inputs)):
            if path not in new_inputs:
                reasons.append(f"input removed: {path}")
            elif path not in old_inputs:
                reasons.append(f"input added: {path}")
            elif old_inputs[path] != new_inputs[path]:
                reasons.append(f"input changed: {path}")
        reasons += [f"input missing: {path}" for path in new["missing_inputs"]]
        try:
            manifest = json.loads(Path(str(verified.get("manifest_file"))).read_text())
        except (OSError, ValueError):
            reasons.append("the verified manifest is gone: outputs cannot be checked")
        else:
            problems = manifest_cache.verify_outputs(
                self.root, list(self.spec.outputs), manifest, self.outputs_cache
            )
            # A missing output is named once, not again by the entry-by-entry diff.
            gone = {p.split(": ", 1)[1] for p in problems if p.startswith("missing output: ")}
            reasons += [
                f"outputs: {p}" for p in problems
                if not (p.startswith("missing: ") and p[len("missing: "):].split(" (")[0] in gone)
            ]
        if self.doit_values is not None and not self.doit_values.get(DOIT_VALUE):
            reasons.append(
                f"doit has no record of task {self.spec.step!r} (after `doit forget`, or a new "
                "dependency file): doit runs it again"
            )
        if record.get("run_id") and record.get("run_id") != verified.get("run_id"):
            reasons.append(f"a newer run {record['run_id']} was started and has not been verified")
        return reasons

    def _settings_change(self, run_id: str) -> str:
        """Which backend settings differ from those pinned in the verified run."""
        table = f"[tool.substrax.compute.backends.{self.backend_name}]"
        try:
            pinned = self.project.store.read(run_id).settings
        except HandleError:
            return f"settings changed: the backend settings {table} differ from the verified run's"
        keys = sorted(k for k in set(pinned) | set(self.settings) if pinned.get(k) != self.settings.get(k))
        changes = ", ".join(f"{k} was {pinned.get(k)!r}, now {self.settings.get(k)!r}" for k in keys)
        return f"settings changed in {table}: {changes or 'the backend changed'}"

    def check(self, task: Any, values: dict[str, Any], doit_state: tuple[Any, Any] | None = None) -> bool:
        """doit's uptodate for the public task: ours AND the user's. It is
        the whole decision, so it also tells the phases whether to act.
        `doit_state`, doit's (dependency manager, tasks dict), is handed to
        the user's UptodateCalculators, as doit hands it to its own."""
        # Every user item is asked, as doit does: some (config_changed, run_once)
        # note the values they save when they are asked.
        user = list(self._user_checks(task, values, doit_state)) if self._user_checks_normalized else []
        try:
            result = self.up_to_date(values, task, doit_state) and all(user)
        except SubstraxError:
            result = False
        self.needs_run = not result or always_execute()  # doit -a runs it whatever we say
        return result

    def __call__(self, task: Any, values: dict[str, Any]) -> bool:
        return self.check(task, values)

    def __repr__(self) -> str:
        # doit info names each false uptodate object by its str()
        mine = "" if not self.user_uptodate else " and the uptodate items given to it"
        return (
            f"the verified outputs of step {self.spec.step!r}{mine} "
            f"(`substrax-compute why {self.spec.step!r}` says what changed)"
        )

    def clean_outputs(self, dryrun: bool = False) -> None:
        """`doit clean STEP` with clean=True: remove the declared outputs,
        folders included (doit's own clean leaves non-empty folders)."""
        for out in self.spec.outputs:
            path = self.root / out.rstrip("/")
            if not (path.exists() or path.is_symlink()):
                continue
            emit(f"{self.spec.step} - {'would remove' if dryrun else 'removing'} {out}")
            if not dryrun:
                from substrax_tasks.promote import remove_path  # not on a no-op's path

                remove_path(path)

    def configure_task(self, task: Any) -> None:
        for item in self.user_uptodate:
            if hasattr(item, "configure_task"):
                item.configure_task(task)

    def _user_checks(
        self, task: Any, values: dict[str, Any], doit_state: tuple[Any, Any] | None
    ) -> Iterator[bool]:
        """The user's uptodate items, evaluated as doit evaluates them."""
        for func, args, kwargs in self._user_checks_normalized:
            if callable(func):
                if isinstance(func, UptodateCalculator) and doit_state is not None:
                    func.setup(*doit_state)
                magic: list[Any] = []
                for i, name in enumerate(list(inspect.signature(func).parameters)[:2]):
                    if (i, name) == (0, "task"):
                        magic.append(task)
                    elif (i, name) == (1, "values"):
                        magic.append(values)
                result = func(*magic, *args, **kwargs)
            elif isinstance(func, str):
                result = subprocess.call(  # noqa: S602 - doit's own str form
                    func, shell=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
                result = result == 0
            else:
                result = func
            if result is not None:
                yield bool(result)

    def active(self) -> bool:
        """Phases act only when the step must run. When doit runs a phase
        without having asked the public task (`doit` with no default_tasks),
        the records decide; under `doit -a` (which asks no task), it runs."""
        if self.needs_run is None:
            if always_execute():
                self.needs_run = True
                return True
            try:
                self.needs_run = not self.up_to_date()
            except SubstraxError:
                self.needs_run = True
        return self.needs_run

    # --------------------------------------------------------- machinery
    def backend(self, handle: RunHandle) -> Backend:
        return self.project.backend_for(handle)

    def _retrying(self, what: str, call: Callable[[], _T]) -> _T:
        """Retry failures of the machinery, never a failed command."""
        for attempt in range(self.retries + 1):
            try:
                return call()
            except BackendError as exc:
                if attempt == self.retries:
                    raise
                wait = RETRY_BACKOFF_SECONDS * (attempt + 1)
                emit(
                    f"{self.spec.step}: {what} failed ({exc}); "
                    f"retry {attempt + 1} of {self.retries} in {wait:.0f} s"
                )
                time.sleep(wait)
        raise AssertionError("unreachable")

    def _save(self, handle: RunHandle, **changes: Any) -> RunHandle:
        self.handle = self.project.store.update_state(handle, **changes)
        return self.handle

    @contextlib.contextmanager
    def _reported(self) -> Iterator[None]:
        """Our errors become doit failures with their message, not tracebacks."""
        try:
            yield
        except BackendError as exc:
            raise _Abort(TaskError(self._named(exc))) from None
        except SubstraxError as exc:
            raise _Abort(TaskFailed(self._named(exc))) from None

    def _named(self, exc: Exception) -> str:
        """The message, naming the step once."""
        text = str(exc)
        prefix = f"step {self.spec.step!r}"
        return text if text.startswith(prefix) else f"{prefix}: {text}"

    def _action(self, body: Callable[[], Any]) -> Any:
        if os.getpid() != self.pid:
            return TaskError(
                f"step {self.spec.step!r}: remote steps cannot run in doit's worker processes "
                "(`doit -n N` or `-P process`): the phases of a step share state in one process. "
                "Run them concurrently with threads: `doit -n N -P thread`"
            )
        try:
            with self._reported():
                result = body()
        except _Abort as abort:
            result = abort.failure
        except BaseException:
            self.chain_open = False
            raise
        if isinstance(result, (TaskFailed, TaskError)):
            self.chain_open = False  # doit runs no later phase
        return result

    # ------------------------------------------------------------ phases
    def launch(self) -> Any:
        return self._action(self._launch)

    def _launch(self) -> None:
        if not self.active():
            return
        self.chain_open = True
        self.lock.acquire()
        check_inputs_exist(self.spec, self.root)
        check_outputs_inside(self.spec, self.root)
        unset = [name for name in self.spec.forward_env if name not in os.environ]
        if unset:
            raise SubstraxError(
                f"secret(s) {', '.join(unset)} named in secrets=[...] are not set in this "
                "environment; set them (their values are forwarded to the command, never stored)"
            )
        parts = self.key_parts()
        key = self.key(parts)
        handle = self._reusable_run(key)
        if handle is None:
            self._retire_unlaunched()
            handle = self.project.new_run(self.spec, self.backend_name)
            handle = self._save(handle, key=key, key_parts=parts, phase="created")
            self.write_record(run_id=handle.run_id)
            emit(f"{self.spec.step}: new run {handle.run_id} on {self.backend_name}")
        self.handle = handle
        if phase_index(handle.state.get("phase")) < phase_index("launched"):
            backend = self.backend(handle)
            launched = self._retrying("launch", lambda: backend.launch(handle))
            self._save(launched, phase="launched")

    def _retire_unlaunched(self) -> None:
        """The step's previous run, if its launch never succeeded (say a host
        key was refused, then the settings changed), would read `pending`
        for ever: record that it was given up."""
        run_id = self.read_record().get("run_id")
        if not run_id:
            return
        try:
            old = self.project.store.read(str(run_id))
        except HandleError:
            return
        if phase_index(old.state.get("phase")) < phase_index("launched") and not old.state.get("verdict"):
            self._save(old, verdict={"state": "failed", "message": "never launched; a newer run replaced it"})

    def _reusable_run(self, key: str) -> RunHandle | None:  # noqa: PLR0911 - one return per case
        """The step's last run, if it has today's key and is worth keeping:
        still going (reattach), or finished but not yet fetched."""
        run_id = self.read_record().get("run_id")
        if not run_id:
            return None
        try:
            handle = self.project.store.read(str(run_id))
        except HandleError:
            return None
        if handle.state.get("key") != key or handle.state.get("verdict"):
            return None
        backend = self.backend(handle)
        status = backend.poll(handle)
        phase = handle.state.get("phase")
        if not status.final:
            emit(f"{self.spec.step}: reattaching to run {handle.run_id} ({status.state})")
            return handle
        if status.state != "succeeded":
            return None
        if phase != "promoted":
            emit(f"{self.spec.step}: run {handle.run_id} finished; fetching its outputs again")
            return handle
        if backend.outputs_available(handle):
            emit(f"{self.spec.step}: outputs changed here; fetching run {handle.run_id} again")
            return self._save(handle, phase="started")
        return None

    def setup(self) -> Any:
        return self._action(lambda: self._advance("set_up", "setup", lambda b, h: b.setup(h)))

    def sync(self) -> Any:
        return self._action(lambda: self._advance("synced", "sync", lambda b, h: b.sync(h)))

    def _advance(self, phase: str, what: str, call: Callable[[Backend, RunHandle], RunHandle]) -> None:
        handle = self.handle
        if not self.active() or handle is None:
            return
        if phase_index(handle.state.get("phase")) >= phase_index(phase):
            return
        backend = self.backend(handle)
        self._save(self._retrying(what, lambda: call(backend, handle)), phase=phase)

    def run(self) -> Any:
        return self._action(self._run)

    def _run(self) -> Any:
        handle = self.handle
        if not self.active() or handle is None:
            return None
        backend = self.backend(handle)
        try:
            if phase_index(handle.state.get("phase")) < phase_index("started"):
                if backend.poll(handle).state == "pending":
                    pending = handle
                    handle = self._retrying("start", lambda: _started(backend, pending))
                handle = self._save(handle, phase="started")
            # The connection the fetch will use is kept up meanwhile.
            with backend.ready_for_fetch(handle):
                status = backend.stream_log(handle, cast(IO[bytes], _TextSink()), follow=True)
        except KeyboardInterrupt:
            self.interrupted = True
            self._on_interrupt(backend, handle)
            raise
        # What the backend noted as the run ended (its final status, where
        # its outputs are) saves the fetch a question to the host.
        self.handle = handle = self.project.store.read(handle.run_id)
        if status.state != "succeeded":
            tail = backend.read_log(handle, 0)[-1500:].decode(errors="replace")
            return TaskFailed(
                f"step {self.spec.step!r}: run {handle.run_id} {status.state}"
                + (f" (exit code {status.exit_code})" if status.exit_code is not None else "")
                + (f": {status.message}" if status.message else "")
                + f"\nlast lines of its log (substrax-compute logs {handle.run_id}):\n{tail}"
            )
        return None

    def _on_interrupt(self, backend: Backend, handle: RunHandle) -> None:
        if backend.capabilities.interrupt_cancels:
            emit(f"\n{self.spec.step}: interrupted; cancelling local run {handle.run_id}", err=True)
            backend.cancel(handle)
        else:
            emit(
                f"\n{self.spec.step}: detached from run {handle.run_id}, which goes on. "
                f"`doit {self.spec.step}` reattaches; `substrax-compute cancel {handle.run_id}` stops it.",
                err=True,
            )

    def fetch(self) -> Any:
        return self._action(self._fetch)

    def _fetch(self) -> Any:
        handle = self.handle
        if not self.active() or handle is None:
            return None
        backend = self.backend(handle)
        try:
            fetched = self._retrying("fetch", lambda: backend.fetch(handle))
        except manifest_cache.ManifestError as exc:
            self._save(handle, verdict={"state": "failed", "message": str(exc)})
            return TaskFailed(f"step {self.spec.step!r}: {exc}; nothing was promoted")
        missing = fetched.manifest.get("missing") or []
        if missing:
            message = f"the run did not produce declared output(s) {', '.join(missing)}"
            self._save(handle, verdict={"state": "failed", "message": message})
            return TaskFailed(
                f"step {self.spec.step!r}: run {handle.run_id}: {message}; nothing was promoted"
            )
        manifest_file = self.project.store.run_dir(handle.run_id) / "manifest.json"
        # compact: a manifest of 20,000 files is 3 MB, 4x slower to indent
        write_json_atomic(manifest_file, fetched.manifest, indent=None)
        self.fetched = fetched
        self._save(handle, phase="fetched", manifest_digest=fetched.manifest["digest"])
        return None

    def verify(self) -> Any:
        """The public task: verify the staged outputs, promote them, record."""
        try:
            return self._action(self._verify)
        finally:
            self.chain_open = False

    def _verify(self) -> Any:
        handle, fetched = self.handle, self.fetched
        if not self.active() or handle is None or fetched is None:
            verified = self.read_record().get("verified") or {}
            return {DOIT_VALUE: verified.get("run_id", "")}
        outputs = list(self.spec.outputs)
        digest = str(fetched.manifest["digest"])
        # Staged and final files share inode and mtime after the rename, so
        # the cache filled here makes the next no-op check stat-only. The
        # hashes the fetch took as files arrived are reused while they match.
        in_place = fetched.root.resolve() == self.root.resolve()  # nothing to promote
        problems = manifest_cache.verify_outputs(fetched.root, outputs, fetched.manifest, self.outputs_cache)
        if problems:
            return TaskFailed(
                f"step {self.spec.step!r}: the fetched outputs of run {handle.run_id} do not match "
                "its manifest; nothing was promoted:\n  " + "\n  ".join(problems)
            )
        renamed = False
        if not in_place:
            try:
                from substrax_tasks.promote import promote  # not on a no-op's path

                renamed = promote(fetched.root, self.root, outputs)
            except OSError as exc:
                return TaskFailed(
                    f"step {self.spec.step!r}: could not move the outputs of run {handle.run_id} into "
                    f"place ({exc}); the run is kept: fix that, then `doit {self.spec.step}` "
                    "promotes them without running the command again"
                )
        # Renames moved the very files just verified: walking them again
        # proves nothing more. A copy (another file system) or outputs
        # verified in place are checked once more where they now stand.
        if not renamed and not manifest_cache.outputs_match(self.root, outputs, digest, self.outputs_cache):
            return TaskFailed(f"step {self.spec.step!r}: outputs changed while they were promoted")
        self._save(handle, phase="promoted")
        self.write_record(
            verified={
                "run_id": handle.run_id,
                "key": handle.state.get("key"),
                "key_parts": handle.state.get("key_parts"),
                "digest": digest,
                "manifest_file": str(self.project.store.run_dir(handle.run_id) / "manifest.json"),
            }
        )
        atexit.register(self._acknowledge, handle.run_id)
        return {DOIT_VALUE: handle.run_id}

    def teardown(self) -> None:
        """doit's teardown (after success, failure or Ctrl-C). Idempotent.

        Under `-n N -P thread` doit calls every teardown from each worker
        thread that runs out of tasks, while another thread may still drive
        this step: such a call waits for the chain to end, or for doit's
        last call, from the main thread as it finishes."""
        with self._teardown_lock:
            last_call = threading.current_thread() is threading.main_thread()
            if self.torn_down or (self.chain_open and not last_call and not self.interrupted):
                return
            self.torn_down = True
            self._teardown()

    def _teardown(self) -> None:
        try:
            if self.handle is None:
                return
            handle = self.project.store.read(self.handle.run_id)
            backend = self.backend(handle)
            status = backend.status(handle)
            if self.chain_open and not self.interrupted and not status.final and status.state != "pending":
                # doit is ending (a Ctrl-C seen by another thread, a failure
                # elsewhere) while this step's run goes on: abandoned.
                self.interrupted = True
                self._on_interrupt(backend, handle)
                status = backend.status(handle)
            launched = phase_index(handle.state.get("phase")) >= phase_index("launched")
            done = (
                handle.state.get("phase") == "promoted"
                or (status.final and status.state != "succeeded")
                # launched but never started (setup or sync failed): nothing to keep
                or (status.state == "pending" and launched)
            )
            if done or (self.interrupted and backend.capabilities.interrupt_cancels):
                backend.teardown(handle)
            elif status.final:
                emit(f"{self.spec.step}: keeping run {handle.run_id} until its outputs are home; "
                      f"`doit {self.spec.step}` fetches them again")
        finally:
            self.lock.release()


def _uptodate_item(step: str, item: Any) -> tuple[Any, list[Any], dict[str, Any]]:
    """An uptodate item as doit takes it: bool, None, str, callable, or
    (callable, args, kwargs); anything else is refused at declaration."""
    if isinstance(item, bool) or item is None or isinstance(item, str) or callable(item):
        return item, [], {}
    if isinstance(item, tuple) and item and callable(item[0]):
        return item[0], list(item[1]) if len(item) > 1 else [], dict(item[2]) if len(item) > 2 else {}
    raise SubstraxError(
        f"step {step!r}: uptodate item {item!r} must be a bool, None, str, callable or "
        "(callable, args, kwargs), as in doit"
    )


def always_execute() -> bool:
    """`doit -a` / `--always-execute`: doit then runs tasks without asking
    whether they are up to date, and the user means "run it again"."""
    args = sys.argv[1:]
    args = args[: args.index("--")] if "--" in args else args
    return "-a" in args or "--always-execute" in args


def _started(backend: Backend, handle: RunHandle) -> RunHandle:
    """backend.start, with Ctrl-C/SIGTERM/SIGHUP held back until it returns:
    interrupted half-way, the worker could start its command after the
    client gave up on it, and nothing would cancel that run."""
    if threading.current_thread() is not threading.main_thread():
        return backend.start(handle)
    caught: list[int] = []
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    held = [sig for sig in signals if signal.getsignal(sig) is not None]
    previous = {sig: signal.getsignal(sig) for sig in held}
    for sig in held:
        signal.signal(sig, lambda signum, _frame: caught.append(signum))
    try:
        return backend.start(handle)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if caught:
            raise KeyboardInterrupt(f"signal {signal.Signals(caught[0]).name}")


def check_outputs_inside(spec: StepSpec, root: Path) -> None:
    """An output reached through a symlink could be written outside the
    project (without a sandbox) or not at all (bubblewrap cannot bind onto
    it): refused at launch, before anything runs."""
    for out in spec.outputs:
        rel = Path(out.rstrip("/"))
        for parent in reversed(rel.parents[:-1]):  # outer folders first, "." left out
            if (root / parent).is_symlink():
                raise SubstraxError(
                    f"output {out} lies under {parent.as_posix()}, a symlink to "
                    f"{(root / parent).readlink()}: outputs must be real paths inside the project; "
                    "replace the link by a folder or declare the output where it really is"
                )
        try:
            (root / rel).resolve().relative_to(root.resolve())
        except ValueError:
            raise SubstraxError(
                f"output {out} is a symlink leading outside the project "
                f"({(root / rel).resolve()}); remove it or declare the output where it really is"
            ) from None


_CHECK_SIGNATURE = inspect.Signature(
    [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in ("task", "values")]
)


class StepCheck(UptodateCalculator):  # type: ignore[misc]  # doit is untyped
    """The public task's uptodate item: the runner's check. An
    UptodateCalculator, so doit hands it what the user's own calculators
    (result_dep, ...) need before asking it."""

    def __init__(self, runner: StepRunner) -> None:
        super().__init__()
        self.runner = runner
        self.doit_state: tuple[Any, Any] | None = None
        # doit asks inspect.signature() of every uptodate callable on every
        # run; a ready answer spares it the introspection of __call__.
        self.__signature__ = _CHECK_SIGNATURE

    def setup(self, dep_manager: Any, tasks_dict: Any) -> None:
        # Kept here for the call that follows, not on the runner: the runners
        # live in a module's table until exit, and holding doit's tasks from
        # there kept doit's whole task graph alive for the interpreter's
        # teardown.
        super().setup(dep_manager, tasks_dict)
        self.doit_state = (dep_manager, tasks_dict)

    def configure_task(self, task: Any) -> None:
        self.runner.configure_task(task)

    def __call__(self, task: Any, values: dict[str, Any]) -> bool:
        try:
            return self.runner.check(task, values, self.doit_state)
        finally:
            # doit sets them up again before each call; kept, they would tie
            # doit's tasks in a cycle that only the garbage collector frees
            # (at exit, walking every object: +0.1 s with 1,000 steps).
            self.doit_state = self.tasks_dict = self.get_val = None

    def __repr__(self) -> str:
        return repr(self.runner)


class _Abort(Exception):
    def __init__(self, failure: TaskFailed | TaskError) -> None:
        super().__init__(str(failure))
        self.failure = failure


_PROJECTS: dict[tuple[Path, tuple[Any, ...]], ResolvedProject] = {}
# Each path a dodo names (or the cwd) resolved once: resolve() lstats every
# component, for every step.
_ROOTS: dict[str, Path] = {}


def project_of(path: str | os.PathLike[str] | None) -> ResolvedProject:
    """The project's configuration, resolved once per dodo load: a dodo with
    1,000 steps reads pyproject.toml once, and a no-op doit validates nothing
    while the configuration is unchanged (see resolved.py)."""
    # the cwd as text, no Path: this runs for every step of a dodo
    raw = os.getcwd() if path is None else os.fspath(path)  # noqa: PTH109
    root = _ROOTS.get(raw)
    if root is None:
        given = Path(raw)
        root = given.resolve()
        if given.is_absolute():  # a relative one moves with the cwd: resolved each time
            _ROOTS[raw] = root
    config = config_key(root)
    project = _PROJECTS.get((root, config))
    if project is None:
        project = _PROJECTS[root, config] = resolve(root, config_stamp(root, config))
    return project
