"""Small files packed in the cache (cache/packs.py), through the real `doit`
and `substrax-compute`: what an entry of many small files takes on disk,
restores byte for byte, damaged and re-signed packs, entries made before
packs, and threads and processes storing and restoring at once."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

from cache_parts import entries, folder_cache, restored
from dodo_helpers import (
    compute,
    doit_ok,
    make_project,
    popen_doit,
    popen_output,
    run_count,
    show,
    step_ran,
    stop,
    write_pyproject,
)
from progress import wait_exit

# 3,000 files of 10 bytes, all different, and one of 100 KiB (not packed)
SMALL = """
def task_small():
    yield from remote_step("small", outputs=["out/"], shell=(
        "mkdir -p out/d && for i in $(seq 3000); do printf %010d $i > out/d/f$i; done "
        "&& head -c 102400 /dev/zero | tr '\\\\0' b > out/big && printf same > out/a && printf same > out/b"))
"""
FILES = 3000


def project(tmp_path: Path, name: str, cache: str, body: str = SMALL, default: str = "small") -> Path:
    (tmp_path / name).mkdir()
    root = make_project(tmp_path / name, body, default_tasks=[default])
    write_pyproject(root, cache="[tool.substrax.compute.cache]\n" + cache)
    return root


def disk_use(folder: Path) -> int:
    return sum(p.lstat().st_blocks * 512 for p in folder.rglob("*") if p.is_file())


def cache_use(folder: Path) -> int:
    """All the disk a cache folder takes: its objects and its entries' files
    (manifests, logs, stats), as the account, `cache status` and max_size count it."""
    return disk_use(folder / "objects") + disk_use(folder / "entries")


def apparent(folder: Path) -> int:
    return sum(p.lstat().st_size for p in folder.rglob("*") if p.is_file())


def files_of(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def account(folder: Path) -> int:
    return int(json.loads((folder / "size.json").read_text())["bytes"])


def test_many_small_files_take_about_their_own_bytes_in_the_cache_and_restore_whole(tmp_path: Path) -> None:
    """3,000 files of 10 bytes take a block each in the project (12 MB on
    ext4 or tmpfs) but one pack in the cache: its objects take at most twice
    the files' bytes plus a block or two; the 100 KiB file stays an object of
    its own. `cache status` and the account count the pack's disk use and
    the entry's (its manifest of 3,000 files takes more than the pack), and
    a second clone restores every byte."""
    folder = tmp_path / "team-cache"
    root = project(tmp_path, "a", folder_cache(tmp_path))
    doit_ok(root)
    small = [p for p in (root / "out").rglob("*") if p.is_file() and p.stat().st_size < 64 << 10]
    small_bytes = sum(p.stat().st_size for p in small)
    assert len(small) == FILES + 2 and disk_use(root / "out") >= FILES * 512  # a sector each, at least
    (entry,) = entries(folder)
    packs = json.loads(entry.read_text())["packs"]
    assert sum(pack["count"] for pack in packs) == FILES + 1  # out/a and out/b: one member
    objects = sorted(p for p in (folder / "objects").rglob("*") if p.is_file())
    assert len(objects) == len(packs) + 1, objects  # the packs and out/big
    big = hashlib.sha256(b"b" * 102400).hexdigest()
    assert big in {p.name for p in objects}
    packed_disk = disk_use(folder / "objects") - (folder / "objects" / big[:2] / big).stat().st_blocks * 512
    assert packed_disk <= 2 * small_bytes + 8192, (packed_disk, small_bytes)
    status = compute(root, "cache", "status")
    shown = status.stdout.split("1 entries, ", 1)[1].split(" on disk", 1)[0]
    number, unit = shown.split()
    reported = float(number) * {"B": 1, "KiB": 1024, "MiB": 1 << 20, "GiB": 1 << 30}[unit]
    assert disk_use(folder / "entries") > disk_use(folder / "objects")  # the manifest: ~150 bytes a file
    assert abs(reported - cache_use(folder)) <= 0.001 * reported + 51, show(status)
    assert account(folder) == cache_use(folder)
    second = project(tmp_path, "b", folder_cache(tmp_path))
    done = doit_ok(second)
    assert restored(done) and run_count(second) == 0, show(done)
    assert files_of(second / "out") == files_of(root / "out")
    assert doit_ok(second).stdout.count("-- small") == 1  # and up to date at once: nothing hashed wrong


def test_max_size_counts_a_pack_by_its_disk_use(tmp_path: Path) -> None:
    """A max_size of 1 MiB keeps the entry (its pack and its 100 KiB file),
    which took 12 MB as one object per file; one of 64 KiB trims it. The
    account stays what the folder holds."""
    roomy = f'path = "{tmp_path / "roomy"}"\nmax_size = "1MiB"\n'
    root = project(tmp_path, "a", roomy)
    done = doit_ok(root)
    assert step_ran(done, "small") and len(entries(tmp_path / "roomy")) == 1, show(done)
    assert account(tmp_path / "roomy") == cache_use(tmp_path / "roomy") <= 1 << 20
    tight = f'path = "{tmp_path / "tight"}"\nmax_size = "64KiB"\n'
    other = project(tmp_path, "b", tight)
    done = doit_ok(other)
    assert step_ran(done, "small") and entries(tmp_path / "tight") == [], show(done)
    assert account(tmp_path / "tight") == cache_use(tmp_path / "tight") <= 64 << 10


def test_max_size_counts_the_entries_manifests_too(tmp_path: Path) -> None:
    """The entry of 3,000 files names each in its manifest (~450 KB) where
    its pack and its 100 KiB file take ~150 KB: a max_size of 320 KiB, which
    the objects alone fit in, trims it; `cache status` and the account count
    both, and a later entry that fits pushes out an older one past max_size."""
    tight = f'path = "{tmp_path / "tight"}"\nmax_size = "320KiB"\n'
    root = project(tmp_path, "a", tight)
    done = doit_ok(root)
    folder = tmp_path / "tight"
    assert step_ran(done, "small") and entries(folder) == [], show(done)
    assert account(folder) == cache_use(folder) <= 320 << 10
    assert "0 entries" in compute(root, "cache", "status").stdout
    # One entry of 1,500 files fits (~220 KB with its manifest); a second does not beside it.
    half = SMALL.replace("seq 3000", "seq 1500").replace("head -c 102400", "head -c 1024")
    first = project(tmp_path, "b", tight, body=half)
    doit_ok(first)
    (kept,) = entries(folder)
    second = project(tmp_path, "c", tight, body=half.replace("printf same", "printf other"))
    doit_ok(second)
    (left,) = entries(folder)
    assert left != kept and account(folder) == cache_use(folder) <= 320 << 10


def _as_made_before_packs(folder: Path) -> None:
    """Rewrite the entry as a release before packs kept it: version 1, no
    `packs`, one object per file (its packs left behind, named by no entry)."""
    path = entries(folder)[0]
    entry = json.loads(path.read_text())
    objects = folder / "objects"
    data = b"".join((objects / p["sha256"][:2] / p["sha256"]).read_bytes() for p in entry.pop("packs"))
    offset, seen, below = 0, set(), entry.pop("pack_below")
    for item in entry["manifest"]["entries"]:  # the packed files: each small one once, in order
        if item["type"] != "file" or item["size"] >= below or item["sha256"] in seen:
            continue
        seen.add(digest := item["sha256"])
        obj = folder / "objects" / digest[:2] / digest
        obj.parent.mkdir(mode=0o700, exist_ok=True)
        obj.write_bytes(data[offset : offset + item["size"]])
        obj.chmod(0o600)
        offset += item["size"]
    assert offset == len(data)
    entry["version"] = 1
    path.write_text(json.dumps(entry, sort_keys=True, separators=(",", ":")))


def test_an_entry_made_before_packs_still_restores(tmp_path: Path) -> None:
    root = project(tmp_path, "a", folder_cache(tmp_path))
    doit_ok(root)
    _as_made_before_packs(tmp_path / "team-cache")
    second = project(tmp_path, "b", folder_cache(tmp_path))
    done = doit_ok(second)
    assert restored(done) and run_count(second) == 0, show(done)
    assert files_of(second / "out") == files_of(root / "out")


def _keypair(folder: Path, name: str) -> Path:
    key = folder / name
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(key)], check=True)
    return key


def _repacked(shared: Path) -> None:
    """A writer of the store swaps the entry's pack for one of its choosing,
    and the entry's listing of it too: the entry is whole, its signature not."""
    path = entries(shared)[0]
    entry = json.loads(path.read_text())
    pack = entry["packs"][0]
    old = shared / "objects" / pack["sha256"][:2] / pack["sha256"]
    data = old.read_bytes().replace(b"0000000001", b"0000000666", 1)
    digest = hashlib.sha256(data).hexdigest()
    new = shared / "objects" / digest[:2] / digest
    new.parent.mkdir(exist_ok=True)
    new.write_bytes(data)
    pack["sha256"] = digest
    path.write_text(json.dumps(entry, sort_keys=True, separators=(",", ":")))


