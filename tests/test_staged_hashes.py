"""Hashing a copy while it runs (StagedHasher) and reading rsync's names of
the files it received: both only ever save verification work, so what they
leave out is as important as what they hash."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from substrax_tasks.backends.ssh_watch import _digest_of_line_matches
from substrax_tasks.manifest_cache import build_manifest, manifest_module
from substrax_tasks.staged_hashes import StagedHasher
from substrax_tasks.transports.rsync import _OutputReader, _unescape


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def entry_of(path: Path) -> list[object]:
    st = path.lstat()
    return [st.st_size, st.st_mtime_ns, st.st_ino, sha(path.read_bytes()), st.st_mode & 0o7777]


def test_named_files_are_hashed_as_cache_entries(tmp_path: Path) -> None:
    (tmp_path / "out/sub").mkdir(parents=True)
    (tmp_path / "out/a.txt").write_bytes(b"alpha\n")
    (tmp_path / "out/sub/b.bin").write_bytes(os.urandom(3 << 20))  # several reads of the buffer
    (tmp_path / "out/empty").write_bytes(b"")
    with StagedHasher(tmp_path) as hasher:
        for rel in ("out/a.txt", "out/sub/b.bin", "out/empty"):
            hasher.add(rel)
    assert hasher.entries == {
        rel: entry_of(tmp_path / rel) for rel in ("out/a.txt", "out/sub/b.bin", "out/empty")
    }


def test_a_file_not_yet_in_place_is_tried_again_after_the_next_name(tmp_path: Path) -> None:
    """rsync names a file just before renaming it into place."""
    (tmp_path / "out").mkdir()
    with StagedHasher(tmp_path) as hasher:
        hasher.add("out/late.txt")  # not there yet
        hasher.add("out/missing.txt")  # never will be
        # as rsync does: written under a temp name, renamed into place whole
        for name, data in (("late.txt", b"late\n"), ("next.txt", b"next\n")):
            (tmp_path / "out" / f".{name}.tmp").write_bytes(data)
            (tmp_path / "out" / f".{name}.tmp").replace(tmp_path / "out" / name)
        hasher.add("out/next.txt")
    assert sorted(hasher.entries) == ["out/late.txt", "out/next.txt"]
    assert hasher.entries["out/late.txt"] == entry_of(tmp_path / "out/late.txt")


def test_symlinks_folders_and_fifos_are_left_to_verification(tmp_path: Path) -> None:
    (tmp_path / "out/dir").mkdir(parents=True)
    (tmp_path / "out/target.txt").write_bytes(b"t\n")
    os.symlink("target.txt", tmp_path / "out/link")
    os.mkfifo(tmp_path / "out/fifo")  # never opened for long: O_NONBLOCK
    with StagedHasher(tmp_path) as hasher:
        for rel in ("out/link", "out/dir", "out/fifo", "out/target.txt"):
            hasher.add(rel)
    assert list(hasher.entries) == ["out/target.txt"]


def test_a_failed_copy_stops_the_hashing(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"a")
    try:
        with StagedHasher(tmp_path) as hasher:
            hasher.add("a")
            raise RuntimeError("the copy broke off")
    except RuntimeError:
        pass
    assert set(hasher.entries) <= {"a"}  # hashed or not, depending on the thread: nothing else


# ----------------------------------------------------------------- rsync's output


def test_unescape_reverses_rsyncs_octal_escapes() -> None:
    assert _unescape(b"out/plain.txt") == "out/plain.txt"
    assert _unescape(b"out/new\\#012line") == "out/new\nline"
    # a literal backslash-hash-digits is written with its backslash escaped
    assert _unescape(b"out/back\\#134#101") == "out/back\\#101"
    assert _unescape(b"out/\\#303\\#251t\\#303\\#251") == "out/été"
    assert _unescape(b"out/raw\\#377") == os.fsdecode(b"out/raw\xff")  # not UTF-8: as the file system has it


def test_output_reader_sends_file_names_on_and_keeps_the_rest() -> None:
    names: list[str] = []
    reader = _OutputReader(names.append, None, None)
    text = (
        b"~out/\n~out/a.txt\n~out/sub/\n~out/sub/new\\#012line\n"
        b"\nNumber of regular files transferred: 2\nTotal transferred file size: 10 bytes\n"
    )
    for i in range(0, len(text), 7):  # lines split across chunks
        reader.feed(text[i : i + 7])
    reader.feed(b"sent 1 bytes")  # an unterminated last line
    reader.feed(b"\n")
    assert names == ["out/a.txt", "out/sub/new\nline"]
    kept = bytes(reader.output)
    assert b"Number of regular files transferred: 2" in kept and b"sent 1 bytes" in kept
    assert b"~" not in kept


# ----------------------------------------------------------------- the manifest's line


def test_the_digest_is_checked_from_the_line_the_host_sent(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out/a,\"missing\":[].txt").write_bytes(b"a")  # the separator, inside a name
    manifest = build_manifest(tmp_path, ["out/"])
    line: bytes = manifest_module().manifest_json(manifest)  # type: ignore[attr-defined]
    assert _digest_of_line_matches(line, manifest["digest"])
    assert not _digest_of_line_matches(line.replace(b'"size":1', b'"size":2'), manifest["digest"])
    assert not _digest_of_line_matches(line, "0" * 64)
    spaced = json.dumps(manifest).encode()  # valid JSON, another form: digested again later
    assert not _digest_of_line_matches(spaced, manifest["digest"])
    assert not _digest_of_line_matches(line, None)
