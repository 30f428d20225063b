"""The unit half of tests/integration/chain/test_proofs.py: the same subject, the
tests that start no process and open no connection (see its docstring)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from proofs_parts import FILE_NAME

from substrax_tasks.step.spec import make_spec
from substrax_tasks.store.run_store import RunStore
from substrax_tasks.uptodate.check import Step
from substrax_tasks.uptodate.proofs import VERSION, ProofFile, proof_file

# ------------------------------------------------------------ the file


@pytest.mark.unit
def test_proofs_of_two_processes_are_merged_private_and_atomic(tmp_path: Path) -> None:
    path = tmp_path / "state" / "cache" / FILE_NAME
    path.parent.mkdir(parents=True)
    first, second = ProofFile(path), ProofFile(path)  # as two doit processes see it
    assert not first.holds("a", "1")
    first.record("a", "1")
    second.record("b", "2")
    first.save()
    second.save()
    third = ProofFile(path)
    assert third.holds("a", "1")
    assert third.holds("b", "2")
    assert not third.holds("a", "2")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.unit
def test_the_declared_part_of_a_proof_ignores_the_order_of_dicts(tmp_path: Path) -> None:
    """Equal declarations, equal proofs, whatever order a dodo builds its
    env or resources in; any other value, another proof."""
    def declared(env: dict[str, str], resources: dict[str, int]) -> bytes:
        spec = make_spec("step", ["true"], tmp_path, env=env, resources=resources)
        return Step(spec, tmp_path, "local", {"sandbox": "none"}, RunStore(tmp_path / "state")).declared

    first = declared({"A": "1", "B": "2"}, {"cpus": 2, "memory": 4})
    assert declared({"B": "2", "A": "1"}, {"memory": 4, "cpus": 2}) == first
    assert declared({"A": "1", "B": "3"}, {"cpus": 2, "memory": 4}) != first
    assert declared({"A": "1", "B": "2"}, {"cpus": 2, "memory": 8}) != first


@pytest.mark.unit
def test_saved_only_when_something_new(tmp_path: Path) -> None:
    path = tmp_path / FILE_NAME
    proofs = ProofFile(path)
    proofs.save()
    assert not path.exists()
    proofs.record("a", "1")
    proofs.save()
    before = path.stat().st_mtime_ns, path.stat().st_ino
    again = ProofFile(path)
    again.record("a", "1")  # already there
    again.save()
    assert (path.stat().st_mtime_ns, path.stat().st_ino) == before


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"[]",
        json.dumps({"version": VERSION + 1, "proofs": {"a": "1"}}).encode(),
        json.dumps({"version": VERSION, "proofs": ["a"]}).encode(),
        json.dumps({"version": VERSION, "proofs": {"a": 1}}).encode(),
    ],
)
@pytest.mark.unit
def test_a_damaged_or_foreign_file_holds_nothing_and_is_rewritten(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / FILE_NAME
    path.write_bytes(content)
    proofs = ProofFile(path)
    assert not proofs.holds("a", "1")
    proofs.record("b", "2")
    proofs.save()
    assert json.loads(path.read_text()) == {"version": VERSION, "proofs": {"b": "2"}}


@pytest.mark.unit
def test_a_removed_state_folder_is_not_made_again(tmp_path: Path) -> None:
    proofs = proof_file(tmp_path / "gone" / "cache" / FILE_NAME)
    proofs.record("a", "1")
    proofs.save()
    assert not (tmp_path / "gone").exists()


@pytest.mark.unit
def test_one_object_per_project_in_a_process(tmp_path: Path) -> None:
    assert proof_file(tmp_path / "s") is proof_file(tmp_path / "s")
    assert proof_file(tmp_path / "s") is not proof_file(tmp_path / "t")
    store = RunStore(tmp_path)
    assert Step(make_spec("a", ["true"], tmp_path), tmp_path, "local", {}, store).files.proofs == (
        Step(make_spec("b", ["true"], tmp_path), tmp_path, "local", {}, store).files.proofs
    )


# ----------------------------------------------------------- the chain


# ------------------------------------------- what loading a dodo installs


# ------------------------------------------- what the collector walks at load


