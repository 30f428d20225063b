"""Shared parts of the tests: real processes, real bubblewrap, no mocks.

Every process a test starts is found and stopped by pid: task trees carry a
unique marker in their argv (see `marker`), and every worker that left a
status file under the test's tmp_path is stopped when the test ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from progress import run as progress_run
from progress import wait_for as progress_wait_for

from substrax_tasks._remote import control
from substrax_tasks.backends.job import STATUS_FILE
from substrax_tasks.config.pyproject import cache_file
from substrax_tasks.step.spec import make_spec
from substrax_tasks.store.handle import RunHandle
from substrax_tasks.store.project import Project

# What a test marked `unit` may not do (enforced there); fixtures shared by
# the modules: the S3 server of the bucket transport, the session's SSH hosts
# (`host`, `root_host`).

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "remote" / "worker.py"
PY38 = Path("/root/.pyenv/versions/3.8.18/bin/python")
GRACE = 0.5  # grace_seconds of every test run: SIGTERM, then SIGKILL after this
WAIT = 30.0  # deadline for conditions, without progress (progress.py)


# ---------------------------------------------------------------- bubblewrap


def _bwrap_problem() -> str | None:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bubblewrap (bwrap) is not installed; apt-get install bubblewrap"
    probe = subprocess.run(
        [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--unshare-pid", "true"],
        capture_output=True,
        timeout=30,
        check=False,
    )
    if probe.returncode != 0:
        return f"bubblewrap is installed but unusable here: {probe.stderr.decode(errors='replace').strip()}"
    return None


BWRAP_PROBLEM = _bwrap_problem()
needs_bwrap = pytest.mark.skipif(
    BWRAP_PROBLEM is not None, reason=f"SANDBOX NOT TESTED: {BWRAP_PROBLEM}"
)
SANDBOXES = [
    pytest.param("none", id="no-sandbox"),
    pytest.param("bwrap", id="bwrap", marks=needs_bwrap),
]


# ----------------------------------------------------------------- processes


def wait_for(
    condition: Callable[[], object],
    what: str,
    timeout: float = WAIT,
    progress: Callable[[], object] | None = None,
) -> None:
    """Poll `condition` until it holds; fails after `timeout` seconds with no
    progress in the test's folder (or of `progress()`): see progress.py."""
    progress_wait_for(condition, what, timeout, progress)


def marked_pids(marker: str) -> list[int]:
    """Live processes (zombies count as gone) whose argv contains `marker`."""
    needle = marker.encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if needle in cmdline and control.start_ticks(int(entry)) is not None:
            found.append(int(entry))
    return found


def describe(pids: Sequence[int]) -> str:
    """For failure messages: what those processes are."""
    lines = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            cmd = "(gone)"
        lines.append(f"{pid}: {cmd[:200]}")
    return "\n".join(lines)


