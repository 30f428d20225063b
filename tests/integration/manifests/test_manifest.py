"""Manifests of output trees (remote/manifest.py) and their local use
(substrax_tasks.uptodate.manifests), on real files."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from manifest_parts import OLD_NS, age, project, record, sha, short_racy_window, write  # noqa: F401 - fixtures

from substrax_tasks._remote import manifest as remote_manifest
from substrax_tasks.backends.scripts import remote_script
from substrax_tasks.uptodate.manifests import (
    HashCache,
    ManifestError,
    build_manifest,
    diff_manifests,
    verify_outputs,
)

PY38 = Path("/root/.pyenv/versions/3.8.18/bin/python")


# ----------------------------------------------------------------- entries


# ----------------------------------------------------------------- digest


# ----------------------------------------------------------------- outputs


# ----------------------------------------------------------------- symlink escape


# ----------------------------------------------------------------- the hash cache


# ----------------------------------------------------------------- diff_manifests


# ----------------------------------------------------------------- the CLI under Python 3.8


def py38() -> Path:
    if not PY38.exists():
        pytest.skip(f"NOT TESTED on Python 3.8: {PY38} is missing (remote hosts may run 3.8)")
    return PY38


def test_cli_prints_the_same_manifest_under_python38(project: Path) -> None:
    script = remote_script("manifest.py")
    proc = subprocess.run(
        [str(py38()), str(script), str(project), "out/", "report.txt", "nope/"],
        capture_output=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == b""
    printed = json.loads(proc.stdout)
    assert printed == build_manifest(project, ["out/", "report.txt", "nope/"])
    assert printed["missing"] == ["nope/"]


def test_cli_refuses_a_symlink_escape_under_python38(project: Path) -> None:
    os.symlink("/etc/passwd", project / "out/leak")
    proc = subprocess.run(
        [str(py38()), str(remote_script("manifest.py")), str(project), "out/"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert "symlink out/leak -> /etc/passwd" in proc.stderr
    assert "refused, never followed" in proc.stderr


def test_cli_usage_errors(tmp_path: Path) -> None:
    script = str(remote_script("manifest.py"))
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, check=False)
    assert proc.returncode == 2
    assert "usage" in proc.stderr
    proc = subprocess.run(
        [sys.executable, script, str(tmp_path / "nope"), "out/"], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 1
    assert "is not a folder" in proc.stderr


def test_cli_takes_outputs_named_like_options_after_a_double_dash(tmp_path: Path) -> None:
    """The ssh backend passes `--` first: an output may start with "-"."""
    write(tmp_path / "-o" / "a.txt", b"a\n")
    proc = subprocess.run([sys.executable, str(remote_script("manifest.py")), "--", str(tmp_path), "-o/"],
                          capture_output=True, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == build_manifest(tmp_path, ["-o/"])


def test_the_cache_works_under_python38(project: Path) -> None:
    age(project)
    code = """
