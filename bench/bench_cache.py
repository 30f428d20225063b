"""The cache of verified runs: a restore against a plain copy of the same bytes.

    .venv/bin/python bench/bench_cache.py [--size-mib 1024] [--files 20000] [--repeats 3]

A restore here is what `doit` does on a hit: the entry's objects copied (or
downloaded) into a staging folder, then verified against its manifest (every
byte hashed). Baselines: `cp --reflink=auto` of the object (local), `rclone
copy` of the object from the same S3 server (tests/s3_server.py: rclone
serve s3 on loopback), `cp -r --reflink=auto` of the 20,000-file tree, and
a no-op `doit` of 20 steps with the cache off. Interleaved, medians.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # s3_server
from _common import doit_argv, fmt_s, load_average, median, scratch_parent

from substrax_tasks import manifest_cache
from substrax_tasks._cache_store import Folder, Shared, object_path
from substrax_tasks.cache import _materialize


def make_store(folder: Path, tree: Path, outputs: list[str]) -> dict[str, Any]:
    """The objects of `tree` in `folder`; the manifest."""
    manifest = manifest_cache.build_manifest(tree, outputs)
    store = Folder(folder)
    files = [e for e in manifest["entries"] if e["type"] == "file"]
    store.put([(tree / e["path"], object_path(e["sha256"])) for e in files])
    return manifest


def restore(store: Folder | Shared, manifest: dict[str, Any], outputs: list[str], scratch: Path) -> None:
    staging = scratch / "staging"
    _materialize(store, manifest, staging)
    problems = manifest_cache.verify_outputs(staging, outputs, manifest, scratch / "hash-cache.json")
    assert not problems, problems
    shutil.rmtree(staging)
    (scratch / "hash-cache.json").unlink(missing_ok=True)


def timed(call: Callable[[], object], cleanup: Callable[[], object] = lambda: None) -> float:
    start = time.perf_counter()
    call()
    took = time.perf_counter() - start
    cleanup()
    return took


def pair(name: str, ours: Callable[[], object], base: Callable[[], object], cleanup: Callable[[], object],  # noqa: PLR0917
         repeats: int, goal: str, baseline: str) -> None:  # fmt: skip
    a: list[float] = []
    b: list[float] = []
    for _ in range(repeats):  # interleaved: a busier moment slows both
        a.append(timed(ours, cleanup))
        b.append(timed(base, cleanup))
    ratio = median(a) / median(b)
    print(f"| {name} | {fmt_s(median(a))} s | {baseline} {fmt_s(median(b))} s | {ratio:.2f}x | {goal} |")


def _rclone(rclone: str, remote: str, dest: Path) -> None:
    done = subprocess.run([rclone, "copyto", remote, str(dest)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def bench_noop(scratch: Path, repeats: int) -> None:
    body = "".join(
        f'    yield from remote_step("s{i}", shell="mkdir -p o{i} && echo {i} > o{i}/f", outputs=["o{i}/"])\n'
        for i in range(20)
    )
    dodo = textwrap.dedent("""\
        from substrax_tasks import doit_config, remote_step
        DOIT_CONFIG = doit_config(default_tasks=[%s])
        def task_all():
        """) % ", ".join(f'"s{i}"' for i in range(20))  # fmt: skip
    roots = []
    for enabled in ("true", "false"):
        root = scratch / f"noop-{enabled}"
        root.mkdir()
        (root / "dodo.py").write_text(dodo + body)
        local = '[tool.substrax.compute.backends.local]\nsandbox = "none"\n'
        (root / "pyproject.toml").write_text(f"{local}[tool.substrax.compute.cache]\nenabled = {enabled}\n")
        env = {**os.environ, "XDG_CACHE_HOME": str(scratch / "xdg")}
        subprocess.run(doit_argv(), cwd=root, env=env, check=True, capture_output=True)
        roots.append((root, env))

    def noop(root: Path, env: dict[str, str]) -> Callable[[], object]:
        return lambda: subprocess.run(doit_argv(), cwd=root, env=env, check=True, capture_output=True)

    pair("no-op doit, 20 steps", noop(*roots[0]), noop(*roots[1]), lambda: None, repeats * 3, "~1.0x",
         "cache off")  # fmt: skip


def main() -> int:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--files", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"bench_cache: {load_average()}, {os.cpu_count()} cpus")
    print("| figure | restore | baseline | ratio | goal |\n| --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(prefix="bench-cache-", dir=scratch_parent()) as tmp:
        scratch = Path(tmp)
        big = scratch / "tree" / "big"
        big.parent.mkdir()
        with big.open("wb") as f:
            for _ in range(args.size_mib):
                f.write(os.urandom(1 << 20))
        manifest = make_store(scratch / "cache", scratch / "tree", ["big"])
        obj = scratch / "cache" / object_path(manifest["entries"][0]["sha256"])
        dest = scratch / "cp-dest"

        def clean() -> None:
            dest.unlink(missing_ok=True)

        local = Folder(scratch / "cache")
        pair(f"{args.size_mib} MiB from the local folder", lambda: restore(local, manifest, ["big"], scratch),
             lambda: subprocess.run(["cp", "--reflink=auto", str(obj), str(dest)], check=True), clean,
             args.repeats, "<= 1.2x", "cp --reflink=auto")  # fmt: skip

        from s3_server import running_s3_server  # the tests' server: rclone serve s3 on loopback

        with running_s3_server(scratch / "s3") as server:
            os.environ.update(server.env)
            prefix = f"s3://{server.bucket}/bench"
            shared = Shared(prefix, writable=True)
            shared.put([(obj, object_path(manifest["entries"][0]["sha256"]))])
            rclone = str(Path(sys.executable).with_name("rclone"))
            remote = (f":s3,provider=Other,endpoint='{server.endpoint}',access_key_id={server.access_key},"
                      f"secret_access_key={server.secret_key}:{server.bucket}/bench/"
                      f"{object_path(manifest['entries'][0]['sha256'])}")  # fmt: skip
            pair(f"{args.size_mib} MiB from S3", lambda: restore(shared, manifest, ["big"], scratch),
                 lambda: _rclone(rclone, remote, dest),
                 clean, args.repeats, "<= 1.2x", "rclone copyto")  # fmt: skip
        big.unlink()
        shutil.rmtree(scratch / "cache")

        small = scratch / "tree" / "small"
        for i in range(args.files):
            sub = small / f"d{i % 100}"
            sub.mkdir(parents=True, exist_ok=True)
            (sub / f"f{i}").write_bytes(hashlib.sha256(str(i).encode()).digest() * 16)
        manifest = make_store(scratch / "cache", scratch / "tree", ["small/"])
        tree_dest = scratch / "cp-tree"
        pair(f"{args.files} small files from the local folder",
             lambda: restore(Folder(scratch / "cache"), manifest, ["small/"], scratch),
             lambda: subprocess.run(["cp", "-r", "--reflink=auto", str(small), str(tree_dest)], check=True),
             lambda: shutil.rmtree(tree_dest, ignore_errors=True), args.repeats, "<= 1.5x",
             "cp -r --reflink=auto")  # fmt: skip
        bench_noop(scratch, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
