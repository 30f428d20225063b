#!/usr/bin/env python3
"""Peak memory of a verified fetch of many small files (issue 29 item 5).

    .venv/bin/python bench/bench_fetch_memory.py [--files 20000,200000] [--sandbox bwrap|none]

It measures and prints; it asserts nothing. For each file count N it makes,
on tmpfs (/dev/shm when present), a project with one `remote_step` on the
local backend whose command writes N x 4 KiB files into `out/`, and runs
`doit` once: the run writes into its sandbox's staging folder (bubblewrap,
`--sandbox bwrap`, the default), and the chain then does what it does after
any backend's run, the SSH backend's included: it reads the manifest the
worker wrote as the command ended (N entries, JSON), links the outputs into
a fetch folder, makes their modes safe, verifies them against the manifest
(hashing each file into the step's hash cache), promotes them, writes the
manifest it keeps and the step record. Only the copy differs: rsync over ssh
for the SSH backend, in a process of its own. The cache of runs is off
(it keeps the files in the user's cache, a figure of its own; `--cache on` measures
it too, in a cache of the bench's own).

Side by side, with their peak memory (ru_maxrss, from wait4):

* the `doit` of the remote step (the figure);
* a plain doit task whose Python action writes the same N files: what doit
  and the interpreter hold anyway;
* `rsync -a` of the outputs into a fresh folder on the same file system
  (the copy a fetch makes, without the verification).

The extra over the plain doit, divided by N, mixes two costs: what the
package and its run cost whatever N (its imports, the backend's settings
models: ~15 MiB over plain doit) and what grows with N. So the same remote
step is also run with 100 files, and the growth per file is
(peak(N) - peak(100)) / (N - 100): the memory a fetch holds per file.
`--sandbox none` runs in place (no fetch folder: verification only).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import doit_argv, load_average, scratch_parent

WRITE_FILES = """\
import os, sys
count, outdir = int(sys.argv[1]), sys.argv[2]
block = os.urandom(4096)
for folder in range(max(1, count // 1000)):
    os.makedirs("%s/d%03d" % (outdir, folder), exist_ok=True)
for i in range(count):
    with open("%s/d%03d/f%06d" % (outdir, i % max(1, count // 1000), i), "wb") as f:
        f.write(block[: 4000 + i % 96])
"""

REMOTE_DODO = """\
from substrax_tasks import doit_config, remote_step

DOIT_CONFIG = doit_config()


def task_write():
    yield from remote_step("write", command=["python3", "write.py", "{files}", "out"],
                           inputs=["write.py"], outputs=["out/"])
"""

BASELINE_DODO = """\
import runpy
import sys

DOIT_CONFIG = {{"dep_file": ".doit.db", "backend": "sqlite3"}}


def write():
    sys.argv = ["write.py", "{files}", "out"]
    runpy.run_path("write.py")


def task_write():
    return {{"actions": [write], "targets": ["out"]}}
"""

PYPROJECT = """\
[project]
name = "bench-fetch-memory"
version = "0"

[tool.substrax.compute]
default_backend = "local"

[tool.substrax.compute.backends.local]
sandbox = "{sandbox}"

[tool.substrax.compute.cache]
enabled = {cache}
"""


def peak_of(argv: list[str], cwd: Path) -> tuple[int, str]:
    """(peak resident memory in KiB, output) of the command, which must succeed."""
    env = {**os.environ, "XDG_CACHE_HOME": str(cwd.parent / "cache")}  # a cache of this bench's own
    env.pop("SUBSTRAX_BACKEND", None)
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    assert proc.stdout is not None
    output = proc.stdout.read().decode(errors="replace")
    proc.stdout.close()
    _pid, status, usage = os.wait4(proc.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        print(f"\n{' '.join(argv)} in {cwd} failed (exit {code}):\n{output[-3000:]}")
        raise SystemExit(1)
    return usage.ru_maxrss, output


def project(root: Path, dodo: str, files: int, sandbox: str, cache: bool) -> Path:
    root.mkdir(parents=True)
    (root / "write.py").write_text(WRITE_FILES)
    (root / "dodo.py").write_text(dodo.format(files=files))
    (root / "pyproject.toml").write_text(PYPROJECT.format(sandbox=sandbox, cache=str(cache).lower()))
    return root


SMALL = 100  # files of the remote step that gives the fixed cost


def measure(scratch: Path, files: int, sandbox: str, cache: bool) -> tuple[int, int, int]:
    remote = project(scratch / f"remote-{files}", REMOTE_DODO, files, sandbox, cache)
    baseline = project(scratch / f"baseline-{files}", BASELINE_DODO, files, sandbox, cache)
    remote_kib, _ = peak_of(doit_argv(), remote)
    found = sum(len(names) for _f, _d, names in os.walk(remote / "out"))
    if found != files:
        print(f"the remote step made {found} files, expected {files}")
        raise SystemExit(1)
    baseline_kib, _ = peak_of(doit_argv(), baseline)
    rsync_kib, _ = peak_of(["rsync", "-a", f"{remote}/out/", str(scratch / f"copy-{files}")], scratch)
    for folder in (remote, baseline, scratch / f"copy-{files}"):
        shutil.rmtree(folder, ignore_errors=True)
    return remote_kib, baseline_kib, rsync_kib


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--files", default="20000,200000", help="file counts (default 20000,200000)")
    parser.add_argument("--sandbox", choices=("bwrap", "none"), default="bwrap")
    parser.add_argument("--cache", choices=("on", "off"), default="off",
                        help="the run cache (a cache of the bench's own): off measures the fetch alone, "
                             "on adds keeping the run, as users get it")
    args = parser.parse_args()
    counts = [int(part) for part in args.files.split(",") if part.strip()]
    if shutil.which("rsync") is None:
        parser.error("rsync is not installed: it is the baseline")
    scratch = Path(tempfile.mkdtemp(prefix="bench-fetch-memory-", dir=scratch_parent()))
    print(f"bench_fetch_memory: {platform.python_implementation()} {platform.python_version()}, "
          f"files in {scratch}, sandbox {args.sandbox!r}, cache {args.cache}, {load_average()}")
    rows = []
    try:
        small_kib = measure(scratch, SMALL, args.sandbox, args.cache == "on")[0]
        for files in counts:
            rows.append((files, *measure(scratch, files, args.sandbox, args.cache == "on")))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\n{'files':>8} {'remote doit':>12} {'plain doit':>11} {'rsync -a':>9} {'extra a file':>13}"
          f" {'growth a file':>14}  (peak memory, MiB)")
    print(f"(the remote doit of {SMALL} files: {small_kib / 1024:.1f} MiB)")
    for files, remote_kib, baseline_kib, rsync_kib in rows:
        per_file = (remote_kib - baseline_kib) * 1024 / files
        growth = (remote_kib - small_kib) * 1024 / max(1, files - SMALL)
        print(f"{files:>8,} {remote_kib / 1024:>12.1f} {baseline_kib / 1024:>11.1f} {rsync_kib / 1024:>9.1f} "
              f"{per_file:>11.0f} B {growth:>12.0f} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
