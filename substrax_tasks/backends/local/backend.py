"""The local backend: the step runs on this machine, under bubblewrap.

As over ssh, the command sees the step's declared inputs and the lock file
of the project only (project_view.py), with the environment built from the lock
file (remote/env.py, into the store's `envs/`) first on its PATH.

The run's folder in the store is also its working folder; the worker is
started detached (its own session, double-forked), so it goes on if the
client exits. Status and cancel are `remote/control.py`'s, as for every
backend, called here in this process.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from substrax_tasks._remote import checkpoints, control, env, gpus, sandbox
from substrax_tasks.atomic import write_json_atomic
from substrax_tasks.backends import gpus as _gpus
from substrax_tasks.backends.base import Backend, Capabilities, Fetched, RunStatus
from substrax_tasks.backends.checkpoints import LIVE, checkpoints_folder, live_folder
from substrax_tasks.backends.job import (
    WorkerPaths,
    build_job,
    damaged_status,
    env_dir_of,
    status_from_record,
)
from substrax_tasks.backends.local.program import resolve_program, show_toolchains
from substrax_tasks.backends.local.settings import LocalSettings
from substrax_tasks.backends.scripts import remote_dir
from substrax_tasks.backends.state import BackendState
from substrax_tasks.console import emit
from substrax_tasks.errors import BackendError, SubstraxError
from substrax_tasks.hardlinks import link_tree
from substrax_tasks.poll import wait_readable
from substrax_tasks.step.view import project_view, written_paths
from substrax_tasks.store.cost import cap_deadline
from substrax_tasks.store.handle import RunHandle
from substrax_tasks.uptodate import manifests as manifest_cache

START_TIMEOUT_SECONDS = 30.0  # worker start-up; bubblewrap probe included
CANCEL_MARGIN_SECONDS = 10.0  # beyond the grace period, for the SIGKILL and reap
SPAWNER_EXIT_SECONDS = 1.0  # it exits as its stdin closes


class LocalBackend(Backend):
    name = "local"
    Settings = LocalSettings
    State = BackendState  # it keeps nothing in the handle: its run's folder is here
    capabilities = Capabilities(interrupt_cancels=True, checkpoints=True)
    settings: LocalSettings

    def paths(self, handle: RunHandle) -> WorkerPaths:
        return WorkerPaths(
            project=str(handle.state.project),
            run_dir=str(self.store.run_dir(handle.run_id)),
        )

    def launch(self, handle: RunHandle) -> RunHandle:
        if self.settings.sandbox == "bwrap" and shutil.which("bwrap") is None:
            raise BackendError(
                'sandbox = "bwrap" in [tool.substrax.compute.backends.local] but bubblewrap '
                "is not installed; install it (apt-get install bubblewrap) or set "
                'sandbox = "auto" to run without it'
            )
        project = handle.state.project
        if not project:
            raise BackendError(f"run {handle.run_id}: its handle names no project folder")
        paths = self.paths(handle)
        Path(paths.staging).mkdir(parents=True, exist_ok=True)
        lock = env.lock_file(str(project))
        built_as = env.digest(str(project), lock, sys.executable, self.settings.pip_args) if lock else ""
        if lock is not None and not (Path(self.store.envs_dir) / built_as / env.READY).is_file():
            emit(f"{handle.step}: building the environment from {lock}")  # said before its wait
        try:  # the interpreter running doit makes the venv, as the user's own would
            built = env.ensure(str(project), str(self.store.envs_dir), sys.executable,
                                  self.settings.pip_args)  # fmt: skip
        except env.BuildFailed as exc:  # the lock (or pip_args) cannot be met: the step fails, exit 1
            raise SubstraxError(
                f"run {handle.run_id}: building the environment: {exc}; fix the lock file or pip_args"
            ) from None
        env_dir = env_dir_of(handle.step, built)
        # What ssh and skypilot would upload is all the sandbox shows.
        view = project_view(Path(project), self.store.root, handle.spec.inputs, written_paths(handle.spec))
        job = build_job(
            handle.spec,
            paths,
            sandbox=self.settings.sandbox,
            network_isolation=self.settings.network_isolation,
            grace_seconds=self.settings.grace_seconds,
            hide=[str(Path.home())],
            extra_ro=interpreter_paths(),
            env_dir=env_dir,
            cache_dirs=self.settings.cache_dirs,
            cache_root=str(self.store.home_cache),
            project_hidden=view.hidden,
            project_shown=view.files,
            left_out=view.left_out,
            gpus=_gpus.job_gpus(
                handle.spec, self.settings.hide_gpus_when_unasked, gpus.host_gpus,
                # where ssh runs keep theirs by default: one holder per GPU of this machine
                str(Path.home() / ".substrax-remote" / "gpus"), "this machine",
            ),
            checkpoints_kept=live_folder(self.store, handle),
            timeout_spent=handle.state.command_seconds_spent(),
            cap=cap_deadline(handle),
        )
        if self.settings.sandbox != "none":  # without one, the worker finds what doit would
            # The argv's program first, as asked here; then what a shell or
            # a script finds on the task's PATH in the sandbox.
            resolve_program(job, {**os.environ, **handle.spec.env})
            show_toolchains(job, {**os.environ, **handle.spec.env})
        write_json_atomic(Path(paths.job), job)
        return handle

    def relaunch(self, handle: RunHandle) -> RunHandle:
        """This machine again, in the run's own folder: what the lost
        attempt left running is stopped (without a sandbox its command's
        tree outlives a killed worker), its status and log kept aside in
        `attempt-<n>/`, its half-written outputs removed; then launched as
        a new run is. Its checkpoints stay where they are, bound in place
        (without a sandbox: kept back from the project first)."""
        self.cancel(handle)
        paths = self.paths(handle)
        folder = checkpoints_folder(self.store, handle)
        kept = None if folder is None else str(folder / LIVE)
        written = (self._record(handle) or {}).get("checkpoints_root")
        if kept is not None and isinstance(written, str) and written != kept:
            # Without a sandbox the command wrote them in the project, and its
            # worker, killed, never kept them back as it does when a command ends.
            checkpoints.keep_from_place(written, kept)
        run_dir = Path(paths.run_dir)
        lost = handle.state.attempts[-2].number if len(handle.state.attempts) > 1 else 1
        aside = run_dir / f"attempt-{lost}"
        aside.mkdir(mode=0o700, exist_ok=True)
        for file in (paths.status, paths.log):
            with contextlib.suppress(FileNotFoundError):
                Path(file).replace(aside / Path(file).name)
        shutil.rmtree(Path(paths.staging).parent, ignore_errors=True)
        return self.launch(handle)

    def snapshot_of(self, handle: RunHandle) -> str | None:
        """The checkpoints are kept in place (bound into the sandbox): the
        attempt starts from what its folder holds."""
        folder = checkpoints_folder(self.store, handle)
        live = None if folder is None else folder / LIVE
        held = 0 if live is None else sum(len(files) for _top, _dirs, files in os.walk(live))
        return f"{held} file(s) left in its checkpoints folder" if held else None

    def start(self, handle: RunHandle) -> RunHandle:
        paths = self.paths(handle)
        # The worker holds only what its task may see (the task can read its
        # /proc/<pid>/environ without a sandbox): the plain settings and
        # substrax's own SUBSTRAX_* settings; the step's secrets only in memory.
        secrets = {name: os.environ[name] for name in handle.spec.forward_env if name in os.environ}
        # Returns once the worker has started the command (or failed to).
        request = {
            "job": paths.job, "log": paths.log, "env": worker_environment(), "secrets": secrets,
            "sandbox": self.settings.sandbox,
        }
        code, problem = _SPAWNER.start(request)
        if code == _gpus.WORKER_BUSY:
            raise _gpus.busy(json.loads(Path(paths.job).read_text())["gpus"], "this machine")
        status = self.poll(handle)
        if code != 0 or status.state == "pending":
            tail = self.read_log(handle, 0)[-2000:].decode(errors="replace")
            raise BackendError(
                f"run {handle.run_id}: the worker failed to start ({problem or f'exit {code}'}): {tail}"
            )
        return handle

    def _record(self, handle: RunHandle) -> dict[str, Any] | None:
        return control.read_json(self.paths(handle).status)

    def hourly_price(self, handle: RunHandle) -> float | None:
        """This machine costs nothing unless `hourly_cost` says it does."""
        return 0.0

    def poll(self, handle: RunHandle) -> RunStatus:
        record = control.status(str(self.store.run_dir(handle.run_id)))
        if record.get("damaged"):
            return damaged_status(record)
        if record.get("state") is None:
            if not record.get("exists"):  # deleted by hand: nothing can record its end
                return RunStatus("lost", message=(
                    f"its run folder {self.store.run_dir(handle.run_id)} was deleted while it went on "
                    "(its worker stops the command when it sees that)"))  # fmt: skip
            return RunStatus("pending")
        return status_from_record(record, worker_alive=bool(record.get("worker_alive")))

    def pause(self, handle: RunHandle, seconds: float) -> bool:
        """Sleep until the run's worker exits (it writes the final status
        first), or `seconds` pass: a short step is seen to end at once, not
        at the next poll. The worker is detached, so it is not our child to
        wait for: a pidfd (Linux 5.3) is, and it stays bound to that process
        whatever pid is reused; the start ticks checked after opening it
        prove it is the run's worker."""
        record = self._record(handle) or {}
        pid = record.get("worker_pid")
        if not isinstance(pid, int):  # no worker yet
            time.sleep(seconds)
            return False
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:  # it has exited: its end is there to read
            return True
        except OSError:  # no pidfd on this kernel
            time.sleep(seconds)
            return False
        try:
            if not control.alive(pid, record.get("worker_start_ticks")):
                return True
            return wait_readable(fd, seconds)
        finally:
            os.close(fd)

    def cancel(self, handle: RunHandle) -> bool:
        status = self.poll(handle)
        if status.final and status.state != "lost":  # a lost run's tree may still be alive
            return False
        wait = self.settings.grace_seconds + CANCEL_MARGIN_SECONDS
        answer = control.cancel(str(self.store.run_dir(handle.run_id)), wait)
        if answer.get("cancelled"):
            return True
        if answer.get("reason") in ("finished", "not started"):  # ended meanwhile, or no run folder
            return False
        raise BackendError(f"run {handle.run_id}: {answer.get('reason')}")

    def read_log(self, handle: RunHandle, offset: int) -> bytes:
        try:
            with Path(self.paths(handle).log).open("rb") as f:
                f.seek(offset)
                return f.read(1 << 20)
        except FileNotFoundError:
            return b""

    def fetch(self, handle: RunHandle) -> Fetched:
        """Nothing crosses a network: the outputs are hard-linked from the
        run's staging folder into a fresh fetch folder, so a promotion that
        fails half-way can be redone from the untouched staging folder.
        Without a sandbox the outputs were written in place."""
        record = self._record(handle) or {}
        root = record.get("outputs_root")
        if not isinstance(root, str):
            raise BackendError(f"run {handle.run_id}: its status names no outputs folder")
        outputs = list(handle.spec.outputs)
        # The manifest the worker took as the command ended, if any (else one taken now).
        manifest = manifest_cache.read_manifest_file(self.store.run_dir(handle.run_id) / "manifest.json")
        if manifest is None:
            manifest = manifest_cache.build_manifest(Path(root), outputs)
        if record.get("sandbox") == "none":  # written in place: the root is the project's own
            return Fetched(Path(root), manifest, saw_whole_project=True)
        fetched = self.store.run_dir(handle.run_id) / "fetched"
        shutil.rmtree(fetched, ignore_errors=True)
        for out in outputs:
            link_tree(Path(root) / out.rstrip("/"), fetched / out.rstrip("/"))
        return Fetched(fetched, manifest)

    def outputs_available(self, handle: RunHandle) -> bool:
        """Until teardown empties it (the chain does, after promotion), the
        sandbox's staging folder holds the outputs."""
        record = self._record(handle) or {}
        root = record.get("outputs_root")
        return record.get("sandbox") != "none" and isinstance(root, str) and Path(root).is_dir()

    def forget(self, handle: RunHandle) -> str:
        # The run's folder is the one that was deleted: its worker sees that
        # and stops the command (remote/worker.py); nothing else holds it.
        return "its worker stops the command when it sees its folder gone"

    def teardown(self, handle: RunHandle, *, force: bool = False) -> None:
        self.cancel(handle)  # leaves a finished run alone
        work = Path(self.paths(handle).staging).parent
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(self.store.run_dir(handle.run_id) / "fetched", ignore_errors=True)
        if work.exists():
            raise BackendError(f"run {handle.run_id}: could not remove {work}")


