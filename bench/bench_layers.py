#!/usr/bin/env python3
"""A speed-up layer measured A/B against its removal (issue 30).

    .venv/bin/python bench/bench_layers.py LAYER [--sweep 20,200] [--jobs 4]
        [--noop-steps 1000] [--repeats 5] [--only sweep|noop] [--keep]
    .venv/bin/python bench/bench_layers.py --check   # every layer still removable (make bench-smoke)

It measures and prints; it asserts nothing. It copies this checkout's
`substrax_tasks/` and `remote/` into a folder on tmpfs, removes LAYER from
the copy (the plain version: a few exact text edits below, each checked, so
that an edit that no longer applies stops the bench instead of measuring
nothing), and times both versions side by side on the figures a user
notices, with the bench scripts' own A/B options (the copy is loaded with
`PYTHONPATH`, this checkout's package through the venv):

* sweep: `bench_steps.py --steps N --jobs J --code COPY` for each N of
  `--sweep`: full `doit -n J -P thread` of N trivial local steps; the row
  `code#1` is the plain version, `remote` the one with the layer;
* noop: `bench_chain.py --steps N --src COPY`: the no-op `doit` of N steps
  (100 output files each); `remote/--src` is the ratio with the layer over
  without it.

Runs are interleaved (each version goes first as often) and medians shown
with their spread, as the two scripts do. On a machine busy with other work
the times move more than a layer does: `--project PROJECT` times the no-op
`doit` in PROJECT (a project bench_chain.py built and kept, `--keep`), no
rebuild, each way in turn, and prints the ratio within each repeat (wall
and CPU: the CPU time moves less with the load); `--callgrind` adds the
instructions of one no-op each way, counted by valgrind's callgrind, which
no load moves. Nothing of this is in the product: the layer is removed in
the copy only.

Layers (what is removed):

* spawner: the local backend's worker spawner (backends/local/spawner.py); each
  run's worker is started as `python worker.py JOB --detach --env-stdin`.
* freeze: both `gc.freeze()` calls of step/tasks.py.
* config-cache: the resolved configuration kept in a private folder
  (store/project.py, Project.open): every `doit` validates pyproject.toml (pydantic).
* stat-loop: uptodate/walk.py's walk_checked as plain Python: `os.scandir` on the
  folder's descriptor, `stat.S_ISDIR`, `max()`, no memo of parent folders.
* memo-projects: step/tasks.py project_of's dicts: each step opens its project.
* memo-roots: only project_of's resolved roots: each step resolves
  its project's path again (the projects are still kept).
* memo-program: backends/local/program.py's lru_cache: each step asks its program (`--python
  NAME`) which interpreter it runs.
* memo-lock: uptodate/check.py's digests of lock files: hashed at each key.
* memo-bwrap: remote/sandbox.py's answer to "is bubblewrap usable?": the
  spawner probes it for each run, as each worker would.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from _common import doit_argv, load_average, median, scratch_parent
from bench_steps import PYCACHE

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Span:
    """The text from `start` up to (not including) `end`."""

    start: str
    end: str


Edit = tuple[str, "str | Span", str]  # (file under the copy, exact text or span, its plain replacement)

SPAWNER: list[Edit] = [
    (
        "substrax_tasks/backends/local/backend.py",
        "        code, problem = _SPAWNER.start(request)\n",
        """\
        worker = [sys.executable, str(remote_dir() / "worker.py"), paths.job, "--detach", "--env-stdin"]
        with Path(paths.log).open("ab") as log:
            try:
                done = subprocess.run(
                    worker, input=json.dumps(secrets).encode(), stdout=subprocess.DEVNULL, stderr=log,
                    env=request["env"], start_new_session=True, timeout=START_TIMEOUT_SECONDS,
                    check=False,
                )
                code, problem = done.returncode, ""
            except subprocess.TimeoutExpired:
                code, problem = -1, "timed out"
