"""What the cache of verified runs takes on disk, and the time to store and
restore, for one output of many small files and for one big file.

    .venv/bin/python bench/bench_cache_disk.py [--files 50000] [--size-mib 1024] [--repeats 3] [--src DIR]

Each case is a project whose one step makes the output: `--files` files of
10 bytes (all different, 100 folders), or one file of `--size-mib` MiB of
random bytes. Shown for each: the output's own disk use (du: its blocks)
and apparent size (its bytes), and what the cache folder takes after the
step was kept (its objects, and its entry's JSON: the manifest names every
file with its sha256), as blocks (st_blocks * 512). Times, medians of
`--repeats`, interleaved:

- store: a `doit` that runs the step and keeps it (a new, empty cache
  folder each time) less the same `doit` with the cache off
  (SUBSTRAX_CACHE=off): what keeping the run costs;
- restore: a `doit` in a fresh clone that restores the step, nothing run.

`--src DIR` runs the same beside it with another version's package
(`PYTHONPATH=DIR`, DIR holding its `substrax_tasks/` and `remote/`, e.g.
`git archive main substrax_tasks remote | tar -x -C DIR`): an A/B of two
versions under the same load. Scratch space is on /dev/shm (tmpfs, 4 KiB
blocks, as ext4) when writable.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from _common import doit_argv, fmt_s, load_average, median, scratch_parent

LOCAL = ""  # the default sandbox: a run without one is never kept
SMALL = ("python3 -c 'import os; [(os.makedirs(f\"out/d{{i%100}}\",exist_ok=True), "
         "open(f\"out/d{{i%100}}/f{{i}}\",\"w\").write(f\"{{i:010d}}\")) for i in range({n})]'")  # fmt: skip
BIG = "mkdir -p out && head -c {n}M /dev/urandom > out/big"


@dataclass
class Version:
    name: str
    pythonpath: str | None
    store: list[float] = field(default_factory=list)
    plain: list[float] = field(default_factory=list)
    restore: list[float] = field(default_factory=list)
    objects: int = 0
    entry: int = 0

    def env(self, scratch: Path) -> dict[str, str]:
        env = {**os.environ, "XDG_CACHE_HOME": str(scratch / "xdg")}
        env.pop("SUBSTRAX_CACHE", None)
        if self.pythonpath:
            env["PYTHONPATH"] = self.pythonpath
        return env


def blocks(folder: Path) -> int:
    return sum(p.lstat().st_blocks * 512 for p in folder.rglob("*") if p.is_file() or p.is_symlink())


def apparent(folder: Path) -> int:
    return sum(p.lstat().st_size for p in folder.rglob("*") if p.is_file())


def project(root: Path, shell: str, cache: Path) -> Path:
    root.mkdir(parents=True)
    (root / "pyproject.toml").write_text(f'{LOCAL}[tool.substrax.compute.cache]\npath = "{cache}"\n')
    (root / "dodo.py").write_text(
        "from substrax_tasks import doit_config, remote_step\n"
        'DOIT_CONFIG = doit_config(default_tasks=["step"])\n'
        "def task_all():\n"
        f"    yield from remote_step('step', shell={shell!r}, outputs=['out/'])\n"
    )
    return root


def doit(root: Path, env: dict[str, str], expect: str) -> float:
    start = time.perf_counter()
    done = subprocess.run(doit_argv(), cwd=root, env=env, capture_output=True, text=True, check=False)
    took = time.perf_counter() - start
    assert done.returncode == 0 and expect in done.stdout, done.stdout + done.stderr
    return took


def one_repeat(version: Version, scratch: Path, shell: str, i: int) -> Path:
    """Store (and run with the cache off), then restore in a clone; the first project."""
    where = scratch / f"{'src' if version.pythonpath else 'this'}-{i}"
    cache = where / "cache"
    env = version.env(where)
    plain = project(where / "plain", shell, cache)
    version.plain.append(doit(plain, {**env, "SUBSTRAX_CACHE": "off"}, "succeeded on local"))
    shutil.rmtree(plain)
    first = project(where / "first", shell, cache)
    version.store.append(doit(first, env, "succeeded on local"))
    version.objects = blocks(cache / "objects")
    version.entry = blocks(cache / "entries")
    clone = project(where / "clone", shell, cache)
    version.restore.append(doit(clone, env, "restored from cache entry"))
    shutil.rmtree(clone)
    return first


def kib(n: float) -> str:
    return f"{n / 1024:,.0f} KiB"


def case(name: str, shell: str, versions: list[Version], scratch: Path, repeats: int) -> None:
    own_blocks = own_bytes = 0
    for i in range(repeats):
        for version in versions if i % 2 == 0 else versions[::-1]:  # interleaved, alternating the first
            first = one_repeat(version, scratch, shell, i)
            own_blocks, own_bytes = blocks(first / "out"), apparent(first / "out")
            shutil.rmtree(first.parent)
    print(f"\n### {name}: the output takes {kib(own_blocks)} on disk (du), {kib(own_bytes)} apparent\n")
    print("| version | cache objects | entry (JSON) | objects / apparent | (objects + entry) / du "
          "| store (less a run with the cache off) | restore |")
    print("|---|---|---|---|---|---|---|")
    for v in versions:
        store = median(v.store) - median(v.plain)
        print(f"| {v.name} | {kib(v.objects)} | {kib(v.entry)} | {v.objects / own_bytes:.2f}x "
              f"| {(v.objects + v.entry) / own_blocks:.3f}x | {fmt_s(store)} s "
              f"({fmt_s(median(v.store))} - {fmt_s(median(v.plain))}) | {fmt_s(median(v.restore))} s |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--files", type=int, default=50_000)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--src", metavar="DIR", help="also run another version's package (PYTHONPATH=DIR)")
    args = parser.parse_args()
    if args.src and not (Path(args.src) / "substrax_tasks" / "__init__.py").is_file():
        parser.error(f"--src {args.src}: no substrax_tasks/ there")
    versions = [Version("this tree", None)]
    if args.src:
        versions.append(Version(f"--src {args.src}", str(Path(args.src).resolve())))
    print(f"load average before: {load_average()}")
    scratch = Path(tempfile.mkdtemp(prefix="bench-cache-disk-", dir=scratch_parent()))
    try:
        case(f"{args.files:,} files of 10 bytes", SMALL.format(n=args.files), versions, scratch, args.repeats)
        for v in versions:
            v.store, v.plain, v.restore = [], [], []
        case(f"one file of {args.size_mib} MiB", BIG.format(n=args.size_mib), versions, scratch, args.repeats)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\nload average after: {load_average()}")


if __name__ == "__main__":
    main()
