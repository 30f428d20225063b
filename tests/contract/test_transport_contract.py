"""One contract, every transport: what substrax_tasks.transports.base.Transport
promises (and the backends rely on), run against each implementation over a
real server: RsyncTransport against a throwaway sshd in a network namespace,
BucketTransport against `rclone serve s3`. The download tests reach each one
only through the `Transport` interface.

Add a transport by adding a parameter to the `bound` fixture (a test fails
until every implementation of `Transport` has one). What only one
transport can do (uploads, modes and symlinks through rsync; empty folders,
manifests and endpoints of buckets) is tested here with rsync alone, or in
that transport's own tests.
"""

from __future__ import annotations

import importlib
import inspect
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from s3_server import S3Server
from ssh_helpers import needs_root, needs_sshd
from testbeds.sshd_host import SshHost

from substrax_tasks import transports as transports_package
from substrax_tasks.errors import BackendError
from substrax_tasks.transports.base import Transport
from substrax_tasks.transports.bucket import BucketTransport
from substrax_tasks.transports.openssh import SshTarget
from substrax_tasks.transports.rsync import RsyncTransport
from substrax_tasks.uptodate import manifests as manifest_cache

TREE = {
    "a.txt": b"alpha\n",
    "data/x.bin": bytes(range(256)) * 40,
    "data/sub/deeper/y.bin": b"\0" * 70_000,
    "data/sub/z.txt": b"zed",
    "other.txt": b"not asked for",
}
ASKED = ["a.txt", "data/"]
ASKED_FILES = [rel for rel in TREE if rel != "other.txt"]


@dataclass
class Bound:
    """A transport, a fresh remote root for the test, and a way to write and
    read that root behind the transport's back."""

    name: str
    transport: Transport
    remote_root: str
    put: Callable[[str, bytes], None]
    get: Callable[[str], bytes | None]  # None: not there


@pytest.fixture(scope="module")
def ssh_target(host: SshHost) -> Iterator[SshTarget]:
    target = SshTarget(
        host=host.address, port=host.port, user=host.user,
        identity_file=str(host.client_key), known_hosts=str(host.known_hosts),
    )  # fmt: skip
    yield target
    target.stop_master()


def _rsync_bound(host: SshHost, target: SshTarget) -> Bound:
    root = host.scratch / f"transport-{secrets.token_hex(4)}"

    def put(rel: str, data: bytes) -> None:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def get(rel: str) -> bytes | None:
        path = root / rel
        return path.read_bytes() if path.is_file() else None

    return Bound("rsync", RsyncTransport(target, show_progress=False), str(root), put, get)


def _bucket_bound(server: S3Server) -> Bound:
    fs = server.filesystem()
    prefix = f"{server.bucket}/transport-{secrets.token_hex(4)}/outputs"

    def put(rel: str, data: bytes) -> None:
        fs.pipe_file(f"{prefix}/{rel}", data)

    def get(rel: str) -> bytes | None:
        fs.invalidate_cache()
        try:
            return bytes(fs.cat_file(f"{prefix}/{rel}"))
        except FileNotFoundError:
            return None

    transport = BucketTransport(storage_options=server.storage_options(), show_progress=False)
    return Bound("bucket", transport, f"s3://{prefix}", put, get)


# Each implementation of Transport, by the name its binding goes by.
BOUND_IMPLEMENTATIONS = {"rsync": RsyncTransport, "bucket": BucketTransport}


@pytest.fixture(
    params=[
        pytest.param("rsync", id="rsync", marks=[needs_sshd, needs_root]),
        pytest.param("bucket", id="bucket"),
    ]
)
def bound(request: pytest.FixtureRequest) -> Bound:
    if request.param == "rsync":
        found = _rsync_bound(request.getfixturevalue("host"), request.getfixturevalue("ssh_target"))
    else:
        found = _bucket_bound(request.getfixturevalue("s3_server"))
    assert type(found.transport) is BOUND_IMPLEMENTATIONS[request.param]
    return found


def test_every_transport_is_bound_to_this_suite() -> None:
    """A transport added to the package is held to the contract here too:
    every implementation of `Transport` in substrax_tasks.transports has a
    binding above."""
    package = Path(transports_package.__file__).parent
    for module in sorted(p.stem for p in package.glob("*.py") if p.stem != "__init__"):
        importlib.import_module(f"{transports_package.__name__}.{module}")
    implemented = {cls for cls in _subclasses(Transport) if not inspect.isabstract(cls)}
    assert implemented == set(BOUND_IMPLEMENTATIONS.values())