import json, sys
sys.path.insert(0, sys.argv[1])
import manifest as m
cache = {}
a = m.build_manifest(sys.argv[2], ["out/"], cache)
b = m.build_manifest(sys.argv[2], ["out/"], cache)
assert a == b and cache, cache
open(sys.argv[2] + "/out/a.txt", "w").write("x")
c = m.build_manifest(sys.argv[2], ["out/"], cache)
print(json.dumps({"a": a, "c": c}))
"""
    proc = subprocess.run(
        [str(py38()), "-c", code, str(remote_script("manifest.py").parent), str(project)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["c"] == build_manifest(project, ["out/"])  # as this side describes the same tree
    diffs = diff_manifests(result["a"], result["c"])
    assert [d.split(" (")[0] for d in diffs] == ["changed content: out/a.txt"]


# ----------------------------------------------------------------- local use


@pytest.mark.parametrize("count", [0, 1, 999, 1000, 1001, 2500])
def test_the_digest_is_of_the_whole_canonical_json_taken_in_chunks(count: int) -> None:
    """A manifest's digest is the sha256 of its entries' canonical JSON,
    whatever the chunk boundaries (paths with quotes and non-ASCII text)."""
    mod = remote_manifest
    entries = [
        {"path": f'out/é{i}"x', "type": "file", "size": i, "mode": 0o644, "sha256": sha(b"%d" % i),
         "target": None}
        for i in range(count)
    ]
    whole = json.dumps(entries, sort_keys=True, separators=(",", ":")).encode()
    assert mod.entries_digest(entries) == hashlib.sha256(whole).hexdigest()


def test_the_digest_of_20000_entries_holds_no_copy_of_their_json() -> None:
    """Issue 29: the digest of a verified fetch's manifest held its whole
    canonical JSON twice (text and bytes, ~6 MB for 20,000 files) while the
    entries were alive; in chunks it holds a few hundred KB."""
    import tracemalloc

    mod = remote_manifest
    entries = [
        {"path": f"out/d{i % 20:03d}/f{i:06d}", "type": "file", "size": 4000 + i % 96, "mode": 0o644,
         "sha256": sha(b"%d" % i), "target": None}
        for i in range(20_000)
    ]
    whole = len(json.dumps(entries, sort_keys=True, separators=(",", ":")))
    tracemalloc.start()
    try:
        mod.entries_digest(entries)
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < whole / 4, f"the digest held {peak:,} bytes; the JSON is {whole:,}"


def _manifest_of_20000_files() -> dict[str, Any]:
    entries = [
        {"path": f"out/d{i % 20:03d}/f{i:06d}", "type": "file", "size": 4000 + i % 96, "mode": 0o644,
         "sha256": sha(b"%d" % i), "target": None}
        for i in range(20_000)
    ]
    digest = remote_manifest.entries_digest(entries)
    return {"version": remote_manifest.VERSION, "entries": entries, "missing": [], "digest": digest}


def test_a_fetched_manifest_of_20000_files_holds_a_small_record_per_file(tmp_path: Path) -> None:
    """Issue 29: the manifest a fetch verifies against (received from a
    host or a bucket, `checked_manifest`) was parsed whole, a dict per entry
    (~590 bytes a file) held from the fetch to the end of the chain. Its
    entries are packed as they are read now: ~80 bytes a file."""
    import tracemalloc

    from substrax_tasks.transports.base import checked_manifest

    data = remote_manifest.canonical_json(_manifest_of_20000_files()).encode()
    tracemalloc.start()
    try:
        received = checked_manifest(data, "on the host")
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 20_000 * 120, f"a manifest of 20,000 files received held {held:,} bytes"
    # its text, decoded a window (1 MiB) at a time
    assert peak < 20_000 * 120 + 4 * 2**20, f"receiving it took {peak:,} bytes at its peak"
    assert received["digest"] == remote_manifest.entries_digest(received["entries"])
    assert received["entries"][7] == {"path": "out/d007/f000007", "type": "file", "size": 4007, "mode": 0o644,
                                      "sha256": sha(b"7"), "target": None}  # fmt: skip


def test_the_manifest_in_a_run_folder_is_read_a_window_at_a_time(tmp_path: Path) -> None:
    """The local backend reads the manifest the worker left in the run's
    folder a window at a time: never the file's 3 MB of text at once."""
    import tracemalloc

    from substrax_tasks.uptodate.manifests import read_manifest_file

    path = tmp_path / "manifest.json"
    path.write_text(remote_manifest.canonical_json(_manifest_of_20000_files()))
    tracemalloc.start()
    try:
        read = read_manifest_file(path)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert read is not None
    assert len(read["entries"]) == 20_000
    assert held < 20_000 * 120, f"a manifest of 20,000 files read held {held:,} bytes"
    assert peak < 20_000 * 120 + 3 * 2**20, f"reading it took {peak:,} bytes at its peak"


