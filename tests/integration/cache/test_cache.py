"""The cache of verified runs (docs/cache.md), through the real `doit` and
`substrax-compute`: clones of one project sharing a cache folder or a real
S3 server, branch switches, damaged and unsigned entries, read-only and
unreachable stores, and gc."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from cache_parts import entries, folder_cache, restored
from dodo_helpers import (
    clean_env,
    compute,
    doit,
    doit_ok,
    handles,
    make_project,
    run_count,
    run_dirs,
    show,
    step_ran,
    tree_files,
    unsafe_modes,
    write_pyproject,
)
from local_runs import run_dir, submit, wait_final
from s3_server import S3Server

from substrax_tasks._remote import manifest as remote_manifest
from substrax_tasks.store.project import Project

BODY = """
def task_make():
    yield from remote_step("make", shell="mkdir -p out/sub && cat data/in.txt data/in.txt > out/res.txt "
                           "&& printf x > out/sub/x && ln -s res.txt out/link",
                           inputs=["data/"], outputs=["out/"])
"""


def project(tmp_path: Path, name: str, cache: str = "", body: str = BODY) -> Path:
    """A project in `tmp_path/name` whose cache table is `cache`."""
    (tmp_path / name).mkdir()
    root = make_project(tmp_path / name, body, default_tasks=["make"], files={"data/in.txt": "hello\n"})
    write_pyproject(root, cache="[tool.substrax.compute.cache]\n" + cache)
    return root


def test_a_second_clone_restores_from_a_shared_folder_without_running(tmp_path: Path) -> None:
    first = project(tmp_path, "a", folder_cache(tmp_path))
    done = doit_ok(first)
    assert not restored(done) and run_count(first) == 1
    assert len(entries(tmp_path / "team-cache")) == 1

    second = project(tmp_path, "b", folder_cache(tmp_path))
    why = compute(second, "why", "make")
    assert f"would be restored from cache entry {entries(tmp_path / 'team-cache')[0].stem[:16]}" in why.stdout
    done = doit_ok(second)
    assert restored(done), show(done)
    assert run_count(second) == 0  # no run folder: nothing was launched, no worker
    assert tree_files(second / "out") == tree_files(first / "out")
    assert (second / "out" / "link").is_symlink()
    assert (second / "out" / "res.txt").read_bytes() == b"hello\nhello\n"
    # up to date from then on, and `why` agrees
    again = doit_ok(second)
    assert not step_ran(again, "make")
    assert "up to date" in compute(second, "why", "make").stdout


def test_changing_an_input_or_the_command_misses(tmp_path: Path) -> None:
    doit_ok(project(tmp_path, "a", folder_cache(tmp_path)))
    second = project(tmp_path, "b", folder_cache(tmp_path))
    (second / "data" / "in.txt").write_text("other\n")
    done = doit_ok(second)
    assert not restored(done) and run_count(second) == 1
    third = project(tmp_path, "c", folder_cache(tmp_path), body=BODY.replace("printf x", "printf y"))
    done = doit_ok(third)
    assert not restored(done) and run_count(third) == 1


def test_doit_forget_restores_and_doit_always_runs_for_real_replacing_the_entry(tmp_path: Path) -> None:
    root = project(tmp_path, "a", folder_cache(tmp_path))
    doit_ok(root)
    first = json.loads(entries(tmp_path / "team-cache")[0].read_text())["provenance"]["run_id"]
    shutil.rmtree(root / "out")
    doit_ok(root, "forget", "make")
    done = doit_ok(root)
    assert restored(done) and run_count(root) == 1, show(done)
    done = doit_ok(root, "-a", "make")
    assert not restored(done) and run_count(root) == 2, show(done)
    again = json.loads(entries(tmp_path / "team-cache")[0].read_text())["provenance"]["run_id"]
    assert again != first and again == json.loads((root / ".substrax/steps/make.json").read_text())["run_id"]


# the user's own uptodate item: doit's config_changed of a version file
VERSIONED = BODY.replace(
    'outputs=["out/"])', 'outputs=["out/"], uptodate=[config_changed(open("version.txt").read())])'
).replace("def task_make", "from doit.tools import config_changed\n\n\ndef task_make")


def test_a_rerun_asked_for_by_doit_always_or_a_user_uptodate_item_is_real_under_threads(
    tmp_path: Path,
) -> None:
    """doit tells a task nothing of `-a`: a step whose own check held but
    whose phases doit runs anyway (`-a`, or the user's uptodate item said
    so) runs for real, never restores; a step that must run restores."""
    root = project(tmp_path, "a", folder_cache(tmp_path), body=VERSIONED)
    (root / "version.txt").write_text("1")
    threads = ("-n", "4", "-P", "thread")
    doit_ok(root, *threads)
    (root / "version.txt").write_text("2")  # the user's item turns false; the step's own check holds
    done = doit_ok(root, *threads)
    assert not restored(done) and run_count(root) == 2, show(done)
    done = doit_ok(root, "-a", *threads, "make")
    assert not restored(done) and run_count(root) == 3, show(done)
    last = json.loads((root / ".substrax/steps/make.json").read_text())["run_id"]
    assert json.loads(entries(tmp_path / "team-cache")[0].read_text())["provenance"]["run_id"] == last
    assert not step_ran(doit_ok(root, *threads), "make")
    shutil.rmtree(root / "out")  # now the step's own check says run: the entry is restored, -a or not
    done = doit_ok(root, "-a", *threads, "make")
    assert restored(done) and run_count(root) == 3, show(done)


# doit in-process, to see what a restore imported
DOIT_IMPORTS = """
import sys
from doit.cmd_base import DodoTaskLoader
from doit.doit_cmd import DoitMain

