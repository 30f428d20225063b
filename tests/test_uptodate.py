"""uptodate.py without doit: the key, the proof and `why`'s reasons as plain
functions of a step, its record and the files."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from substrax_tasks.step.spec import make_spec
from substrax_tasks.store.run_store import RunStore
from substrax_tasks.uptodate import check as uptodate
from substrax_tasks.uptodate import manifests as manifest_cache
from substrax_tasks.uptodate import walk as tree
from substrax_tasks.uptodate.check import DOIT_VALUE, Step
from substrax_tasks.uptodate.proofs import proof_file

pytestmark = pytest.mark.unit

RACY = 0.05


@pytest.fixture(autouse=True)
def short_racy_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manifest_cache.manifest_module(), "RACY_SECONDS", RACY)


def make_step(
    root: Path, command: str = "cp in.txt out/a.txt", settings: dict[str, object] | None = None
) -> Step:
    spec = make_spec("fit", ["/bin/sh", "-c", command], root, inputs=["in.txt", "data"], outputs=["out/"])
    return Step(spec, root, "local", dict(settings or {"sandbox": "none"}), RunStore(root / ".state"))


def verified(root: Path, step: Step) -> None:
    """What the chain leaves once it promoted a run: outputs in place, the
    run's manifest saved, the record naming the verified key and digest."""
    (root / "out").mkdir(exist_ok=True)
    (root / "out" / "a.txt").write_text("made\n")
    manifest = manifest_cache.build_manifest(root, ["out/"])
    manifest_file = root / ".state" / "runs" / "r1" / "manifest.json"
    manifest_file.parent.mkdir(parents=True)
    manifest_file.write_text(json.dumps(manifest))
    parts = uptodate.key_parts(step)
    record = {"run_id": "r1", "key": uptodate.key(parts), "key_parts": parts,
              "digest": manifest["digest"], "manifest_file": str(manifest_file)}
    uptodate.write_record(step, run_id="r1", verified=record)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "in.txt").write_text("input\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x").write_text("x\n")
    return tmp_path


def test_the_key_moves_with_input_contents_and_settings_only(root: Path) -> None:
    step = make_step(root)
    first = uptodate.key(uptodate.key_parts(step))
    assert uptodate.key(uptodate.key_parts(make_step(root))) == first
    (root / "data" / "x").write_text("y\n")  # a file of an input folder
    assert uptodate.key(uptodate.key_parts(step)) != first
    assert uptodate.key(uptodate.key_parts(make_step(root, settings={"sandbox": "bwrap"}))) != first


def test_up_to_date_only_with_a_verified_record_and_matching_outputs(root: Path) -> None:
    step = make_step(root)
    assert not uptodate.up_to_date(step, None)  # never verified
    verified(root, step)
    assert uptodate.up_to_date(step, {DOIT_VALUE: "r1"})
    (root / "out" / "a.txt").write_text("edited\n")
    assert not uptodate.up_to_date(step, {DOIT_VALUE: "r1"})


def test_forgotten_by_doit_reruns_unless_doit_never_saved_the_run(root: Path) -> None:
    step = make_step(root)
    verified(root, step)
    # doit was killed before it saved its DB: the record is trusted
    assert uptodate.up_to_date(step, {})
    uptodate.write_record(step, acknowledged="r1")  # that doit exited normally
    assert not uptodate.up_to_date(step, {})  # so no value means `doit forget`


def test_a_proof_is_kept_once_the_racy_window_passed_and_moves_with_any_change(root: Path) -> None:
    step = make_step(root)
    verified(root, step)
    proofs = root / ".state" / "cache" / "up-to-date.json"
    assert uptodate.up_to_date(step, None)
    kept = proof_file(proofs)
    assert not kept.holds("fit", uptodate.proof(step)[0])  # type: ignore[index]  # too young
    time.sleep(RACY + 0.02)
    assert uptodate.up_to_date(step, None)
    now = uptodate.proof(step)
    assert now is not None and kept.holds("fit", now[0])
    (root / "uv.lock").write_text("lock\n")  # an environment lock appears
    assert uptodate.proof(step) != now
    (root / "uv.lock").unlink()
    (root / "data" / "new").write_text("n\n")
    assert uptodate.proof(step) != now


def test_explain_names_each_change(root: Path) -> None:
    step = make_step(root)
    assert uptodate.explain(step, None, lambda run_id: None)[0].startswith("no verified run yet")
    verified(root, step)
    assert uptodate.explain(step, {DOIT_VALUE: "r1"}, lambda run_id: None) == []
    uptodate.write_record(step, acknowledged="r1")  # the doit that verified it exited normally
    (root / "in.txt").write_text("changed\n")
    (root / "out" / "a.txt").unlink()
    changed = make_step(root, command="true", settings={"sandbox": "bwrap"})
    reasons = uptodate.explain(changed, {}, lambda run_id: {"sandbox": "none"})
    assert reasons[0].startswith("command changed")
    table = "[tool.substrax.compute.backends.local]"
    assert f"settings changed in {table}: sandbox was 'none', now 'bwrap'" in reasons
    assert "input changed: in.txt" in reasons
    assert any(r.startswith("outputs: missing") for r in reasons)
    assert reasons[-1].startswith("doit has no record of task 'fit'")
    # a run doit was never told about (its doit was killed first) is no reason
    uptodate.write_record(step, acknowledged="")
    reasons = uptodate.explain(changed, {}, lambda run_id: None)
    assert not any(r.startswith("doit has no record") for r in reasons)


def _walk_stamp(root: Path) -> str:
    items: list[Any] = []
    tree.stat_walk(root, ["out/"], items)
    return tree.stamp_of(items)


def _replace(path: Path, make: Callable[[Path], object]) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
    make(path)


OUTPUT_CHANGES: dict[str, Callable[[Path], object]] = {
    "edit-nested-file": lambda out: (out / "sub" / "deep" / "f").write_text("other\n"),
    "add-file": lambda out: (out / "sub" / "new").write_text("n\n"),
    "remove-file": lambda out: (out / "sub" / "deep" / "f").unlink(),
    "chmod": lambda out: (out / "a").chmod(0o600),
    "retarget-link": lambda out: _replace(out / "link", lambda p: p.symlink_to("sub")),
    "folder-to-file": lambda out: _replace(out / "sub", lambda p: p.write_text("")),
    "rename": lambda out: (out / "a").rename(out / "b"),
}


@pytest.mark.parametrize("change", OUTPUT_CHANGES)
def test_the_walk_of_the_outputs_moves_with_any_change_in_them(tmp_path: Path, change: str) -> None:
    """(An edit that keeps the size shows only in the ctime, which can stay
    within one clock tick: that is the racy window's part, tested above.)"""
    out = tmp_path / "out"
    (out / "sub" / "deep").mkdir(parents=True)
    (out / "sub" / "deep" / "f").write_text("ffff\n")
    (out / "a").write_text("a\n")
    (out / "link").symlink_to("a")
    before = _walk_stamp(tmp_path)
    assert _walk_stamp(tmp_path) == before  # nothing changed: the same stamp
    OUTPUT_CHANGES[change](out)
    assert _walk_stamp(tmp_path) != before