""",
    ),
]

FREEZE: list[Edit] = [
    ("substrax_tasks/step/tasks.py", "    if _DECLARED[0] % FREEZE_EVERY == 0:\n        gc.freeze()\n", ""),
    ("substrax_tasks/step/tasks.py", "        _FROZEN[0] = True\n        gc.freeze()\n",
     "        _FROZEN[0] = True\n"),
]

CONFIG_CACHE: list[Edit] = [
    ("substrax_tasks/store/project.py",
     "        private_dir(CACHE_FOLDER)  # made, or refused when not ours alone\n", ""),
    ("substrax_tasks/store/project.py",
     '            data = json.loads(trusted_file(cached) or b"null")  # not ours alone: validate again\n',
     "            data = None\n"),
    ("substrax_tasks/store/project.py",
     "            write_json_atomic(cached, record)\n", "            pass\n"),
]

PLAIN_WALK = """\
def walk_checked(base: str, checked: Sequence[tuple[str, bool, bool]], items: list[Any]) -> int:
    newest = 0
    prefix = base + "/" if base and not base.endswith("/") else base
    for rel, is_dir, walk in checked:
        items.append(rel)
        items.append(is_dir)
        parts = rel.split("/")
        for depth in range(1, len(parts)):
            try:
                items.append(os.lstat(prefix + "/".join(parts[:depth])).st_mode)
            except OSError:
                items.append(-1)
        top = prefix + rel
        try:
            st = os.lstat(top)
        except OSError:
            items.append(None)
            continue
        items.append((st.st_mode, st.st_size, st.st_ctime_ns, st.st_ino, st.st_dev))
        newest = max(newest, st.st_ctime_ns)
        if stat.S_ISLNK(st.st_mode):
            items.append(_readlink_or_none(top))
        if walk and stat.S_ISDIR(st.st_mode):
            newest = max(newest, _walk_folder(top, rel, items))
    return newest


def _walk_folder(top: str, rel: str, items: list[Any]) -> int:
    newest = 0
    stack = [(top, rel)]
    while stack:
        dir_abs, dir_rel = stack.pop()
        items.append(dir_rel)
        try:
            fd = os.open(dir_abs, _O_DIR)
        except OSError:
            items.append(None)
            continue
        try:
            with os.scandir(fd) as entries:
                for entry in entries:
                    try:
                        est = entry.stat(follow_symlinks=False)
                    except OSError:
                        items.append((entry.name, None))
                        continue
                    newest = max(newest, est.st_ctime_ns)
                    items.append((entry.name, est.st_mode, est.st_size, est.st_ctime_ns, est.st_ino))
                    if stat.S_ISDIR(est.st_mode):
                        stack.append((dir_abs + "/" + entry.name, dir_rel + "/" + entry.name))
                    elif stat.S_ISLNK(est.st_mode):
                        items.append(_readlink_or_none(dir_abs + "/" + entry.name))
        except OSError:
            items.append(None)
        finally:
            os.close(fd)
    return newest


