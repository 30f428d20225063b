"""The unit half of tests/integration/manifests/test_manifest.py: the same subject, the
tests that start no process and open no connection (see its docstring)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import time
from pathlib import Path
from typing import Any, cast

import pytest
from manifest_parts import OLD_NS, age, project, record, sha, short_racy_window, write  # noqa: F401 - fixtures

from substrax_tasks._remote import manifest as remote_manifest
from substrax_tasks.backends.scripts import remote_script
from substrax_tasks.uptodate.manifests import (
    HashCache,
    ManifestError,
    build_manifest,
    diff_manifests,
    outputs_match,
    verify_outputs,
)


def by_path(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["path"]: e for e in manifest["entries"]}


# ----------------------------------------------------------------- entries


@pytest.mark.unit
def test_entries_of_files_dirs_and_symlinks(project: Path) -> None:
    m = build_manifest(project, ["out/", "report.txt"])
    assert m["version"] == 1
    assert m["missing"] == []
    entries = m["entries"]
    assert [e["path"] for e in entries] == sorted(e["path"] for e in entries)
    got = by_path(m)
    assert set(got) == {
        "out", "out/a.txt", "out/run.sh", "out/sub", "out/sub/b.bin", "out/sub/up_one", "out/empty",
        "out/link_to_file", "out/link_to_dir", "out/dangling", "report.txt",
    }  # fmt: skip
    assert got["out/a.txt"] == {
        "path": "out/a.txt", "type": "file", "size": 6, "mode": 0o644,
        "sha256": sha(b"alpha\n"), "target": None,
    }  # fmt: skip
    assert got["out/run.sh"]["mode"] == 0o755
    assert got["out/sub/b.bin"] == {
        "path": "out/sub/b.bin", "type": "file", "size": 2560, "mode": 0o600,
        "sha256": sha(bytes(range(256)) * 10), "target": None,
    }  # fmt: skip
    assert got["out/sub"] == {
        "path": "out/sub", "type": "dir", "size": 0, "mode": 0o750, "sha256": None, "target": None,
    }  # fmt: skip
    assert got["out/empty"]["type"] == "dir"
    assert got["out/link_to_file"] == {
        "path": "out/link_to_file", "type": "symlink", "size": len("a.txt"), "mode": 0o777,
        "sha256": None, "target": "a.txt",
    }  # fmt: skip
    assert got["out/sub/up_one"]["target"] == "../a.txt"
    assert got["report.txt"]["sha256"] == sha(b"report\n")
    assert "data/input.csv" not in got


@pytest.mark.unit
def test_special_mode_bits_are_kept(tmp_path: Path) -> None:
    write(tmp_path / "out/tool", b"x", 0o4755)
    (tmp_path / "out").chmod(0o1777)
    got = by_path(build_manifest(tmp_path, ["out/"]))
    assert got["out/tool"]["mode"] == 0o4755
    assert got["out"]["mode"] == 0o1777


@pytest.mark.unit
def test_large_file_hash_spans_many_buffers(tmp_path: Path) -> None:
    data = os.urandom(3 * (1 << 20) + 12345)
    write(tmp_path / "big.bin", data)
    (e,) = build_manifest(tmp_path, ["big.bin"])["entries"]
    assert e["sha256"] == sha(data)
    assert e["size"] == len(data)


@pytest.mark.unit
def test_symlinks_are_recorded_not_followed(project: Path) -> None:
    m = build_manifest(project, ["out/"])
    paths = {e["path"] for e in m["entries"]}
    # link_to_dir -> sub is one entry: nothing is listed through it
    assert not any(p.startswith("out/link_to_dir/") for p in paths)
    got = by_path(m)
    assert got["out/link_to_dir"]["type"] == "symlink"
    assert got["out/link_to_dir"]["target"] == "sub"
    assert got["out/link_to_file"]["sha256"] is None
    assert got["out/dangling"]["target"] == "not-yet"


@pytest.mark.unit
def test_link_that_climbs_out_and_back_into_its_output_is_accepted(tmp_path: Path) -> None:
    write(tmp_path / "out/x", b"x")
    os.symlink("../out/x", tmp_path / "out/back")
    os.symlink("deep/../x", tmp_path / "out/lexical")  # deep does not exist: read lexically
    got = by_path(build_manifest(tmp_path, ["out/"]))
    assert got["out/back"]["target"] == "../out/x"
    assert got["out/lexical"]["type"] == "symlink"


# ----------------------------------------------------------------- digest


@pytest.mark.unit
def test_digest_is_sha256_of_canonical_entries(project: Path) -> None:
    m = build_manifest(project, ["out/", "report.txt"])
    canonical = json.dumps(m["entries"], sort_keys=True, separators=(",", ":"))
    assert m["digest"] == sha(canonical.encode())


@pytest.mark.unit
def test_digest_is_stable_and_cache_independent(project: Path, tmp_path: Path) -> None:
    outputs = ["out/", "report.txt"]
    first = build_manifest(project, outputs)
    age(project)  # so the cache is filled
    cache: dict[str, bytes] = {}
    cold = build_manifest(project, outputs, cache)
    warm = build_manifest(project, outputs, cache)
    assert cache  # the cache was used
    assert first["digest"] == cold["digest"] == warm["digest"]
    assert first == warm
    # a copy elsewhere (other inodes, other mtimes) has the same digest
    copy = tmp_path / "copy"
    shutil.copytree(project, copy, symlinks=True)
    assert build_manifest(copy, list(reversed(outputs)))["digest"] == first["digest"]


@pytest.mark.parametrize(
    "change",
    ["content", "mode", "add", "delete", "retarget", "empty_dir"],
)
@pytest.mark.unit
def test_digest_changes_with_the_tree(project: Path, change: str) -> None:
    before = build_manifest(project, ["out/"])["digest"]
    if change == "content":
        (project / "out/a.txt").write_bytes(b"alphA\n")
    elif change == "mode":
        (project / "out/a.txt").chmod(0o600)
    elif change == "add":
        write(project / "out/sub/new", b"")
    elif change == "delete":
        (project / "out/sub/b.bin").unlink()
    elif change == "retarget":
        (project / "out/link_to_file").unlink()
        os.symlink("run.sh", project / "out/link_to_file")
    elif change == "empty_dir":
        (project / "out/empty/inner").mkdir()
    assert build_manifest(project, ["out/"])["digest"] != before


# ----------------------------------------------------------------- outputs


@pytest.mark.unit
def test_missing_outputs_are_listed(project: Path) -> None:
    m = build_manifest(project, ["out/", "nope/", "gone.txt", "out2/deeper/x"])
    assert m["missing"] == ["nope/", "gone.txt", "out2/deeper/x"]
    assert {e["path"] for e in m["entries"]} >= {"out", "out/a.txt"}
    empty = build_manifest(project, ["nope/"])
    assert empty["entries"] == [] and empty["missing"] == ["nope/"]


@pytest.mark.unit
def test_output_under_a_file_is_an_error(project: Path) -> None:
    with pytest.raises(ManifestError, match=r"output report\.txt/x lies under report\.txt, which is a file"):
        build_manifest(project, ["report.txt/x"])


@pytest.mark.unit
def test_folder_output_that_is_a_file_is_an_error(project: Path) -> None:
    with pytest.raises(ManifestError, match=r"report\.txt/ is declared as a folder but is a file"):
        build_manifest(project, ["report.txt/"])


@pytest.mark.unit
def test_file_output_that_is_a_folder_is_an_error(project: Path) -> None:
    with pytest.raises(ManifestError, match=r"output out is declared as a file but is a folder"):
        build_manifest(project, ["out"])


@pytest.mark.parametrize(
    ("outputs", "message"),
    [
        (["/abs/out/"], "bad output path"),
        (["../out/"], "bad output path"),
        (["out/../x"], "bad output path"),
        (["./out/"], "bad output path"),
        (["out//x"], "bad output path"),
        ([""], "bad output path"),
        (["out/", "out/sub/"], "overlap"),
        (["out/", "out"], "overlap"),
        (["out/a.txt", "out/"], "overlap"),
    ],
)
@pytest.mark.unit
def test_bad_output_paths_are_refused(project: Path, outputs: list[str], message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        build_manifest(project, outputs)


@pytest.mark.unit
def test_outputs_must_be_a_list_not_a_string(project: Path) -> None:
    with pytest.raises(ManifestError, match="not the string"):
        remote_manifest.build_manifest(project, "out/")
    with pytest.raises(ManifestError, match="not the string"):
        build_manifest(project, "out/")
    assert not outputs_match(project, "out/", "0" * 64, project / "cache.json")  # refused: no match


@pytest.mark.unit
def test_special_files_are_refused(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    os.mkfifo(tmp_path / "out/pipe")
    with pytest.raises(ManifestError, match=r"out/pipe is a fifo"):
        build_manifest(tmp_path, ["out/"])


# ----------------------------------------------------------------- symlink escape


@pytest.mark.parametrize(
    ("link", "target", "why"),
    [
        ("out/abs", "/etc/passwd", "its target is absolute"),
        ("out/abs_inside", "/proj/out/a.txt", "its target is absolute"),
        ("out/up", "../data/input.csv", "it leads to data/input.csv"),
        ("out/sub/up2", "../../report.txt", "it leads to report.txt"),
        ("out/root", "../../../../../../etc", "climbs out of the project"),
        ("out/parent", "..", "it leads to ."),
    ],
)
@pytest.mark.unit
def test_symlink_pointing_outside_is_refused(project: Path, link: str, target: str, why: str) -> None:
    os.symlink(target, project / link)
    with pytest.raises(ManifestError) as info:
        build_manifest(project, ["out/"])
    message = str(info.value)
    assert f"symlink {link} -> {target}" in message
    assert why in message
    assert "refused, never followed" in message


@pytest.mark.unit
def test_symlink_escape_through_another_link_is_refused(project: Path) -> None:
    # each link's text looks harmless, but a/.. is the folder above `out`
    os.symlink(".", project / "out/here")
    os.symlink("here/../report.txt", project / "out/sneaky")
    with pytest.raises(ManifestError, match=r"symlink out/sneaky -> here/\.\./report\.txt .*refused"):
        build_manifest(project, ["out/"])


@pytest.mark.unit
def test_symlink_into_a_sibling_output_is_refused(project: Path) -> None:
    os.symlink("../report.txt", project / "out/rep")
    with pytest.raises(ManifestError, match=r"out/rep -> \.\./report\.txt points outside its output"):
        build_manifest(project, ["out/", "report.txt"])


@pytest.mark.unit
def test_symlink_loop_is_refused(project: Path) -> None:
    os.symlink("loop2", project / "out/loop1")
    os.symlink("loop1", project / "out/loop2")
    with pytest.raises(ManifestError, match=r"is a loop .*refused, never followed"):
        build_manifest(project, ["out/"])


@pytest.mark.unit
def test_output_that_is_a_symlink_is_refused(project: Path) -> None:
    os.symlink("report.txt", project / "rep_link")
    with pytest.raises(ManifestError, match=r"output rep_link is a symlink -> report\.txt.*never followed"):
        build_manifest(project, ["rep_link"])
    os.symlink("out", project / "out_link")
    with pytest.raises(ManifestError, match=r"out_link/ is declared as a folder but is a symlink"):
        build_manifest(project, ["out_link/"])


@pytest.mark.unit
def test_output_under_a_symlinked_folder_is_refused(project: Path) -> None:
    os.symlink("out", project / "via")
    with pytest.raises(ManifestError, match=r"output via/sub lies under via, a symlink"):
        build_manifest(project, ["via/sub/"])


@pytest.mark.parametrize("target", ["absolute", "relative"])
@pytest.mark.unit
def test_refused_link_is_never_followed(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str
) -> None:
    secret = write(tmp_path / "secret_dir/secret.txt", b"do not read").parent
    link_text = str(secret) if target == "absolute" else "../../secret_dir"
    os.symlink(link_text, project / "out/leak")
    touched: list[str] = []

    def spy(name: str) -> Any:
        real = getattr(os, name)

        def call(path: Any, *args: Any, **kwargs: Any) -> Any:
            touched.append(os.fsdecode(path))
            return real(path, *args, **kwargs)

        return call

    with monkeypatch.context() as m:
        for name in ("open", "scandir", "listdir", "lstat", "stat", "readlink"):
            m.setattr(os, name, spy(name))
        with pytest.raises(ManifestError, match="out/leak"):
            build_manifest(project, ["out/"])
    assert touched  # the spy saw the walk
    assert not [p for p in touched if "secret" in p]


# ----------------------------------------------------------------- the hash cache


@pytest.mark.unit
def test_cached_hash_is_reused_while_size_mtime_ctime_inode_and_device_match(project: Path) -> None:
    age(project)
    target = project / "out/a.txt"
    cache: dict[str, bytes] = {}
    first = by_path(build_manifest(project, ["out/"], cache))["out/a.txt"]
    st = target.stat()
    key = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
    assert cache["out/a.txt"] == record(key, sha(b"alpha\n"))
    cache["out/a.txt"] = record(key, sha(b"what the cache says\n"))
    reused = by_path(build_manifest(project, ["out/"], cache))["out/a.txt"]
    assert reused["sha256"] == sha(b"what the cache says\n")  # not read again
    assert first["sha256"] == sha(b"alpha\n")

    # Rewritten in place (same inode, same size) with its mtime set back,
    # as a hostile task could: the ctime moved, so it is read again.
    with target.open("r+b") as f:
        f.write(b"ALPHA\n")
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (target.stat().st_ino, target.stat().st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    rehashed = by_path(build_manifest(project, ["out/"], cache))["out/a.txt"]
    assert rehashed["sha256"] == sha(b"ALPHA\n")
    time.sleep(0.06)  # out of the racy window: cached again
    build_manifest(project, ["out/"], cache)
    stat_values, digest = remote_manifest.record_values(cache["out/a.txt"])
    assert digest == sha(b"ALPHA\n")
    assert stat_values[2] == target.stat().st_ctime_ns


@pytest.mark.unit
def test_cache_entry_with_another_inode_is_not_trusted(project: Path) -> None:
    age(project)
    cache: dict[str, bytes] = {}
    build_manifest(project, ["out/"], cache)
    target = project / "out/a.txt"
    st = target.stat()
    # replace by a new file (new inode) with the same size and mtime
    tmp = project / "out/.new"
    tmp.write_bytes(b"omega\n")
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(tmp, target)
    assert target.stat().st_ino != st.st_ino
    got = by_path(build_manifest(project, ["out/"], cache))["out/a.txt"]
    assert got["sha256"] == sha(b"omega\n")


@pytest.mark.unit
def test_a_file_modified_just_now_is_hashed_but_not_cached(project: Path) -> None:
    age(project)
    write(project / "out/fresh.txt", b"fresh")
    cache: dict[str, bytes] = {}
    m = build_manifest(project, ["out/"], cache)
    assert by_path(m)["out/fresh.txt"]["sha256"] == sha(b"fresh")
    assert "out/fresh.txt" not in cache
    assert "out/a.txt" in cache


@pytest.mark.unit
def test_cache_forgets_deleted_files_and_keeps_other_outputs(project: Path) -> None:
    age(project)
    cache: dict[str, bytes] = {"elsewhere/x": record((1, 2, 3, 4, 5), "f" * 64)}
    build_manifest(project, ["out/", "report.txt"], cache)
    assert "out/sub/b.bin" in cache
    (project / "out/sub/b.bin").unlink()
    (project / "report.txt").unlink()
    build_manifest(project, ["out/", "report.txt"], cache)
    assert "out/sub/b.bin" not in cache
    assert "report.txt" not in cache
    assert "elsewhere/x" in cache  # not under these outputs: left alone


@pytest.mark.unit
def test_malformed_cache_entries_are_ignored(project: Path) -> None:
    age(project)
    cache: dict[str, bytes] = {"out/a.txt": "junk", "out/run.sh": b"\1"}  # type: ignore[dict-item]
    got = by_path(build_manifest(project, ["out/"], cache))
    assert got["out/a.txt"]["sha256"] == sha(b"alpha\n")
    assert remote_manifest.record_values(cache["out/a.txt"])[1] == sha(b"alpha\n")


# ----------------------------------------------------------------- diff_manifests


@pytest.mark.unit
def test_diff_of_equal_manifests_is_empty(project: Path) -> None:
    m = build_manifest(project, ["out/"])
    assert diff_manifests(m, build_manifest(project, ["out/"])) == []


@pytest.mark.unit
def test_diff_names_each_kind_of_change(project: Path) -> None:
    expected = build_manifest(project, ["out/"])
    (project / "out/a.txt").write_bytes(b"changed, and longer\n")  # content
    (project / "out/run.sh").chmod(0o644)  # mode
    (project / "out/sub/b.bin").unlink()  # missing
    write(project / "out/new.txt", b"new")  # extra
    (project / "out/empty").rmdir()
    write(project / "out/empty", b"")  # type: dir -> file
    (project / "out/link_to_file").unlink()
    os.symlink("run.sh", project / "out/link_to_file")  # link target
    actual = build_manifest(project, ["out/"])
    diffs = diff_manifests(expected, actual)
    old, new = sha(b"alpha\n")[:12], sha(b"changed, and longer\n")[:12]
    assert diffs == [
        f"changed content: out/a.txt (6 bytes, sha256 {old} -> 20 bytes, sha256 {new})",
        "changed type: out/empty (dir -> file)",
        "changed content: out/link_to_file (symlink -> a.txt, now -> run.sh)",
        "extra: out/new.txt (file)",
        "changed mode: out/run.sh (0755 -> 0644)",
        "missing: out/sub/b.bin (file)",
    ]


@pytest.mark.unit
def test_diff_counts_a_missing_or_extra_folder_on_one_line(project: Path) -> None:
    expected = build_manifest(project, ["out/"])
    shutil.rmtree(project / "out/sub")
    for i in range(5):
        write(project / f"out/extra/f{i}", b"x")
    diffs = diff_manifests(expected, build_manifest(project, ["out/"]))
    assert diffs == [
        "extra: out/extra/ (dir) (and the 5 entries inside it)",
        "missing: out/sub/ (dir) (and the 2 entries inside it)",
    ]


@pytest.mark.unit
def test_diff_of_a_missing_output(project: Path) -> None:
    expected = build_manifest(project, ["out/", "report.txt"])
    shutil.rmtree(project / "out")
    diffs = diff_manifests(expected, build_manifest(project, ["out/", "report.txt"]))
    assert diffs == ["missing: out/ (dir) (and the 9 entries inside it)"]


# ----------------------------------------------------------------- the CLI under Python 3.8


# ----------------------------------------------------------------- local use


@pytest.mark.unit
def test_this_side_imports_the_very_file_shipped_to_hosts() -> None:
    assert sys.modules["substrax_tasks._remote.manifest"] is remote_manifest
    assert Path(remote_manifest.__file__ or "").resolve() == remote_script("manifest.py").resolve()
    assert ManifestError is remote_manifest.ManifestError


@pytest.mark.unit
def test_hash_cache_file_is_private_atomic_and_written_only_on_change(project: Path, tmp_path: Path) -> None:
    age(project)
    cache_file = tmp_path / "state/cache.json"
    expected = build_manifest(project, ["out/"])
    assert verify_outputs(project, ["out/"], expected, cache_file) == []
    assert stat.S_IMODE(cache_file.stat().st_mode) == 0o600
    data = json.loads(cache_file.read_text())
    assert data["version"] == 3
    assert data["entries"]["out/a.txt"][-64:] == sha(b"alpha\n")  # the hex of the record, the digest last
    assert not list(cache_file.parent.glob("*.tmp"))

    os.utime(cache_file, ns=(OLD_NS, OLD_NS))
    assert verify_outputs(project, ["out/"], expected, cache_file) == []
    assert cache_file.stat().st_mtime_ns == OLD_NS  # nothing changed: not rewritten

    loaded = HashCache.load(cache_file)
    assert not loaded.changed
    assert loaded.entries["out/a.txt"] == bytes.fromhex(data["entries"]["out/a.txt"])


@pytest.mark.unit
def test_bad_entries_of_a_hash_cache_file_are_dropped(tmp_path: Path) -> None:
    f = tmp_path / "cache.json"
    good_values, good_digest = (4, OLD_NS, OLD_NS, 12, 2049), "a" * 64
    good = [*good_values, good_digest]
    bad: list[object] = [
        [4, OLD_NS, 12, "a" * 64],  # the key of version 1: no ctime, no device
        [4, "x", OLD_NS, 12, 2049, "a" * 64],
        [4, OLD_NS, OLD_NS, 12, 2049, None],
        "junk",
        None,
    ]
    entries = {"good": good, **{f"bad{i}": b for i, b in enumerate(bad)}}
    f.write_text(json.dumps({"version": 2, "entries": entries}))
    cache = HashCache.load(f)
    assert dict(cache.entries) == {"good": record(good_values, good_digest)}
    assert cache.changed
    cache.save()
    assert json.loads(f.read_text())["entries"] == {"good": record(good_values, good_digest).hex()}
    assert not HashCache.load(f).changed


@pytest.mark.unit
def test_an_unreadable_tree_is_a_manifest_error(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def vanished(path: Any, *args: Any, **kwargs: Any) -> str:
        raise FileNotFoundError(2, "No such file or directory", os.fsdecode(path))

    monkeypatch.setattr(os, "readlink", vanished)
    with pytest.raises(ManifestError, match=r"cannot read .*out/.*No such file or directory"):
        build_manifest(project, ["out/"])


@pytest.mark.parametrize("content", [b"", b"{not json", b"[1, 2]", b'{"version": 99, "entries": {}}'])
@pytest.mark.unit
def test_unreadable_hash_cache_loads_empty(tmp_path: Path, content: bytes) -> None:
    f = tmp_path / "cache.json"
    f.write_bytes(content)
    cache = HashCache.load(f)
    assert dict(cache.entries) == {}
    assert cache.changed  # rewritten in the current format on save
    cache.save()
    assert json.loads(f.read_text()) == {"version": 3, "entries": {}}


@pytest.mark.unit
def test_verify_outputs_reports_differences(project: Path, tmp_path: Path) -> None:
    cache_file = tmp_path / "cache.json"
    expected = build_manifest(project, ["out/", "report.txt"])
    assert verify_outputs(project, ["out/", "report.txt"], expected, cache_file) == []
    (project / "out/a.txt").write_bytes(b"tampered")
    (project / "report.txt").unlink()
    problems = verify_outputs(project, ["out/", "report.txt"], expected, cache_file)
    assert problems[0] == "missing output: report.txt"
    assert any(p.startswith("changed content: out/a.txt") for p in problems)
    assert "missing: report.txt (file)" in problems


@pytest.mark.unit
def test_verify_outputs_refuses_an_escape_and_a_never_produced_output(project: Path, tmp_path: Path) -> None:
    cache_file = tmp_path / "cache.json"
    expected = build_manifest(project, ["out/", "never/"])
    assert verify_outputs(project, ["out/", "never/"], expected, cache_file) == [
        "output never produced: never/"
    ]
    os.symlink("../data", project / "out/data")
    (problem,) = verify_outputs(project, ["out/"], build_manifest(project, ["report.txt"]), cache_file)
    assert problem.startswith("refused: symlink out/data -> ../data points outside its output")


@pytest.mark.unit
def test_verify_outputs_notices_a_damaged_digest(project: Path, tmp_path: Path) -> None:
    expected = build_manifest(project, ["out/"])
    expected["digest"] = "0" * 64
    (problem,) = verify_outputs(project, ["out/"], expected, tmp_path / "cache.json")
    assert "does not match its own entries" in problem


@pytest.fixture
def no_racy_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trust timestamps of files written a moment ago (tests write and
    check within milliseconds; the real window is RACY_SECONDS)."""
    monkeypatch.setattr(remote_manifest, "RACY_SECONDS", 0)


