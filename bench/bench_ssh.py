#!/usr/bin/env python3
"""Figures of the SSH backend (issue 4): verified fetch and cancel over a real sshd.

    .venv/bin/python bench/bench_ssh.py [--repeats N] [--trials N] [--login user|root]

It measures and prints; it asserts nothing (unless --strict). The host is the
test bed's throwaway sshd (tests/support/testbeds/sshd_host.py): as root in a network
namespace of its own, joined by a veth pair (loopback otherwise). By default
it logs in as a user made for the bench (`sxbench`, no shell start-up files)
whose home and scratch folder are on tmpfs (/dev/shm); `--login root` logs in
as root instead (root's .bashrc runs `pyenv init` on every ssh command here).
The project folder is on tmpfs too, and the remote run folders live under
`remote_root`, an absolute path in the scratch folder (tmpfs). Remote commands
run in bubblewrap when it is usable (sandbox "auto").

Two runs make the data, once: a 1 GiB file of random bytes (`big/`) and
20,000 x 4 KiB files of random bytes in 100 folders (`small/`). Then, side by
side in one loop (the order rotates each repeat; medians; a ratio is the
median of the ratios of one repeat):

(a) verified fetch of the 1 GiB output: what `doit` does once the run has
    finished, i.e. the chain's `fetch` phase (SshBackend.fetch: read the
    manifest the worker wrote as the command ended, then rsync into local
    staging) and its `verify` phase (check the staged copy
    against the manifest, promote it into the project, write the record),
    driven through StepDriver.fetch()/verify(). The OpenSSH
    ControlMaster is up, as a run shorter than ControlPersist (30 s)
    leaves it; paramiko's connection is open (the run phase used it). A
    second row times the same fetch with the master stopped first, as
    after a longer run or for a `substrax-compute fetch` long after it
    (its rsync logs in anew, as the bare rsync does).
    Baselines: bare `rsync -a` over ssh with the same cipher (aes128-gcm)
    into a fresh folder followed by hashlib sha256 of the copy (goal <=
    1.1x), and `rsync -a` with ssh's default options followed by coreutils
    `sha256sum` (goal <= 0.6x).
(b) the same verified fetch of the 20,000 small files vs bare `rsync -a`
    with the same cipher (goal <= 1.3x, as in bench/README.md and issue
    20); a no-op fetch (SshBackend.fetch when the staging folder already
    holds the outputs, ControlMaster cold and warm) vs a no-op `rsync -a`.
(c) `substrax-compute --project DIR cancel RUN` (the real CLI, a subprocess)
    -> the remote task tree gone, over --trials runs (goal < 1.5 s); the same
    through backend.cancel() in this process, to show the CLI's own cost. The
    task starts a double-forked `setsid` descendant, then sleeps; every
    process of it carries the run's marker in its argv, and this script
    scans /proc (the "remote" processes run on this machine) until none is
    left.

Where the time goes: the phases of each verified fetch are timed (wrappers
around the backend's status call, the rsync download, the wait for the
worker's manifest before it, the verification, the
promotion and the post-promotion check when one is made; what overlaps the
download is inside its time); a profile section times what they are made of
(a remote command over paramiko, remote Python start-up, the remote
manifest, OpenSSH connect with and without a ControlMaster, rsync with and
without the transport's options).

The fetch's manifest is the one the worker wrote as the command ended
(`<run folder>/manifest.json`). Before each fetch this script puts it back
as the worker left it, so every repeat sees what the first fetch after the
run sees.

A measurement that fails (the code under test raising, say) is noted and
taken again, up to 3 times; the failures are listed under their table. On a
2-CPU machine shared with other work one 1 GiB copy took 1.7 to 3.5 s from
one repeat to the next: trust the phase breakdown more than a ratio's second
digit, and rerun with more --repeats when the load average is high.

Everything it starts it stops by pid (runs torn down, the ControlMaster
stopped, the host stopped with stop_host); files are removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib.util
import io
import json
import math
import os
import platform
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from _common import (
    cli_argv,
    fmt_s,
    load_average,
    marker_processes,
    median,
    read_cmdline,
    scratch_parent,
    smoke_verdict,
)

import substrax_tasks.run.promote as promote_module
from substrax_tasks.backends.remote_run import RemoteRun
from substrax_tasks.backends.ssh.backend import SshBackend
from substrax_tasks.backends.ssh.connection import SshConnection
from substrax_tasks.errors import BackendError
from substrax_tasks.run.step_driver import StepDriver
from substrax_tasks.step.spec import make_spec, safe_name
from substrax_tasks.step.tasks import project_of
from substrax_tasks.store.handle import RunHandle
from substrax_tasks.store.project import Project
from substrax_tasks.transports.rsync import RsyncTransport
from substrax_tasks.uptodate import manifests as manifest_cache
from substrax_tasks.uptodate.check import DOIT_VALUE, Step

REPO = Path(__file__).resolve().parents[1]
TESTBED_FILE = REPO / "tests" / "support" / "testbeds" / "sshd_host.py"

BIG_MIB = 1024  # the big output's size (--big-mib)
SMALL_FILES = 20_000  # how many small files (--files)
SMALL_BYTES = 4096
SMALL_DIRS = 100
SMOKE_BIG_MIB = 8  # --smoke: every figure measured once, at a size that takes seconds
SMOKE_FILES = 500
CIPHER = "aes128-gcm@openssh.com"
BENCH_USER = "sxbench"
WORKER_RECORD = "manifest.json"  # the manifest the worker wrote for the fetch
REMOTE_PYTHON = "/usr/bin/python3"
GRACE_SECONDS = 5.0
GOAL_BIG_SAME = 1.1  # verified fetch / (rsync -a same cipher + hashlib sha256)
GOAL_BIG_DEFAULT = 0.6  # verified fetch / (rsync -a default + sha256sum)
GOAL_SMALL = 1.3  # verified fetch / rsync -a (issue 20, bench/README.md)
GOAL_CANCEL = 1.5  # seconds
TREE_UP_TIMEOUT = 30.0
GONE_TIMEOUT = GRACE_SECONDS + 30.0
SCAN_PAUSE_SECONDS = 0.001
CLI_IMPORTS = (
    "import substrax_tasks.cli.main, substrax_tasks.store.project, substrax_tasks.backends.ssh.backend"
)
SMALL_SCRIPT = (
    "import os, sys\n"
    "n, size, dirs = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])\n"
    "for d in range(dirs):\n"
    "    os.makedirs('small/d%03d' % d, exist_ok=True)\n"
    "for i in range(n):\n"
    "    with open('small/d%03d/f%05d.bin' % (i % dirs, i), 'wb') as f:\n"
    "        f.write(os.urandom(size))\n"
)


class BenchError(RuntimeError):
    """The bench could not measure what it should (a failed run or fetch)."""


class Host(Protocol):
    """The parts of the test bed's SshHost (tests/support/testbeds/sshd_host.py) used here."""

    address: str
    port: int
    user: str
    client_key: Path
    known_hosts: Path
    scratch: Path
    netns: str | None

    @property
    def destination(self) -> str: ...


