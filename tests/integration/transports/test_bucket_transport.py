"""The bucket transport against a real S3 server (`rclone serve s3`, which
checks signatures): the run folder a worker leaves in the bucket, its
manifest, and what a fetch does when the bucket is not as the manifest says.
What every transport must do is in test_transport_contract.py.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from bucket_transport_parts import OUTPUTS, fetch
from local_runs import on_a_terminal
from s3_server import S3Server

from substrax_tasks._remote import manifest as remote_manifest
from substrax_tasks.errors import BackendError
from substrax_tasks.transports.base import MAX_MANIFEST_BYTES
from substrax_tasks.transports.bucket import BucketTransport
from substrax_tasks.uptodate import manifests as manifest_cache

ROOT = os.geteuid() == 0
TREE = {
    "model.bin": os.urandom(300_000),
    "reports/summary.json": b'{"ok": true}\n',
    "reports/plots/a/loss.csv": b"step,loss\n1,0.5\n",
    "reports/plots/b.csv": b"x\n",
}


def make_tree(root: Path, tree: dict[str, bytes] = TREE) -> Path:
    for rel, data in tree.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (root / "logs").mkdir(exist_ok=True)  # an output folder left empty
    return root


def finished_run(server: S3Server, workdir: Path) -> tuple[str, dict[str, Any]]:
    """A run folder as the worker leaves it: the outputs under
    <run>/outputs/, then <run>/manifest.json (taken where the run ran)."""
    run = f"s3://{server.bucket}/runs/{secrets.token_hex(6)}"
    made = make_tree(workdir / "ran")
    (made / "model.bin").chmod(0o750)  # a mode the bucket cannot keep: the fetch sets it
    manifest = manifest_cache.build_manifest(made, OUTPUTS)
    assert manifest["missing"] == ["never.txt"]
    put_tree(server, f"{run}/outputs", TREE)
    write_object(server, f"{run}/manifest.json", json.dumps(manifest, indent=1, sort_keys=True).encode())
    return run, manifest


def write_object(server: S3Server, uri: str, data: bytes) -> None:
    server.filesystem().pipe_file(uri.removeprefix("s3://"), data)


def put_tree(server: S3Server, uri: str, tree: dict[str, bytes]) -> None:
    """Objects as a worker writes them to its mounted bucket."""
    for rel, data in tree.items():
        write_object(server, f"{uri}/{rel}", data)


# --------------------------------------------------------------- the fetch


def test_a_finished_run_fetches_and_verifies_with_the_endpoint_from_the_environment(
    s3_env: S3Server, tmp_path: Path
) -> None:
    """BucketTransport() as the backend builds it: endpoint and credentials
    from AWS_* only. Empty output folders arrive (S3 holds no folders)."""
    run, expected = finished_run(s3_env, tmp_path)
    staging = tmp_path / "staging"
    manifest = fetch(BucketTransport(show_progress=False), run, staging)
    assert manifest == expected
    assert (staging / "model.bin").read_bytes() == TREE["model.bin"]
    assert (staging / "model.bin").stat().st_mode & 0o777 == 0o750
    assert (staging / "logs").is_dir() and not any((staging / "logs").iterdir())
    assert manifest_cache.verify_outputs(staging, OUTPUTS, manifest, tmp_path / "cache.json") == [
        "output never produced: never.txt"
    ]


def test_setuid_sticky_and_world_writable_modes_a_worker_recorded_arrive_without_those_bits(
    s3_env: S3Server, tmp_path: Path
) -> None:
    """Issue 28, item 2, on the bucket's path: a bucket keeps no modes, so
    the fetch sets the ones the run's manifest names (a host's user made
    6755, 4777 and 1777), and sets them made safe: a root client gets no
    setuid, setgid or sticky bit and nothing world-writable."""
    run = f"s3://{s3_env.bucket}/runs/{secrets.token_hex(6)}"
    made = make_tree(tmp_path / "ran")
    unsafe = {"model.bin": 0o6755, "reports/summary.json": 0o4777, "reports/plots": 0o1777}
    for rel, mode in unsafe.items():
        (made / rel).chmod(mode)
    manifest = manifest_cache.build_manifest(made, OUTPUTS)
    recorded = {e["path"]: e["mode"] & 0o7777 for e in manifest["entries"] if e["path"] in unsafe}
    assert recorded == unsafe  # what the worker recorded, as a host's user made them
    put_tree(s3_env, f"{run}/outputs", TREE)
    write_object(s3_env, f"{run}/manifest.json", json.dumps(manifest).encode())
    staging = tmp_path / "staging"
    fetch(BucketTransport(show_progress=False), run, staging)
    arrived = {rel: (staging / rel).stat().st_mode & 0o7777 for rel in unsafe}
    assert arrived == {"model.bin": 0o755, "reports/summary.json": 0o775, "reports/plots": 0o775}


# The fetch as the SkyPilot backend runs it, in a mount namespace where the
# staging folder is a full 1 MiB tmpfs; what it raised.
FETCH_ON_A_FULL_DISK = """
import sys
from pathlib import Path
from substrax_tasks.transports.bucket import BucketTransport
staging = Path(sys.argv[2])
(staging.parent / "filler").write_bytes(bytes(900_000))
try:
    BucketTransport(show_progress=False).fetch_run(sys.argv[1], ["model.bin"], staging)
