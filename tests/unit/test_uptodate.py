"""uptodate.py without doit: the key, the proof and `status`, the one answer
of doit's check and `why`, as plain functions of a step, its store and its
files. Each reason a step runs again is made here, and what the check says
(its first reason) and what `why` says (every reason) are held equal."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from substrax_tasks._remote import manifest as remote_manifest
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
    monkeypatch.setattr(remote_manifest, "RACY_SECONDS", RACY)


def make_step(
    root: Path,
    command: str = "cp in.txt out/a.txt",
    settings: dict[str, object] | None = None,
    *,
    backend: str = "local",
    inputs: tuple[str, ...] = ("in.txt", "data"),
    **declared: Any,
) -> Step:
    spec = make_spec("fit", ["/bin/sh", "-c", command], root, inputs=inputs, outputs=["out/"], **declared)
    return Step(spec, root, backend, dict(settings or {"sandbox": "none"}), RunStore(root / ".state"))


def verified(root: Path, step: Step) -> str:
    """What the chain leaves once it promoted a run: its handle, outputs in
    place, the run's manifest saved, the record naming the verified key and
    digest. Returns the run's id."""
    handle = step.files.store.new_run(step.spec, step.backend, step.settings)
    (root / "out").mkdir(exist_ok=True)
    (root / "out" / "a.txt").write_text("made\n")
    manifest = manifest_cache.build_manifest(root, ["out/"])
    manifest_file = step.files.store.manifest_file(handle.run_id)
    manifest_file.write_text(json.dumps(manifest))
    parts = uptodate.key_parts(step)
    record = {"run_id": handle.run_id, "key": uptodate.key(parts), "key_parts": parts,
              "digest": manifest["digest"], "manifest_file": str(manifest_file)}
    uptodate.write_record(step, run_id=handle.run_id, verified=record)
    return handle.run_id


def check_and_why(step: Step, values: dict[str, Any] | None = None) -> tuple[str, ...]:
    """What doit's check (the first reason: it stops there) and `why` (every
    reason) say of the step, asserting that they agree. `values`: doit's
    saved values of the public task (None: unknown)."""
    check = uptodate.status(step, values)
    why = uptodate.status(step, values, every_reason=True)
    assert check.up_to_date == why.up_to_date == (not why.reasons)
    assert check.reasons == why.reasons[:1], (check.reasons, why.reasons)
    return why.reasons


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "in.txt").write_text("input\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x").write_text("x\n")
    return tmp_path


@pytest.fixture
def step(root: Path) -> Step:
    """A step whose run was verified and promoted, and that is up to date."""
    made = make_step(root)
    verified(root, made)
    assert check_and_why(made) == ()
    return made


def test_the_key_moves_with_input_contents_and_settings_only(root: Path) -> None:
    step = make_step(root)
    first = uptodate.key(uptodate.key_parts(step))
    assert uptodate.key(uptodate.key_parts(make_step(root))) == first
    (root / "data" / "x").write_text("y\n")  # a file of an input folder
    assert uptodate.key(uptodate.key_parts(step)) != first
    assert uptodate.key(uptodate.key_parts(make_step(root, settings={"sandbox": "bwrap"}))) != first


def test_never_verified(root: Path) -> None:
    (reason,) = check_and_why(make_step(root))
    assert reason.startswith("no verified run yet")


# Each change, and every reason `why` gives for it, in its order; the check
# must say the first of them. Each function changes the project of a step
# that was up to date, and returns the step as declared now.
def _edit(path: str, text: str) -> Callable[[Path, Step], Step]:
    def edit(root: Path, step: Step) -> Step:
        (root / path).write_text(text)
        return step
    return edit


def _remove(path: str) -> Callable[[Path, Step], Step]:
    def remove(root: Path, step: Step) -> Step:
        target = root / path
        shutil.rmtree(target) if target.is_dir() else target.unlink()
        return step
    return remove


def _declared(**changes: Any) -> Callable[[Path, Step], Step]:
    return lambda root, step: make_step(root, **changes)


def _several_at_once(root: Path, step: Step) -> Step:
    (root / "in.txt").write_text("x\n")
    (root / "out" / "a.txt").write_text("edited\n")
    return make_step(root, "true")


def _chmod_output(root: Path, step: Step) -> Step:
    (root / "out" / "a.txt").chmod(0o600)
    return step