def load_testbed() -> ModuleType:
    """tests/support/testbeds/sshd_host.py, loaded from its file (it is no installed
    module; loading it by path keeps mypy and the bench independent of
    sys.path). Its functions: start_host, stop_host, ssh_options, missing_tools."""
    name = "substrax_bench_sshd_host"
    module = sys.modules.get(name)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(name, TESTBED_FILE)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {TESTBED_FILE}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclass needs it there while it loads
    spec.loader.exec_module(module)
    return module


testbed = load_testbed()


# ------------------------------------------------------------------ helpers


def fmt_ratio(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}x"


def verdict(value: float, goal: float, below: bool = False) -> str:
    if math.isnan(value):
        return "not measured"
    met = value < goal if below else value <= goal
    return "met" if met else "MISSED"


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    sys.stdout.flush()


def progress(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@contextlib.contextmanager
def quiet() -> Iterator[io.StringIO]:
    """Swallow what the code under test prints (rsync's summary line). With
    stderr not a terminal the transport shows no progress bar, as in CI."""
    sink = io.StringIO()
    with contextlib.redirect_stderr(sink), contextlib.redirect_stdout(sink):
        yield sink


def files_under(root: Path) -> list[Path]:
    found: list[Path] = []
    for folder, _dirs, names in os.walk(root):
        found += [Path(folder) / name for name in names]
    return found


def hashlib_tree(root: Path) -> None:
    """sha256 of every file, as hashlib.file_digest does it (one buffer)."""
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    for path in files_under(root):
        digest = hashlib.sha256()
        with path.open("rb", buffering=0) as f:
            while n := f.readinto(view):
                digest.update(view[:n])


def sha256sum_tree(root: Path) -> None:
    files = [str(p) for p in files_under(root)]
    for at in range(0, len(files), 2000):
        subprocess.run(["sha256sum", "--", *files[at : at + 2000]], stdout=subprocess.DEVNULL, check=True)


# ------------------------------------------------------------------ phases


class Recorder:
    """Times named functions while a trial is being recorded: each wrapped
    call adds its duration to its label."""

    def __init__(self) -> None:
        self.current: dict[str, float] | None = None
        self._originals: list[tuple[object, str, object]] = []

    def wrap(self, owner: object, name: str, label: str) -> None:
        original = getattr(owner, name, None)
        if not callable(original):
            print(f"note: {owner!r} has no {name}: its phase is not timed", file=sys.stderr)
            return
        recorder = self

        @functools.wraps(original)
        def timed_call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if recorder.current is not None:
                    recorder.current[label] = recorder.current.get(label, 0.0) + time.perf_counter() - t0

        self._originals.append((owner, name, original))
        setattr(owner, name, timed_call)

    @contextlib.contextmanager
    def recording(self) -> Iterator[dict[str, float]]:
        phases: dict[str, float] = {}
        self.current = phases
        try:
            yield phases
        finally:
            self.current = None

    def restore(self) -> None:
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals.clear()


PHASES = ("status", "manifest", "rsync", "verify copy", "promote", "outputs_match", "teardown")


def phase_recorder() -> Recorder:
    recorder = Recorder()
    recorder.wrap(RemoteRun, "status", "status")
    recorder.wrap(RemoteRun, "manifest", "manifest")
    recorder.wrap(RsyncTransport, "download", "rsync")
    recorder.wrap(manifest_cache, "verify_outputs", "verify copy")
    recorder.wrap(promote_module, "promote", "promote")  # imported by name when it is called
    recorder.wrap(manifest_cache, "outputs_match", "outputs_match")
    recorder.wrap(SshBackend, "teardown", "teardown")  # the chain's close, after the promotion
    return recorder


# ------------------------------------------------------------------ the bed


@dataclass
class Bed:
    """The host, the project and the runs that hold the data."""

    host: Host
    project: Project
    local: Path  # scratch for the baselines' copies
    remote_root: str
    runs: dict[str, RunHandle] = field(default_factory=dict)
    outputs_root: dict[str, str] = field(default_factory=dict)
    extra_handles: list[RunHandle] = field(default_factory=list)
    markers: list[bytes] = field(default_factory=list)
    big_mib: int = BIG_MIB
    small_files: int = SMALL_FILES
    # whether the run folder held the manifest the worker wrote as the command ended
    worker_record: dict[str, bool] = field(default_factory=dict)  # WORKER_RECORD

    @property
    def backend(self) -> SshBackend:
        handle = next(iter([*self.runs.values(), *self.extra_handles]))
        backend = self.project.backend_for(handle)
        assert isinstance(backend, SshBackend)
        return backend

    def stop_master(self) -> None:
        self.backend.settings.target().stop_master()

    def ssh_command(self, cipher: str | None) -> str:
        """rsync's -e for the bare baselines: the test bed's ssh options,
        without multiplexing, with or without the cipher."""
        argv = testbed.ssh_options(self.host) + (["-o", f"Ciphers={cipher}"] if cipher else [])
        return shlex.join(argv)

    def remote(self, name: str) -> str:
        return f"{self.host.destination}:{self.outputs_root[name]}/{name}/"

    def read_remote(self, path: str) -> bytes | None:
        """A whole remote file (None: not there)."""
        done = self.backend.conn.run(["cat", path])
        return done.stdout if done.returncode == 0 else None

    def record_path(self, handle: RunHandle) -> str:
        """The manifest the worker wrote for the fetch."""
        return f"{handle.backend_state['remote_run_dir']}/{WORKER_RECORD}"


def project_toml(host: Host, remote_root: str) -> str:
    return (
        "[tool.substrax.compute]\n"
        'default_backend = "ssh"\n'
        "\n[tool.substrax.compute.backends.ssh]\n"
        f"host = {json.dumps(host.address)}\n"
        f"port = {host.port}\n"
        f"user = {json.dumps(host.user)}\n"
        f"identity_file = {json.dumps(str(host.client_key))}\n"
        f"known_hosts = {json.dumps(str(host.known_hosts))}\n"
        f"remote_root = {json.dumps(remote_root)}\n"
        f"python = {json.dumps(REMOTE_PYTHON)}\n"
        f"grace_seconds = {GRACE_SECONDS}\n"
        "lifetime_minutes = 60.0\n"
    )


@contextlib.contextmanager
def bench_bed(login: str) -> Iterator[Bed]:
    base = Path(tempfile.mkdtemp(prefix="substrax-bench-ssh-", dir=scratch_parent()))
    host: Host | None = None
    bed: Bed | None = None
    try:
        if scratch_parent() is not None:
            # the login user's home and scratch folder on tmpfs too
            setattr(testbed, "USER_DIR_BASE", Path(str(scratch_parent())))  # noqa: B010
        user = None if login == "root" or os.geteuid() != 0 else login
        t0 = time.perf_counter()
        host = testbed.start_host(base / "host", user=user)
        progress(
            f"host {host.destination} port {host.port} "
            f"({'network namespace ' + str(host.netns) if host.netns else 'loopback'}) "
            f"up in {time.perf_counter() - t0:.2f} s"
        )
        remote_root = f"{host.scratch}/remote"
        root = base / "project"
        root.mkdir()
        (root / "pyproject.toml").write_text(project_toml(host, remote_root))
        local = base / "local"
        local.mkdir()
        bed = Bed(host, Project.open(root), local, remote_root)
        yield bed
    finally:
        if bed is not None:
            for note in cleanup(bed):
                print(f"cleanup: {note}", file=sys.stderr)
        if host is not None:
            testbed.stop_host(host)
        shutil.rmtree(base, ignore_errors=True)


def cleanup(bed: Bed) -> list[str]:
    """Tear down every run (the remote folders), stop the ControlMaster,
    kill by pid whatever still carries a marker."""
    notes: list[str] = []
    for handle in [*bed.runs.values(), *bed.extra_handles]:
        try:
            with quiet():
                bed.project.backend_for(bed.project.store.read(handle.run_id)).teardown(handle)
        except Exception as exc:  # noqa: BLE001 - cleanup goes on whatever one run does
            notes.append(f"run {handle.run_id}: teardown failed: {exc}")
    if bed.runs:
        with contextlib.suppress(Exception):
            bed.stop_master()
    with contextlib.suppress(ImportError, OSError):
        # the configuration cache remote_step() keeps for this project, if any
        from substrax_tasks.config.pyproject import cache_file  # not in every version

        cache_file(bed.project.root).unlink(missing_ok=True)
    for marker in bed.markers:
        killed = kill_marked(marker)
        if killed:
            notes.append(f"{killed} process(es) with marker {marker.decode()} killed by pid")
    return notes


def data_spec(bed: Bed, name: str) -> Any:
    """The step that makes `name`'s data on the host: random bytes, so no
    copy or hash is cheaper than it would be for real outputs."""
    if name == "big":
        argv = ["sh", "-c", f"mkdir -p big && head -c {bed.big_mib}M /dev/urandom > big/data.bin"]
    else:
        argv = ["python3", "-c", SMALL_SCRIPT, str(bed.small_files), str(SMALL_BYTES), str(SMALL_DIRS)]
    return make_spec(name, argv, bed.project.root, outputs=[f"{name}/"])


def new_run(bed: Bed, name: str) -> RunHandle:
    """A finished run of `name`'s step, as the run phase leaves it for the
    fetch. A verified fetch ends with the promotion, which tears its run
    down (the chain's close): each verified fetch is given a run of its own,
    so each sees what the first fetch after a run sees. It is the last of
    bed.extra_handles (torn down at the end, if still there)."""
    with quiet():
        handle = bed.project.submit(data_spec(bed, name), backend="ssh")
    bed.extra_handles.append(handle)
    backend = bed.project.backend_for(handle)
    status = backend.wait(handle, poll_seconds=0.05)
    if status.state != "succeeded":
        log = backend.read_log(handle, 0).decode(errors="replace")[-1500:]
        raise BackendError(f"the {name} run {status.state}: {status.message}\n{log}")
    handle = bed.extra_handles[-1] = bed.project.store.read(handle.run_id)
    record = bed.read_remote(f"{handle.backend_state['remote_run_dir']}/status.json")
    if not isinstance(json.loads(record or b"{}").get("outputs_root"), str):
        raise BenchError(f"the {name} run's status names no outputs folder")
    return handle


def make_data(bed: Bed, names: Sequence[str]) -> None:
    """One run of each of `names` kept for the whole bench: the no-op
    fetches, the bare rsyncs and the profile read its outputs."""
    for name in names:
        t0 = time.perf_counter()
        new_run(bed, name)
        bed.runs[name] = handle = bed.extra_handles.pop()  # kept here instead
        record = bed.read_remote(f"{handle.backend_state['remote_run_dir']}/status.json")
        status = json.loads(record or b"{}")
        bed.outputs_root[name] = status["outputs_root"]
        bed.worker_record[name] = kept = bed.read_remote(bed.record_path(handle)) is not None
        progress(
            f"data: {name} made on the host in {time.perf_counter() - t0:.1f} s "
            f"(sandbox {status.get('sandbox')}); it wrote its manifest for the fetch: "
            f"{'yes' if kept else 'NO (the host takes one at each fetch)'}"
        )


# ------------------------------------------------------------------ fetches


def reset_local(bed: Bed, name: str, handle: RunHandle | None = None) -> None:
    """Back to "the run has just finished": no staging, no outputs here, no
    hash cache, no step record."""
    handle = handle or bed.runs[name]
    state = bed.project.store.root
    safe = safe_name(handle.spec.step)
    for path in (
        bed.project.store.run_dir(handle.run_id) / "fetched",
        bed.project.root / name,
        state / "cache" / f"{safe}.outputs.json",
        state / "cache" / f"{safe}.outputs.json.stamp",
        state / "steps" / f"{safe}.json",
    ):
        remove(path)


def verified_fetch(bed: Bed, name: str, recorder: Recorder, *, master: str = "warm") -> dict[str, float]:
    """The chain's fetch and verify phases, timed, on a run of its own
    just finished; returns the phases and "total", which leaves out the
    run's teardown (the chain's close after the promotion: its own phase
    in the breakdown).

    master "warm": up, as a run shorter than ControlPersist (30 s) finds
    it (the sync phase's rsync started it). "cold": the master stopped
    first, as a run longer than that, or a `substrax-compute fetch` long
    after the run."""
    handle = new_run(bed, name)
    reset_local(bed, name, handle)
    bed.stop_master()
    if master == "warm":
        target = bed.backend.settings.target()
        subprocess.run([*target.ssh_argv(), target.host, "true"], capture_output=True, check=True)
    # the project as remote_step() resolves it for its runners
    project = project_of(bed.project.root)
    backend, settings = project.settings_for("ssh")
    runner = StepDriver(Step(handle.spec, project.root, backend, settings, project.store), project)
    runner.handle = handle
    with quiet() as said, recorder.recording() as phases:
        t0 = time.perf_counter()
        fetched = runner.fetch()
        verified = runner.promote() if fetched is None else fetched
        total = time.perf_counter() - t0
    if fetched is not None or verified is not None or runner.recorded() != {DOIT_VALUE: handle.run_id}:
        raise BenchError(f"verified fetch of {name} failed: {verified}\n{said.getvalue()[-1500:]}")
    if not bed.project.backend_for(handle).released(bed.project.store.read(handle.run_id)):
        raise BenchError(
            f"the {name} run was not torn down by its promotion: the chain changed, and so must this bench"
        )
    return {**phases, "total": total - phases.get("teardown", 0.0)}


def noop_fetch(bed: Bed, name: str, *, warm_master: bool) -> float:
    """SshBackend.fetch when the staging folder holds the outputs already."""
    handle = bed.project.store.read(bed.runs[name].run_id)
    backend = bed.project.backend_for(handle)
    staging = bed.project.store.run_dir(handle.run_id) / "fetched"
    with quiet():
        if not (staging / name).is_dir():
            backend.fetch(handle)
        if not warm_master:
            bed.stop_master()
        return timed(lambda: backend.fetch(handle))


def bare_rsync(bed: Bed, name: str, dest: Path, cipher: str | None) -> float:
    argv = ["rsync", "-a", "-e", bed.ssh_command(cipher), bed.remote(name), f"{dest}/"]
    return timed(lambda: subprocess.run(argv, stdin=subprocess.DEVNULL, check=True))


def fresh(path: Path) -> Path:
    remove(path)
    return path


def phase_columns(samples: list[dict[str, float]]) -> list[str]:
    return [fmt_s(median([s.get(p, 0.0) for s in samples])) for p in PHASES] + [
        fmt_s(median([s["total"] - sum(s.get(p, 0.0) for p in PHASES if p != "teardown") for s in samples]))
    ]


def ratios(over: list[float], under: list[float]) -> float:
    return median([a / b for a, b in zip(over, under, strict=True) if b > 0])


def rotate(items: list[tuple[str, Callable[[], None]]], i: int) -> list[tuple[str, Callable[[], None]]]:
    k = i % len(items)
    return items[k:] + items[:k]


ATTEMPTS = 3


def run_step(label: str, step: Callable[[], None], failures: list[str]) -> None:
    """Run one measurement; a failure (of the code under test or of this
    script) is noted and the measurement taken again, up to ATTEMPTS times.
    A step appends its figures only once it has all of them."""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - whatever fails is reported with the figures
            failures.append(f"{label}, attempt {attempt}: {type(exc).__name__}: {str(exc).strip()[:300]}")
        else:
            return
    raise BenchError(f"{label} failed {ATTEMPTS} times; last: {failures[-1]}")


def print_failures(failures: list[str]) -> None:
    if failures:
        print(f"    FAILURES (each measurement taken again): {len(failures)}")
        for line in failures:
            print(f"      {line}")


def bench_big(bed: Bed, repeats: int) -> dict[str, float]:
    recorder = phase_recorder()
    fetch: list[dict[str, float]] = []
    fetch_cold: list[dict[str, float]] = []
    same: list[float] = []
    same_rsync: list[float] = []
    default: list[float] = []
    default_rsync: list[float] = []
    failures: list[str] = []

    def base_same() -> None:
        dest = fresh(bed.local / "same")
        t_rsync = bare_rsync(bed, "big", dest, CIPHER)
        t_hash = timed(lambda: hashlib_tree(dest))
        remove(dest)
        same_rsync.append(t_rsync)
        same.append(t_rsync + t_hash)

    def base_default() -> None:
        dest = fresh(bed.local / "default")
        t_rsync = bare_rsync(bed, "big", dest, None)
        t_hash = timed(lambda: sha256sum_tree(dest))
        remove(dest)
        default_rsync.append(t_rsync)
        default.append(t_rsync + t_hash)

    steps: list[tuple[str, Callable[[], None]]] = [
        ("fetch", lambda: fetch.append(verified_fetch(bed, "big", recorder))),
        ("fetch cold", lambda: fetch_cold.append(verified_fetch(bed, "big", recorder, master="cold"))),
        ("same", base_same),
        ("default", base_default),
    ]

    try:
        for i in range(repeats):
            for label, step in rotate(steps, i):
                run_step(label, step, failures)
            progress(f"(a) {bed.big_mib} MiB: repeat {i + 1}/{repeats} done")
    finally:
        recorder.restore()
        reset_local(bed, "big")
    totals = [s["total"] for s in fetch]
    r_same, r_default = ratios(totals, same), ratios(totals, default)
    cold = [s["total"] for s in fetch_cold]
    rows = [
        ["verified fetch, master up (fetch + verify)", fmt_s(median(totals)), "", "", ""],
        ["rsync -a, aes128-gcm + hashlib sha256", fmt_s(median(same)), fmt_ratio(r_same),
         f"<= {GOAL_BIG_SAME}x", verdict(r_same, GOAL_BIG_SAME)],
        ["rsync -a, default options + sha256sum", fmt_s(median(default)), fmt_ratio(r_default),
         f"<= {GOAL_BIG_DEFAULT}x", verdict(r_default, GOAL_BIG_DEFAULT)],
        ["  (its rsync alone, aes128-gcm)", fmt_s(median(same_rsync)), "", "", ""],
        ["  (its rsync alone, default cipher)", fmt_s(median(default_rsync)), "", "", ""],
        ["verified fetch, ssh master cold (a later `fetch`)", fmt_s(median(cold)),
         f"{fmt_ratio(ratios(cold, same))} / {fmt_ratio(ratios(cold, default))}", "vs the 2 baselines", ""],
    ]  # fmt: skip
    print_table(
        f"(a) verified fetch of {bed.big_mib} MiB vs rsync + hash (seconds, medians of {repeats};"
        " ratio = median of per-repeat ratios)",
        ["what", "seconds", "ratio", "goal", "verdict"],
        rows,
    )
    breakdown = [
        ["master up", *phase_columns(fetch)],
        ["ssh master cold", *phase_columns(fetch_cold)],
    ]
    print_table(
        "    where the verified fetch's time goes (seconds, medians)",
        ["variant", *PHASES, "other"],
        breakdown,
    )
    print_failures(failures)
    return {"1 GiB verified fetch": median(totals), "its ratio to rsync + hashlib": r_same,
            "its ratio to rsync + sha256sum": r_default, "master cold": median(cold)}  # fmt: skip


def bench_small(bed: Bed, repeats: int) -> dict[str, float]:
    recorder = phase_recorder()
    fetch: list[dict[str, float]] = []
    fetch_cold: list[dict[str, float]] = []
    bare: list[float] = []
    noop_cold: list[float] = []
    noop_warm: list[float] = []
    noop_bare: list[float] = []
    failures: list[str] = []

    def base() -> None:
        dest = fresh(bed.local / "small")
        fresh_copy = bare_rsync(bed, "small", dest, CIPHER)
        no_op = bare_rsync(bed, "small", dest, CIPHER)
        remove(dest)
        bare.append(fresh_copy)
        noop_bare.append(no_op)

    def noop() -> None:
        cold = noop_fetch(bed, "small", warm_master=False)
        warm = noop_fetch(bed, "small", warm_master=True)
        noop_cold.append(cold)
        noop_warm.append(warm)

    steps: list[tuple[str, Callable[[], None]]] = [
        ("fetch", lambda: fetch.append(verified_fetch(bed, "small", recorder))),
        ("fetch cold", lambda: fetch_cold.append(verified_fetch(bed, "small", recorder, master="cold"))),
        ("bare", base),
        ("noop", noop),
    ]

    try:
        for i in range(repeats):
            for label, step in rotate(steps, i):
                run_step(label, step, failures)
            progress(f"(b) {bed.small_files:,} files: repeat {i + 1}/{repeats} done")
    finally:
        recorder.restore()
        reset_local(bed, "small")
    totals = [s["total"] for s in fetch]
    r_small = ratios(totals, bare)
    r_cold, r_warm = ratios(noop_cold, noop_bare), ratios(noop_warm, noop_bare)
    cold = [s["total"] for s in fetch_cold]
    rows = [
        ["verified fetch, master up (fetch + verify)", fmt_s(median(totals)), fmt_ratio(r_small),
         f"<= {GOAL_SMALL}x", verdict(r_small, GOAL_SMALL)],
        ["verified fetch, ssh master cold (a later `fetch`)", fmt_s(median(cold)),
         fmt_ratio(ratios(cold, bare)), "", ""],
        ["rsync -a, aes128-gcm (fresh copy)", fmt_s(median(bare)), "", "", ""],
        ["no-op fetch (SshBackend.fetch), ControlMaster cold", fmt_s(median(noop_cold)), fmt_ratio(r_cold),
         "", ""],
        ["no-op fetch (SshBackend.fetch), ControlMaster alive", fmt_s(median(noop_warm)), fmt_ratio(r_warm),
         "", ""],
        ["no-op rsync -a, aes128-gcm", fmt_s(median(noop_bare)), "", "", ""],
    ]  # fmt: skip
    print_table(
        f"(b) verified fetch of {bed.small_files:,} x {SMALL_BYTES // 1024} KiB files vs rsync -a (seconds,"
        f" medians of {repeats}; ratios vs the rsync row below each)",
        ["what", "seconds", "ratio", "goal", "verdict"],
        rows,
    )
    breakdown = [
        ["master up", *phase_columns(fetch)],
        ["ssh master cold", *phase_columns(fetch_cold)],
    ]
    print_table(
        "    where the verified fetch's time goes (seconds, medians)",
        ["variant", *PHASES, "other"],
        breakdown,
    )
    print_failures(failures)
    return {"small verified fetch": median(totals), "its ratio to rsync": r_small,
            "no-op fetch, master cold": r_cold, "no-op fetch, master alive": r_warm}  # fmt: skip


# ------------------------------------------------------------------ cancel


def kill_marked(marker: bytes) -> int:
    killed = 0
    for _round in range(50):
        pids = marker_processes(marker)
        if not pids:
            break
        for pid in pids:
            argv = read_cmdline(pid)
            if argv is not None and any(marker in arg for arg in argv):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
        time.sleep(0.02)
    return killed


def task_command(marker: str) -> list[str]:
    """sh -c SCRIPT MARKER: a double-forked, setsid descendant, then a sleep.
    The sleeps read MARKER+"1" / MARKER+"2" as extra (tiny) durations."""
    script = f'(setsid sh -c "sleep 300 {marker}1; :" {marker} &); sleep 300 {marker}2; :'
    return ["sh", "-c", script, marker]


def wait_tree_up(marker: str) -> bool:
    wanted = {f"{marker}1".encode(), f"{marker}2".encode()}
    deadline = time.monotonic() + TREE_UP_TIMEOUT
    while time.monotonic() < deadline:
        seen = {
            arg
            for argv in marker_processes(marker.encode()).values()
            if argv[0].rsplit(b"/", 1)[-1] == b"sleep"
            for arg in argv[1:]
        }
        if wanted <= seen:
            return True
        time.sleep(0.01)
    return False


@dataclass
class CancelSample:
    gone: float
    returned: float
    state: str
    ok: bool
    error: str = ""


def cancel_trial(bed: Bed, via: str) -> CancelSample:
    marker = f"0.000{secrets.randbelow(10**12):012d}"
    bed.markers.append(marker.encode())
    spec = make_spec("bench-cancel", task_command(marker), bed.project.root)
    with quiet():
        handle = bed.project.submit(spec, backend="ssh")
    bed.extra_handles.append(handle)
    handle = bed.project.store.read(handle.run_id)
    backend = bed.project.backend_for(handle)
    nan = float("nan")
    if not wait_tree_up(marker):
        return CancelSample(nan, nan, backend.poll(handle).state, False, "the task tree never came up")
    outcome: dict[str, object] = {}
    proc: subprocess.Popen[bytes] | None = None
    done: Callable[[], bool]
    t0 = time.perf_counter()
    if via == "cli":
        cli = subprocess.Popen(
            [*cli_argv(), "--project", str(bed.project.root), "cancel", handle.run_id],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        proc = cli
        done = lambda: cli.poll() is not None  # noqa: E731
    else:

        def call() -> None:
            try:
                outcome["result"] = backend.cancel(handle)
            except Exception as exc:  # noqa: BLE001 - reported in the table
                outcome["error"] = str(exc)

        thread = threading.Thread(target=call, daemon=True)
        thread.start()
        done = lambda: not thread.is_alive()  # noqa: E731
    gone: float | None = None
    returned: float | None = None
    while True:
        now = time.perf_counter()
        if gone is None and not marker_processes(marker.encode()):
            gone = time.perf_counter() - t0
        if returned is None and done():
            returned = time.perf_counter() - t0
        if (gone is not None and returned is not None) or now - t0 > GONE_TIMEOUT:
            break
        time.sleep(SCAN_PAUSE_SECONDS)
    if proc is not None:
        try:
            _out, err = proc.communicate(timeout=GONE_TIMEOUT)
            ok, error = proc.returncode == 0, err.decode(errors="replace").strip()
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            ok, error = False, "the CLI did not exit"
    else:
        ok, error = outcome.get("result") is True, str(outcome.get("error", ""))
    state = backend.poll(bed.project.store.read(handle.run_id)).state
    with quiet(), contextlib.suppress(Exception):
        backend.teardown(bed.project.store.read(handle.run_id))
    return CancelSample(
        nan if gone is None else gone, nan if returned is None else returned, state, ok, error
    )


def bench_cancel(bed: Bed, trials: int) -> dict[str, float]:
    samples: dict[str, list[CancelSample]] = {"cli": [], "in-process": []}
    for i in range(trials):
        for via in ("cli", "in-process") if i % 2 == 0 else ("in-process", "cli"):
            sample = cancel_trial(bed, via)
            samples[via].append(sample)
            if sample.error:
                progress(f"[cancel {via} trial {i + 1}] {sample.error}")
        progress(f"(c) cancel: trial {i + 1}/{trials} done")
    startup = [
        timed(lambda: subprocess.run([*cli_argv(), "--version"], stdout=subprocess.DEVNULL, check=False))
        for _ in range(5)
    ]
    imports = [
        timed(
            lambda: subprocess.run(
                [sys.executable, "-c", CLI_IMPORTS], stdout=subprocess.DEVNULL, check=False
            )
        )
        for _ in range(5)
    ]
    target = bed.backend.settings.target()

    def connect() -> None:
        conn = SshConnection(target)
        try:
            conn.client()
        finally:
            conn.close()

    connects = [timed(connect) for _ in range(5)]
    rows = []
    for via, got in samples.items():
        gone = [s.gone for s in got if not math.isnan(s.gone)]
        back = [s.returned for s in got if not math.isnan(s.returned)]
        worst = max(gone) if len(gone) == len(got) and gone else float("nan")
        cli = via == "cli"
        rows.append([
            "substrax-compute cancel (CLI)" if cli else "backend.cancel() in this process",
            fmt_s(median(gone)), fmt_s(worst), fmt_s(median(back)),
            fmt_s(max(back) if back else float("nan")), f"{len(gone)}/{len(got)}",
            ",".join(sorted({s.state for s in got})), f"{sum(s.ok for s in got)}/{len(got)}",
            f"< {GOAL_CANCEL} s" if cli else "",
            verdict(worst, GOAL_CANCEL, below=True) + " (max)" if cli else "",
        ])  # fmt: skip
    print_table(
        f"(c) cancel -> remote task tree gone (seconds; {trials} trials each)",
        ["via", "gone med", "gone max", "returned med", "returned max", "gone", "state", "exit ok", "goal",
         "verdict"],
        rows,
    )  # fmt: skip
    print(
        f"    CLI start-up alone (substrax-compute --version): median {fmt_s(median(startup))} s;"
        f" python -c 'import the CLI and the ssh backend': {fmt_s(median(imports))} s;"
        f"\n    a new paramiko connection (TCP, key exchange, auth): {fmt_s(median(connects))} s"
    )
    return {f"cancel via {via}, gone": median([c.gone for c in got]) for via, got in samples.items()}


# ------------------------------------------------------------------ profile


def remote_times(bed: Bed, argv: list[str], repeats: int) -> tuple[float, set[int]]:
    """Median seconds of a command over paramiko (open connection), and the
    sizes of its stdout seen (more than one: some output was lost)."""
    conn = bed.backend.conn
    sizes: set[int] = set()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = conn.run(argv)
        times.append(time.perf_counter() - t0)
        if result.returncode != 0:
            raise BenchError(f"{shlex.join(argv)}: {result.stderr.decode(errors='replace')[-500:]}")
        sizes.add(len(result.stdout))
    return median(times), sizes


def bench_profile(bed: Bed, repeats: int) -> None:
    backend = bed.backend
    handle = bed.runs["small"]
    bin_dir = str(handle.backend_state["remote_bin"])
    run_dir = str(handle.backend_state["remote_run_dir"])
    rows: list[list[str]] = []

    def add(what: str, seconds: float, note: str = "") -> None:
        rows.append([what, fmt_s(seconds), note])

    add("paramiko: `true` (connection open)", remote_times(bed, ["true"], repeats)[0])
    add("paramiko: python3 -c pass (remote Python start-up)",
        remote_times(bed, [REMOTE_PYTHON, "-c", "pass"], repeats)[0])  # fmt: skip
    add("paramiko: python3 -I -S -c pass (no site)",
        remote_times(bed, [REMOTE_PYTHON, "-I", "-S", "-c", "pass"], repeats)[0])  # fmt: skip
    status_argv = [REMOTE_PYTHON, f"{bin_dir}/control.py", "status", run_dir]
    add("paramiko: control.py status (the fetch's first call)", remote_times(bed, status_argv, repeats)[0])
    for name in ("big", "small"):
        outputs = [f"{name}/"]
        plain = [REMOTE_PYTHON, f"{bin_dir}/manifest.py", "--", bed.outputs_root[name], *outputs]
        t_plain, sizes = remote_times(bed, plain, max(3, repeats // 3))
        lost = f"; OUTPUT LOST: stdout sizes {sorted(sizes)}" if len(sizes) > 1 else ""
        add(f"paramiko: manifest.py {name}/ (hashes all)", t_plain,
            f"stdout {max(sizes) / 1e6:.2f} MB{lost}")  # fmt: skip
        saved = bed.local / "manifest.json"
        saved.write_bytes(backend.conn.run(plain).stdout)
        try:
            loads = [timed(functools.partial(json.loads, saved.read_bytes())) for _ in range(5)]
            add(f"here: json.loads of that manifest ({name})", median(loads))
        except ValueError as exc:
            add(f"here: json.loads of that manifest ({name})", float("nan"), f"TRUNCATED: {exc}")
    for name, kept in bed.worker_record.items():
        rows.append([f"the manifest the worker kept of {name}/", "", "yes" if kept else "no"])

    target = backend.settings.target()
    ssh_true = [*target.ssh_argv(), bed.host.address, "true"]
    cold, warm = [], []
    for _ in range(repeats):
        target.stop_master()
        cold.append(timed(lambda: subprocess.run(ssh_true, stdin=subprocess.DEVNULL, check=True)))
        warm.append(timed(lambda: subprocess.run(ssh_true, stdin=subprocess.DEVNULL, check=True)))
    add("OpenSSH: ssh HOST true, no ControlMaster (connect + auth)", median(cold))
    add("OpenSSH: ssh HOST true through a live ControlMaster", median(warm))
    target.stop_master()

    # rsync of the 20,000 files, fresh each time, ControlMaster cold
    transport = backend.transport()
    dest = bed.local / "profile"
    source = f"{target.host}:{bed.outputs_root['small'].rstrip('/')}/"
    full = transport._argv(source, f"{dest}/")
    variants = {
        "transport argv (progress2, stats, no-inc-recursive, files-from)": full,
        "  without --info=progress2 --stats": [a for a in full if a not in ("--info=progress2", "--stats")],
        "  without --no-inc-recursive": [a for a in full if a != "--no-inc-recursive"],
    }
    got: dict[str, list[float]] = {k: [] for k in variants}
    through_transport: list[float] = []

    def rsync_once(argv: list[str]) -> float:
        remove(dest)
        dest.mkdir()
        target.stop_master()
        return timed(lambda: subprocess.run(argv, input=b"small\0", stdout=subprocess.DEVNULL, check=True))

    labels = list(variants)
    for i in range(max(3, repeats // 2)):
        for label in labels[i % len(labels) :] + labels[: i % len(labels)]:
            got[label].append(rsync_once(variants[label]))
        remove(dest)
        target.stop_master()
        with quiet():
            through_transport.append(
                timed(lambda: transport.download(bed.outputs_root["small"], ["small"], dest))
            )
    remove(dest)
    for label, times in got.items():
        add(f"rsync small/: {label}", median(times))
    add("rsync small/: RsyncTransport.download (parses its output in Python)", median(through_transport))
    print_table(
        f"    profile: the pieces (seconds, medians of {repeats} unless noted)",
        ["what", "seconds", "note"],
        rows,
    )


# ------------------------------------------------------------------ main


def describe(bed: Bed, login: str) -> None:
    version = subprocess.run(["rsync", "--version"], capture_output=True, text=True, check=False)
    ssh = subprocess.run(["ssh", "-V"], capture_output=True, text=True, check=False)
    print(
        f"substrax-tasks SSH backend bench  |  {platform.node()}  {os.cpu_count()} CPUs  "
        f"Linux {platform.release()}  Python {platform.python_version()}"
        f"\n{version.stdout.splitlines()[0] if version.stdout else 'rsync ?'}; {ssh.stderr.strip()}"
        f"\nhost: {bed.host.destination} port {bed.host.port}, "
        f"{'network namespace ' + str(bed.host.netns) if bed.host.netns else 'loopback'}, login {login}"
        f"\nproject {bed.project.root}; remote_root {bed.remote_root}; remote python {REMOTE_PYTHON}; "
        f"{load_average()}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=5, help="repeats of (a) and (b) (default 5)")
    parser.add_argument("--trials", type=int, default=10, help="cancel trials per way (default 10)")
    parser.add_argument(
        "--login", default=BENCH_USER,
        help=f"the remote user: '{BENCH_USER}' (default; made for the bench, as root) or 'root'",
    )  # fmt: skip
    parser.add_argument("--skip", action="append", default=[],
                        choices=("big", "small", "cancel", "profile"))  # fmt: skip
    parser.add_argument("--strict", action="store_true", help="exit 1 when a goal is missed")
    parser.add_argument("--files", type=int, default=SMALL_FILES,
                        help=f"how many small files (default {SMALL_FILES:,})")  # fmt: skip
    parser.add_argument("--big-mib", type=int, default=BIG_MIB,
                        help=f"the big output's size in MiB (default {BIG_MIB})")  # fmt: skip
    parser.add_argument(
        "--smoke", action="store_true",
        help=f"every part once at a small size ({SMOKE_FILES} files, {SMOKE_BIG_MIB} MiB, one repeat and "
        "trial); exit 1 unless every figure was measured (make bench-smoke)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.smoke:
        args.repeats, args.trials, args.files, args.big_mib = 1, 1, SMOKE_FILES, SMOKE_BIG_MIB
    if args.repeats < 1 or args.trials < 1 or args.files < 1 or args.big_mib < 1:
        parser.error("--repeats, --trials, --files and --big-mib must be at least 1")
    missing = testbed.missing_tools() + [t for t in ("rsync", "sha256sum") if shutil.which(t) is None]
    if missing:
        print(f"cannot run: missing {', '.join(missing)} (apt-get install openssh-server rsync)",
              file=sys.stderr)  # fmt: skip
        return 1
    out = io.StringIO()
    figures: dict[str, float] = {}
    with bench_bed(args.login) as bed:
        bed.small_files, bed.big_mib = args.files, args.big_mib
        describe(bed, "root" if bed.host.user == "root" else bed.host.user)
        needed = {"big"} - set(args.skip)
        if not {"small", "profile"} <= set(args.skip):  # the profile reads the small files' run
            needed.add("small")
        make_data(bed, sorted(needed))
        with contextlib.redirect_stdout(Tee(sys.stdout, out)):
            if "big" not in args.skip:
                figures |= bench_big(bed, args.repeats)
            if "small" not in args.skip:
                figures |= bench_small(bed, args.repeats)
            if "cancel" not in args.skip:
                figures |= bench_cancel(bed, args.trials)
            if "profile" not in args.skip:
                bench_profile(bed, 1 if args.smoke else max(5, args.repeats))
    print(f"\nat the end: {load_average()}")
    if args.smoke:
        return smoke_verdict("bench_ssh.py", figures)
    return 1 if args.strict and "MISSED" in out.getvalue() else 0


class Tee(io.TextIOBase):
    def __init__(self, *streams: io.TextIOBase | Any) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # clean-up already ran in bench_bed()
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
