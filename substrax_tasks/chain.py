"""The phases of one step, as doit actions: launch, setup, sync, run, fetch,
verify/promote, teardown.

Each phase writes its durable record (the handle's state, the step record)
the moment it finishes, because doit saves its own DB only at the end of a
run and loses it on SIGKILL. A rerun reads those records to reattach to a
run that is still going, or to fetch a finished one again, instead of
starting a second run.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from doit.exceptions import TaskError, TaskFailed

from substrax_tasks import manifest_cache
from substrax_tasks._atomic import write_json_atomic
from substrax_tasks.backends.base import Backend, Fetched
from substrax_tasks.errors import BackendError, HandleError, SubstraxError
from substrax_tasks.handle import RunHandle
from substrax_tasks.promote import promote
from substrax_tasks.runs import Project
from substrax_tasks.spec import StepSpec, canonical_digest, check_inputs_exist, safe_name
from substrax_tasks.steplock import StepLock

PHASES = ("created", "launched", "set_up", "synced", "started", "fetched", "promoted")
RETRY_BACKOFF_SECONDS = 2.0
DOIT_VALUE = "substrax_run"  # saved by doit with the public task's values


class _TextSink:
    """Log bytes to doit's (possibly captured, text-only) stdout."""

    def write(self, data: bytes) -> int:
        sys.stdout.write(data.decode(errors="replace"))
        return len(data)

    def flush(self) -> None:
        sys.stdout.flush()


def phase_index(phase: str | None) -> int:
    return PHASES.index(phase) if phase in PHASES else -1