def test_a_signed_entry_whose_pack_is_damaged_or_swapped_is_refused(tmp_path: Path) -> None:
    """In a shared store read with allowed_signers: a pack changed in place is
    a damaged entry (its members are hashed as they are written out); a pack
    swapped with the entry's listing of it breaks the signature. Neither is
    promoted; the step runs."""
    listed = _keypair(tmp_path, "listed")
    signers = tmp_path / "allowed_signers"
    signers.write_text(f"ci@team {(tmp_path / 'listed.pub').read_text()}")
    shared = tmp_path / "shared"
    writer = f'shared = "file://{shared}"\nmode = "readwrite"\npath = "{tmp_path}/cache-a"\n'
    writer += f'signing_key = "{listed}"\n'
    doit_ok(project(tmp_path, "a", writer))
    key = entries(shared)[0].stem[:16]
    _repacked(shared)
    reader = f'shared = "file://{shared}"\npath = "{tmp_path}/cache-b"\nallowed_signers = "{signers}"\n'
    second = project(tmp_path, "b", reader)
    done = doit_ok(second)
    assert f"refused cache entry {key} in file://{shared}" in done.stdout, show(done)
    assert not restored(done) and run_count(second) == 1
    assert (second / "out" / "d" / "f1").read_bytes() == b"0000000001"
    # now the pack itself, under its own name, and the entry untouched
    doit_ok(project(tmp_path, "c", writer.replace("cache-a", "cache-c")), "-a", "small")  # signed again
    pack = json.loads(entries(shared)[0].read_text())["packs"][0]
    obj = shared / "objects" / pack["sha256"][:2] / pack["sha256"]
    obj.write_bytes(obj.read_bytes().replace(b"0000000001", b"0000000666", 1))
    third = project(tmp_path, "d", reader.replace("cache-b", "cache-d"))
    done = doit_ok(third)
    assert f"cache entry {key} in file://{shared} is damaged" in done.stdout, show(done)
    assert not restored(done) and run_count(third) == 1
    assert (third / "out" / "d" / "f1").read_bytes() == b"0000000001"