code = DoitMain(DodoTaskLoader()).run([])
print("imported pydantic:", "pydantic" in sys.modules)
sys.exit(code)
"""


def test_a_restore_in_a_project_already_validated_imports_no_pydantic(tmp_path: Path) -> None:
    """The cache's options are kept with the project's validated settings:
    a restore after outputs were deleted does not validate the config again."""
    doit_ok(project(tmp_path, "a", folder_cache(tmp_path)))
    second = project(tmp_path, "b", folder_cache(tmp_path))
    assert restored(doit_ok(second))
    shutil.rmtree(second / "out")
    doit_ok(second, "forget", "make")
    done = subprocess.run([sys.executable, "-c", DOIT_IMPORTS], cwd=second, env=clean_env(),
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 0 and restored(done), show(done)
    assert done.stdout.splitlines()[-1] == "imported pydantic: False", show(done)
    assert (second / "out" / "res.txt").read_bytes() == b"hello\nhello\n"


def test_switching_a_git_branch_and_back_restores(tmp_path: Path) -> None:
    root = project(tmp_path, "a")  # the default local folder ($XDG_CACHE_HOME)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(root)]
    (root / ".gitignore").write_text(".substrax/\nout/\n")
    steps = (["init", "-q", "-b", "main"], ["add", "."], ["commit", "-qm", "one"], ["switch", "-qc", "other"])
    for argv in steps:
        subprocess.run([*git, *argv], check=True)
    doit_ok(root)  # on `other` first: the same data, so its entry serves main too
    (root / "data" / "in.txt").write_text("other branch\n")
    subprocess.run([*git, "commit", "-qam", "two"], check=True)
    assert not restored(doit_ok(root)) and run_count(root) == 2
    subprocess.run([*git, "switch", "-q", "main"], check=True)
    done = doit_ok(root)
    assert restored(done) and run_count(root) == 2, show(done)
    assert (root / "out" / "res.txt").read_text() == "hello\nhello\n"
    subprocess.run([*git, "switch", "-q", "other"], check=True)
    assert restored(doit_ok(root)) and (root / "out" / "res.txt").read_text() == "other branch\n" * 2


def _res_pack(folder: Path) -> Path:
    """The pack holding out/res.txt (12 bytes: packed with the entry's other small files)."""
    entry = json.loads(entries(folder)[0].read_text())
    (sha,) = [str(p["sha256"]) for p in entry["packs"]]  # out/res.txt and out/sub/x
    return folder / "objects" / sha[:2] / sha


RES_SHA = hashlib.sha256(b"hello\nhello\n").hexdigest()


def _edit_manifest(folder: Path, key: str = "mode", value: object = None) -> None:
    """Change out/res.txt's `key` in the entry's manifest (by default, flip its mode)."""
    path = entries(folder)[0]
    entry = json.loads(path.read_text())
    for item in entry["manifest"]["entries"]:
        if item["path"] == "out/res.txt":
            item[key] = value if value is not None else 0o600 if item["mode"] != 0o600 else 0o644
    path.write_text(json.dumps(entry))


def _edit_entry(folder: Path, edit: Callable[[dict[str, object]], object]) -> None:
    path = entries(folder)[0]
    entry = json.loads(path.read_text())
    edit(entry)
    path.write_text(json.dumps(entry))


TAMPERING: dict[str, Callable[[Path], object]] = {
    "pack-changed": lambda f: _res_pack(f).write_bytes(_res_pack(f).read_bytes().replace(b"hel", b"HEL", 1)),
    "pack-removed": lambda f: _res_pack(f).unlink(),
    "pack-truncated": lambda f: _res_pack(f).write_bytes(_res_pack(f).read_bytes()[:6]),
    "pack-grown": lambda f: _res_pack(f).write_bytes(_res_pack(f).read_bytes() + b"more"),
    "pack-unlisted": lambda f: _edit_entry(f, lambda e: e.pop("packs")),  # its files' objects are not there
    "manifest-edited": _edit_manifest,
    # a writer of the store aiming outside the staging folder: refused before anything is written
    "path-escapes": lambda f: _edit_manifest(f, "path", "../../../escaped"),
    "digest-not-a-name": lambda f: _edit_manifest(f, "sha256", "../victim"),  # objects/../../victim
    "entry-truncated": lambda f: entries(f)[0].write_bytes(entries(f)[0].read_bytes()[:100]),
}


@pytest.mark.parametrize("how", list(TAMPERING))
def test_a_damaged_entry_is_never_promoted_and_the_step_runs(tmp_path: Path, how: str) -> None:
    team = tmp_path / "team-cache"
    doit_ok(project(tmp_path, "a", folder_cache(tmp_path)))
    key = entries(team)[0].stem
    (tmp_path / "victim").write_text("mine")  # beside the store, where a hostile digest points
    TAMPERING[how](team)
    second = project(tmp_path, "b", folder_cache(tmp_path))
    done = doit_ok(second)
    assert f"cache entry {key[:16]} in {team} is damaged" in done.stdout, show(done)
    assert not restored(done) and run_count(second) == 1
    assert (second / "out" / "res.txt").read_bytes() == b"hello\nhello\n"
    assert not list(tmp_path.rglob("escaped")) and (tmp_path / "victim").read_text() == "mine"
    # the run replaced the entry (and the bad object): a third clone restores it whole
    third = project(tmp_path, "c", folder_cache(tmp_path))
    done = doit_ok(third)
    assert restored(done) and run_count(third) == 0, show(done)
    assert (third / "out" / "res.txt").read_bytes() == b"hello\nhello\n"


def test_an_object_missing_from_a_shared_store_is_a_damaged_entry(tmp_path: Path) -> None:
    """A download that finds no object (the bucket transport's copies) is a
    damaged entry, not an unreachable store: the step runs, the entry is named."""
    shared = tmp_path / "shared"
    doit_ok(project(tmp_path, "a", f'shared = "file://{shared}"\nmode = "readwrite"\n'))
    (key,) = [p.stem for p in entries(shared)]
    _res_pack(shared).unlink()
    second = project(tmp_path, "b", f'path = "{tmp_path}/cache-b"\nshared = "file://{shared}"\n')
    done = doit_ok(second)
    assert f"cache entry {key[:16]} in file://{shared} is damaged" in done.stdout, show(done)
    assert "warning: the cache store" not in done.stderr, show(done)
    assert not restored(done) and run_count(second) == 1
    assert (second / "out" / "res.txt").read_bytes() == b"hello\nhello\n"


BIG = """
def task_make():
    yield from remote_step("make", shell="mkdir -p out && head -c 3000000 /dev/zero | tr '\\\\0' x > out/big",
                           outputs=["out/"])
"""


def test_an_object_changed_after_its_stat_was_recorded_is_hashed_and_refused(tmp_path: Path) -> None:
    """A restore records the stat of the large objects it hashed, and the
    next one copies an object whose stat is unchanged without reading it to
    hash; an object written since (same size, in place) is hashed again."""
    team = tmp_path / "team-cache"
    doit_ok(project(tmp_path, "a", folder_cache(tmp_path), body=BIG))
    (entry,) = entries(team)
    sha = hashlib.sha256(b"x" * 3_000_000).hexdigest()
    for name in ("b", "c"):  # b hashes and records, c trusts the record
        root = project(tmp_path, name, folder_cache(tmp_path), body=BIG)
        done = doit_ok(root)
        assert restored(done) and run_count(root) == 0, show(done)
        assert (root / "out" / "big").read_bytes() == b"x" * 3_000_000
        assert sha in entry.with_name(entry.name + ".stats").read_text()
    with (team / "objects" / sha[:2] / sha).open("r+b") as obj:
        obj.write(b"y")
    root = project(tmp_path, "d", folder_cache(tmp_path), body=BIG)
    done = doit_ok(root)
    assert f"cache entry {entry.stem[:16]} in {team} is damaged" in done.stdout, show(done)
    assert not restored(done) and run_count(root) == 1
    assert (root / "out" / "big").read_bytes() == b"x" * 3_000_000


ONE_FILE = """
def task_make():
    yield from remote_step("make", shell="printf one > one", outputs=["one"])
"""


def test_a_restored_file_output_is_not_hashed_again_by_the_next_check(tmp_path: Path) -> None:
    """The promotion renames a restored file into place, which gives it a new
    ctime: its hash cache entry takes that ctime, so the next check (a no-op
    doit, keeping the restore in the local folder) reads none of its bytes."""
    doit_ok(project(tmp_path, "a", folder_cache(tmp_path), body=ONE_FILE))
    root = project(tmp_path, "b", folder_cache(tmp_path), body=ONE_FILE)
    done = doit_ok(root)
    assert restored(done), show(done)
    st = (root / "one").lstat()
    cache = json.loads((root / ".substrax" / "cache" / "make.outputs.json").read_text())["entries"]
    sha = hashlib.sha256(b"one").hexdigest()
    stat_values, digest = remote_manifest.record_values(bytes.fromhex(cache["one"]))
    assert (stat_values, digest) == ([st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev], sha)


def test_read_mode_never_writes_the_shared_store(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    root = project(tmp_path, "a", f'shared = "file://{shared}"\nmode = "read"\n')
    doit_ok(root)
    assert list(shared.iterdir()) == []
    assert len(entries(tmp_path / "a" / "xdg-cache")) == 0  # XDG_CACHE_HOME is the test's, not the project's
    done = compute(root, "cache", "push", "make")
    assert done.returncode == 0, show(done)  # push is the explicit way to write it
    assert len(entries(shared)) == 1 and "make: pushed (1 new objects)" in done.stdout, show(done)  # one pack
    again = compute(root, "cache", "push", "--all")  # objects the store holds are not sent again
    assert again.returncode == 0 and "make: pushed (0 new objects)" in again.stdout, show(again)


def _dead_endpoint() -> str:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_an_unreachable_store_degrades_to_running_with_one_warning(s3_env: S3Server, tmp_path: Path) -> None:
    body = BODY + BODY.replace("make", "make2").replace("out/", "out2/").replace('"out2/"]', '"out2/"]')
    root = project(tmp_path, "a", f'shared = "s3://{s3_env.bucket}/dead"\nmode = "readwrite"\n', body=body)
    env = {"AWS_ENDPOINT_URL": _dead_endpoint(), "AWS_MAX_ATTEMPTS": "1"}
    done = doit_ok(root, "make", "make2", env=env)
    assert run_count(root) == 2
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning: the cache store")]
    assert len(warnings) == 1 and f"s3://{s3_env.bucket}/dead" in warnings[0], show(done)


def test_two_clones_share_an_s3_store(s3_env: S3Server, tmp_path: Path) -> None:
    prefix = f"s3://{s3_env.bucket}/team-{tmp_path.name}"
    first = project(tmp_path, "a", f'path = "{tmp_path}/cache-a"\nshared = "{prefix}"\nmode = "readwrite"\n')
    doit_ok(first)
    second = project(tmp_path, "b", f'path = "{tmp_path}/cache-b"\nshared = "{prefix}"\n')
    done = doit_ok(second)
    assert "restored from cache entry" in done.stdout and prefix in done.stdout, show(done)
    assert run_count(second) == 0
    assert tree_files(second / "out") == tree_files(first / "out")
    status = compute(second, "cache", "status")
    assert "this project: 1 hits, 0 misses" in status.stdout, show(status)
    # the hit filled b's local folder, entry as it came: a third clone on it
    # restores with the store unreachable
    came = [p.read_bytes() for p in entries(tmp_path / "cache-a")]
    assert [p.read_bytes() for p in entries(tmp_path / "cache-b")] == came
    third = project(tmp_path, "c", f'path = "{tmp_path}/cache-b"\nshared = "s3://{s3_env.bucket}/dead"\n')
    done = doit_ok(third, env={"AWS_ENDPOINT_URL": _dead_endpoint(), "AWS_MAX_ATTEMPTS": "1"})
    assert "restored from cache entry" in done.stdout and f"{tmp_path}/cache-b" in done.stdout, show(done)
    assert tree_files(third / "out") == tree_files(first / "out")


PARTS = """
def task_make():
    yield from remote_step("make", shell="mkdir -p out && head -c 41943040 /dev/urandom > out/big",
                           outputs=["out/"])
"""
MIB = 1 << 20


def _flipped(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :]


# An object of 40 MiB: parts of 16, 16 and 8 MiB. Changed through the S3
# server, as another client would: rclone lists the size it last saw, so a
# file grown behind its back was read at its old size (whole and right).
S3_TAMPERING: dict[str, Callable[[bytes], bytes]] = {
    "middle-part-changed": lambda data: _flipped(data, 20 * MIB),
    "truncated": lambda data: data[: 20 * MIB],
    "grown": lambda data: data + b"more",
}


@pytest.mark.parametrize("how", list(S3_TAMPERING))
def test_a_big_object_damaged_in_an_s3_store_is_a_damaged_entry(
    s3_env: S3Server, tmp_path: Path, how: str
) -> None:
    """An object downloaded as parts and hashed as they arrive: a change in
    any part, or a size other than listed, is found; nothing is promoted."""
    prefix = f"team-{tmp_path.name}"
    shared = f'shared = "s3://{s3_env.bucket}/{prefix}"\nmode = "readwrite"\n'
    doit_ok(project(tmp_path, "a", f'path = "{tmp_path}/cache-a"\n{shared}', body=PARTS))
    (objects,) = [o for o in (s3_env.data_dir / s3_env.bucket / prefix / "objects").rglob("*") if o.is_file()]
    key = f"{s3_env.bucket}/{objects.relative_to(s3_env.data_dir / s3_env.bucket)}"
    fs = s3_env.filesystem()
    fs.pipe_file(key, S3_TAMPERING[how](fs.cat_file(key)))
    second = project(tmp_path, "b", f'path = "{tmp_path}/cache-b"\n{shared}', body=PARTS)
    done = doit_ok(second)
    assert f"in s3://{s3_env.bucket}/{prefix} is damaged" in done.stdout, show(done)
    assert "warning: the cache store" not in done.stderr, show(done)
    assert not restored(done) and run_count(second) == 1
    assert hashlib.sha256((second / "out" / "big").read_bytes()).hexdigest() != objects.name
    assert not list((tmp_path / "cache-b").rglob(objects.name))  # nothing of it kept


def _keypair(folder: Path, name: str) -> Path:
    key = folder / name
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(key)], check=True)
    return key