def _subclasses(cls: type) -> list[type]:
    found: list[type] = []
    direct_ones: list[type] = cls.__subclasses__()
    for direct in direct_ones:
        found += [direct, *_subclasses(direct)]
    return found


def make_tree(root: Path, tree: dict[str, bytes] = TREE) -> Path:
    for rel, data in tree.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def put_tree(bound: Bound, tree: dict[str, bytes] = TREE) -> None:
    for rel, data in tree.items():
        bound.put(rel, data)


def files_under(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------ upload


@pytest.fixture
def rsync_bound(host: SshHost, ssh_target: SshTarget) -> Bound:
    return _rsync_bound(host, ssh_target)


@needs_sshd
@needs_root
def test_upload_copies_files_and_nested_folders_and_creates_the_remote_root(
    rsync_bound: Bound, tmp_path: Path
) -> None:
    bound = rsync_bound
    assert isinstance(bound.transport, RsyncTransport)
    local = make_tree(tmp_path / "local")
    stats = bound.transport.upload(local, ASKED, bound.remote_root)
    for rel in ASKED_FILES:
        assert bound.get(rel) == TREE[rel], rel
    assert bound.get("other.txt") is None
    assert stats.files == len(ASKED_FILES)
    assert stats.bytes == sum(len(TREE[rel]) for rel in ASKED_FILES)


@needs_sshd
@needs_root
def test_upload_of_a_path_that_is_not_here_fails(rsync_bound: Bound, tmp_path: Path) -> None:
    bound = rsync_bound
    assert isinstance(bound.transport, RsyncTransport)
    local = make_tree(tmp_path / "local")
    with pytest.raises(BackendError):
        bound.transport.upload(local, ["a.txt", "nothing-here.txt"], bound.remote_root)


# ---------------------------------------------------------------- download


def test_download_keeps_relative_paths_and_makes_the_local_root(bound: Bound, tmp_path: Path) -> None:
    put_tree(bound)
    staging = tmp_path / "not" / "yet" / "there"
    stats = bound.transport.download(bound.remote_root, ASKED, staging)
    assert files_under(staging) == {rel: TREE[rel] for rel in ASKED_FILES}
    assert stats.files == len(ASKED_FILES)
    assert stats.bytes == sum(len(TREE[rel]) for rel in ASKED_FILES)


def test_a_folder_is_the_same_with_or_without_its_trailing_slash(bound: Bound, tmp_path: Path) -> None:
    put_tree(bound)
    bound.transport.download(bound.remote_root, ["data/"], tmp_path / "slash")
    bound.transport.download(bound.remote_root, ["data"], tmp_path / "plain")
    assert files_under(tmp_path / "slash") == files_under(tmp_path / "plain")
    assert set(files_under(tmp_path / "plain")) == {rel for rel in ASKED_FILES if rel.startswith("data/")}


def test_a_download_verifies_against_the_manifest_of_the_source(bound: Bound, tmp_path: Path) -> None:
    local = make_tree(tmp_path / "local")
    outputs = ["a.txt", "data/"]
    expected = manifest_cache.build_manifest(local, outputs)
    put_tree(bound)
    staging = tmp_path / "staging"
    bound.transport.download(bound.remote_root, outputs, staging)
    assert manifest_cache.verify_outputs(staging, outputs, expected, tmp_path / "cache.json") == []


def test_download_replaces_a_file_already_at_the_final_path(bound: Bound, tmp_path: Path) -> None:
    put_tree(bound)
    staging = make_tree(tmp_path / "staging", {"a.txt": b"stale and longer than the new one\n"})
    bound.transport.download(bound.remote_root, ["a.txt"], staging)
    assert (staging / "a.txt").read_bytes() == TREE["a.txt"]


def test_download_skips_a_path_that_is_not_there_and_brings_the_others(bound: Bound, tmp_path: Path) -> None:
    """The contract: each path "that exists there" (the manifest check then
    names the missing one); nothing half-made is left for it."""
    put_tree(bound)
    staging = tmp_path / "staging"
    bound.transport.download(bound.remote_root, ["a.txt", "gone.txt"], staging)
    assert (staging / "a.txt").is_file()
    assert not (staging / "gone.txt").exists()
    assert not [p for p in staging.rglob("*") if p.name.endswith(".part")]


def test_no_terminal_gives_a_start_and_a_summary_line(
    bound: Bound, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    put_tree(bound)
    capfd.readouterr()
    bound.transport.download(bound.remote_root, ASKED, tmp_path / "staging")
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("fetch:")]
    assert len(lines) == 2, err  # when it starts, and what it copied
    assert lines[0].startswith("fetch: started, "), err
    assert lines[1].startswith(f"fetch: {len(ASKED_FILES)} files, "), err
    assert "━" not in err