except BaseException as exc:
    print(type(exc).__name__, getattr(exc, "errno", None), getattr(exc, "filename", None))
"""


def test_a_full_disk_here_during_a_fetch_is_an_os_error_naming_the_file_for_the_phase_to_tell(
    s3_env: S3Server, tmp_path: Path
) -> None:
    """Issue 28, item 8, on the bucket's path: the phase tells an OSError of
    a full disk as one (where, what is kept, the fix); a BackendError
    `fetch of ... failed: OSError: ...` ended doit with exit status 2."""
    if not ROOT or shutil.which("unshare") is None:
        pytest.skip("FULL DISK NOT TESTED: a tmpfs in a mount namespace needs root and unshare")
    run, _manifest = finished_run(s3_env, tmp_path)  # model.bin: 300 kB, more than is left
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = 'mount -t tmpfs -o size=1m none "$1" && shift && exec "$@"'
    done = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", mount, "sh", str(disk),
         sys.executable, "-c", FETCH_ON_A_FULL_DISK, run, str(disk / "staging")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    kind, code, filename = done.stdout.split()
    assert (kind, code) == ("OSError", str(errno.ENOSPC)), done.stdout
    assert filename == str(disk / "staging" / "model.bin"), done.stdout


def test_explicit_endpoint_and_storage_options_need_no_environment(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    options = s3_server.storage_options()
    endpoint = options.pop("endpoint_url")
    run, expected = finished_run(s3_server, tmp_path)
    transport = BucketTransport(endpoint_url=endpoint, storage_options=options, show_progress=False)
    assert fetch(transport, run, tmp_path / "staging") == expected


def test_an_object_changed_after_the_manifest_fails_verification(s3_env: S3Server, tmp_path: Path) -> None:
    run, _ = finished_run(s3_env, tmp_path)
    write_object(s3_env, f"{run}/outputs/reports/summary.json", b'{"ok": false}\n')
    staging = tmp_path / "staging"
    manifest = fetch(BucketTransport(show_progress=False), run, staging)
    problems = manifest_cache.verify_outputs(staging, OUTPUTS, manifest, tmp_path / "cache.json")
    assert len(problems) == 2, problems
    assert problems[0] == "output never produced: never.txt"
    assert problems[1].startswith("changed content: reports/summary.json (13 bytes, sha256 "), problems


def test_an_object_added_under_an_output_folder_fails_verification(s3_env: S3Server, tmp_path: Path) -> None:
    run, _ = finished_run(s3_env, tmp_path)
    write_object(s3_env, f"{run}/outputs/reports/extra.txt", b"not the run's\n")
    staging = tmp_path / "staging"
    manifest = fetch(BucketTransport(show_progress=False), run, staging)
    problems = manifest_cache.verify_outputs(staging, OUTPUTS, manifest, tmp_path / "cache.json")
    assert "extra: reports/extra.txt (file)" in problems, problems


def test_an_output_gone_from_the_bucket_is_named_by_the_verification(
    s3_env: S3Server, tmp_path: Path
) -> None:
    run, _ = finished_run(s3_env, tmp_path)
    s3_env.filesystem().rm_file(f"{run}/outputs/model.bin".removeprefix("s3://"))
    staging = tmp_path / "staging"
    manifest = fetch(BucketTransport(show_progress=False), run, staging)
    assert not (staging / "model.bin").exists()
    problems = manifest_cache.verify_outputs(staging, OUTPUTS, manifest, tmp_path / "cache.json")
    assert "missing output: model.bin" in problems, problems


# ----------------------------------------------------------- the manifest


def test_read_manifest_returns_what_the_run_wrote(s3_env: S3Server, tmp_path: Path) -> None:
    run, expected = finished_run(s3_env, tmp_path)
    assert BucketTransport().read_manifest(f"{run}/manifest.json") == expected


def test_a_missing_manifest_says_the_run_did_not_finish_writing(s3_env: S3Server) -> None:
    run = f"s3://{s3_env.bucket}/runs/never-finished"
    write_object(s3_env, f"{run}/outputs/half.bin", b"half")
    with pytest.raises(BackendError) as caught:
        BucketTransport().read_manifest(f"{run}/manifest.json")
    message = str(caught.value)
    assert f"the run folder {run} holds no manifest.json" in message
    assert "the run did not finish writing its outputs" in message


def _digest_mismatch(text: bytes) -> bytes:
    data = json.loads(text)
    data["entries"][0]["size"] += 1
    return json.dumps(data).encode()


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        pytest.param(lambda text: text[: len(text) // 2], "it is not a JSON object", id="truncated"),
        pytest.param(lambda text: b"[]", "it is not a JSON object", id="a-list"),
        pytest.param(_digest_mismatch, "does not match its entries", id="digest-mismatch"),
        pytest.param(
            lambda text: text.replace(b'"version": 1', b'"version": 99'),
            "version 99, expected 1",
            id="version",
        ),
    ],
)
def test_a_damaged_manifest_names_the_run_folder(
    s3_env: S3Server, tmp_path: Path, damage: Any, why: str
) -> None:
    run, _ = finished_run(s3_env, tmp_path)
    uri = f"{run}/manifest.json"
    fs = s3_env.filesystem()
    write_object(s3_env, uri, damage(bytes(fs.cat_file(uri.removeprefix("s3://")))))
    with pytest.raises(BackendError) as caught:
        BucketTransport().read_manifest(uri)
    message = str(caught.value)
    assert f"the manifest in the run folder {run} is damaged" in message and why in message, message
    assert "did not finish writing its outputs" in message


def test_an_oversized_manifest_is_refused_unread(s3_env: S3Server, tmp_path: Path) -> None:
    run, _ = finished_run(s3_env, tmp_path)
    uri = f"{run}/manifest.json"
    write_object(s3_env, uri, b" " * (MAX_MANIFEST_BYTES + 1))
    with pytest.raises(BackendError, match=r"is larger than 64 MiB: refused unread, nothing was fetched"):
        BucketTransport().read_manifest(uri)


@pytest.mark.parametrize("kind", ["fifo", "socket", "char device"])
def test_a_manifest_that_lists_a_special_file_is_refused_before_anything_is_fetched(
    s3_env: S3Server, tmp_path: Path, kind: str
) -> None:
    """An object store holds no fifo or device, but its manifest could name
    one (a hostile cluster writes both): refused as over ssh, nothing made."""
    run, manifest = finished_run(s3_env, tmp_path)
    odd = {"path": "reports/odd", "type": kind, "size": 0, "mode": 0o666, "sha256": None, "target": None}
    manifest["entries"] = sorted([*manifest["entries"], odd], key=lambda e: e["path"])
    manifest["digest"] = remote_manifest.entries_digest(manifest["entries"])
    write_object(s3_env, f"{run}/outputs/reports/odd", b"")
    write_object(s3_env, f"{run}/manifest.json", json.dumps(manifest).encode())
    staging = tmp_path / "fetched"
    with pytest.raises(BackendError, match=rf"lists 'reports/odd' as a '{kind}': outputs are files"):
        BucketTransport().fetch_run(run, OUTPUTS, staging)
    assert not staging.exists()


# ------------------------------------------------------------------ errors


def test_wrong_credentials_are_refused_by_the_server_and_say_what_to_check(
    s3_env: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run, _ = finished_run(s3_env, tmp_path)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(BackendError, match=r"was refused .*check the credentials"):
        BucketTransport().read_manifest(f"{run}/manifest.json")


def test_an_endpoint_that_does_not_answer_says_so(s3_env: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's retries, with back-off, take ~10 s
    with pytest.raises(BackendError, match=r"Could not connect .*is the endpoint right and reachable"):
        BucketTransport().read_manifest(f"s3://{s3_env.bucket}/runs/x/manifest.json")


@pytest.mark.parametrize("rel", ["../escape.txt", "/abs.txt", "a/./b", "a//b", ""])
def test_paths_that_are_not_plain_relative_paths_are_refused(
    s3_env: S3Server, tmp_path: Path, rel: str
) -> None:
    with pytest.raises(BackendError, match="not a plain relative path"):
        BucketTransport().download(f"s3://{s3_env.bucket}/runs/x/outputs", [rel], tmp_path / "staging")


def test_many_small_files_all_arrive(s3_env: S3Server, tmp_path: Path) -> None:
    tree = {f"many/{i // 10}/f{i}.txt": f"file {i}\n".encode() for i in range(60)}
    local = make_tree(tmp_path / "local", tree)
    remote = f"s3://{s3_env.bucket}/many-{secrets.token_hex(4)}"
    put_tree(s3_env, remote, tree)
    stats = BucketTransport(show_progress=False).download(remote, ["many/"], tmp_path / "staging")
    assert (stats.files, stats.bytes) == (60, sum(len(d) for d in tree.values()))
    expected = manifest_cache.build_manifest(local, ["many/"])
    assert manifest_cache.verify_outputs(tmp_path / "staging", ["many/"], expected, tmp_path / "c.json") == []


# ------------------------------------------------- broken copies, progress

BROKEN_COPY_SCRIPT = """
import json, os, sys
from pathlib import Path
from substrax_tasks.errors import BackendError
from substrax_tasks.transports.bucket import BucketTransport
staging = Path(sys.argv[2])
try:
    BucketTransport(show_progress=False).download(sys.argv[1], ["out/"], staging)
    code, message = 0, ""