@pytest.mark.parametrize("signed_by", ["listed", "unlisted", "nobody"])
def test_allowed_signers_restore_only_entries_signed_by_a_listed_key(tmp_path: Path, signed_by: str) -> None:
    listed, unlisted = _keypair(tmp_path, "listed"), _keypair(tmp_path, "unlisted")
    signers = tmp_path / "allowed_signers"
    signers.write_text(f"ci@team {(tmp_path / 'listed.pub').read_text()}")
    shared = tmp_path / "shared"
    signing = {"listed": f'signing_key = "{listed}"\n', "unlisted": f'signing_key = "{unlisted}"\n'}
    writer = f'shared = "file://{shared}"\nmode = "readwrite"\npath = "{tmp_path}/cache-a"\n'
    doit_ok(project(tmp_path, "a", writer + signing.get(signed_by, "")))
    reader = f'shared = "file://{shared}"\npath = "{tmp_path}/cache-b"\nallowed_signers = "{signers}"\n'
    second = project(tmp_path, "b", reader)
    done = doit_ok(second)
    if signed_by == "listed":
        assert restored(done) and run_count(second) == 0, show(done)
        return
    assert not restored(done) and run_count(second) == 1, show(done)
    key = entries(shared)[0].stem[:16]
    assert f"refused cache entry {key} in file://{shared}" in done.stdout
    # `why` promises no restore a signature refuses (a third clone, nothing local)
    third = project(tmp_path, "c", reader.replace("cache-b", "cache-c"))
    assert "not up to date" in (why := compute(third, "why", "make").stdout) and "restored" not in why
    fingerprint = subprocess.run(["ssh-keygen", "-lf", f"{unlisted}.pub"], capture_output=True, text=True,
                                 check=True).stdout.split()[1]  # fmt: skip
    assert (fingerprint if signed_by == "unlisted" else "it is not signed") in done.stdout, show(done)