class StepRunner:
    """One remote step in one doit process: its check and its phases."""

    def __init__(
        self,
        spec: StepSpec,
        project: Project,
        backend: str | None,
        retries: int = 0,
        tracked: list[str] | None = None,
        user_uptodate: list[Any] | None = None,
    ) -> None:
        self.spec = spec
        self.project = project
        self.backend_name, self.settings = project.settings_for(backend)
        self.retries = retries
        self.tracked = list(tracked or [])
        self.user_uptodate = list(user_uptodate or [])
        self.safe = safe_name(spec.step)
        state = project.store.root
        self.record_file = state / "steps" / f"{self.safe}.json"
        self.outputs_cache = state / "cache" / f"{self.safe}.outputs.json"
        self.inputs_cache = state / "cache" / f"{self.safe}.inputs.json"
        self.lock = StepLock(state / "locks", self.safe, spec.step)
        # What this process learned; doit runs the phases in order.
        self.needs_run: bool | None = None
        self.handle: RunHandle | None = None
        self.fetched: Fetched | None = None
        self.interrupted = False
        self.torn_down = False

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
        inputs = [i if not (self.project.root / i).is_dir() else i.rstrip("/") + "/" for i in spec.inputs]
        tracked = [t for t in self.tracked if (self.project.root / t).exists()]
        cache = manifest_cache.HashCache.load(self.inputs_cache)
        try:
            manifest = manifest_cache.build_manifest(self.project.root, inputs + tracked, cache.entries)
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
        }

    def key(self, parts: dict[str, Any] | None = None) -> str:
        return canonical_digest(parts if parts is not None else self.key_parts())

    def up_to_date(self, values: dict[str, Any] | None = None) -> bool:
        """Verified outputs of a run with today's key, still intact here.
        `values` are doit's saved values: empty after `doit forget`."""
        if values is not None and not values.get(DOIT_VALUE):
            return False
        verified = self.read_record().get("verified")
        if not isinstance(verified, dict) or verified.get("key") != self.key():
            return False
        return manifest_cache.outputs_match(
            self.project.root, list(self.spec.outputs), str(verified.get("digest")), self.outputs_cache
        )

    def check(self, task: Any, values: dict[str, Any]) -> bool:
        """doit's uptodate for the public task: ours AND the user's. It is
        the whole decision, so it also tells the phases whether to act."""
        try:
            result = self.up_to_date(values) and all(self._user_checks(task, values))
        except SubstraxError:
            result = False
        self.needs_run = not result
        return result

    def __call__(self, task: Any, values: dict[str, Any]) -> bool:
        return self.check(task, values)

    def configure_task(self, task: Any) -> None:
        for item in self.user_uptodate:
            if hasattr(item, "configure_task"):
                item.configure_task(task)

    def _user_checks(self, task: Any, values: dict[str, Any]) -> Iterator[bool]:
        for item in self.user_uptodate:
            if item is None:
                continue
            if isinstance(item, bool):
                yield item
            elif isinstance(item, str):
                yield subprocess.call(item, shell=True) == 0  # noqa: S602 - doit's own str form
            elif callable(item):
                names = list(inspect.signature(item).parameters)
                args = [a for n, a in zip(names[:2], (task, values), strict=False) if n in ("task", "values")]
                result = item(*args)
                if result is not None:
                    yield bool(result)

    def active(self) -> bool:
        """Phases act only when the step must run. When doit runs a phase
        without having asked the public task (`doit` with no default_tasks),
        the records decide."""
        if self.needs_run is None:
            try:
                self.needs_run = not self.up_to_date()
            except SubstraxError:
                self.needs_run = True
        return self.needs_run

    # --------------------------------------------------------- machinery
    def backend(self, handle: RunHandle) -> Backend:
        return self.project.backend_for(handle)

    def _retrying(self, what: str, call: Callable[[], RunHandle]) -> RunHandle:
        """Retry failures of the machinery, never a failed command."""
        for attempt in range(self.retries + 1):
            try:
                return call()
            except BackendError as exc:
                if attempt == self.retries:
                    raise
                wait = RETRY_BACKOFF_SECONDS * (attempt + 1)
                print(f"{self.spec.step}: {what} failed ({exc}); retry {attempt + 1} of {self.retries} in {wait:.0f} s")
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
            raise _Abort(TaskError(f"step {self.spec.step!r}: {exc}")) from None
        except SubstraxError as exc:
            raise _Abort(TaskFailed(f"step {self.spec.step!r}: {exc}")) from None

    def _action(self, body: Callable[[], Any]) -> Any:
        try:
            with self._reported():
                return body()
        except _Abort as abort:
            return abort.failure

    # ------------------------------------------------------------ phases
    def launch(self) -> Any:
        return self._action(self._launch)

    def _launch(self) -> None:
        if not self.active():
            return
        self.lock.acquire()
        check_inputs_exist(self.spec, self.project.root)
        parts = self.key_parts()
        key = self.key(parts)
        handle = self._reusable_run(key)
        if handle is None:
            handle = self.project.new_run(self.spec, self.backend_name)
            handle = self._save(handle, key=key, key_parts=parts, phase="created")
            self.write_record(run_id=handle.run_id)
            print(f"{self.spec.step}: new run {handle.run_id} on {self.backend_name}")
        self.handle = handle
        if phase_index(handle.state.get("phase")) < phase_index("launched"):
            backend = self.backend(handle)
            launched = self._retrying("launch", lambda: backend.launch(handle))
            self._save(launched, phase="launched")

    def _reusable_run(self, key: str) -> RunHandle | None:
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
            print(f"{self.spec.step}: reattaching to run {handle.run_id} ({status.state})")
            return handle
        if status.state != "succeeded":
            return None
        if phase != "promoted":
            print(f"{self.spec.step}: run {handle.run_id} finished; fetching its outputs again")
            return handle
        if backend.outputs_available(handle):
            print(f"{self.spec.step}: outputs changed here; fetching run {handle.run_id} again")
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
        if phase_index(handle.state.get("phase")) < phase_index("started"):
            if backend.poll(handle).state == "pending":
                handle = self._retrying("start", lambda: backend.start(handle))
            handle = self._save(handle, phase="started")
        try:
            status = backend.stream_log(handle, _TextSink(), follow=True)
        except KeyboardInterrupt:
            self.interrupted = True
            self._on_interrupt(backend, handle)
            raise
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
        if backend.name == "local":
            print(f"\n{self.spec.step}: interrupted; cancelling local run {handle.run_id}", file=sys.stderr)
            backend.cancel(handle)
        else:
            print(
                f"\n{self.spec.step}: detached from run {handle.run_id}, which goes on. "
                f"`doit {self.spec.step}` reattaches; `substrax-compute cancel {handle.run_id}` stops it.",
                file=sys.stderr,
            )

    def fetch(self) -> Any:
        return self._action(self._fetch)

    def _fetch(self) -> Any:
        handle = self.handle
        if not self.active() or handle is None:
            return None
        backend = self.backend(handle)
        try:
            fetched = backend.fetch(handle)
        except manifest_cache.ManifestError as exc:
            self._save(handle, verdict={"state": "failed", "message": str(exc)})
            return TaskFailed(f"step {self.spec.step!r}: {exc}; nothing was promoted")
        missing = fetched.manifest.get("missing") or []
        if missing:
            message = f"the run did not produce declared output(s) {', '.join(missing)}"
            self._save(handle, verdict={"state": "failed", "message": message})
            return TaskFailed(f"step {self.spec.step!r}: run {handle.run_id}: {message}; nothing was promoted")
        run_dir = self.project.store.run_dir(handle.run_id)
        write_json_atomic(run_dir / "manifest.json", fetched.manifest)
        self.fetched = fetched
        self._save(handle, phase="fetched", manifest_digest=fetched.manifest["digest"])
        return None

    def verify(self) -> Any:
        """The public task: verify the staged outputs, promote them, record."""
        return self._action(self._verify)

    def _verify(self) -> Any:
        handle, fetched = self.handle, self.fetched
        if not self.active() or handle is None or fetched is None:
            verified = self.read_record().get("verified") or {}
            return {DOIT_VALUE: verified.get("run_id", "")}
        outputs = list(self.spec.outputs)
        digest = str(fetched.manifest["digest"])
        if fetched.in_place:
            problems = manifest_cache.verify_outputs(self.project.root, outputs, fetched.manifest, self.outputs_cache)
        else:
            # Staged and final files share inode and mtime after the rename,
            # so the cache filled here makes the next no-op check stat-only.
            problems = manifest_cache.verify_outputs(fetched.root, outputs, fetched.manifest, self.outputs_cache)
        if problems:
            return TaskFailed(
                f"step {self.spec.step!r}: the fetched outputs of run {handle.run_id} do not match "
                "its manifest; nothing was promoted:\n  " + "\n  ".join(problems)
            )
        if not fetched.in_place:
            promote(fetched.root, self.project.root, outputs)
        if not manifest_cache.outputs_match(self.project.root, outputs, digest, self.outputs_cache):
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
        return {DOIT_VALUE: handle.run_id}

    def teardown(self) -> None:
        """doit's teardown (after success, failure or Ctrl-C). Idempotent:
        doit may call it once per worker thread."""
        if self.torn_down:
            return
        self.torn_down = True
        try:
            if self.handle is None:
                return
            handle = self.project.store.read(self.handle.run_id)
            backend = self.backend(handle)
            status = backend.status(handle)
            done = handle.state.get("phase") == "promoted" or (status.final and status.state != "succeeded")
            if done or (self.interrupted and backend.name == "local"):
                backend.teardown(handle)
            elif status.final:
                print(f"{self.spec.step}: keeping run {handle.run_id} until its outputs are home; "
                      f"`doit {self.spec.step}` fetches them again")
        finally:
            self.lock.release()


class _Abort(Exception):
    def __init__(self, failure: TaskFailed | TaskError) -> None:
        super().__init__(str(failure))
        self.failure = failure


def project_of(path: str | Path | None) -> Project:
    return Project.open(Path.cwd() if path is None else Path(path))
