"""The driver's use of the run cache (cache.py): restore before a launch,
say in the step record where the outputs came from, keep a promoted run."""

from __future__ import annotations

import contextlib
import shutil
import threading
from typing import TYPE_CHECKING

from substrax_tasks.backends.base import MAX_LOG_BYTES
from substrax_tasks.cache.run_cache import LOG_KEPT, CacheOptions, RunCache, cache_key
from substrax_tasks.cache.storage import Damaged
from substrax_tasks.console import emit
from substrax_tasks.errors import BackendError, SubstraxError
from substrax_tasks.store.phase import Phase

if TYPE_CHECKING:
    from substrax_tasks.backends.base import Backend, Fetched
    from substrax_tasks.run.driven_run import DrivenRun
    from substrax_tasks.store.handle import RunHandle

# Said once per doit, not per step: the first run not kept (a list, so no global statement).
_SAID_NOT_KEPT: list[str] = []
_SAID_LOCK = threading.Lock()


def run_cache_of(driver: DrivenRun) -> RunCache | None:
    options = CacheOptions(**driver.project.cache)
    return RunCache(options, driver.root, driver.project.store) if options.used() else None


def restored_from_cache(driver: DrivenRun) -> bool:
    """Whether the driver's step was restored from the cache (its outputs
    staged and verified, to be promoted), unless the step's own check held
    (`doit -a`, or a user's uptodate item, asked for a real run, which then
    replaces the entry)."""
    run_cache = run_cache_of(driver)
    if run_cache is None or driver.check_held:
        return False
    driver.restored = run_cache.restore(driver.step, driver.parts)
    if driver.restored is not None:
        driver.fetched = driver.restored.fetched
    return driver.restored is not None


def _say_once_not_kept(step: str, run_id: str) -> None:
    """Once per doit: the why, for the first run left out."""
    with _SAID_LOCK:
        if _SAID_NOT_KEPT:
            return
        _SAID_NOT_KEPT.append(run_id)
    emit(
        f"{step}: run {run_id} is not kept in the run cache: it ran without the sandbox "
        '(sandbox = "none", or "auto" without a usable bubblewrap), so it could read project files '
        "its key does not cover (runs without the sandbox are never kept)"
    )


def log_tail(backend: Backend, handle: RunHandle) -> bytes:
    """The last LOG_KEPT bytes of the run's log, with a note when its start
    was left out."""
    tail, offset = bytearray(), 0
    while offset < MAX_LOG_BYTES and (chunk := backend.read_log(handle, offset)):
        offset += len(chunk)
        tail += chunk
        del tail[:-LOG_KEPT]
    if offset > len(tail):
        note = f"[substrax: the last {LOG_KEPT >> 10} KiB of the run's log of {offset} bytes]\n"
        return note.encode() + bytes(tail)
    return bytes(tail)


def keep_after(driver: DrivenRun, fetched: Fetched) -> None:
    """As the chain ends, after the outputs are home: drop a restore's staging
    folder, or keep a run just promoted (its `fetched` outputs) as an entry
    (never delaying its promotion). A failure to keep it is one line; the
    step is done."""
    restored, handle, run_cache = driver.restored, driver.handle, run_cache_of(driver)
    if restored is not None:
        shutil.rmtree(restored.fetched.root, ignore_errors=True)
        if run_cache is not None and restored.shared is not None:
            try:
                run_cache.adopt(driver.step, restored)
            except (OSError, Damaged) as exc:
                emit(f"{driver.step.name}: could not keep {restored.label} locally: {exc}", err=True)
        return
    manifest = fetched.manifest
    if run_cache is None or handle is None or handle.state.phase is not Phase.PROMOTED:
        return
    if driver.edited:  # outputs of files its key does not name (outputs_phases.edited_while_running)
        return
    if fetched.saw_whole_project:
        _say_once_not_kept(driver.step.name, handle.run_id)
        return
    backend = driver.backend(handle)
    provenance: dict[str, str | None] = {
        "run_id": handle.run_id, "backend": handle.backend, "host": backend.ran_on(handle),
    }  # fmt: skip
    log = None
    with contextlib.suppress(SubstraxError, OSError):  # the entry is kept without them
        ended = backend.poll(handle)  # the run is over: its status is recorded, no machine asked
        provenance.update(started_at=ended.started_at, ended_at=ended.ended_at)
        log = log_tail(backend, handle)
    try:
        key = cache_key(driver.parts, run_cache.settings.key_backend)
        run_cache.save(driver.step, key, manifest, provenance, log)
    except (OSError, Damaged, BackendError) as exc:
        emit(f"{driver.step.name}: could not keep run {handle.run_id} in the cache: {exc}", err=True)