def test_a_noop_doit_does_not_consult_the_cache(s3_env: S3Server, tmp_path: Path) -> None:
    root = project(tmp_path, "a", f'shared = "s3://{s3_env.bucket}/noop-{tmp_path.name}"\n')
    doit_ok(root)
    stats = (root / ".substrax/cache/run-cache.json").read_text()
    env = {"AWS_ENDPOINT_URL": _dead_endpoint(), "AWS_MAX_ATTEMPTS": "1"}
    done = doit_ok(root, env=env)
    assert not step_ran(done, "make") and "warning" not in done.stderr, show(done)
    assert (root / ".substrax/cache/run-cache.json").read_text() == stats


def test_cache_forget_removes_the_entry_and_status_counts(tmp_path: Path) -> None:
    root = project(tmp_path, "a", folder_cache(tmp_path))
    doit_ok(root)
    status = compute(root, "cache", "status")
    assert "1 entries" in status.stdout and "0 hits, 1 misses" in status.stdout, show(status)
    done = compute(root, "cache", "forget", "make")
    assert done.returncode == 0 and "entry removed" in done.stdout, show(done)
    assert entries(tmp_path / "team-cache") == []
    shutil.rmtree(root / "out")
    assert not restored(doit_ok(root)) and run_count(root) == 2