# Eight steps of 500 small files each; steps 0-3 and 4-7 write the same
# files, so their packs are the same object, stored by two threads at once.
SWEEP = """
def task_sweep():
    for i in range(8):
        yield from remote_step("s%d" % i, outputs=["out/s%d/" % i], shell=(
            "mkdir -p out/s%d && for j in $(seq 500); do printf %%s-%%d %d $j > out/s%d/f$j; done"
            % (i, i // 4, i)))
"""
STEPS = [f"s{i}" for i in range(8)]


def _sweep(tmp_path: Path, name: str) -> Path:
    return project(tmp_path, name, folder_cache(tmp_path), body=SWEEP, default="s0")


def _outputs(root: Path) -> dict[str, bytes]:
    return files_of(root / "out")


def test_threads_store_and_restore_packs_at_once(tmp_path: Path) -> None:
    first = _sweep(tmp_path, "a")
    done = doit_ok(first, "-n", "4", "-P", "thread", *STEPS)
    assert all(step_ran(done, s) for s in STEPS) and "not kept" not in done.stdout, show(done)
    folder = tmp_path / "team-cache"
    assert len(entries(folder)) == 8
    packs = {p["sha256"] for e in entries(folder) for p in json.loads(e.read_text())["packs"]}
    assert len(packs) == 2  # one per distinct content: shared by four entries each
    assert account(folder) == cache_use(folder)
    second = _sweep(tmp_path, "b")
    done = doit_ok(second, "-n", "4", "-P", "thread", *STEPS)
    assert done.stdout.count("restored from cache entry") == 8 and run_count(second) == 0, show(done)
    assert _outputs(second) == _outputs(first)


def test_two_doits_storing_and_restoring_at_once_stay_correct(tmp_path: Path) -> None:
    """Two doit processes, each with four threads: one stores the sweep
    while the other stores or restores the same entries; both succeed, each
    output whole, the account what the folder holds, and a third restores all."""
    for parent in ("p1", "p2"):  # each doit's output files beside its project
        (tmp_path / parent).mkdir()
    first = project(tmp_path / "p1", "a", folder_cache(tmp_path), body=SWEEP, default="s0")
    second = project(tmp_path / "p2", "b", folder_cache(tmp_path), body=SWEEP, default="s0")
    procs = [popen_doit(root, "-n", "4", "-P", "thread", *STEPS) for root in (first, second)]
    try:
        codes = [wait_exit(proc, "the doit to end", 120) for proc in procs]
    finally:
        for proc in procs:
            stop(proc)
    said = [popen_output(root) for root in (first, second)]
    assert codes == [0, 0], said
    assert all("not kept" not in s and "damaged" not in s for s in said), said
    assert _outputs(first) == _outputs(second)
    folder = tmp_path / "team-cache"
    assert len(entries(folder)) == 8 and account(folder) == cache_use(folder)
    packs = {p["sha256"] for e in entries(folder) for p in json.loads(e.read_text())["packs"]}
    assert len(packs) == 2 and len(list((folder / "objects").rglob("*.part"))) == 0
    third = _sweep(tmp_path, "c")
    done = doit_ok(third, "-n", "4", "-P", "thread", *STEPS)
    assert done.stdout.count("restored from cache entry") == 8, show(done)
    assert _outputs(third) == _outputs(first)
