"""Handle version 3: the core's state typed, the backend's its own; a
version-2 handle (tests/support/v2_handles/, written by the release before)
read, split and written as 3 the next time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from handle_versions import V2_FIXTURES, v2_fixture
from pydantic import ValidationError

from substrax_tasks.backends.registry import backend_class
from substrax_tasks.store.handle import HANDLE_VERSION, CoreState, read_handle
from substrax_tasks.store.phase import Phase
from substrax_tasks.store.run_store import RunStore

pytestmark = pytest.mark.unit


def plant(tmp_path: Path, name: str) -> tuple[RunStore, str]:
    """The v2 fixture `name` as a run of a store under tmp_path."""
    store = RunStore(tmp_path / ".substrax")
    data = v2_fixture(name)
    store.run_dir(data["run_id"]).mkdir(parents=True)
    store.handle_path(data["run_id"]).write_text(json.dumps(data))
    return store, data["run_id"]


@pytest.mark.parametrize("name", sorted(V2_FIXTURES))
def test_a_version_2_handle_reads_as_3_with_the_backends_keys_in_its_own_part(
    tmp_path: Path, name: str
) -> None:
    store, run_id = plant(tmp_path, name)
    old = v2_fixture(name)["state"]
    handle = store.read(run_id)
    assert handle.version == HANDLE_VERSION == 3
    assert handle.state.phase is Phase(old["phase"]) and handle.state.project == old["project"]
    assert handle.state.key == old["key"] and handle.state.times == old["times"]
    assert set(handle.backend_state) == set(old) - set(CoreState.model_fields)
    assert not set(handle.backend_state) & set(CoreState.model_fields)
    # Every key that release wrote is one the backend declares: its model
    # (extra keys refused) reads it.
    own = backend_class(V2_FIXTURES[name]).State.of(handle)
    assert own.model_dump(exclude_unset=True) == handle.backend_state


@pytest.mark.parametrize("name", sorted(V2_FIXTURES))
def test_a_version_2_handle_is_written_as_3_the_next_time_with_nothing_lost(
    tmp_path: Path, name: str
) -> None:
    store, run_id = plant(tmp_path, name)
    old = v2_fixture(name)["state"]
    store.update_state(store.read(run_id), verdict={"state": "failed", "message": "checked"})
    written = json.loads(store.handle_path(run_id).read_text())
    assert written["version"] == 3
    both = {**written["state"], **written["backend_state"]}
    assert {key: both[key] for key in old} == old
    assert written["state"]["verdict"] == {"state": "failed", "message": "checked"}
    assert read_handle(store.handle_path(run_id)).backend_state == written["backend_state"]


def test_a_key_neither_part_declares_is_refused_and_the_handle_stays_as_it_was(tmp_path: Path) -> None:
    store, run_id = plant(tmp_path, "ssh.json")
    handle = store.read(run_id)
    before = store.handle_path(run_id).read_text()
    ssh = backend_class("ssh")
    backend = ssh(ssh.Settings.model_validate(handle.settings), store)
    with pytest.raises(ValidationError, match="remote_rundir"):
        backend.save_state(handle, remote_rundir="/typo")  # a typo of remote_run_dir
    with pytest.raises(ValidationError, match="remote_run_dir"):
        store.update_state(handle, remote_run_dir="/x")  # a backend's key is not the core's
    with pytest.raises(ValidationError, match="cluster"):
        backend.save_state(handle, cluster="sx-1")  # skypilot's key is not ssh's
    assert store.handle_path(run_id).read_text() == before
    saved = backend.save_state(handle, uploaded=7)
    assert saved.backend_state["uploaded"] == 7 and saved.state == handle.state


def test_an_unknown_phase_in_an_old_handle_reads_as_none(tmp_path: Path) -> None:
    store, run_id = plant(tmp_path, "local.json")
    data = json.loads(store.handle_path(run_id).read_text())
    data["state"]["phase"] = "dreaming"
    store.handle_path(run_id).write_text(json.dumps(data))
    assert store.read(run_id).state.phase is None


@pytest.mark.parametrize("backend", ["local", "ssh", "skypilot"])
def test_the_cores_state_has_no_field_of_a_backend(backend: str) -> None:
    """What the core needs of a backend's state it asks the backend (ran_on,
    released, lifetime_left, capabilities); tests/unit/test_import_graph.py
    checks it never reads `backend_state`."""
    declared = backend_class(backend).State
    assert declared.model_config.get("extra") == "forbid"
    assert not set(declared.model_fields) & set(CoreState.model_fields)
