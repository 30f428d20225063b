"""The unit half of tests/integration/{local,ssh}/test_checkpoints.py: which
files of a checkpoints folder are finished (remote/checkpoints.py), and a
snapshot kept here only where its copy matches the list taken there
(backends/checkpoints.py). No process, no connection: the copy is a
function that copies files here."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from substrax_tasks._remote import checkpoints as remote_checkpoints
from substrax_tasks.backends.checkpoints import Snapshots
from substrax_tasks.run.promote import UNSAFE_BITS, safe_mode


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.mark.unit
def test_only_finished_files_are_listed(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "model.pt").write_bytes(b"whole")
    (tmp_path / "state.json").write_bytes(b"{}")
    for temporary in ["model.pt.tmp", ".model.pt.XyZ12", "opt.part", "x.tmp.pt", "notes~"]:
        (tmp_path / temporary).write_bytes(b"half")
    (tmp_path / "link").symlink_to("state.json")
    listed = remote_checkpoints.finished_files(str(tmp_path))
    assert listed == [
        {"path": "state.json", "size": 2, "sha256": sha(b"{}")},
        {"path": "sub/model.pt", "size": 5, "sha256": sha(b"whole")},
    ]


@pytest.mark.unit
def test_a_file_changed_during_the_pull_keeps_its_last_verified_version(tmp_path: Path) -> None:
    there = tmp_path / "there"
    there.mkdir()
    snapshots = Snapshots(tmp_path / "kept")

    def copy(paths: list[str], into: Path) -> None:
        for rel in paths:
            (into / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(there / rel, into / rel)

    (there / "a.pt").write_bytes(b"a1")
    (there / "b.pt").write_bytes(b"b1")
    assert snapshots.pull(remote_checkpoints.finished_files(str(there)), copy) == 2
    first = snapshots.latest()
    assert first is not None
    # Listed as a2 and b2, then b.pt replaced by b3 before it was copied.
    (there / "a.pt").write_bytes(b"a2")
    (there / "b.pt").write_bytes(b"b2")
    listed = remote_checkpoints.finished_files(str(there))
    (there / "b.pt").write_bytes(b"b3")
    assert snapshots.pull(listed, copy) == 2
    latest = snapshots.latest()
    assert latest is not None
    files, manifest = latest
    assert (files / "a.pt").read_bytes() == b"a2"
    assert (files / "b.pt").read_bytes() == b"b1"  # the last whole one, not b3 (unverified)
    assert manifest["b.pt"]["sha256"] == sha(b"b1")
    # The previous snapshot is gone once `latest` names the new one.
    kept = [p.name for p in (tmp_path / "kept").iterdir() if p.name.startswith("snap-")]
    assert kept == [files.parent.name]


@pytest.mark.unit
def test_a_pull_that_breaks_off_leaves_the_last_snapshot_in_place(tmp_path: Path) -> None:
    snapshots = Snapshots(tmp_path / "kept")
    snapshots.pull([], lambda paths, into: None)
    before = snapshots.latest()

    def broken(paths: list[str], into: Path) -> None:
        (into / "half.pt").write_bytes(b"ha")
        raise OSError("connection lost")

    with pytest.raises(OSError, match="connection lost"):
        snapshots.pull([{"path": "half.pt", "size": 4, "sha256": sha(b"half")}], broken)
    assert snapshots.latest() == before
    assert not [p for p in (tmp_path / "kept").iterdir() if p.name.endswith(".partial")]


# ---- No checkpoint file keeps a privilege (issue 28, item 2)


def unsafe_in(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): f"{p.lstat().st_mode & 0o7777:04o}" for p in [root, *root.rglob("*")]
            if not p.is_symlink() and p.lstat().st_mode & remote_checkpoints.UNSAFE_BITS}  # fmt: skip


@pytest.mark.unit
def test_make_safe_is_the_promotions_rule_for_every_mode(tmp_path: Path) -> None:
    assert remote_checkpoints.UNSAFE_BITS == UNSAFE_BITS
    for mode in range(0o10000):
        (tmp_path / f"f{mode:04o}").write_bytes(b"")
        (tmp_path / f"f{mode:04o}").chmod(mode)
    (tmp_path / "d").mkdir()
    (tmp_path / "d").chmod(0o1777)
    (tmp_path / "link").symlink_to("f6755")
    remote_checkpoints.make_safe(str(tmp_path))
    wrong = {p.name: f"{p.lstat().st_mode & 0o7777:04o}" for p in tmp_path.glob("f*")
             if p.lstat().st_mode & 0o7777 != safe_mode(int(p.name[1:], 8))}  # fmt: skip
    assert wrong == {}
    assert (tmp_path / "d").lstat().st_mode & 0o7777 == 0o775


@pytest.mark.unit
def test_a_snapshot_keeps_no_setuid_bit_even_from_the_previous_one(tmp_path: Path) -> None:
    """A copy that brought a setuid file (a transport that kept the mode),
    and a file changed during the next pull, whose previous version is
    copied from the last snapshot: neither keeps the bit here."""
    there = tmp_path / "there"
    there.mkdir()
    snapshots = Snapshots(tmp_path / "kept")

    def copy(paths: list[str], into: Path) -> None:
        for rel in paths:
            shutil.copy2(there / rel, into / rel)

    (there / "a.pt").write_bytes(b"a1")
    (there / "a.pt").chmod(0o6755)
    snapshots.pull(remote_checkpoints.finished_files(str(there)), copy)
    assert unsafe_in(tmp_path / "kept") == {}
    listed = remote_checkpoints.finished_files(str(there))
    (there / "a.pt").write_bytes(b"a2")  # changed after the list: the previous version stays
    snapshots.pull(listed, copy)
    latest = snapshots.latest()
    assert latest is not None and (latest[0] / "a.pt").read_bytes() == b"a1"
    assert unsafe_in(tmp_path / "kept") == {}


@pytest.mark.unit
def test_a_snapshot_in_the_bucket_and_its_restore_keep_no_setuid_bit(tmp_path: Path) -> None:
    there, bucket, kept = tmp_path / "ckpt", tmp_path / "bucket", tmp_path / "kept"
    (there / "sub").mkdir(parents=True)
    (there / "sub" / "model.pt").write_bytes(b"weights")
    (there / "sub" / "model.pt").chmod(0o4777)
    kept.mkdir()
    (kept / "old").write_bytes(b"")
    (kept / "old").chmod(0o6755)  # what an earlier command left there
    remote_checkpoints.push(str(there), str(bucket))
    remote_checkpoints.restore(str(bucket), str(kept))
    assert unsafe_in(bucket) == {} and unsafe_in(kept) == {}


# ---- With the bucket transport: the snapshot pushed from the machine into
# the bucket it mounts, and restored from there (a folder stands in for it).


@pytest.mark.unit
def test_a_snapshot_pushed_to_the_bucket_is_restored_whole(tmp_path: Path) -> None:
    there, bucket, kept = tmp_path / "ckpt", tmp_path / "bucket", tmp_path / "kept"
    (there / "sub").mkdir(parents=True)
    (there / "sub" / "model.pt").write_bytes(b"weights")
    (there / "state.json.tmp").write_bytes(b"half")  # being written: not taken
    first = remote_checkpoints.push(str(there), str(bucket))
    (there / "sub" / "model.pt").write_bytes(b"weights 2")
    second = remote_checkpoints.push(str(there), str(bucket))
    assert first["files"] == second["files"] == 1
    # latest.json names the newest, and the older snapshot is gone.
    assert sorted(p.name for p in bucket.iterdir()) == ["latest.json", second["snapshot"]]
    assert remote_checkpoints.restore(str(bucket), str(kept))["files"] == 1
    assert (kept / "sub" / "model.pt").read_bytes() == b"weights 2"
    assert not (kept / "state.json.tmp").exists()


@pytest.mark.unit
def test_a_push_over_max_checkpoint_size_copies_nothing_and_keeps_the_last_snapshot(tmp_path: Path) -> None:
    """The bucket's side of max_checkpoint_size: a snapshot over it (a
    sparse 3 GiB file, no disk used) is not pushed; its size and largest
    file are answered, from a stat of each, and latest.json still names the
    last whole one."""
    there, bucket = tmp_path / "ckpt", tmp_path / "bucket"
    there.mkdir()
    (there / "state.json").write_bytes(b'{"i": 1}')
    first = remote_checkpoints.push(str(there), str(bucket), 1 << 30)
    with (there / "big.bin").open("wb") as big:
        big.truncate(3 << 30)
    answer = remote_checkpoints.push(str(there), str(bucket), 1 << 30)
    assert answer == {"over": {"bytes": (3 << 30) + 8, "largest": "big.bin", "size": 3 << 30}}
    assert sorted(p.name for p in bucket.iterdir()) == ["latest.json", first["snapshot"]]
    assert remote_checkpoints.over_bound(str(there), 4 << 30) is None


@pytest.mark.unit
def test_a_file_replaced_under_the_push_keeps_its_last_whole_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    there, bucket = tmp_path / "ckpt", tmp_path / "bucket"
    there.mkdir()
    (there / "model.pt").write_bytes(b"v1")
    remote_checkpoints.push(str(there), str(bucket))
    (there / "model.pt").write_bytes(b"v2")
    listed = remote_checkpoints.finished_files(str(there))

    def replaced_while_listed(root: str) -> list[dict[str, object]]:
        (there / "model.pt").write_bytes(b"v3")  # after it was hashed, before the copy
        return listed

    monkeypatch.setattr(remote_checkpoints, "finished_files", replaced_while_listed)
    remote_checkpoints.push(str(there), str(bucket))
    kept = tmp_path / "kept"
    remote_checkpoints.restore(str(bucket), str(kept))
    assert (kept / "model.pt").read_bytes() == b"v1"


@pytest.mark.unit
def test_a_push_killed_before_latest_leaves_the_previous_snapshot_named(tmp_path: Path) -> None:
    there, bucket = tmp_path / "ckpt", tmp_path / "bucket"
    there.mkdir()
    (there / "model.pt").write_bytes(b"v1")
    remote_checkpoints.push(str(there), str(bucket))
    # A push that copied its files but died before writing latest.json.
    (bucket / "snap-0-dead" / "files").mkdir(parents=True)
    (bucket / "snap-0-dead" / "files" / "model.pt").write_bytes(b"v2 half")
    kept = tmp_path / "kept"
    remote_checkpoints.restore(str(bucket), str(kept))
    assert (kept / "model.pt").read_bytes() == b"v1"


@pytest.mark.unit
def test_a_damaged_snapshot_in_the_bucket_is_refused_not_restored(tmp_path: Path) -> None:
    there, bucket = tmp_path / "ckpt", tmp_path / "bucket"
    there.mkdir()
    (there / "model.pt").write_bytes(b"v1")
    name = remote_checkpoints.push(str(there), str(bucket))["snapshot"]
    (bucket / name / "files" / "model.pt").write_bytes(b"bitrot")
    with pytest.raises(ValueError, match=r"model\.pt in the snapshot .* does not match its manifest"):
        remote_checkpoints.restore(str(bucket), str(tmp_path / "kept"))


@pytest.mark.unit
def test_a_backend_that_keeps_no_checkpoints_refuses_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from substrax_tasks.backends import registry
    from substrax_tasks.backends.base import Capabilities
    from substrax_tasks.errors import SubstraxError
    from substrax_tasks.run.step_driver import StepDriver

    monkeypatch.setattr(registry, "backend_class", lambda name: SimpleNamespace(capabilities=Capabilities()))
    driver = SimpleNamespace(spec=SimpleNamespace(checkpoints="ckpt/"), step=SimpleNamespace(backend="other"))
    said = r"checkpoints='ckpt/': the other backend does not keep checkpoints across runs \(the local, ssh"
    with pytest.raises(SubstraxError, match=said):
        StepDriver._refuse_unkept_checkpoints(driver)  # type: ignore[arg-type]