TABLE = "[tool.substrax.compute.backends.local]"
REASONS: dict[str, tuple[Callable[[Path, Step], Step], list[str]]] = {
    "input-changed": (_edit("in.txt", "changed\n"), ["input changed: in.txt"]),
    "input-added-to-a-folder": (_edit("data/y", "y\n"), ["input added: data/y"]),
    "input-removed-from-a-folder": (_remove("data/x"), ["input removed: data/x"]),
    "input-missing": (_remove("in.txt"), ["input removed: in.txt", "input missing: in.txt"]),
    "command-changed": (
        _declared(command="true"),
        ["command changed: was ['/bin/sh', '-c', 'cp in.txt out/a.txt'], now ['/bin/sh', '-c', 'true']"],
    ),
    "env-changed": (_declared(env={"MODE": "slow"}), ["env changed: was {}, now {'MODE': 'slow'}"]),
    "timeout-changed": (_declared(timeout=60.0), ["timeout changed: was None, now 60.0"]),
    "settings-changed": (
        _declared(settings={"sandbox": "bwrap"}),
        [f"settings changed in {TABLE}: sandbox was 'none', now 'bwrap'"],
    ),
    "backend-changed": (_declared(backend="ssh"), ["backend changed: local -> ssh"]),
    "backend-changed-said-first": (  # and no diff of one backend's settings against another's
        _declared(backend="ssh", settings={"host": "gpu-box"}, env={"MODE": "slow"}),
        ["backend changed: local -> ssh", "env changed: was {}, now {'MODE': 'slow'}"],
    ),
    "several-at-once": (
        _several_at_once,
        [
            "command changed: was ['/bin/sh', '-c', 'cp in.txt out/a.txt'], now ['/bin/sh', '-c', 'true']",
            "input changed: in.txt",
            "outputs: changed content: out/a.txt "
            "(5 bytes, sha256 9ccbd3f1b19a -> 7 bytes, sha256 68f01b289aed)",
        ],
    ),
    "output-file-missing": (_remove("out/a.txt"), ["outputs: missing: out/a.txt (file)"]),
    "output-folder-missing": (_remove("out"), ["outputs: missing output: out/"]),
    "output-file-added": (_edit("out/stray", "s"), ["outputs: extra: out/stray (file)"]),
    "output-mode-changed": (
        _chmod_output,
        ["outputs: changed mode: out/a.txt (0644 -> 0600)"],
    ),
}


@pytest.mark.parametrize("change", REASONS)
def test_check_and_why_agree_on_each_reason(root: Path, step: Step, change: str) -> None:
    make_change, expected = REASONS[change]
    now = make_change(root, step)
    assert list(check_and_why(now, {DOIT_VALUE: "run"})) == expected


def test_settings_changed_when_the_run_s_handle_is_unreadable(root: Path, step: Step) -> None:
    run_id = uptodate.read_record(step)["run_id"]
    step.files.store.handle_path(run_id).unlink()
    assert check_and_why(make_step(root, settings={"sandbox": "bwrap"})) == (
        f"settings changed: the backend settings {TABLE} differ from the verified run's",
    )


@pytest.mark.parametrize("lock", ["uv.lock", "requirements.txt"])
def test_an_environment_lock_that_changes_or_goes(root: Path, lock: str) -> None:
    """Said in words, naming the lock file: never its digests."""
    (root / lock).write_text("one\n")
    step = make_step(root)
    verified(root, step)
    assert check_and_why(step) == ()
    (root / lock).write_text("two\n")
    assert check_and_why(step) == (f"environment changed: {lock} changed",)
    (root / lock).unlink()
    assert check_and_why(step) == (
        f"environment changed: {lock} is gone, the step now runs without a locked environment",
    )


def test_an_environment_lock_that_appears(root: Path, step: Step) -> None:
    (root / "requirements.lock").write_text("pinned\n")
    assert check_and_why(step) == (
        "environment changed: requirements.lock appeared, the environment is built from it now",
    )


def test_an_environment_lock_companion_that_changes_and_another_lock(root: Path) -> None:
    (root / "uv.lock").write_text("one\n")
    (root / "pyproject.toml").write_text("[project]\n")
    step = make_step(root)
    verified(root, step)
    (root / "pyproject.toml").write_text("[project]\nname = 'p'\n")
    assert check_and_why(step) == ("environment changed: pyproject.toml changed",)
    (root / "uv.lock").unlink()
    (root / "requirements.lock").write_text("pinned\n")
    assert check_and_why(step) == (
        "environment changed: it is built from requirements.lock now, no longer from uv.lock",
    )


