"""Helpers for the tests of the doit chain: a small project in a temporary
folder, the real `doit` and `substrax-compute` run as processes, and looks
into the store.

Not collected by pytest (the name does not start with test_).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from local_runs import marked_pids
from progress import run as progress_run
from progress import wait_exit as _wait_exit
from progress import wait_for as _wait_for

from substrax_tasks._remote import control

BIN = Path(sys.executable).parent
DOIT = BIN / "doit"
COMPUTE = BIN / "substrax-compute"
REPO = Path(__file__).resolve().parents[2]
GRACE = 0.5
WAIT = 30.0
# The tests of the chain import their waits from here: deadlines that move on
# while the run moves (progress.py).
wait_for = _wait_for
wait_exit = _wait_exit
# remote/manifest.py's racy window for the doit processes of the tests:
# short, so a test need not wait 2 s for a proof or a cached hash.
RACY_SECONDS = "0.1"


def _bwrap_usable() -> bool:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return False
    probe = subprocess.run(
        [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--unshare-pid", "true"],
        capture_output=True,
        timeout=30,
        check=False,
    )
    return probe.returncode == 0


BWRAP = _bwrap_usable()
needs_bwrap = pytest.mark.skipif(not BWRAP, reason="SANDBOX NOT TESTED: bubblewrap is missing or unusable")
# The sandbox of most tests: bubblewrap where it works (as on CI).
DEFAULT_SANDBOX = "bwrap" if BWRAP else "none"
SANDBOXES = [
    pytest.param("none", id="no-sandbox"),
    pytest.param("bwrap", id="bwrap", marks=needs_bwrap),
]

HEADER = """\
from pathlib import Path

from doit import get_var

from substrax_tasks import doit_config, remote_step
"""


# The chain's tests watch runs being made and made again: the run cache
# (test_cache.py) would restore the outputs instead of running the step.
NO_RUN_CACHE = "[tool.substrax.compute.cache]\nenabled = false\n"


def write_pyproject(
    root: Path, sandbox: str = DEFAULT_SANDBOX, extra: str = "", cache: str = NO_RUN_CACHE
) -> None:
    (root / "pyproject.toml").write_text(
        "[tool.substrax.compute.backends.local]\n"
        f'sandbox = "{sandbox}"\n'
        f"grace_seconds = {GRACE}\n" + extra + cache
    )


def write_dodo(root: Path, body: str, default_tasks: Sequence[str] = ()) -> None:
    config = f"DOIT_CONFIG = doit_config(default_tasks={list(default_tasks)!r})\n"
    (root / "dodo.py").write_text(HEADER + config + "\n" + textwrap.dedent(body))


def make_project(
    tmp_path: Path,
    body: str,
    default_tasks: Sequence[str] = (),
    sandbox: str = DEFAULT_SANDBOX,
    files: Mapping[str, str] | None = None,
) -> Path:
    """A project folder with pyproject.toml, dodo.py (HEADER + body) and files."""
    root = tmp_path / "proj"
    root.mkdir(exist_ok=True)
    write_pyproject(root, sandbox)
    write_dodo(root, body, default_tasks)
    for rel, text in (files or {}).items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SUBSTRAX_", "DOIT_"))}
    env["PYTHONUNBUFFERED"] = "1"
    env["SUBSTRAX_RACY_SECONDS"] = RACY_SECONDS
    env.update(extra or {})
    return env


def doit(
    root: Path, *args: str, env: Mapping[str, str] | None = None, timeout: float = 90
) -> subprocess.CompletedProcess[str]:
    """Run the real `doit ARGS` in the project; stdout and stderr captured.
    Killed after `timeout` seconds with nothing moving (progress.run)."""
    return progress_run([str(DOIT), *args], cwd=root, env=clean_env(env), timeout=timeout)


def doit_ok(root: Path, *args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    done = doit(root, *args, env=env)
    assert done.returncode == 0, show(done)
    return done


# Exec doit with SIGINT, SIGTERM and SIGHUP at their defaults: a test run
# started with them ignored (`nohup`, `cmd &` in a script) passes that on to
# every child, and doit, like any program, keeps a signal ignored that it was
# started with. The pid stays doit's.
EXEC_WITH_DEFAULT_SIGNALS = """
import os, signal, sys
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, signal.SIG_DFL)
os.execv(sys.argv[1], sys.argv[1:])
"""


def popen_doit(root: Path, *args: str, env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    """`doit ARGS` started in the background, its output in files beside the
    project (read them with `popen_output`); signals as a terminal gives them."""
    out = (root.parent / "doit.out").open("w")
    err = (root.parent / "doit.err").open("w")
    try:
        return subprocess.Popen(
            [sys.executable, "-c", EXEC_WITH_DEFAULT_SIGNALS, str(DOIT), *args],
            cwd=root, env=clean_env(env), stdout=out, stderr=err, text=True,
        )
    finally:
        out.close()
        err.close()


def popen_output(root: Path) -> str:
    return (root.parent / "doit.out").read_text() + (root.parent / "doit.err").read_text()


def stop(proc: subprocess.Popen[str]) -> None:
    """Stop a process this test started, by its pid."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def compute(
    root: Path, *args: str, timeout: float = 60, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return progress_run([str(COMPUTE), "--project", str(root), *args], cwd=root, env=clean_env(env),
                        timeout=timeout)  # fmt: skip


