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




@pytest.mark.unit
def test_attempts_are_recorded_and_their_command_time_summed(project: Project) -> None:
    """`preemptions`: each attempt in the handle, its times plain ISO
    strings; the time the command ran in the attempts that ended is what a
    step's timeout bounds over all of them."""
    spec = make_spec("long", ["true"], project.root, outputs=["o"], timeout=100)
    handle = project.new_run(spec, settings={"sandbox": "none"})
    assert handle.state.attempts == [] and handle.state.command_seconds_spent() == 0
    lost = {"number": 1, "machine": "gpu-box", "launched_at": "2026-12-07T00:00:00.000+00:00",
            "started_at": "2026-12-07T00:00:05.000+00:00", "ended_at": "2026-12-07T00:00:35.500+00:00",
            "outcome": "lost", "message": "the host restarted"}  # fmt: skip
    going = {"number": 2, "machine": "gpu-box", "launched_at": "2026-12-07T00:01:00.000+00:00",
             "started_at": "2026-12-07T00:01:10.000+00:00", "snapshot": "snap-0a1b2c"}  # fmt: skip
    handle = project.store.update_state(handle, attempts=[lost, going])
    again = project.store.read(handle.run_id)
    assert [a.model_dump(exclude_none=True) for a in again.state.attempts] == [lost, going]
    assert again.state.attempts[0].command_seconds == 30.5
    assert again.state.command_seconds_spent() == 30.5  # the attempt going is not counted yet
    data = json.loads((run_dir(project, handle) / HANDLE_FILE).read_text())
    assert data["state"]["attempts"][1]["snapshot"] == "snap-0a1b2c"


@pytest.mark.unit
def test_an_attempt_with_a_key_this_release_does_not_know_is_refused(project: Project) -> None:
    from substrax_tasks.errors import HandleError

    spec = make_spec("long", ["true"], project.root, outputs=["o"])
    handle = project.new_run(spec, settings={"sandbox": "none"})
    path = run_dir(project, handle) / HANDLE_FILE
    data = json.loads(path.read_text())
    data["state"]["attempts"] = [{"number": 1, "machine": "m", "launched_at": "2026-12-07T00:00:00+00:00",
                                  "zone": "eu"}]  # fmt: skip
    path.write_text(json.dumps(data))
    with pytest.raises(HandleError, match=r"damaged handle \(state\.attempts\.0\.zone"):
        project.store.read(handle.run_id)