def test_gc_keeps_running_and_unfetched_runs_and_removes_what_dry_run_listed(tmp_path: Path) -> None:
    root = project(tmp_path, "a", folder_cache(tmp_path))
    doit_ok(root)
    doit_ok(root, "-a", "make")  # the first run's manifest is now no step record's
    api = Project.open(root)
    running = submit(api, ["sh", "-c", "sleep 60"], step="slow")
    unfetched = submit(api, ["sh", "-c", "mkdir -p res && echo x > res/f"], step="quick", outputs=["res/"])
    wait_final(api, unfetched)

    def listing(folder: Path) -> list[str]:  # status.reserve: the worker removes it as it exits, maybe now
        return sorted(p.name for p in folder.iterdir() if p.name != "status.reserve")

    try:
        kept = {d.name: listing(d) for d in run_dirs(root)}
        listed = compute(root, "gc", "--dry-run")
        assert listed.returncode == 0, show(listed)
        would = [line.removeprefix("would remove ") for line in listed.stdout.splitlines()]
        assert would and all(running.run_id not in w and unfetched.run_id not in w for w in would), would
        old = next(h for h in handles(root) if h["step"] == "make")["run_id"]
        assert any(w.endswith(f"{old}/manifest.json") for w in would)
        assert {d.name: listing(d) for d in run_dirs(root)} == kept  # nothing went
        done = compute(root, "gc")
        assert [line.removeprefix("removed ") for line in done.stdout.splitlines()] == would, show(done)
        for d in run_dirs(root):
            assert (d / "handle.json").exists() and (d / "run.log").exists()
        for handle in (running, unfetched):
            assert listing(run_dir(api, handle)) == kept[handle.run_id]
        assert "up to date" in compute(root, "why", "make").stdout
    finally:
        api.backend_for(running).cancel(running)


def test_gc_older_than_drops_entries_not_used_for_that_long(tmp_path: Path) -> None:
    root = project(tmp_path, "a", folder_cache(tmp_path))
    doit_ok(root)
    (entry,) = entries(tmp_path / "team-cache")
    objects = sorted((tmp_path / "team-cache" / "objects").rglob("*"))
    kept = compute(root, "gc", "--older-than", "1")
    assert kept.returncode == 0 and "cache entry" not in kept.stdout, show(kept)  # used just now
    month_ago = entry.stat().st_mtime - 31 * 86400
    os.utime(entry, (month_ago, month_ago))
    listed = compute(root, "gc", "--older-than", "30", "--dry-run")
    assert f"would remove cache entry {entry.stem[:16]}" in listed.stdout, show(listed)
    assert entry.exists()
    done = compute(root, "gc", "--older-than", "30")
    assert f"removed cache entry {entry.stem[:16]}" in done.stdout, show(done)
    assert not entry.exists() and not any(p.is_file() for p in objects if p.exists())
    bad = compute(root, "gc", "--older-than", "soon")
    assert bad.returncode == 2 and "'soon' is not a number of days" in bad.stderr, show(bad)


# ------------------------------------------------- outputs carry no privileges

TOOL = """
def task_make():
    yield from remote_step("make", shell="mkdir -p out/d && echo tool > out/tool && printf x > out/d/x",
                           outputs=["out/"])
"""
PRIVILEGED = {"out/tool": 0o6755, "out/d": 0o1777, "out/d/x": 0o4777}