def test_a_fetched_manifest_is_written_again_byte_for_byte(tmp_path: Path) -> None:
    """The manifest a verified fetch keeps (the run folder's, modes made
    safe) is the one it read, written from its packed entries in chunks."""
    from substrax_tasks.atomic import write_json_atomic
    from substrax_tasks.uptodate.manifests import read_manifest_file

    manifest = _manifest_of_20000_files()
    path = tmp_path / "manifest.json"
    path.write_text(remote_manifest.canonical_json(manifest) + "\n")
    read = read_manifest_file(path)
    assert read is not None
    write_json_atomic(tmp_path / "again.json", read, indent=None)
    assert (tmp_path / "again.json").read_bytes() == path.read_bytes()


def test_entries_come_out_in_path_order_whatever_the_names(tmp_path: Path) -> None:
    """The walk yields entries in path order, one folder listed at a time:
    a folder's contents sort after siblings whose names continue its name
    with a character below "/" (`a`, `a-b`, `a.txt`, `a/x`), across outputs
    too; the digest taken as they come is the manifest's."""
    for rel in ["a/x-y/z", "a/x.txt", "a/x/deep/f", "a/x0", "a-b", "a.txt", "c/d/e", "c/d-e/f",
                "c/d/e-f/g", "c/d/e.f"]:  # fmt: skip
        write(tmp_path / rel, rel.encode())
    (tmp_path / "a/x/link").symlink_to("deep/f")
    outputs = ["c/d/", "a.txt", "a/", "a-b", "c/d-e/"]
    manifest = build_manifest(tmp_path, outputs)
    paths = [e["path"] for e in manifest["entries"]]
    on_disk = ["a", "a.txt", "a-b", "c/d", "c/d-e"]
    for top in ("a", "c/d", "c/d-e"):
        for dirpath, dirnames, filenames in os.walk(tmp_path / top):
            on_disk += [str(Path(dirpath, name).relative_to(tmp_path)) for name in dirnames + filenames]
    assert paths == sorted(on_disk)
    assert remote_manifest.tree_digest(tmp_path, outputs) == (manifest["digest"], [])
    assert remote_manifest.tree_digest(tmp_path, [*outputs, "gone/"]) == (manifest["digest"], ["gone/"])


def test_verifying_10000_files_holds_no_entry_per_file(tmp_path: Path) -> None:
    """Issue 29: a verified fetch held the manifest of what it verified, a
    dict of six keys per file (~5 MiB for 10,000 files), and so did each
    later check of the outputs. Verified now from the digest alone, taken
    as the walk goes: memory per folder listed, not per file."""
    import tracemalloc

    base = tmp_path / "proj"
    for i in range(10_000):
        write(base / f"out/d{i % 10:03d}/f{i:06d}", b"%d" % i)
    age(base)
    expected = build_manifest(base, ["out/"])
    cache = HashCache.load(tmp_path / "cache.json")
    assert verify_outputs(base, ["out/"], expected, cache) == []  # the cache filled: no file read below
    tracemalloc.start()
    try:
        problems = verify_outputs(base, ["out/"], expected, cache)
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert problems == []
    # 1 MiB of it is the read buffer, a few hundred KB one folder's listing
    assert peak < 3 * 2**20, f"verifying 10,000 files held {peak:,} bytes at its peak"
    (base / "out/d007/f000007").write_bytes(b"changed")
    assert verify_outputs(base, ["out/"], expected, cache) == [
        "changed content: out/d007/f000007 (1 bytes, sha256 7902699be42c -> 7 bytes, sha256 "
        f"{sha(b'changed')[:12]})"
    ]


