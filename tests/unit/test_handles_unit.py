"""The unit half of tests/integration/store/test_handles.py: the same subject, the
tests that start no process and open no connection (see its docstring)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from local_runs import (
    run_dir,
)

from substrax_tasks.step.spec import make_spec
from substrax_tasks.store.handle import HANDLE_VERSION
from substrax_tasks.store.project import Project
from substrax_tasks.store.run_store import HANDLE_FILE, RunStore, run_digest


@pytest.mark.unit
@pytest.mark.parametrize("other", ["a.manifest", "a.outputs", "a.inputs", "a.holder", "a.json"])
def test_no_two_steps_share_a_file_of_the_store(tmp_path: Path, other: str) -> None:
    """A step's name may end as another's files do (steps/a.json and the
    record of a step "a.manifest" once shared a folder with a's restore
    manifest)."""
    store = RunStore(tmp_path)

    def files(step: str) -> set[Path]:
        per_step = (store.step_record, store.restored_manifest, store.inputs_cache, store.outputs_cache)
        lock = store.step_lock(step)
        return {*(path(step) for path in per_step), lock, lock.with_suffix(".holder.json")}

    assert not files("a") & files(other)
    assert store.step_records() == []
    store.step_record("a").parent.mkdir()
    for step in ("a", other):
        store.step_record(step).write_text("{}")
        store.restored_manifest(step).parent.mkdir(exist_ok=True)
        store.restored_manifest(step).write_text("[]")
    assert store.step_records() == sorted([store.step_record("a"), store.step_record(other)])


@pytest.mark.unit
def test_handle_records_spec_settings_and_digest(project: Project) -> None:
    spec = make_spec(
        "record", ["sh", "-c", "true"], project.root, outputs=["out/"], env={"A": "1"}, timeout=9
    )
    handle = project.new_run(spec, settings={"sandbox": "none"})
    data = json.loads((run_dir(project, handle) / HANDLE_FILE).read_text())
    assert data["version"] == HANDLE_VERSION == 3
    assert data["run_id"] == handle.run_id
    assert data["step"] == "record"
    assert data["backend"] == "local"
    assert data["settings"] == {
        "sandbox": "none", "network_isolation": False, "grace_seconds": 5.0, "cache_dirs": [],
        "max_parallel": None, "hide_gpus_when_unasked": False, "pip_args": [], "keep_checkpoints": False,
        "hourly_cost": None, "max_cost": None,
    }
    assert data["spec"]["command"] == ["sh", "-c", "true"]
    assert data["spec"]["outputs"] == ["out/"]
    assert data["spec"]["env"] == {"A": "1"}
    assert data["spec"]["timeout"] == 9
    assert data["spec_digest"] == run_digest(spec, "local", data["settings"])
    assert data["created_at"]
    assert data["state"]["project"] == str(project.root)


