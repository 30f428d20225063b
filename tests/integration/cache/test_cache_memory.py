"""What keeping a run in the cache holds in memory (issue 29 item 5): the
entry's JSON is written from the manifest's packed records a chunk at a
time, and the files are walked from them as they are copied, so a run of
many files costs a small record per file, as its fetch does."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

from substrax_tasks._remote import manifest as remote_manifest
from substrax_tasks.cache.run_cache import CacheOptions, RunCache, cache_key
from substrax_tasks.cache.storage import entry_path
from substrax_tasks.step.spec import StepSpec
from substrax_tasks.store.run_store import RunStore
from substrax_tasks.uptodate import manifests as manifest_cache
from substrax_tasks.uptodate.check import Step

FILES = 20_000


@pytest.fixture(autouse=True)
def no_racy_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file goes into the hash cache at once, as the files of a real
    fetch do (older than the racy window by the time it is kept): each check
    then loads a hash cache of every file, whatever this machine's speed."""
    monkeypatch.setattr(remote_manifest, "RACY_SECONDS", 0.0)


def _promoted_run(tmp_path: Path) -> tuple[Step, RunCache, dict[str, object]]:
    """A step whose 20,000 small outputs were just promoted: its manifest as
    a fetch reads it (packed records, from the run folder's file), its hash
    cache filled by the verification."""
    root = tmp_path / "project"
    for i in range(FILES):
        folder = root / "out" / f"d{i % 20:03d}"
        if i < 20:
            folder.mkdir(parents=True)
        (folder / f"f{i:06d}").write_bytes(b"%d" % i * (1 + i % 7))
    (root / "out" / "same-a").write_bytes(b"same")  # one content, two files: one member
    (root / "out" / "same-b").write_bytes(b"same")
    (root / "out" / "large").write_bytes(b"x" * (100 << 10))  # not packed: an object of its own
    store = RunStore(root / ".substrax")
    step = Step(StepSpec(step="write", command=["true"], outputs=["out/"]), root, "local", {}, store)
    written = tmp_path / "manifest.json"
    written.write_text(remote_manifest.canonical_json(manifest_cache.build_manifest(root, ["out/"])))
    manifest = manifest_cache.read_manifest_file(written)
    assert manifest is not None
    assert isinstance(manifest["entries"], remote_manifest.PackedEntries)
    assert manifest_cache.outputs_match(root, ["out/"], manifest["digest"], step.files.outputs_cache)
    options = CacheOptions(enabled=True, path=str(tmp_path / "cache"), max_bytes=1 << 30, shared=None,
                           mode="read", allowed_signers=None, signing_key=None,
                           key_backend=False)  # fmt: skip
    return step, RunCache(options, root, store), manifest


def test_keeping_a_run_of_20000_files_holds_a_small_record_per_file(tmp_path: Path) -> None:
    """Issue 29: keeping a run decoded the manifest's packed entries into a
    dict each, and json held every fragment of the entry's text (~1.5 KiB a
    file together), and a Path per file; now the entry is written in pieces
    from the records and the files are walked from them. The entry is the
    same document, byte for byte, and restores."""
    step, cache, manifest = _promoted_run(tmp_path)
    parts = {"step": "write", "spec": "memory"}
    key = cache_key(parts, key_backend=False)
    tracemalloc.start()
    try:
        cache.save(step, key, manifest, {"run_id": "r1", "backend": "local"}, b"the log\n")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    data = (tmp_path / "cache" / entry_path(key)).read_bytes()
    entry = json.loads(data)
    # what `json.dumps` writes of the whole entry, its entries decoded: the document as before
    assert json.dumps(entry, sort_keys=True, separators=(",", ":")).encode() == data
    assert entry["manifest"]["entries"] == list(manifest["entries"])  # type: ignore[call-overload]
    assert sum(pack["count"] for pack in entry["packs"]) == FILES + 1  # the two "same" files: one member
    # at the second check: loading the hash cache and walking the outputs
    # (~470 bytes a file), the packed entries and the packs' members (40
    # bytes a file: a raw digest and a size): ~550 bytes a file. 736 when
    # each member was a tuple of a hex string and an int and each file's
    # Path interned its name for good.
    assert peak < FILES * 600 + 2**20, f"keeping a run of {FILES:,} files took {peak:,} bytes at its peak"

    restored = cache.restore(step, parts)
    assert restored is not None
    big = restored.fetched.root / "out" / "large"
    assert big.read_bytes() == b"x" * (100 << 10)
    assert (restored.fetched.root / "out" / "d007" / "f000007").read_bytes() == b"7"


def test_a_restored_entry_of_20000_files_holds_its_manifest_as_packed_records(tmp_path: Path) -> None:
    """Issue 29: a restore parsed the whole entry, a dict per file held with
    the restored run until its promotion (~600 bytes a file held); its
    manifest's entries are packed as they are read now, as a fetch's are."""
    step, cache, manifest = _promoted_run(tmp_path)
    parts = {"step": "write", "spec": "restored"}
    cache.save(step, cache_key(parts, key_backend=False), manifest, {"run_id": "r1"}, None)
    step.files.outputs_cache.unlink()  # the restore hashes every copy, as on another machine
    del manifest
    tracemalloc.start()
    try:
        restored = cache.restore(step, parts)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert restored is not None
    # the packed entries (~80 bytes a file) and the packs' members (40: a
    # raw digest and a size; 180 as a tuple of a hex string and an int)
    assert held < FILES * 150 + 2**20, f"a restored entry of {FILES:,} files held {held:,} bytes"
    assert isinstance(restored.fetched.manifest["entries"], remote_manifest.PackedEntries)
    assert (restored.fetched.root / "out" / "d007" / "f000007").read_bytes() == b"7"