def test_a_hash_cache_of_10000_files_holds_a_small_record_per_file(tmp_path: Path) -> None:
    """Issue 29: a hash cache held a list of five ints and the hex digest
    per file (~450 bytes and its path); it holds one packed record of 72
    bytes now, filled by a verification and loaded from its file alike."""
    import tracemalloc

    base = tmp_path / "proj"
    for i in range(10_000):
        write(base / f"out/d{i % 10:03d}/f{i:06d}", b"%d" % i)
    age(base)
    expected = build_manifest(base, ["out/"])
    tracemalloc.start()
    try:
        cache = HashCache.load(tmp_path / "cache.json")
        assert verify_outputs(base, ["out/"], expected, cache) == []
        filled, _peak = tracemalloc.get_traced_memory()
        del cache
        tracemalloc.reset_peak()
        before, _peak = tracemalloc.get_traced_memory()
        loaded = HashCache.load(tmp_path / "cache.json")
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(loaded.entries) == 10_000
    # per file: its path (~65 bytes), its record (105) and its slot in the dict
    assert filled < 10_000 * 260, f"a hash cache filled with 10,000 files held {filled:,} bytes"
    assert held - before < 10_000 * 260, f"a hash cache of 10,000 files loaded held {held - before:,} bytes"
    assert peak - before < 10_000 * 600, f"loading a hash cache of 10,000 files took {peak - before:,} bytes"


def test_a_hash_cache_file_of_version_2_is_read_and_rewritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hash cache written before records were packed (version 2, lists)
    is read as it is: its files are not read again, and it is saved in the
    current version."""
    base = tmp_path / "proj"
    write(base / "out/a.txt", b"alpha\n")
    age(base)
    st = (base / "out/a.txt").lstat()
    cache_file = tmp_path / "cache.json"
    stat_values = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
    listed = [*stat_values, sha(b"alpha\n")]
    cache_file.write_text(json.dumps({"version": 2, "entries": {"out/a.txt": listed}}))
    expected = build_manifest(base, ["out/"])

    def never(*_args: object) -> str:
        raise AssertionError("a file was read though the hash cache held it")

    monkeypatch.setattr(remote_manifest, "hash_file", never)
    cache = HashCache.load(cache_file)
    assert verify_outputs(base, ["out/"], expected, cache) == []
    rewritten = {"version": 3, "entries": {"out/a.txt": record(stat_values, sha(b"alpha\n")).hex()}}
    assert json.loads(cache_file.read_text()) == rewritten


def test_saving_a_hash_cache_of_20000_files_holds_no_copy_of_its_json(tmp_path: Path) -> None:
    """Issue 29: json.dumps builds every fragment of a document before it
    joins them (+7 MiB for a cache of 20,000 files, whose file is 2.6 MB);
    the file is now written 250 entries at a time, byte for byte the same."""
    import tracemalloc

    entries = {f"out/d{i % 20:03d}/f{i:06d}": record((4000 + i % 96, OLD_NS + i, OLD_NS + i, 10**6 + i, 2049),
                                                     sha(b"%d" % i)) for i in range(20_000)}  # fmt: skip
    cache = HashCache(tmp_path / "cache.json", entries)
    tracemalloc.start()
    try:
        cache.save()
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    text = (tmp_path / "cache.json").read_text()
    as_hex = {rel: value.hex() for rel, value in entries.items()}
    whole = json.dumps({"version": 3, "entries": as_hex}, sort_keys=True, separators=(",", ":"))
    assert text == whole + "\n"
    assert peak < len(text) / 2, f"saving held {peak:,} bytes; the file is {len(text):,}"


def test_a_file_that_becomes_a_folder_under_the_walk_is_refused(tmp_path: Path) -> None:
    """A folder's listing holds names only, each taken with lstat in its
    turn: a name listed as a file that is a folder by then would leave its
    contents out of the manifest, and is refused instead."""
    write(tmp_path / "out/a", b"a")
    write(tmp_path / "out/b", b"b")
    mod = remote_manifest
    missing, rows = mod._walk(str(tmp_path), mod.check_outputs(["out/"]), None)
    assert missing == []
    assert next(rows)["path"] == "out"
    assert next(rows)["path"] == "out/a"  # out/ is listed by now
    (tmp_path / "out/b").unlink()
    write(tmp_path / "out/b/inside", b"x")
    with pytest.raises(ManifestError, match=r"out/b changed while the manifest was taken \(it is a folder"):
        next(rows)