class Spawner:
    """The client's end of `spawner.py`: one per process, started at its
    first local run, and asked in turn (a lock) by the threads of `doit -n N
    -P thread`. It ends when this process closes its stdin: at exit, or
    killed with it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._closed_at_exit = False

    def start(self, request: dict[str, Any]) -> tuple[int, str]:
        """(the worker's `--detach` exit code, what went wrong if nothing answered)."""
        with self._lock:
            proc = self._running()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(json.dumps(request).encode() + b"\n")
                proc.stdin.flush()
                answered = wait_readable(proc.stdout, START_TIMEOUT_SECONDS)
                line = proc.stdout.readline() if answered else b""
            except OSError as exc:  # it died: the next start makes a new one
                self._stop()
                return -1, f"the worker spawner stopped ({exc})"
            except BaseException:  # an answer left unread would be taken for the next run's
                self._stop()
                raise
            if not line:
                self._stop()
                if answered:
                    return -1, "the worker spawner stopped"
                return -1, f"the worker did not start within {START_TIMEOUT_SECONDS:.0f} s"
            return int(line), ""

    def _running(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is not None:
            self.close()  # it died (killed with its session?): its pipes go with it
        if self._proc is None:
            if not self._closed_at_exit:  # registered on first use: a plain import adds no exit hook
                atexit.register(self.close)
                self._closed_at_exit = True
            self._proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).with_name("spawner.py")), str(remote_dir())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,  # each run's failure goes to its own log
                start_new_session=True,  # no Ctrl-C from the terminal: its client decides
                env=worker_environment(),
            )
        return self._proc

    def _stop(self) -> None:
        """Kill it, and a start stuck in it (its group; the workers left it)."""
        if self._proc is not None:
            with contextlib.suppress(OSError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self.close()

    def close(self) -> None:
        if self._proc is not None:
            proc, self._proc = self._proc, None
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=SPAWNER_EXIT_SECONDS)


_SPAWNER = Spawner()


def worker_environment() -> dict[str, str]:
    """This process's environment as a worker may hold it."""
    return {
        **sandbox.plain_settings(os.environ),
        **{name: value for name, value in os.environ.items() if name.startswith("SUBSTRAX_")},
    }


def interpreter_paths() -> list[str]:
    """The Python running doit stays visible when $HOME is hidden (a venv,
    pyenv or conda interpreter often lives there), read-only."""
    paths = {sys.prefix, sys.base_prefix, str(Path(sys.executable).resolve().parent.parent)}
    return sorted(paths)
