"""The phases that bring a run's outputs home: fetch (copy them into
staging, verified against the run's manifest by the backend) and promote
(verify what a fetch or a restore from the run cache staged, move it into
place, and write the step record that says where it came from)."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from doit.exceptions import TaskFailed

from substrax_tasks.atomic import write_json_atomic
from substrax_tasks.cache.run_cache import cache_key
from substrax_tasks.console import emit
from substrax_tasks.errors import OutputsRefused
from substrax_tasks.run.promote import JOURNAL, make_safe, promote, recover, safe_manifest
from substrax_tasks.step import doit_db
from substrax_tasks.store.phase import Phase
from substrax_tasks.uptodate import check as uptodate
from substrax_tasks.uptodate import manifests as manifest_cache

if TYPE_CHECKING:
    from substrax_tasks.backends.base import Fetched
    from substrax_tasks.run.driven_run import DrivenRun
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

    def fetch_verified() -> Fetched:
        """One fetch, its copy verified here against the run's manifest."""
        try:
            fetched = backend.fetch(handle)
            if fetched.manifest.get("missing"):
                return fetched  # judged below: the command did not make them, nothing was changed
            outputs = list(driver.spec.outputs)
            try:
                make_safe(fetched.root, outputs)  # as the promotion checks them: no setuid bit, ...
            except OSError:
                return fetched  # the promotion says so, and promotes nothing
            problems = manifest_cache.verify_outputs(
                fetched.root, outputs, safe_manifest(fetched.manifest), driver.step.files.outputs_cache
            )
            if problems:
                raise OutputsRefused(
                    f"the fetched outputs of run {handle.run_id} do not match its manifest; nothing was "
                    "promoted:\n  " + "\n  ".join(problems)
                )
        except OutputsRefused:
            seen = (driver.handle or handle).state.get("fetch_refusals")
            driver.save(handle, fetch_refusals=int(seen or 0) + 1)
            raise
        return fetched

    try:
        fetched = driver.retrying("fetch", fetch_verified)
    except manifest_cache.ManifestError as exc:
        driver.save(handle, verdict={"state": "failed", "message": str(exc)})
        return TaskFailed(f"step {step!r}: {exc}; nothing was promoted")
    except OutputsRefused as exc:
        current = driver.handle or handle
        if int(current.state.get("fetch_refusals") or 0) < REFUSALS_BEFORE_GIVING_UP:
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
    missing = fetched.manifest.get("missing") or []
    if missing:
        message = f"the run did not produce declared output(s) {', '.join(missing)}"
        driver.save(handle, verdict={"state": "failed", "message": message})
        return TaskFailed(f"step {driver.spec.step!r}: run {handle.run_id}: {message}; nothing was promoted")
    # The modes the outputs will have here (no setuid bit, ...): the
    # manifest kept, and every later check, agree with the promoted files.
    fetched = dataclasses.replace(fetched, manifest=safe_manifest(fetched.manifest))
    # compact: a manifest of 20,000 files is 3 MB, 4x slower to indent
    write_json_atomic(driver.project.store.manifest_file(handle.run_id), fetched.manifest, indent=None)
    driver.fetched = fetched
    # A copy that verified ends the count: a later refusal (outputs changed
    # here, fetched again) starts it anew.
    driver.advance(handle, Phase.FETCHED, manifest_digest=fetched.manifest["digest"], fetch_refusals=0)
    return None


def promote_outputs(driver: DrivenRun) -> TaskFailed | None:
    handle, fetched, restored, step = driver.handle, driver.fetched, driver.restored, driver.spec.step
    if fetched is None or (handle is None and restored is None):
        return None  # no run driven here (a rerun that found nothing to do)
    source = restored.label if restored is not None else f"run {handle.run_id}"  # type: ignore[union-attr]
    outputs = list(driver.spec.outputs)
    # Outputs carry no privileges, whatever brought them (promote.py): made
    # safe here, before they are verified, never trusting a transport did it.
    try:
        make_safe(fetched.root, outputs)
    except OSError as exc:
        return TaskFailed(f"step {step!r}: could not clear the setuid and world-writable bits of the "
                          f"outputs of {source} ({exc}); nothing was promoted")
    fetched = driver.fetched = dataclasses.replace(fetched, manifest=safe_manifest(fetched.manifest))
    digest = str(fetched.manifest["digest"])
    cache = driver.step.files.outputs_cache
    problems = manifest_cache.verify_outputs(fetched.root, outputs, fetched.manifest, cache)
    if problems:
        return TaskFailed(
            f"step {step!r}: the fetched outputs of {source} do not match "
            "its manifest; nothing was promoted:\n  " + "\n  ".join(problems)
        )
    renamed = False
    if fetched.root.resolve() != driver.root.resolve():
        try:
            where = journal(driver, handle.run_id if handle is not None else None)
            renamed = promote(fetched.root, driver.root, outputs, where)
        except OSError as exc:
            if doit_db.no_space_left(exc, str(exc.filename or driver.root)):
                raise  # the phase's own message: where, what is kept, the fix
            return TaskFailed(
                f"step {step!r}: could not move the outputs of {source} into place "
                f"({exc}); fix that, then `doit {step}` promotes them without running "
                "the command again"
            )
    # Renames moved the very files just verified; a copy (another file
    # system) or outputs verified in place are checked where they stand.
    if not renamed and not manifest_cache.outputs_match(driver.root, outputs, digest, cache):
        return TaskFailed(f"step {step!r}: outputs changed while they were promoted")
    if renamed:
        manifest_cache.renamed_into_place(driver.root, outputs, cache)
    if handle is not None:
        driver.advance(handle, Phase.PROMOTED)
    uptodate.write_record(driver.step, **record_of(driver, digest))
    return None


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
    verified.update(run_id=run_id, manifest_file=str(manifest_file), restored_from=restored.label,
                    provenance=restored.provenance)
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