def kill_pid(pid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def stop_worker(status_file: Path) -> None:
    """Stop the worker that writes `status_file`, if it still runs: SIGTERM
    (it then stops its own tree), SIGKILL if it does not go."""
    try:
        record = json.loads(status_file.read_text())
    except (OSError, ValueError):
        return
    pid, ticks = record.get("worker_pid"), record.get("worker_start_ticks")
    if not control.alive(pid, ticks):
        return
    kill_pid(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while control.alive(pid, ticks) and time.monotonic() < deadline:
        time.sleep(0.02)
    if control.alive(pid, ticks):
        kill_pid(pid)


_CONFIG_CACHES_BEFORE = pytest.StashKey[set[Path]]()


def _config_caches() -> set[Path]:
    folder = cache_file(Path("/")).parent
    return set(folder.glob("config-*.json")) if folder.is_dir() else set()


# Each test project leaves a cached configuration in the private temp folder
# (substrax_tasks/config/pyproject.py); the ones this run made are removed at its end.
# Hooks, not a session fixture: under xdist each worker is a session of its
# own, and one that ends first would remove the caches of the projects the
# other is still running; so only the process that outlives every worker
# (xdist's controller, or pytest itself when run serially) looks.
def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):
        session.stash[_CONFIG_CACHES_BEFORE] = _config_caches()


def pytest_sessionfinish(session: pytest.Session) -> None:
    before = session.stash.get(_CONFIG_CACHES_BEFORE, None)
    if before is not None:
        for path in _config_caches() - before:
            path.unlink(missing_ok=True)


@pytest.fixture(autouse=True)
def _own_run_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's doit processes keep their run cache (docs/cache.md) in
    the test's folder, never the user's ~/.cache nor another test's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


@pytest.fixture(autouse=True)
def _stop_workers_left_running(tmp_path: Path) -> Iterator[None]:
    """A failing test must not leave a worker behind."""
    yield
    for status_file in tmp_path.rglob(STATUS_FILE):
        stop_worker(status_file)


@pytest.fixture
def marker() -> Iterator[str]:
    """A unique string put in the argv of every process of a task tree, so
    the test finds them in /proc (inside a pid namespace too)."""
    value = f"substrax-test-{uuid.uuid4().hex}"
    yield value
    for pid in marked_pids(value):
        kill_pid(pid)


# -------------------------------------------------------------------- tasks

# A descendant that ignores SIGTERM; "$0" is the marker, "$1" its role. It
# writes out/<role>.ready holding its pid and session once its trap is set;
# written under another name and renamed, so that a test polling for the
# file never reads it empty (the shell creates the file before it writes).
DESCENDANT = (
    'trap "" TERM INT HUP; echo "$$ $(cut -d " " -f 6 /proc/$$/stat)" > "out/$1.part"; '
    'mv "out/$1.part" "out/$1.ready"; '
    "while :; do sleep 1; done"
)
# The task: ignores SIGTERM and starts one descendant, either a plain
# background child or one that double-forks and calls setsid.
STUBBORN_TASK = """
trap "" TERM INT HUP
if [ "$2" = setsid ]; then
  ( setsid sh -c "$1" "$0" grandchild & )
else
  sh -c "$1" "$0" child &
fi
echo "$$ $(cut -d " " -f 6 /proc/$$/stat)" > out/task.part
mv out/task.part out/task.ready
echo "task started ($2)"
while :; do sleep 1; done
"""


def stubborn_tree(marker: str, descendant: str = "child") -> list[str]:
    """argv of a task that ignores SIGTERM and whose descendant
    ("child", or "grandchild": double fork + setsid) ignores it too.
    It needs the output folder `out/`."""
    assert descendant in ("child", "grandchild")
    mode = "setsid" if descendant == "grandchild" else "plain"
    return ["sh", "-c", STUBBORN_TASK, marker, DESCENDANT, mode]


def ready_files(out_root: Path, descendant: str) -> tuple[Path, Path]:
    return out_root / "out" / "task.ready", out_root / "out" / f"{descendant}.ready"


def read_pid_sid(path: Path) -> tuple[int, int]:
    pid, sid = path.read_text().split()
    return int(pid), int(sid)


# ------------------------------------------------------------------ projects


@pytest.fixture
def project_dir(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    root.mkdir()
    return root


@pytest.fixture
def project(project_dir: Path) -> Project:
    return Project.open(project_dir)


def submit(
    project: Project,
    command: Sequence[str],
    *,
    sandbox: str = "none",
    step: str = "step",
    inputs: Sequence[str] = (),
    outputs: Sequence[str] = (),
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    **settings: Any,
) -> RunHandle:
    spec = make_spec(
        step, list(command), project.root, inputs=inputs, outputs=outputs, env=env, timeout=timeout
    )
    return project.submit(spec, settings={"sandbox": sandbox, "grace_seconds": GRACE, **settings})


def run_dir(project: Project, handle: RunHandle) -> Path:
    return project.store.run_dir(handle.run_id)


def status_record(project: Project, handle: RunHandle) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((run_dir(project, handle) / STATUS_FILE).read_text())
    return data


def outputs_root(project: Project, handle: RunHandle) -> Path:
    """Where the run's outputs land: the project, or the sandbox's staging."""
    return Path(status_record(project, handle)["outputs_root"])


def log_text(project: Project, handle: RunHandle) -> str:
    return project.backend_for(handle).read_log(handle, 0).decode(errors="replace")


def wait_final(project: Project, handle: RunHandle, timeout: float = WAIT) -> str:
    backend = project.backend_for(handle)
    wait_for(lambda: backend.poll(handle).final, f"run {handle.run_id} to finish", timeout)
    return backend.poll(handle).state


# ----------------------------------------------------------------------- CLI

_CONSOLE_SCRIPT = Path(sys.executable).with_name("substrax-compute")


def cli_argv() -> list[str]:
    if _CONSOLE_SCRIPT.exists():
        return [str(_CONSOLE_SCRIPT)]
    return [sys.executable, "-m", "substrax_tasks.cli.main"]


def cli(project_root: Path | None, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run `substrax-compute [--project ROOT] ARGS` as its own process."""
    argv = cli_argv() + (["--project", str(project_root)] if project_root is not None else [])
    return progress_run([*argv, *args], timeout=timeout)


def on_a_terminal(argv: list[str], timeout: float = 60) -> str:
    """Run `argv` with a pseudo-terminal (120 columns) as its stdout and
    stderr; what it showed there, once it exited with 0."""
    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower,
            env={**os.environ, "COLUMNS": "120", "TERM": "xterm"},
        )  # fmt: skip
        os.close(follower)
        shown = bytearray()
        while True:
            try:
                chunk = os.read(leader, 1 << 16)
            except OSError:  # EIO: the terminal's other end is closed
                break
            if not chunk:
                break
            shown += chunk
        assert proc.wait(timeout=timeout) == 0, shown.decode(errors="replace")
    finally:
        os.close(leader)
    return shown.decode(errors="replace")


@pytest.fixture
def tcp_server() -> Iterator[socket.socket]:
    """A listening TCP socket on the host's 127.0.0.1."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield server
    server.close()


def connections_made(server: socket.socket) -> int:
    server.setblocking(False)
    count = 0
    while True:
        try:
            conn, _ = server.accept()
        except BlockingIOError:
            return count
        conn.close()
        count += 1