def _make_entry_privileged(entry_file: Path, objects: Path) -> None:
    """Rewrite an entry as a writer of the store could: its manifest gives
    setuid, sticky and world-writable modes (its digest taken again, so the
    entry is whole), and its objects get them too."""
    from substrax_tasks._remote import manifest as remote_manifest

    entry = json.loads(entry_file.read_text())
    manifest = entry["manifest"]
    for item in manifest["entries"]:
        item["mode"] = PRIVILEGED.get(item["path"], item["mode"])
    for pack in entry["packs"]:
        (objects / pack["sha256"][:2] / pack["sha256"]).chmod(0o6755)
    manifest["digest"] = remote_manifest.entries_digest(manifest["entries"])
    entry_file.write_text(json.dumps(entry))


def assert_restored_without_privileges(root: Path, done: subprocess.CompletedProcess[str]) -> None:
    assert restored(done) and run_count(root) == 0, show(done)
    assert unsafe_modes(root, ["out"]) == {}, show(done)
    modes = {rel: (root / rel).stat().st_mode & 0o7777 for rel in PRIVILEGED}
    assert modes == {"out/tool": 0o755, "out/d": 0o775, "out/d/x": 0o775}
    assert (root / "out" / "tool").read_text() == "tool\n"
    again = doit_ok(root)
    assert not step_ran(again, "make"), show(again)
    assert "up to date" in compute(root, "why", "make").stdout


def test_an_entry_whose_modes_and_objects_are_setuid_restores_without_those_bits(tmp_path: Path) -> None:
    team = tmp_path / "team-cache"
    doit_ok(project(tmp_path, "a", folder_cache(tmp_path), body=TOOL))
    _make_entry_privileged(entries(team)[0], team / "objects")
    second = project(tmp_path, "b", folder_cache(tmp_path), body=TOOL)
    assert_restored_without_privileges(second, doit_ok(second))


def test_an_s3_entry_whose_modes_are_setuid_restores_without_those_bits(
    s3_env: S3Server, tmp_path: Path
) -> None:
    prefix = f"team-{tmp_path.name}"
    shared = f'shared = "s3://{s3_env.bucket}/{prefix}"\nmode = "readwrite"\n'
    doit_ok(project(tmp_path, "a", f'path = "{tmp_path}/cache-a"\n{shared}', body=TOOL))
    store = s3_env.data_dir / s3_env.bucket / prefix
    _make_entry_privileged(entries(store)[0], store / "objects")
    second = project(tmp_path, "b", f'path = "{tmp_path}/cache-b"\n{shared}', body=TOOL)
    assert_restored_without_privileges(second, doit_ok(second))


# ------------------------------------------------- the local folder: read-only, or not yours

needs_root_for_mounts = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="READ-ONLY CACHE FOLDER NOT TESTED: a read-only bind mount needs root and unshare "
    "(CI runs as root)",
)
READ_ONLY_MOUNT = 'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" "$0" && exec "$@"'