@pytest.mark.usefixtures("no_racy_window")
@pytest.mark.unit
def test_outputs_match_of_an_untouched_tree_reads_no_file(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache_file = tmp_path / "cache.json"
    outputs = ["out/", "report.txt"]
    digest = build_manifest(project, outputs)["digest"]
    assert outputs_match(project, outputs, digest, cache_file)  # hashes, fills the cache
    assert stat.S_IMODE(cache_file.stat().st_mode) == 0o600

    def boom(*args: object, **kwargs: object) -> str:
        raise AssertionError("a file was read although nothing changed")

    monkeypatch.setattr(cast(Any, remote_manifest), "hash_file", boom)
    assert outputs_match(project, outputs, digest, cache_file)
    assert not outputs_match(project, outputs, "0" * 64, cache_file)


@pytest.mark.usefixtures("no_racy_window")
@pytest.mark.parametrize(
    "tamper", ["edit", "edit_same_size", "delete", "add", "chmod", "mkdir", "relink", "remove_output"]
)
@pytest.mark.unit
def test_outputs_match_notices_tampering(project: Path, tmp_path: Path, tamper: str) -> None:
    cache_file = tmp_path / "cache.json"
    outputs = ["out/", "report.txt"]
    digest = build_manifest(project, outputs)["digest"]
    assert outputs_match(project, outputs, digest, cache_file)
    assert outputs_match(project, outputs, digest, cache_file)  # from the cache
    time.sleep(0.01)  # a new timestamp tick for the edit
    if tamper == "edit":
        (project / "out/sub/b.bin").write_bytes(b"other")
    elif tamper == "edit_same_size":
        (project / "report.txt").write_bytes(b"REPORT\n")
    elif tamper == "delete":
        (project / "out/run.sh").unlink()
    elif tamper == "add":
        write(project / "out/empty/new", b"")
    elif tamper == "chmod":
        (project / "out/a.txt").chmod(0o600)
    elif tamper == "mkdir":
        (project / "out/sub/d").mkdir()
    elif tamper == "relink":
        (project / "out/link_to_file").unlink()
        os.symlink("run.sh", project / "out/link_to_file")
    elif tamper == "remove_output":
        shutil.rmtree(project / "out")
    assert not outputs_match(project, outputs, digest, cache_file)


@pytest.mark.usefixtures("no_racy_window")
@pytest.mark.unit
def test_outputs_match_is_false_for_a_refused_tree(project: Path, tmp_path: Path) -> None:
    cache_file = tmp_path / "cache.json"
    digest = build_manifest(project, ["out/"])["digest"]
    os.symlink("/etc", project / "out/etc")
    assert not outputs_match(project, ["out/"], digest, cache_file)


@pytest.mark.unit
@pytest.mark.usefixtures("no_racy_window")
def test_promoted_files_match_their_staged_manifest(tmp_path: Path) -> None:
    """A rename moves a file's ctime, so hashes taken in staging are not
    trusted for the promoted file: it is read again, and matches."""
    staging, proj = tmp_path / "staging", tmp_path / "proj"
    write(staging / "out/big.bin", b"z" * 100_000)
    proj.mkdir()
    cache_file = tmp_path / "cache.json"
    expected = build_manifest(staging, ["out/"])
    assert verify_outputs(staging, ["out/"], expected, cache_file) == []
    os.rename(staging / "out", proj / "out")
    assert verify_outputs(proj, ["out/"], expected, cache_file) == []
    assert outputs_match(proj, ["out/"], expected["digest"], cache_file)


@pytest.mark.unit
def test_a_hash_cache_is_saved_when_an_entry_changed_and_only_then(tmp_path: Path) -> None:
    entry = record((4, OLD_NS, OLD_NS, 12, 2049), "a" * 64)
    cache = HashCache(tmp_path / "cache.json", {"a": entry, "b": entry})
    assert cache.changed  # no file yet
    cache.save()
    loaded = HashCache.load(tmp_path / "cache.json")
    loaded.entries["a"] = bytes(entry)  # the same value again
    loaded.entries.pop("nothing here", None)
    assert not loaded.changed
    loaded.entries.pop("b")
    assert loaded.changed
    loaded.save()
    assert not loaded.changed
    del loaded.entries["a"]
    assert loaded.changed
    with pytest.raises(TypeError, match="item assignment, pop and del only"):
        loaded.entries.update({"c": entry})




# ----------------------------------------------------------------- packed entries

ODD_ENTRIES: list[dict[str, Any]] = [
    {"path": "out", "type": "dir", "size": 0, "mode": 0o755, "sha256": None, "target": None},
    {"path": "out/a", "type": "file", "size": 5, "mode": 0o644, "sha256": "ab" * 32, "target": None},
    {"path": "out/B", "type": "file", "size": 5, "mode": 0o644, "sha256": "AB" * 32, "target": None},
    {"path": "out/é\udcff\n", "type": "symlink", "size": 3, "mode": 0o777, "sha256": None,
     "target": "é\udcfe"},
    {"path": "out/x", "type": "file", "size": 5, "mode": 0o644, "sha256": "ab" * 32, "target": None,
     "more": 1},
    {"path": "out/y", "type": "file", "size": True, "mode": 0o644, "sha256": "ab" * 32, "target": None},
    {"path": "out/z", "type": "file", "size": 5, "mode": 0o644, "sha256": None, "target": None},
    {"path": "out/w", "type": "dir", "size": 0, "mode": 0o755, "sha256": None},
]


@pytest.mark.unit
def test_packed_entries_give_back_every_entry_as_it_was() -> None:
    """Entries are packed into compact records when they are what a
    manifest holds, and kept as their JSON otherwise (an upper-case digest,
    a key more or less, a bool for a size, a path that is not UTF-8): what
    comes back, its digest and its JSON are those of the entries given."""
    packed = remote_manifest.PackedEntries(ODD_ENTRIES)
    assert list(packed) == ODD_ENTRIES
    assert packed == ODD_ENTRIES
    assert (packed[3], packed[-1], packed[1:3]) == (ODD_ENTRIES[3], ODD_ENTRIES[-1], ODD_ENTRIES[1:3])
    assert [type(e["size"]) for e in packed] == [type(e["size"]) for e in ODD_ENTRIES]
    assert remote_manifest.entries_digest(packed) == remote_manifest.entries_digest(ODD_ENTRIES)
    assert "".join(packed.json_pieces()) == remote_manifest.canonical_json(ODD_ENTRIES)


@pytest.mark.parametrize("window", [1, 2, 7, 64, 1 << 20])
@pytest.mark.unit
def test_a_manifest_reads_the_same_whatever_the_window(window: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read a window at a time, a value cut by the window's end (a number
    that may go on, a string, an entry) is read again with more text."""
    monkeypatch.setattr(remote_manifest, "_WINDOW", window)
    doc = {"version": 1, "entries": ODD_ENTRIES, "missing": ["q/"], "near": {"q/": ["r"]},
           "digest": remote_manifest.entries_digest(ODD_ENTRIES)}  # fmt: skip
    for text in (remote_manifest.canonical_json(doc), json.dumps(doc, indent=2)):
        read = remote_manifest.load_manifest(text.encode())
        assert read == {**doc, "entries": read["entries"]}
        assert read["entries"] == ODD_ENTRIES
    assert remote_manifest.load_manifest(b'{"version": 12345678, "entries": []}')["version"] == 12345678
    whole = remote_manifest.canonical_json(doc).encode()
    for cut in range(0, len(whole), 5):
        with pytest.raises(ValueError):  # any cut is refused, whatever it cut
            remote_manifest.load_manifest(whole[:cut])


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (b'{"entries": {"a": 1}}', "its entries are not a list of entries"),
        (b'{"entries": [1]}', "its entries are not a list of entries"),
        (b'{"entries": [{"type": "file"}]}', "its entries are not a list of entries"),
        (b'{"entries": [{"path": "out/p", "type": "fifo"}]}', "it lists 'out/p' as a 'fifo'"),
    ],
)
@pytest.mark.unit
def test_a_manifest_whose_entries_are_not_entries_is_refused_as_it_is_read(text: bytes, said: str) -> None:
    with pytest.raises(remote_manifest.ManifestFormatError, match=said):
        remote_manifest.load_manifest(text)
