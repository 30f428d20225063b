"""The ssh backend's fetch, piece by piece, against a real sshd in a network
namespace (tests/testbeds/sshd_host.py): rsync copies while the host takes
the outputs' manifest (`manifest.py --watch`) and this side hashes each file
as it arrives; `confirm()` then asks the host whether the outputs held still.
A refused tree, a missing output and a change after the copy are each told
apart, and no remote process is left behind.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import describe, marked_pids, wait_for
from ssh_helpers import fresh_user, make_ssh_project, needs_root, needs_sshd, remote_run_dir, ssh_host
from testbeds.sshd_host import SshHost

from substrax_tasks import manifest_cache
from substrax_tasks.backends.base import Fetched
from substrax_tasks.backends.ssh import SshBackend
from substrax_tasks.errors import BackendError
from substrax_tasks.handle import RunHandle
from substrax_tasks.manifest_cache import ManifestError
from substrax_tasks.runs import Project
from substrax_tasks.spec import make_spec
from substrax_tasks.transports.base import TransferStats
from substrax_tasks.transports.rsync import RsyncTransport

pytestmark = [needs_sshd, needs_root]

# Names rsync escapes in its output (a newline, a literal backslash-hash-
# digits, bytes that are not UTF-8) and a plain one, a link and a folder.
ODD_NAMES = {
    b"out/plain.txt": b"plain\n",
    b"out/new\nline.txt": b"newline\n",
    b"out/back\\#101slash": b"backslash\n",
    b"out/sub/\xe9t\xe9.bin": b"latin-1\n",
}
MAKE_ODD = r"""
import os, sys
for name, data in eval(sys.argv[1]).items():
    os.makedirs(os.path.dirname(name), exist_ok=True)
    with open(name, "wb") as f:
        f.write(data)
os.symlink("plain.txt", "out/link")
"""


MAKE_A = ["sh", "-c", "mkdir -p out && echo a > out/a.txt"]


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshHost]:
    with ssh_host(tmp_path_factory.mktemp("sshd-fetch"), fresh_user()) as started:
        yield started


def finished_run(
    tmp_path: Path, host: SshHost, argv: list[str], outputs: list[str]
) -> tuple[SshBackend, RunHandle]:
    root = make_ssh_project(tmp_path, host, "")
    project = Project.open(root)
    handle = project.submit(make_spec("step", argv, root, outputs=outputs))
    backend = project.backend_for(handle)
    assert isinstance(backend, SshBackend)
    assert backend.wait(handle, poll_seconds=0.05).state == "succeeded", backend.read_log(handle, 0)
    return backend, project.store.read(handle.run_id)


def outputs_on_host(handle: RunHandle) -> Path:
    return Path(str(handle.state["outputs_root"]))


def watching(handle: RunHandle) -> list[int]:
    """The `manifest.py --watch` processes of this run on the host."""
    found = []
    for pid in marked_pids(str(remote_run_dir(handle.model_dump(mode="json")))):
        try:
            if b"--watch" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            pass  # gone meanwhile
    return found


def no_watch_left(handle: RunHandle) -> None:
    wait_for(lambda: not watching(handle), "the remote manifest.py --watch to exit")
    assert not watching(handle), describe(watching(handle))


def test_files_are_hashed_as_they_arrive_odd_names_and_a_missing_output_included(
    tmp_path: Path, host: SshHost
) -> None:
    names = {os.fsdecode(k): v for k, v in ODD_NAMES.items()}
    argv = ["python3", "-c", MAKE_ODD, repr(ODD_NAMES)]
    backend, handle = finished_run(tmp_path, host, argv, ["out/", "absent.txt"])
    fetched = backend.begin_fetch(handle)
    try:
        assert fetched.manifest["missing"] == ["absent.txt"]  # skipped by rsync, named by the manifest
        assert fetched.manifest_json is not None and json.loads(fetched.manifest_json) == fetched.manifest
        assert fetched.digest_checked  # on arrival, from the line itself
        for rel, data in names.items():
            assert (fetched.root / rel).read_bytes() == data
            size, mtime, ino, digest, mode = fetched.hashes[rel]  # hashed here as it arrived
            assert digest == hashlib.sha256(data).hexdigest()
            # rsync renamed it into place done: nothing about it changed after the hash,
            # so verification may describe it from this entry (`staged`)
            st = (fetched.root / rel).lstat()
            assert (size, mtime, ino, mode) == (len(data), st.st_mtime_ns, st.st_ino, st.st_mode & 0o7777)
        assert set(fetched.hashes) == set(names)  # the link and the folders are left to verification
        assert (fetched.root / "out/link").readlink() == Path("plain.txt")
    finally:
        fetched.confirm()
    no_watch_left(handle)
    problems = manifest_cache.verify_outputs(
        fetched.root, ["out/", "absent.txt"], fetched.manifest, tmp_path / "cache.json",
        seed=fetched.hashes, digest_checked=True,
    )  # fmt: skip
    assert problems == ["output never produced: absent.txt"]


def test_a_tree_the_manifest_refuses_is_a_manifest_error_not_a_copy_error(
    tmp_path: Path, host: SshHost
) -> None:
    argv = ["sh", "-c", "mkdir -p out && head -c 50000000 /dev/zero > out/big && ln -s /etc/passwd out/leak"]
    backend, handle = finished_run(tmp_path, host, argv, ["out/"])
    with pytest.raises(ManifestError, match=r"symlink out/leak -> /etc/passwd points outside its output"):
        backend.begin_fetch(handle)
    no_watch_left(handle)


def test_outputs_changed_during_the_copy_are_caught_by_confirm(
    tmp_path: Path, host: SshHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, handle = finished_run(tmp_path, host, MAKE_A, ["out/"])
    # the worker kept its manifest for the fetch (manifest.settle): the host
    # sends that one, and its check compares a stat of each entry with it
    settled = remote_run_dir(handle.model_dump(mode="json")) / "manifest-cache.json.settled"
    assert settled.is_file()
    copy = RsyncTransport.download

    def copy_then_change(self: RsyncTransport, *args: Any, **kwargs: Any) -> TransferStats:
        stats = copy(self, *args, **kwargs)
        (outputs_on_host(handle) / "out" / "late.txt").write_text("written as the copy ended\n")
        return stats

    monkeypatch.setattr(RsyncTransport, "download", copy_then_change)
    fetched: Fetched = backend.begin_fetch(handle)
    with pytest.raises(BackendError, match="changed while they were fetched"):
        fetched.confirm()
    fetched.confirm()  # once only: a second call does nothing
    no_watch_left(handle)
    assert not settled.exists()  # the outputs moved on since the run: the next manifest is taken anew
    monkeypatch.setattr(RsyncTransport, "download", copy)
    # fetched again, the tree holds still
    again = backend.fetch(handle)
    assert (again.root / "out" / "late.txt").read_text() == "written as the copy ended\n"
    no_watch_left(handle)


def test_the_status_is_not_asked_again_once_the_run_was_seen_to_end(
    tmp_path: Path, host: SshHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, handle = finished_run(tmp_path, host, MAKE_A, ["out/"])
    assert isinstance(handle.state.get("outputs_root"), str)
    asked: list[str] = []
    original = backend._remote_status

    def counting(h: RunHandle) -> dict[str, object]:
        asked.append(h.run_id)
        return original(h)

    monkeypatch.setattr(backend, "_remote_status", counting)
    fetched = backend.fetch(handle)
    assert (fetched.root / "out" / "a.txt").read_text() == "a\n"
    assert asked == []