@needs_root_for_mounts
def test_a_read_only_cache_folder_restores_and_says_once_it_cannot_store(tmp_path: Path) -> None:
    """On a read-only mount (root cannot write it either), a hit is restored
    all the same; the steps that run say once, together, that they are not kept."""
    team = tmp_path / "team-cache"
    doit_ok(project(tmp_path, "a", folder_cache(tmp_path)))
    before = sorted(str(p.relative_to(team)) for p in team.rglob("*"))
    body = BODY + "".join(BODY.replace('"make"', f'"make{n}"').replace("make()", f"make{n}()")
                          .replace("out/", f"out{n}/") for n in (2, 3))  # fmt: skip
    second = project(tmp_path, "b", folder_cache(tmp_path), body=body)
    done = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", READ_ONLY_MOUNT, str(team),
         str(Path(sys.executable).parent / "doit"), "make", "make2", "make3"],
        cwd=second, env=clean_env(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, show(done)
    assert restored(done) and run_count(second) == 2, show(done)
    assert (second / "out" / "res.txt").read_bytes() == b"hello\nhello\n"
    notes = [line for line in done.stderr.splitlines() if "cannot be written" in line]
    assert len(notes) == 1 and str(team) in notes[0] and "restored from it" in notes[0], show(done)
    assert "warning" not in done.stderr, show(done)
    assert sorted(str(p.relative_to(team)) for p in team.rglob("*")) == before


def _unused_uid() -> int:
    import pwd

    used = {user.pw_uid for user in pwd.getpwall()}
    return next(uid for uid in range(42420, 50000) if uid not in used)


FOREIGN: dict[str, Callable[[Path], object]] = {
    "folder-of-another-uid": lambda team: os.chown(team, _unused_uid(), -1),
    "folder-mode-0777": lambda team: team.chmod(0o777),
    "entries-group-writable": lambda team: (team / "entries").chmod(0o770),
    "entry-of-another-uid": lambda team: os.chown(entries(team)[0], _unused_uid(), -1),
    "pack-world-writable": lambda team: _res_pack(team).chmod(0o646),
}


@pytest.mark.parametrize("how", list(FOREIGN))
def test_a_cache_folder_another_user_could_write_is_refused_and_the_step_runs(
    tmp_path: Path, how: str
) -> None:
    team = tmp_path / "team-cache"
    doit_ok(project(tmp_path, "a", folder_cache(tmp_path)))
    FOREIGN[how](team)
    second = project(tmp_path, "b", folder_cache(tmp_path))
    done = doit_ok(second)
    assert not restored(done) and run_count(second) == 1, show(done)
    assert (second / "out" / "res.txt").read_bytes() == b"hello\nhello\n"
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, show(done)
    assert f"the cache folder {team} is not used" in warnings[0], show(done)
    assert "chown -R" in warnings[0] and "chmod -R go-w" in warnings[0] and "path" in warnings[0], show(done)
    assert len(entries(team)) == 1  # nothing stored in it either


def test_a_cache_folder_made_under_umask_002_is_still_yours_alone(tmp_path: Path) -> None:
    """Folders and files of the local folder are made 0700 and 0600 whatever
    the umask: one group-writable by its umask would be refused next time."""
    first = project(tmp_path, "a", folder_cache(tmp_path))
    doit_argv = [str(Path(sys.executable).parent / "doit")]
    done = subprocess.run(["sh", "-c", 'umask 002 && exec "$0"', *doit_argv], cwd=first, env=clean_env(),
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0 and run_count(first) == 1, show(done)
    team = tmp_path / "team-cache"
    assert unsafe_modes(team.parent, ["team-cache"]) == {}
    assert not [p for p in team.rglob("*") if p.stat().st_mode & 0o077 and not p.is_dir()]
    done = doit_ok(project(tmp_path, "b", folder_cache(tmp_path)))
    assert restored(done) and "warning" not in done.stderr, show(done)

def old_entries(folder: Path, count: int, size: int) -> list[Path]:
    """`count` entries of one `size`-byte object each in the cache `folder`,
    a day old and older (the first trimmed), as another project kept them."""
    made = []
    for i in range(count):
        data = f"entry {i}\n".encode().ljust(size, b".")
        digest = hashlib.sha256(data).hexdigest()
        obj = folder / "objects" / digest[:2] / digest
        obj.parent.mkdir(parents=True, exist_ok=True)
        obj.write_bytes(data)
        key = hashlib.sha256(f"key {i}".encode()).hexdigest()
        manifest = {"digest": digest, "entries": [{"path": "o.txt", "type": "file", "sha256": digest,
                                                   "size": size, "mode": 0o644}]}  # fmt: skip
        entry = folder / "entries" / f"{key}.json"
        entry.parent.mkdir(parents=True, exist_ok=True)
        entry.write_text(json.dumps({"version": 1, "key": key, "step": f"other{i}", "outputs": ["o.txt"],
                                     "manifest": manifest, "provenance": {}}))  # fmt: skip
        when = time.time() - 86400 * (count + 1 - i)
        for path in (obj, entry):
            os.utime(path, (when, when))
        made.append(entry)
    return made


def account(folder: Path) -> int:
    return int(json.loads((folder / "size.json").read_text())["bytes"])


def cache_bytes(folder: Path) -> int:
    """The disk the objects and the entries' files take (their blocks): what the account counts."""
    files = [*(folder / "objects").rglob("*"), *(folder / "entries").rglob("*")]
    return sum(p.stat().st_blocks * 512 for p in files if p.is_file())


def test_keeping_a_run_reads_the_account_not_the_other_entries(tmp_path: Path) -> None:
    """The size of the cache folder (user-wide) is a running account: keeping
    a run adds its objects to it and reads no other entry. Only when the
    account says the folder is over max_size is it trimmed (reading every
    entry once), below max_size, the oldest first, and the account made exact."""
    folder = tmp_path / "team-cache"
    others = old_entries(folder, 50, 1000)
    old = cache_bytes(folder)
    block = old // 50  # what one entry takes on disk: its object of 1,000 bytes and its JSON
    (folder / "size.json").write_text(json.dumps({"version": 3, "bytes": 0}))  # says: nearly empty
    root = project(tmp_path, "a", folder_cache(tmp_path) + f"max_size = {20 * block}\n")
    doit_ok(root)
    assert len(entries(folder)) == 51  # the 50 objects the account does not know were not looked for
    grown = account(folder)
    assert grown == cache_bytes(folder) - old > 0 and all(p.exists() for p in others)  # the new run's only
    (folder / "size.json").write_text(json.dumps({"version": 3, "bytes": old + grown}))  # the truth
    doit_ok(root, "-a", "make")  # over 20 entries' worth: trimmed to 18, the oldest first
    left = [p for p in others if p.exists()]
    assert left == others[-(len(left)):] and 15 <= len(left) <= 17, len(left)
    assert account(folder) == cache_bytes(folder) <= 18 * block
    (folder / "size.json").write_text("{damaged")
    shutil.rmtree(root / "out")
    assert restored(doit_ok(root))
    cached = entries(folder)
    doit_ok(root, "-a", "make")  # a damaged account is counted again
    assert account(folder) == cache_bytes(folder) and entries(folder) == cached


# Steps whose outputs are copied into the cache at once: 2 MB each, all different.
MANY_CACHED = """
NAMES = ["m%02d" % i for i in range(32)]

def task_many():
    for name in NAMES:
        yield from remote_step(name, shell="head -c 2000000 /dev/urandom > out/%s.bin" % name,
                               outputs=["out/%s.bin" % name])
"""


def test_threads_keeping_runs_at_once_never_say_one_was_not_kept(tmp_path: Path) -> None:
    """A trim running while other threads copy objects in does not mistake
    their part files for objects ("could not keep run ... No such file")."""
    folder = tmp_path / "team-cache"
    old_entries(folder, 1000, 100)  # a trim that reads them all leaves a wide window
    names = [f"m{i:02d}" for i in range(32)]
    (tmp_path / "a").mkdir()
    root = make_project(tmp_path / "a", MANY_CACHED, default_tasks=names)
    cache = f"[tool.substrax.compute.cache]\n{folder_cache(tmp_path)}max_size = 40000000\n"
    write_pyproject(root, cache=cache)
    done = doit_ok(root, "-n", "8", "-P", "thread")
    assert "could not keep" not in done.stdout + done.stderr, show(done)
    kept = [json.loads(p.read_text())["step"] for p in entries(folder)]
    assert len(kept) >= 10 and set(kept) <= set(names), kept  # trimmed from 40 MB, the old ones first
    assert account(folder) == cache_bytes(folder) <= 40_000_000


def test_substrax_cache_off_neither_restores_nor_keeps_and_a_bad_value_is_refused(tmp_path: Path) -> None:
    """What `make remote-run` sets: the step runs for real whatever the cache
    holds, `why` does not promise a restore, and the entry stays the first run's."""
    root = project(tmp_path, "a", folder_cache(tmp_path))
    doit_ok(root)
    (entry,) = entries(tmp_path / "team-cache")
    kept = entry.read_bytes()
    shutil.rmtree(root / "out")
    doit_ok(root, "forget", "make")
    off = {"SUBSTRAX_CACHE": "off"}
    why = compute(root, "why", "make", env=off)
    assert why.returncode == 0 and "not up to date" in why.stdout and "restored" not in why.stdout, show(why)
    done = doit_ok(root, env=off)
    assert not restored(done) and step_ran(done, "make") and run_count(root) == 2, show(done)
    assert entry.read_bytes() == kept  # not replaced: nothing kept either
    assert "off here (SUBSTRAX_CACHE=off)" in compute(root, "cache", "status", env=off).stdout
    shutil.rmtree(root / "out")
    bad = doit(root, env={"SUBSTRAX_CACHE": "no"})
    said = bad.stdout + bad.stderr
    assert bad.returncode != 0 and "SUBSTRAX_CACHE='no' is not understood" in said, show(bad)
    assert run_count(root) == 2  # nothing launched


TWO_STEPS = """
def task_two():
    for name in ("one", "two"):
        yield from remote_step(name, shell="printf %s > out/%s.txt" % (name, name),
                               outputs=["out/%s.txt" % name])
"""

INTRODUCED = "note: verified runs are kept in the run cache"


def test_the_first_store_says_where_the_cache_is_once_per_project(tmp_path: Path) -> None:
    cache = folder_cache(tmp_path) + 'max_size = "3GiB"\n'
    root = project(tmp_path, "a", cache, body=TWO_STEPS)
    done = doit_ok(root, "-n", "2", "-P", "thread", "one", "two")
    said = [line for line in done.stdout.splitlines() if INTRODUCED in line]
    assert len(entries(tmp_path / "team-cache")) == 2
    assert len(said) == 1, show(done)
    assert f"{tmp_path / 'team-cache'}" in said[0] and "max_size 3.0 GiB" in said[0], said
    assert "enabled = false" in said[0] and "SUBSTRAX_CACHE=off" in said[0], said
    again = doit_ok(root, "-a", "one", "two")  # stored again: not said again
    assert step_ran(again, "one") and INTRODUCED not in again.stdout, show(again)
    # another project on the same folder restores: its first use, said there once
    other = project(tmp_path, "b", cache, body=TWO_STEPS)
    done = doit_ok(other, "one", "two")
    assert restored(done) and done.stdout.count(INTRODUCED) == 1, show(done)


def test_a_restore_or_a_run_into_a_folder_output_names_the_extra_files_it_removes(tmp_path: Path) -> None:
    """A folder output is replaced whole: a file here that the restored (or
    fetched) outputs lack goes with the old folder, and one line names it,
    as `why` names it before."""
    doit_ok(project(tmp_path, "a", folder_cache(tmp_path)))
    second = project(tmp_path, "b", folder_cache(tmp_path))
    (second / "out" / "notes").mkdir(parents=True)
    (second / "out" / "notes.txt").write_text("mine\n")
    (second / "out" / "notes" / "a.txt").write_text("mine too\n")
    (second / "out" / "sub").mkdir()
    (second / "out" / "sub" / "x").write_text("the entry's own name: replaced, not extra\n")
    done = doit_ok(second)
    assert restored(done), show(done)
    said = [line for line in done.stdout.splitlines() if "removed out/" in line]
    assert len(said) == 1, show(done)
    assert "removed out/notes.txt, out/notes/: not among the outputs of cache entry" in said[0], said
    assert "out/sub" not in said[0] and not (second / "out" / "notes.txt").exists()
    # a run (a fetch promoted) says it the same way; a run with nothing extra says nothing
    (second / "out" / "stray.log").write_text("left here\n")
    (second / "data" / "in.txt").write_text("other\n")
    done = doit_ok(second)
    assert not restored(done) and "make: removed out/stray.log: not among the outputs of run " in done.stdout
    shutil.rmtree(second / "out")
    done = doit_ok(second)
    assert restored(done) and "removed " not in done.stdout, show(done)