def test_the_run_s_view_changed(root: Path, step: Step) -> None:
    """A run verified when runs saw every tracked file (its key has no view
    part) may have read an undeclared file: it runs once more."""
    record = uptodate.read_record(step)
    parts = dict(record["verified"]["key_parts"])
    del parts["view"]
    older = {**record["verified"], "key_parts": parts, "key": uptodate.key(parts)}
    uptodate.write_record(step, verified=older)
    (reason,) = check_and_why(step)
    assert reason.startswith("the run's view changed: runs now see only the step's declared inputs")


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("in.txt", "input changed: in.txt"),
        ("out/a.txt", "outputs: changed content: out/a.txt (5 bytes, sha256 "),
    ],
    ids=["input", "output"],
)
def test_an_edit_keeping_the_size_and_mtime(root: Path, step: Step, path: str, reason: str) -> None:
    """After the racy window: the files' hashes are cached and the step's
    proof is kept, and both hold the file's size and mtime; only the ctime
    moves, which nobody can set back."""
    time.sleep(RACY + 0.02)
    assert check_and_why(step) == ()
    assert proof_file(step.files.proofs).holds("fit", uptodate.proof(step)[0])  # type: ignore[index]
    edited = root / path
    before = edited.stat()
    with edited.open("r+") as f:
        f.write("MADE")
    os.utime(edited, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (edited.stat().st_size, edited.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    (found,) = check_and_why(step)
    assert found.startswith(reason)


def test_forgotten_by_doit_reruns_unless_doit_never_saved_the_run(step: Step) -> None:
    # doit was killed before it saved its DB: the record is trusted
    assert check_and_why(step, {}) == ()
    # the doit that verified the run exited normally
    uptodate.write_record(step, acknowledged=uptodate.read_record(step)["run_id"])
    assert check_and_why(step, {DOIT_VALUE: "run"}) == ()
    assert check_and_why(step, {}) == (  # so no value means `doit forget`
        "doit has no record of task 'fit' (after `doit forget`, or a new dependency file): "
        "doit runs it again",
    )


def test_the_verified_manifest_gone(root: Path, step: Step) -> None:
    """The run's folder removed: its outputs still hold their digest, so the
    step is up to date; once they change, which files cannot be said."""
    manifest_file = Path(uptodate.read_record(step)["verified"]["manifest_file"])
    shutil.rmtree(manifest_file.parent)
    assert check_and_why(step) == ()
    (root / "out" / "a.txt").write_text("edited\n")
    (reason,) = check_and_why(step)
    assert reason == (
        f"outputs: they are not the verified run's, and that run's manifest {manifest_file} is gone or "
        "damaged, so which ones changed cannot be said"
    )


def test_a_newer_run_not_verified_is_no_reason(root: Path, step: Step) -> None:
    """A run started since (going, failed or interrupted) leaves the
    verified outputs what they were: doit skips the step, `why` agrees."""
    uptodate.write_record(step, run_id="fit-newer")
    assert check_and_why(step) == ()


def test_a_damaged_record(root: Path, step: Step) -> None:
    record = uptodate.read_record(step)
    uptodate.write_record(step, verified={**record["verified"], "key": "0" * 64})
    (reason,) = check_and_why(step)
    assert reason.startswith("the verified run's key is not the one its own parts give: the record ")
    uptodate.write_record(step, verified={**record["verified"], "digest": "0" * 64})
    (reason,) = check_and_why(step)
    assert reason.startswith("outputs: their entries are the verified manifest's but their digest is not")


def test_refused_inputs_are_a_reason(root: Path, step: Step) -> None:
    shutil.rmtree(root / "data")
    (root / "elsewhere").mkdir()
    (root / "elsewhere" / "x").write_text("x\n")
    (root / "data").symlink_to("elsewhere")
    step = make_step(root, inputs=("in.txt", "data/x"))
    (reason,) = check_and_why(step)
    assert reason.startswith("step 'fit': inputs refused: ")


def test_a_kept_proof_answers_first_and_moves_with_any_change(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept = proof_file(root / ".state" / "cache" / "up-to-date.json")
    # files younger than the racy window: up to date, and no proof kept
    monkeypatch.setattr(remote_manifest, "RACY_SECONDS", 3600)
    step = make_step(root)
    verified(root, step)
    assert uptodate.status(step, None).up_to_date
    assert not kept.holds("fit", uptodate.proof(step)[0])  # type: ignore[index]
    monkeypatch.setattr(remote_manifest, "RACY_SECONDS", RACY)
    time.sleep(RACY + 0.02)
    assert uptodate.status(step, None).up_to_date
    now = uptodate.proof(step)
    assert now is not None and kept.holds("fit", now[0])
    (root / "uv.lock").write_text("lock\n")  # an environment lock appears
    assert uptodate.proof(step) != now
    (root / "uv.lock").unlink()
    (root / "data" / "new").write_text("n\n")
    assert uptodate.proof(step) != now


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


@pytest.mark.unit
def test_checkpoints_are_in_the_key_only_when_declared_and_why_names_them(root: Path, step: Step) -> None:
    """A step without checkpoints keeps the key it had before they existed
    (no rerun after an upgrade); declaring them is a change `why` names; the
    settings about keeping them are not in the key."""
    assert "checkpoints" not in uptodate.key_parts(step)
    kept = make_step(root, checkpoints="ckpt/")
    assert uptodate.key_parts(kept)["checkpoints"] == "ckpt/"
    assert check_and_why(kept) == ("checkpoints changed: was None, now 'ckpt/'",)
    settings = {"sandbox": "none", "keep_checkpoints": True, "checkpoint_seconds": 5.0}
    assert uptodate.key(uptodate.key_parts(make_step(root, settings=settings))) == uptodate.key(
        uptodate.key_parts(step))