"""

STAT_LOOP: list[Edit] = [
    ("substrax_tasks/uptodate/walk.py", Span("def walk_checked(", "def _readlink_or_none"), PLAIN_WALK),
]

MEMO_PROJECTS: list[Edit] = [
    ("substrax_tasks/step/tasks.py", Span("    where = (os.getcwd()", "    return project\n"),
     '    return Project.open(Path.cwd().joinpath("" if path is None else os.fspath(path)))\n'),
    ("substrax_tasks/step/tasks.py", "    return project\n", ""),
]

MEMO_ROOTS: list[Edit] = [
    ("substrax_tasks/step/tasks.py",
     "    root = _ROOTS.get(where)\n    if root is None:\n        root = _ROOTS[where] = ",
     "    root = "),
]

MEMO_PROGRAM: list[Edit] = [
    ("substrax_tasks/backends/local/program.py", "@functools.lru_cache(maxsize=64)\n", ""),
]

MEMO_LOCK: list[Edit] = [
    ("substrax_tasks/uptodate/check.py",
     "    if stamp not in _LOCK_DIGESTS:\n"
     "        _LOCK_DIGESTS[stamp] = hashlib.sha256(path.read_bytes()).hexdigest()\n"
     "    return _LOCK_DIGESTS[stamp]\n",
     "    return hashlib.sha256(path.read_bytes()).hexdigest()\n"),
]

MEMO_BWRAP: list[Edit] = [
    ("remote/sandbox.py", "@functools.lru_cache(maxsize=None)\ndef bwrap_usable", "def bwrap_usable"),
]

LAYERS: dict[str, list[Edit]] = {
    "spawner": SPAWNER,
    "freeze": FREEZE,
    "config-cache": CONFIG_CACHE,
    "stat-loop": STAT_LOOP,
    "memo-projects": MEMO_PROJECTS,
    "memo-roots": MEMO_ROOTS,
    "memo-program": MEMO_PROGRAM,
    "memo-lock": MEMO_LOCK,
    "memo-bwrap": MEMO_BWRAP,
}


def plain_copy(layer: str, dest: Path) -> None:
    """This checkout's package and remote/ in `dest`, without `layer`."""
    for folder in ("substrax_tasks", "remote"):
        shutil.copytree(REPO / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for rel, where, new in LAYERS[layer]:
        path = dest / rel
        text = path.read_text()
        if isinstance(where, Span):
            start = text.find(where.start)
            end = text.find(where.end, start + 1)
            old = text[start:end] if start != -1 and end != -1 else where.start
        else:
            old = where
        if text.count(old) != 1:
            raise SystemExit(f"{layer}: the edit of {rel} no longer applies (its text is not there once); "
                             "update LAYERS in bench/bench_layers.py")
        path.write_text(text.replace(old, new))


def check_layers() -> int:
    """Every layer's plain version made, then checked by compiling its
    edited files and by ruff's undefined-name rule (F821): a module moved
    or a text changed since stops here, not in the next measurement."""
    failed = []
    with tempfile.TemporaryDirectory(prefix="bench-layers-check-", dir=scratch_parent()) as tmp:
        for layer, edits in LAYERS.items():
            plain = Path(tmp) / layer
            try:
                plain_copy(layer, plain)
            except SystemExit as exc:
                failed.append(f"{layer}: {exc}")
                continue
            edited = sorted({str(plain / rel) for rel, _where, _new in edits})
            ruff = Path(sys.executable).with_name("ruff")
            done = subprocess.run(
                [sys.executable, "-m", "py_compile", *edited], capture_output=True, text=True, check=False
            )
            if done.returncode == 0:
                done = subprocess.run([str(ruff), "check", "--no-cache", "--isolated", "--select", "F821",
                                       "--output-format", "concise", *edited],
                                      capture_output=True, text=True, check=False)  # fmt: skip
            print(f"{layer}: {'ok' if done.returncode == 0 else 'FAILED'} ({len(edits)} edits of "
                  f"{', '.join(sorted({rel for rel, _w, _n in edits}))})")
            if done.returncode != 0:
                failed.append(f"{layer}: {(done.stdout + done.stderr).strip()[-1500:]}")
    for line in failed:
        print(line, file=sys.stderr)
    print(f"bench_layers --check: {len(LAYERS) - len(failed)} of {len(LAYERS)} layers removable")
    return 1 if failed else 0


def noop_env(code: Path | None) -> dict[str, str]:
    """As bench_chain.py runs `doit`, with the package of `code` or this venv's."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("SUBSTRAX_BACKEND", "PYTHONDONTWRITEBYTECODE", "PYTHONPATH")}
    env["PYTHONPYCACHEPREFIX"] = str(PYCACHE)
    if code is not None:
        env["PYTHONPATH"] = str(code)
    return env


def ran_a_task(stdout: str) -> bool:
    return any(line.startswith(". ") for line in stdout.splitlines())


def noop(project: Path, code: Path | None) -> tuple[float, float]:
    """Wall and CPU seconds (user + system) of one no-op `doit` in `project`."""
    started = time.perf_counter()
    proc = subprocess.Popen(doit_argv(), cwd=project, env=noop_env(code), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = proc.stdout.read() if proc.stdout is not None else b""
    _pid, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0 or ran_a_task(out.decode(errors="replace")):
        raise SystemExit(f"not a no-op (exit {proc.returncode}):\n{out.decode(errors='replace')[-2000:]}")
    return wall, usage.ru_utime + usage.ru_stime


def instructions(project: Path, code: Path | None) -> int:
    """Instructions of one no-op `doit` in `project`, callgrind's count."""
    done = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *doit_argv()],
        cwd=project, env=noop_env(code), capture_output=True, text=True, check=True,
    )
    found = re.search(r"Collected : (\d+)", done.stderr)
    if found is None or ran_a_task(done.stdout):
        raise SystemExit(f"no count, or not a no-op:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return int(found.group(1))


def paired(label: str, kept: Sequence[float], removed: Sequence[float], unit: str = "s") -> None:
    ratios = sorted(k / r for k, r in zip(kept, removed, strict=True))
    print(f"  {label}: with the layer {median(kept):.3f} {unit}, without it {median(removed):.3f} {unit}; "
          f"with/without per repeat: median {median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f}, "
          f"{len(ratios)} repeats)")


def measure_project(project: Path, plain: Path, repeats: int, callgrind: bool) -> None:
    """No-op `doit` in a kept project, each way, interleaved."""
    print(f"\nno-op `doit` in {project}, {repeats} repeats each way, interleaved; {load_average()}")
    for code in (None, plain):  # untimed: the copy's bytecode is written
        noop(project, code)
    walls: dict[Path | None, list[float]] = {None: [], plain: []}
    cpus: dict[Path | None, list[float]] = {None: [], plain: []}
    for rep in range(repeats):
        for code in (None, plain) if rep % 2 == 0 else (plain, None):
            wall, cpu = noop(project, code)
            walls[code].append(wall)
            cpus[code].append(cpu)
    paired("wall", walls[None], walls[plain])
    paired("CPU", cpus[None], cpus[plain])
    if callgrind:
        kept, removed = instructions(project, None), instructions(project, plain)
        print(f"  instructions (callgrind, one run each): with the layer {kept / 1e6:,.0f} M, "
              f"without it {removed / 1e6:,.0f} M: {kept / removed:.3f}x")
    print(f"  ({load_average()} at the end)")


def run(script: str, args: Sequence[str]) -> None:
    argv = [sys.executable, str(HERE / script), *args]
    print(f"\n$ {' '.join(argv)}", flush=True)
    subprocess.run(argv, check=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("layer", nargs="?", choices=sorted(LAYERS))
    parser.add_argument("--check", action="store_true",
                        help="time nothing: remove every layer in a copy of its own and check the plain "
                        "version still compiles with every name defined (make bench-smoke)")
    parser.add_argument("--sweep", default="20,200", help="step counts of the sweeps (default 20,200)")
    parser.add_argument("--jobs", default="4", help="doit -n of the sweeps (default 4)")
    parser.add_argument("--noop-steps", default="1000", help="step counts of the no-op (default 1000)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per version (default 5)")
    parser.add_argument("--only", choices=("sweep", "noop"), default=None)
    parser.add_argument("--python", default=None, metavar="NAME",
                        help="the sweeps' commands run NAME -c ... (bench_steps.py --python)")
    parser.add_argument("--keep", action="store_true", help="keep the plain copy")
    parser.add_argument("--project", type=Path, metavar="DIR",
                        help="only time the no-op doit in this built project (bench_chain.py --keep)")
    parser.add_argument("--callgrind", action="store_true",
                        help="with --project: also count the instructions of one no-op each way")
    args = parser.parse_args(argv)
    if args.check:
        return check_layers()
    if args.layer is None:
        parser.error("give the LAYER to measure, or --check")

    scratch = Path(tempfile.mkdtemp(prefix=f"bench-layers-{args.layer}-", dir=scratch_parent()))
    plain = scratch / "plain"
    try:
        plain_copy(args.layer, plain)
        print(f"bench_layers: {args.layer!r} removed in {plain}; the installed package keeps it")
        if args.project is not None:
            measure_project(args.project.resolve(), plain, args.repeats, args.callgrind)
            return 0
        if args.only in (None, "sweep"):
            for steps in args.sweep.split(","):
                python = ["--python", args.python] if args.python else []
                run("bench_steps.py", ["--steps", steps, "--jobs", args.jobs, "--repeats", str(args.repeats),
                                       "--code", str(plain), *python])
        if args.only in (None, "noop"):
            run("bench_chain.py", ["--steps", args.noop_steps, "--repeats", str(args.repeats),
                                   "--src", str(plain)])
    finally:
        if args.keep:
            print(f"plain copy kept in {plain}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
