"""The phases that bring a run's outputs home: fetch (copy them into
staging and verify them against the run's manifest) and promote (move what
a fetch verified, or a restore from the run cache staged, into place, and
write the step record that says where it came from). Both go through
promote.py's `verify_staged` and `promote_verified`, as
`substrax-compute fetch` does."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from doit.exceptions import TaskFailed

from substrax_tasks.atomic import write_json_atomic
from substrax_tasks.cache.run_cache import cache_key
from substrax_tasks.console import emit
from substrax_tasks.errors import OutputsRefused, SubstraxError
from substrax_tasks.run import timeline
from substrax_tasks.run.driven_run import marked_edited, view_changes
from substrax_tasks.run.promote import (
    JOURNAL,
    NotProduced,
    Verified,
    promote_verified,
    recover,
    replaced_extras,
    said_extras,
    verify_staged,
)
from substrax_tasks.step import doit_db
from substrax_tasks.store.phase import Phase
from substrax_tasks.uptodate import check as uptodate
from substrax_tasks.uptodate import manifests as manifest_cache

if TYPE_CHECKING:
    from substrax_tasks.run.driven_run import DrivenRun
    from substrax_tasks.store.handle import RunHandle
    from substrax_tasks.uptodate.check import Step


# A refused copy is kept for one fetch again (a copy can be refused for a
# passing reason: the outputs were put back as the command left them); a
# run refused again, in this doit (`retries`) or the next, can never
# verify: it is given up, so that the step is not refused for ever.
REFUSALS_BEFORE_GIVING_UP = 2


def fetch_outputs(driver: DrivenRun) -> TaskFailed | None:
    handle = driver.handle
    if handle is None:
        return None
    backend = driver.backend(handle)
    step = driver.spec.step

    def fetch_verified() -> Verified:
        """One fetch, its copy verified here against the run's manifest:
        the one verification of what the promotion moves (promote.verify_staged)."""
        try:
            fetched = backend.fetch(handle)
            return verify_staged(fetched, driver.spec.outputs, driver.step.files.outputs_cache,
                                 f"run {handle.run_id}")  # fmt: skip
        except OutputsRefused:
            seen = (driver.handle or handle).state.fetch_refusals
            driver.save(handle, fetch_refusals=int(seen or 0) + 1)
            raise

    try:
        verified = driver.retrying("fetch", fetch_verified)
    except manifest_cache.ManifestError as exc:
        driver.save(handle, verdict={"state": "failed", "message": str(exc)})
        return TaskFailed(f"step {step!r}: {exc}; nothing was promoted")
    except NotProduced as exc:
        driver.save(handle, verdict={"state": "failed", "message": str(exc)})
        driver.remove_made_folders()
        return TaskFailed(f"step {step!r}: run {handle.run_id}: {exc}; nothing was promoted")
    except OutputsRefused as exc:
        current = driver.handle or handle
        if int(current.state.fetch_refusals or 0) < REFUSALS_BEFORE_GIVING_UP:
            return TaskFailed(
                f"step {step!r}: {exc}\nThe run is kept: `doit {step}` fetches it again; refused again, "
                "it is given up and a new run starts"
            )
        message = (
            "damaged: what it left where it ran was refused twice (its manifest or outputs changed "
            "after the command ended); given up and torn down"
        )
        driver.save(handle, verdict={"state": "failed", "message": message})
        return TaskFailed(
            f"step {step!r}: {exc}\nRefused again: run {handle.run_id} is recorded damaged and torn "
            f"down, nothing of it promoted; `doit {step}` starts a new run"
        )
    # The manifest kept has the modes the outputs have here (no setuid
    # bit, ...): every later check agrees with the promoted files.
    # compact: a manifest of 20,000 files is 3 MB, 4x slower to indent
    write_json_atomic(driver.project.store.manifest_file(handle.run_id), verified.manifest, indent=None)
    driver.fetched = verified
    # A copy that verified ends the count: a later refusal (outputs changed
    # here, fetched again) starts it anew.
    driver.advance(handle, Phase.FETCHED, manifest_digest=verified.manifest["digest"], fetch_refusals=0)
    return None


def promote_outputs(driver: DrivenRun) -> TaskFailed | None:
    handle, fetched, restored, step = driver.handle, driver.fetched, driver.restored, driver.spec.step
    if fetched is None or (handle is None and restored is None):
        return None  # no run driven here (a rerun that found nothing to do)
    source = restored.label if restored is not None else f"run {handle.run_id}"  # type: ignore[union-attr]
    cache = driver.step.files.outputs_cache
    verified = fetched
    if not isinstance(verified, Verified):
        # A restore from the run cache, checked by the cache against its
        # entry: made safe and verified here, its hash cache filled by the
        # restore (a stat per file, nothing read again).
        try:
            verified = driver.fetched = verify_staged(fetched, driver.spec.outputs, cache, source)
        except SubstraxError as exc:
            return TaskFailed(f"step {step!r}: {exc}")
    try:
        # What the folder outputs here hold beyond the verified ones goes
        # with the old folder: said, as `why` says it.
        extras = replaced_extras(verified, driver.root, driver.spec.outputs)
        where = journal(driver, handle.run_id if handle is not None else None)
        promote_verified(verified, driver.root, driver.spec.outputs, where, cache)
    except OSError as exc:
        if doit_db.no_space_left(exc, str(exc.filename or driver.root)):
            raise  # the phase's own message: where, what is kept, the fix
        return TaskFailed(
            f"step {step!r}: could not move the outputs of {source} into place "
            f"({exc}); fix that, then `doit {step}` promotes them without running "
            "the command again"
        )
    except SubstraxError as exc:  # a copy onto another file system that does not match
        return TaskFailed(f"step {step!r}: {exc}")
    if extras:
        emit(f"{step}: {said_extras(extras, source)}")
    if handle is not None:
        handle = driver.advance(handle, Phase.PROMOTED)
        # `handle` keeps the key the run was launched with: its checkpoints, removed below, are kept by it.
        edited_while_running(driver, handle)
    uptodate.write_record(driver.step, **record_of(driver, str(verified.manifest["digest"])))
    # The outputs are home: the checkpoints that led to them have done their
    # work. Kept (keep_checkpoints) only if made from the files their key
    # names: a run whose inputs were edited while it went made them from
    # others, and the next run of that key must not start from them.
    kept = bool(driver.step.settings.get("keep_checkpoints")) and not driver.edited
    if driver.spec.checkpoints is not None and not kept:
        driver.project.store.remove_checkpoints(step)
        if handle is not None:
            try:
                driver.backend(handle).remove_checkpoints(handle)
            except SubstraxError as exc:  # the outputs are home: nothing else is at stake
                emit(f"{step}: its checkpoints' snapshots were not removed: {exc}", err=True)
    return None


def edited_while_running(driver: DrivenRun, handle: RunHandle) -> None:
    """A run whose declared inputs (or lock file) changed between its key's
    hashing and its end made its outputs from files its key does not name:
    they are promoted (the run happened), but the run is recorded with
    those files marked (driven_run.marked_edited), in its handle and in the
    step record, so the next doit runs it again whatever they hold then,
    `why` names them, the run is never reused for a key, and keep_after
    does not keep it in the run cache. Said once, here.

    The test is the files here, now, against the key: on `local` the
    sandbox binds them live, so they are what the run read. On ssh and
    SkyPilot the run read the copy uploaded by its sync: an edit made after
    it is refused too (a run more, never an output of other files), and
    one rule, on files this process can stat through the inputs' hash cache
    (a stat per unchanged file), needs no manifest asked of the host."""
    try:
        now = uptodate.key_parts(driver.step)
    except SubstraxError:  # an input refused now (made a folder, a link out...): none is trusted
        now = {**driver.parts, "inputs": {path: "" for path in driver.parts.get("inputs") or {}}}
    # An input that appeared or went is named by its path; its "missing_inputs" part need not be.
    driver.edited = [part for part in view_changes(driver.parts, now) if part != "missing_inputs"]
    if not driver.edited:
        return
    driver.parts = marked_edited(driver.parts, now)
    driver.save(handle, key=uptodate.key(driver.parts), key_parts=driver.parts)
    kept = "not kept in the run cache; " if run_cache_used(driver) else ""
    emit(f"{driver.spec.step}: {', '.join(driver.edited)} changed while the run went: "
         f"{kept}the next doit runs it again")  # fmt: skip


def run_cache_used(driver: DrivenRun) -> bool:
    from substrax_tasks.cache.run_cache import CacheOptions

    return CacheOptions(**driver.project.cache).used()


def record_of(driver: DrivenRun, digest: str) -> dict[str, Any]:
    """What the step record says of outputs just verified and promoted."""
    handle, restored, parts = driver.handle, driver.restored, driver.parts
    verified = {"key": uptodate.key(parts), "key_parts": parts, "digest": digest,
                "cache_key": cache_key(parts, bool(driver.project.cache["key_backend"]))}  # fmt: skip
    if handle is not None:
        manifest_file = driver.project.store.manifest_file(handle.run_id)
        return {"verified": {**verified, "run_id": handle.run_id, "manifest_file": str(manifest_file)}}
    assert restored is not None
    manifest_file = driver.project.store.restored_manifest(driver.spec.step)
    manifest_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    assert driver.fetched is not None  # the restore's, its modes made safe by the promotion
    write_json_atomic(manifest_file, driver.fetched.manifest, indent=None)
    run_id = str(restored.provenance.get("run_id") or restored.key[:16])
    # When and by which doit, for the report (a restore has no handle to time).
    verified.update(run_id=run_id, manifest_file=str(manifest_file), restored_from=restored.label,
                    provenance=restored.provenance, restored_at=timeline.now(), doit=timeline.DOIT_ID)
    return {"run_id": run_id, "verified": verified}


def acknowledge(step: Step, run_id: str) -> None:
    """At interpreter exit, after doit saved its DB (never after SIGKILL,
    nor when the save failed for want of space)."""
    if doit_db.save_failed():
        return
    with contextlib.suppress(OSError):
        if (uptodate.read_record(step).get("verified") or {}).get("run_id") == run_id:
            uptodate.write_record(step, acknowledged=run_id)


def journal(driver: DrivenRun, run_id: str | None) -> Path:
    """Where a promotion is journaled: the run's folder, or beside the
    step record for a restore from the run cache (no run folder)."""
    if run_id is None:
        driver.step.files.record.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        return driver.step.files.record.with_suffix("." + JOURNAL)
    return driver.project.store.run_dir(run_id) / JOURNAL


def recover_promotion(driver: DrivenRun) -> None:
    """A promotion of the step's last run (or restore) that a kill
    interrupted is finished first: nothing reads the outputs half old."""
    run_id = uptodate.read_record(driver.step).get("run_id")
    for where in [journal(driver, None)] + ([journal(driver, str(run_id))] if run_id else []):
        if recover(where):
            emit(f"{driver.spec.step}: finished the promotion of {run_id or 'a restore'}, "
                 "which was interrupted")  # fmt: skip