def show(done: subprocess.CompletedProcess[str]) -> str:
    return f"exit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"


# -------------------------------------------------------------------- store


def run_dirs(root: Path) -> list[Path]:
    runs = root / ".substrax" / "runs"
    return sorted(p for p in runs.iterdir() if p.is_dir()) if runs.is_dir() else []


def run_count(root: Path) -> int:
    return len(run_dirs(root))


def handles(root: Path) -> list[dict[str, Any]]:
    found = [json.loads((d / "handle.json").read_text()) for d in run_dirs(root)]
    return sorted(found, key=lambda h: str(h["created_at"]))


def runs_of(root: Path, step: str) -> list[dict[str, Any]]:
    return [h for h in handles(root) if h["step"] == step]


def status_records(root: Path) -> list[dict[str, Any]]:
    """The worker's status file of each run (runs without one are left out)."""
    found = []
    for d in run_dirs(root):
        path = d / "status.json"
        if path.exists():
            found.append(json.loads(path.read_text()))
    return found


def compute_status(root: Path) -> list[dict[str, Any]]:
    """Every run of the project, oldest first (`status --all --json`)."""
    done = compute(root, "status", "--all", "--json")
    assert done.returncode == 0, show(done)
    runs: list[dict[str, Any]] = json.loads(done.stdout)["runs"]
    return runs


def step_ran(done: subprocess.CompletedProcess[str], task: str) -> bool:
    """doit printed that it executed `task` (".  task")."""
    return any(line.strip() in (f".  {task}",) for line in done.stdout.splitlines())


def step_skipped(done: subprocess.CompletedProcess[str], task: str) -> bool:
    """doit printed that `task` was up to date ("-- task")."""
    return any(line.strip() == f"-- {task}" for line in done.stdout.splitlines())


# ---------------------------------------------------------------- processes


def pid_alive(pid: int) -> bool:
    """Alive and not a zombie."""
    return control.start_ticks(pid) is not None


def pids_with(marker: str) -> list[int]:
    """Live processes whose argv holds `marker` (conftest's scan)."""
    return marked_pids(marker)


def kill_pids(pids: Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def stop_marked(marker: str) -> None:
    """Kill, by pid, what is left of a task tree carrying `marker`."""
    kill_pids(pids_with(marker))


def worker_pids(root: Path) -> list[int]:
    """Workers of the project's runs that are still alive."""
    pids = []
    for record in status_records(root):
        pid = record.get("worker_pid")
        if isinstance(pid, int) and pid_alive(pid):
            pids.append(pid)
    return pids


def tree_files(base: Path) -> dict[str, str]:
    """rel path -> content of every file under base (for comparing outputs)."""
    return {
        p.relative_to(base).as_posix(): p.read_text()
        for p in sorted(base.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


# ------------------------------------------------------------------ modes

UNSAFE_BITS = 0o7002  # setuid, setgid, sticky, world-writable: what no output keeps


def unsafe_modes(root: Path, outputs: Sequence[str]) -> dict[str, str]:
    """Each file and folder of `outputs` under `root` that keeps an unsafe
    bit, with its mode (symlinks aside: their mode means nothing)."""
    found = {}
    for out in outputs:
        top = root / out
        for path in [top, *(top.rglob("*") if top.is_dir() else [])]:
            mode = path.lstat().st_mode
            if not path.is_symlink() and mode & UNSAFE_BITS:
                found[str(path.relative_to(root))] = f"{mode & 0o7777:04o}"
    return found