except BackendError as exc:
    code, message = 3, str(exc)
found = sorted(str(p.relative_to(staging)) for p in staging.rglob("*"))
print(json.dumps({"message": message, "found": found}))
sys.exit(code)
"""


@pytest.mark.skipif(not ROOT or shutil.which("unshare") is None, reason="needs root and unshare for a tmpfs")
def test_a_copy_that_breaks_off_leaves_no_half_file(s3_env: S3Server, tmp_path: Path) -> None:
    """A real broken copy: the staging folder is a 1 MiB tmpfs (in a mount
    namespace of its own), the object 3 MB: the disk fills mid-object."""
    remote = f"s3://{s3_env.bucket}/broken-{secrets.token_hex(4)}"
    write_object(s3_env, f"{remote}/out/a-small.txt", b"small\n")
    write_object(s3_env, f"{remote}/out/big.bin", os.urandom(3_000_000))
    staging = tmp_path / "staging"
    staging.mkdir()
    mount_and_run = 'mount -t tmpfs -o size=1m sx-staging "$1" && shift && exec "$@"'
    result = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", mount_and_run, "sh", str(staging),
         sys.executable, "-c", BROKEN_COPY_SCRIPT, remote, str(staging)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 3, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert "fetch of" in report["message"] and "big.bin" in report["message"], report
    assert "No space left on device" in report["message"], report
    assert "out/big.bin" not in report["found"], report
    assert not [name for name in report["found"] if name.endswith(".part")], report


PROGRESS_SCRIPT = """
import sys
from pathlib import Path
from substrax_tasks.transports.bucket import BucketTransport
BucketTransport().download(sys.argv[1], ["big.bin"], Path(sys.argv[2]))
"""


def test_fetch_on_a_terminal_shows_a_progress_bar_not_the_summary_line(
    s3_env: S3Server, tmp_path: Path
) -> None:
    remote = f"s3://{s3_env.bucket}/progress-{secrets.token_hex(4)}"
    write_object(s3_env, f"{remote}/big.bin", b"\0" * (8 << 20))
    text = on_a_terminal([sys.executable, "-c", PROGRESS_SCRIPT, remote, str(tmp_path / "got")])
    assert (tmp_path / "got" / "big.bin").stat().st_size == 8 << 20
    assert "fetch 1/1 files" in text and "━" in text and "8.4/8.4 MB" in text, text
    assert "fetch: 1 files" not in text, text


def test_importing_the_transport_does_not_import_fsspec() -> None:
    code = (
        "import sys, substrax_tasks, substrax_tasks.transports.bucket\n"
        "loaded = [m for m in ('fsspec', 's3fs', 'botocore') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
