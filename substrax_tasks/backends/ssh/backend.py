"""The SSH backend: the step runs on a host you can ssh to.

paramiko runs the commands (host keys verified), rsync moves the files;
what it shares with the SkyPilot backend is in _remote_run.py. On the host,
everything of a run lives in `<remote_root>/runs/<run-id>/`:

    job.json status.json run.log watchdog.json
    client-<id>/    marks the folder as made by the client whose state folder holds that
                    random id (store.client_id; gc --machines removes only its own)
    manifest.json   the outputs' manifest, written by the worker as the command ended
    project/        the step's declared inputs and the lock file (read-only to the task)
    work/outputs/   what the sandboxed task writes (the outputs' folders)

and `<remote_root>/bin-<digest>/` holds the stdlib-only scripts (worker,
manifest, control, env), `<remote_root>/envs/<lock digest>/` the
environments remote/env.py builds, reused while the lock file is unchanged.
"""

from __future__ import annotations

import functools
import json
import shutil
import time
from pathlib import Path, PurePosixPath
from typing import IO, TYPE_CHECKING, Any

from pydantic import Field

from substrax_tasks._remote import env
from substrax_tasks.backends import gpus as _gpus
from substrax_tasks.backends import remote_run as _remote_run
from substrax_tasks.backends.base import Backend, Capabilities, Fetched, RunStatus
from substrax_tasks.backends.checkpoints import Snapshots, checkpoints_folder
from substrax_tasks.backends.job import (
    WorkerPaths,
    build_job,
    env_dir_of,
    project_key,
)
from substrax_tasks.backends.remote_run import DamagedHost, RemoteRun
from substrax_tasks.backends.scripts import REMOTE_SCRIPTS, remote_script
from substrax_tasks.backends.ssh.connection import NoSession, SshConnection, connection
from substrax_tasks.backends.ssh.settings import SshSettings
from substrax_tasks.backends.state import RemoteState
from substrax_tasks.console import emit
from substrax_tasks.errors import BackendError, SubstraxError
from substrax_tasks.interrupts import check_interrupted
from substrax_tasks.slots import Pool
from substrax_tasks.step.view import project_view, written_paths
from substrax_tasks.store.cost import cap_deadline, watchdog_seconds
from substrax_tasks.store.handle import RunHandle
from substrax_tasks.transports.rsync import RsyncTransport

if TYPE_CHECKING:
    from substrax_tasks.backends.base import Leak

# Made from a random id kept in the state folder, never from the project's
# path, which two clients may share (CI jobs, containers at /workspace);
# folders marked `from-<project>` by earlier releases are no one's to gc.
OWNER_MARK = "client-"
# The absolute runs folder, then each run folder: "+name" marked as this
# client's ($2), "-name" not. Nothing when there is no runs folder.
LIST_RUNS = (
    'cd && cd "$1" 2>/dev/null || exit 0; pwd; '
    'for d in */; do [ -d "$d" ] || continue; d=${d%/}; '
    'if [ -e "$d/$2" ]; then echo "+$d"; else echo "-$d"; fi; done'
)


# An environment on a host that no run folder there names and none used
# for this long is removed by `gc --machines` (remote/env.py --collect).
ENV_UNUSED_DAYS = 7.0

# How long a relaunch waits for a host that does not answer (rebooting),
# trying every HOST_WAIT_POLL_SECONDS.
HOST_WAIT_SECONDS = 600.0
HOST_WAIT_POLL_SECONDS = 2.0


def run_folder_name(handle: RunHandle) -> str:
    """The run's folder under `runs/` there: its id, and for a relaunch
    (`preemptions`) the attempt's number too, a folder of its own."""
    attempts = len(handle.state.attempts)
    return handle.run_id if attempts <= 1 else f"{handle.run_id}-attempt{attempts}"


class SshState(RemoteState):
    """What the ssh backend keeps in a run's handle."""

    remote_root: str | None = None  # absolute, on the host
    remote_run_dir: str | None = None  # the run's folder there: set once launched
    remote_bin: str | None = None  # the worker scripts this client sent
    remote_home: str | None = None  # the login's home, hidden from the sandbox
    gpus: Any = None  # what the job is given (backends/gpus.py)
    env_dir: str | None = None  # the environment built there
    uploaded: int | None = None  # files the sync sent
    left_out: list[str] = Field(default_factory=list)  # what the project's view left out
    outputs_root: str | None = None  # where its outputs are there, from its final status


class SshBackend(Backend):
    name = "ssh"
    Settings = SshSettings
    State = SshState
    settings: SshSettings
    capabilities = Capabilities(checkpoints=True)
    # The run's checkpoints, pulled between polls while a log is followed by polling.
    _pulling: _remote_run.CheckpointPuller | None = None

    # ---------------------------------------------------------- helpers
    @property
    def conn(self) -> SshConnection:
        return connection(self.settings.target())

    def transport(self) -> RsyncTransport:
        return RsyncTransport(self.settings.target(), excludes=self.settings.copy_.excludes)

    def _state(self, handle: RunHandle, key: str) -> str:
        value = getattr(SshState.of(handle), key)
        if not isinstance(value, str):
            raise BackendError(f"run {handle.run_id}: no {key} recorded yet (was it launched?)")
        return value

    def _on_host(self, handle: RunHandle) -> bool:
        """The run has a folder on the host: launched and not torn down."""
        own = SshState.of(handle)
        return own.remote_run_dir is not None and not own.torn_down

    def remote_run(self, handle: RunHandle) -> RemoteRun:
        return RemoteRun(
            self.conn, self.settings.python, self._state(handle, "remote_bin"),
            self._state(handle, "remote_run_dir"), _remote_run.lifetime_end(self.lifetime_left(handle)),
        )  # fmt: skip

    def slot_pool(self, handle: RunHandle) -> Pool | None:
        """max_parallel counts the runs on one host (and port), whichever settings name it."""
        limit, host = self.settings.max_parallel, self.settings.host
        return None if limit is None else Pool(f"ssh-{host}-{self.settings.port}", limit, host)

    # ----------------------------------------------------------- phases
    def launch(self, handle: RunHandle) -> RunHandle:
        conn = self.conn
        home = conn.check(["sh", "-c", 'printf %s "$HOME"'], "reading $HOME").text()
        remote_root = str(Path(home) / self.settings.remote_root)  # relative: to the home folder
        run_dir = f"{remote_root}/runs/{run_folder_name(handle)}"
        bin_dir = f"{remote_root}/bin-{_remote_run.scripts_digest()}"
        complete = f"{bin_dir}/{_remote_run.INSTALLED_MARK}"
        if conn.run(["test", "-f", complete]).returncode != 0:
            conn.check(["mkdir", "-p", "-m", "700", bin_dir], "mkdir")
            for name in REMOTE_SCRIPTS:
                conn.write_bytes(f"{bin_dir}/{name}", remote_script(name).read_bytes(), mode=0o700)
            conn.write_bytes(complete, b"")
        run = RemoteRun(conn, self.settings.python, bin_dir, run_dir)
        gpus = _gpus.job_gpus(
            handle.spec, self.settings.hide_gpus_when_unasked,
            lambda: run.answer(run.checked_script("gpus.py", what="listing the GPUs"), "listing the GPUs"),
            f"{remote_root}/gpus", self.settings.host,
        )  # fmt: skip
        # Only now: a step refused above leaves no folder on the host.
        # `client-<id>` marks the folder as this client's (machines.py).
        mark = f"{run_dir}/{OWNER_MARK}{self.store.client_id()}"
        folders = [f"{run_dir}/work/outputs", f"{run_dir}/project", mark]
        conn.check(["mkdir", "-p", "-m", "700", *folders], "mkdir")
        return self.save_state(
            handle, remote_root=remote_root, remote_run_dir=run_dir, remote_bin=bin_dir, remote_home=home,
            gpus=gpus,
        )

    def relaunch(self, handle: RunHandle) -> RunHandle:
        """The host again once it answers (a rebooting host is waited for,
        HOST_WAIT_SECONDS), the lost attempt's folder removed if it is
        still there (what is left of its command stopped first), and a
        fresh run folder for the new attempt, as `launch` makes. What is
        left that cannot be stopped (or a host that cannot say) fails the
        relaunch, retried as any machinery failure: a new attempt started
        beside it would run the command twice and write the same
        checkpoints."""
        self._wait_for_host()
        if self._on_host(handle):
            try:
                lost = self.remote_run(handle)
                if lost.status().get("exists"):  # gone with a restart's scratch disk (its scripts too)
                    lost.remove()
            except BackendError as exc:
                raise BackendError(
                    f"run {handle.run_id}: what is left of its lost attempt on {self.settings.host} could "
                    f"not be stopped ({exc}); no new attempt starts beside it. Stop those processes there, "
                    f"then run `doit {handle.step}` again"
                ) from None
        return self.launch(handle)

    def _wait_for_host(self) -> None:
        deadline = time.monotonic() + HOST_WAIT_SECONDS
        said = False
        while True:
            try:
                self.conn.check(["true"], f"reaching {self.settings.host}")
                return
            except BackendError as exc:
                if time.monotonic() >= deadline:
                    raise BackendError(
                        f"{self.settings.host} did not answer for {HOST_WAIT_SECONDS:.0f} s ({exc}); "
                        "bring it back and run doit again: the run is relaunched there"
                    ) from None
                if not said:
                    emit(f"waiting up to {HOST_WAIT_SECONDS:.0f} s for {self.settings.host} to answer "
                         f"({exc})", err=True)  # fmt: skip
                    said = True
            check_interrupted()
            time.sleep(HOST_WAIT_POLL_SECONDS)

    def setup(self, handle: RunHandle) -> RunHandle:
        # The timer first: even if setup hangs, nothing outlives the lifetime.
        lifetime, grace = self.settings.lifetime_minutes * 60, self.settings.grace_seconds
        seconds = str(watchdog_seconds(handle, lifetime, grace))  # sooner if the cost cap comes first
        watchdog = self.remote_run(handle).control("watchdog", seconds, what="arming the lifetime timer")
        handle = self.save_state(handle, watchdog=watchdog)
        log = self.store.run_dir(handle.run_id) / "setup.log"
        for command in self.settings.setup_commands:
            result = self.conn.run(["sh", "-c", command], timeout=None)
            with log.open("ab") as f:
                f.write(f"$ {command}\n".encode() + result.stdout + result.stderr)
            if result.returncode != 0:  # not a BackendError: the step fails, not retried
                raise SubstraxError(
                    f"setup command `{command}` failed on {self.settings.host} (exit {result.returncode}):\n"
                    + (result.stdout + result.stderr).decode(errors="replace").strip()[-2000:]
                )
        return handle

    def sync(self, handle: RunHandle) -> RunHandle:
        project = Path(str(handle.state.project))
        outputs = {o.rstrip("/") for o in handle.spec.outputs}
        view = project_view(project, self.store.root, handle.spec.inputs, written_paths(handle.spec))
        files = [f for f in view.files if f not in outputs]  # the sandbox hides them; the run makes them anew
        stats = self.transport().upload(project, files, f"{self._state(handle, 'remote_run_dir')}/project")
        run = self.remote_run(handle)
        envs = f"{self._state(handle, 'remote_root')}/envs"
        lock = env.lock_file(str(project))
        if lock is not None:  # a build there says nothing until it ends: said before
            emit(f"{handle.step}: environment from {lock} on {self.settings.host}: checking it "
                 "(built there if it is new)")  # fmt: skip
        result = run.run_script("env.py", f"{run.run_dir}/project", envs, self.settings.python,
                                *self.settings.pip_args, what="building the environment", long=True)
        if result.returncode != 0:
            raise result.failure("building the environment", self.settings.host)
        env_dir = env_dir_of(handle.step, run.answer(result, "building the environment"))
        return self.save_state(handle, env_dir=env_dir, uploaded=stats.files, left_out=view.left_out)

    def start(self, handle: RunHandle) -> RunHandle:
        run = self.remote_run(handle)
        paths = WorkerPaths(project=f"{run.run_dir}/project", run_dir=run.run_dir)
        own = SshState.of(handle)
        cache_root = f"{self._state(handle, 'remote_root')}/cache/{project_key(str(handle.state.project))}"
        job = build_job(
            handle.spec,
            paths,
            sandbox=self.settings.sandbox,
            network_isolation=self.settings.copy_.network_isolation,
            grace_seconds=self.settings.grace_seconds,
            # The login's home (its credentials) and the remote root: other
            # runs' folders sit beside this one's, and its own parts are bound back.
            hide=[own.remote_home or "", self._state(handle, "remote_root")],
            env_dir=own.env_dir,
            cache_dirs=self.settings.cache_dirs,
            cache_root=cache_root,
            left_out=own.left_out,
            gpus=own.gpus,
            checkpoints_kept=f"{run.run_dir}/work/checkpoints",
            timeout_spent=handle.state.command_seconds_spent(),
            cap=cap_deadline(handle),
        )
        snapshots = self.snapshots(handle)
        if snapshots is not None:  # before the worker: the command reads them as it starts
            _remote_run.push_checkpoints(run, self.transport().upload, snapshots, job["checkpoints"]["kept"],
                                         handle.step)  # fmt: skip
        self.conn.write_bytes(paths.job, json.dumps(job, indent=1).encode())
        _remote_run.start_worker(run, handle, paths.job, job.get("gpus"), self.settings.host)
        return handle

    def poll(self, handle: RunHandle) -> RunStatus:
        own = SshState.of(handle)
        if own.final_status is not None:
            return RunStatus(**own.final_status)
        if own.remote_run_dir is None:
            return RunStatus("pending")
        return _remote_run.worker_status(self, handle, self.remote_run(handle), self.settings.host)

    def cancel(self, handle: RunHandle) -> bool:
        status = self.poll(handle)
        if status.final and status.state != "lost":
            return False
        run = self.remote_run(handle)
        host, grace = self.settings.host, self.settings.grace_seconds
        return _remote_run.cancel_worker(self, handle, run, status, where=host, grace_seconds=grace)

    def stream_log(
        self, handle: RunHandle, out: IO[bytes], follow: bool = False, offset: int = 0
    ) -> RunStatus:
        """With follow, one follower on the host streams the log until the
        run ends (_remote_run.follow_log)."""
        status = self.poll(handle)
        if not follow or SshState.of(handle).remote_run_dir is None:
            return super().stream_log(handle, out, follow=follow, offset=offset)
        puller = self.checkpoint_puller(handle)
        if status.final:
            status = super().stream_log(handle, out, follow=follow, offset=offset)
        else:
            try:
                status = _remote_run.follow_log(self, handle, out, offset, self.remote_run(handle), puller)
            except NoSession:
                # More steps follow runs on this host at once than sshd lets one
                # connection hold sessions (raised before anything was sent):
                # this one polls, as before, pulling the checkpoints between polls.
                self._pulling = puller
                try:
                    status = super().stream_log(handle, out, follow=True, offset=offset)
                finally:
                    self._pulling = None
        if status.state in ("failed", "timed_out", "cancelled"):
            # What the command left as it ended is whole now: the next run starts from it.
            _remote_run.pull_as_ended(puller, handle.step)
        return status

    def keep_last_checkpoints(self, handle: RunHandle) -> None:
        if self._on_host(handle):
            _remote_run.pull_as_ended(self.checkpoint_puller(handle), handle.step)

    def pause(self, handle: RunHandle, seconds: float) -> bool:
        if self._pulling is not None:
            self._pulling.when_due()
        return super().pause(handle, seconds)

    def snapshots(self, handle: RunHandle) -> Snapshots | None:
        folder = checkpoints_folder(self.store, handle)
        return None if folder is None else Snapshots(folder)

    def checkpoint_puller(self, handle: RunHandle) -> _remote_run.CheckpointPuller | None:
        snapshots = self.snapshots(handle)
        if snapshots is None or SshState.of(handle).torn_down:
            return None
        quiet = RsyncTransport(self.settings.target(), quiet=True)
        bound = _remote_run.SnapshotBound(self.settings.max_checkpoint_size, "ssh")
        return _remote_run.CheckpointPuller(self.remote_run(handle), quiet, snapshots,
                                            self.settings.checkpoint_seconds, handle.step, bound)  # fmt: skip

    def read_log(self, handle: RunHandle, offset: int) -> bytes:
        kept = _remote_run.read_kept_log(self.store.run_dir(handle.run_id) / "run.log", offset)
        if kept is not None:  # torn down: the remote folder and its log are gone
            return kept
        if SshState.of(handle).remote_run_dir is None:
            return b""
        return self.remote_run(handle).read_log(offset)

    def fetch(self, handle: RunHandle) -> Fetched:
        staging = self.store.run_dir(handle.run_id) / "fetched"
        return self.remote_run(handle).fetch(
            self.transport(), list(handle.spec.outputs), staging, SshState.of(handle).outputs_root
        )

    def ran_on(self, handle: RunHandle) -> str:
        return self.settings.host

    @classmethod
    def released(cls, handle: RunHandle) -> bool:
        return SshState.of(handle).torn_down

    @classmethod
    def lifetime_left(cls, handle: RunHandle, now: float | None = None) -> float | None:
        return _remote_run.lifetime_left(SshState.of(handle), now)

    def outputs_available(self, handle: RunHandle) -> bool:
        if not self._on_host(handle):
            return False
        try:
            return bool(self.remote_run(handle).status().get("exists"))
        except BackendError:
            return False

    def leaks(self, project: str, handles: list[RunHandle]) -> list[Leak]:
        """Run folders under remote_root marked as this client's (its state
        folder's id), or named by one of its handles, that no live handle
        accounts for."""
        from substrax_tasks.backends.base import Leak

        live = {h.run_id for h in handles if not SshState.of(h).torn_down}
        # a relaunched run's folder is named after its attempt (run_folder_name)
        live |= {PurePosixPath(folder).name for h in handles
                 if not SshState.of(h).torn_down and (folder := SshState.of(h).remote_run_dir)}  # fmt: skip
        known = {h.run_id for h in handles}
        runs = f"{self.settings.remote_root}/runs"
        listed = self.conn.check(["sh", "-c", LIST_RUNS, "sh", runs, OWNER_MARK + self.store.client_id()],
                                 f"listing the run folders on {self.settings.host}").text().splitlines()
        where = listed[0] if listed else ""  # absolute: remote_root may be relative to the home
        bin_dir = f"{where.rsplit('/', 1)[0]}/bin-{_remote_run.scripts_digest()}"
        leaks = []
        for line in listed[1:]:
            name, marked = line[1:], line.startswith("+")
            if name not in live and (marked or name in known):
                path = f"{where}/{name}"
                run = RemoteRun(self.conn, self.settings.python, bin_dir, path)
                leaks.append(Leak(self.name, self.settings.host, path, True, run.remove))  # as teardown
        return leaks + self._unused_envs(where.rsplit("/", 1)[0], bin_dir) if where else leaks

    def _unused_envs(self, remote_root: str, bin_dir: str) -> list[Leak]:
        """The environments under remote_root that no run folder there names
        (of any client: they share them) and none used for ENV_UNUSED_DAYS;
        each removed again under its lock, kept if used meanwhile. None
        listed where this release never installed its scripts."""
        from substrax_tasks.backends.base import Leak

        if self.conn.run(["test", "-f", f"{bin_dir}/.complete"]).returncode != 0:
            return []
        runs, envs = f"{remote_root}/runs", f"{remote_root}/envs"
        there = RemoteRun(self.conn, self.settings.python, bin_dir, remote_root)
        collect = ("env.py", "--collect", envs, runs, str(ENV_UNUSED_DAYS))
        listed = there.answer(there.checked_script(*collect, "--dry-run", what="listing the environments"),
                              "listing the environments").get("unused")  # fmt: skip

        def remove(path: str) -> None:
            done = there.answer(there.checked_script(*collect, "--only", path, what=f"removing {path}"),
                                f"removing {path}")  # fmt: skip
            if not done.get("removed"):
                raise BackendError(f"environment {path} kept: used since it was listed, or being built")

        paths = [str(e["path"]) for e in listed if isinstance(e, dict)] if isinstance(listed, list) else []
        return [Leak(self.name, self.settings.host, path, True, functools.partial(remove, path),
                     kind="environment") for path in paths]  # fmt: skip

    def forget(self, handle: RunHandle) -> str:
        try:
            if not self._on_host(handle):
                return "nothing of it was on the host"
            run = self.remote_run(handle)
            run.remove()  # stops what runs there first, as the lifetime timer would
            return f"stopped it and removed its folder {run.run_dir} on {self.settings.host}"
        finally:
            self.settings.target().stop_master()

    def teardown(self, handle: RunHandle, *, force: bool = False) -> None:
        # What a fetch left here (a copy refused, or the folders a promotion
        # emptied) is of no use once the run is given up or home.
        shutil.rmtree(self.store.run_dir(handle.run_id) / "fetched", ignore_errors=True)
        if not self._on_host(handle):
            self.settings.target().stop_master()
            return
        try:
            self._tear_down(handle, force=force)
        except DamagedHost:
            # Its scripts were changed there: put back the ones this client
            # sent (it checks them before each use), then stop and remove.
            self.remote_run(handle).reinstall()
            self._tear_down(handle, force=force)

    def _tear_down(self, handle: RunHandle, *, force: bool) -> None:
        if not self.poll(handle).final:
            self.cancel(handle)
        if force or not self.settings.keep_remote:
            run = self.remote_run(handle)
            run.keep_log(self.store.run_dir(handle.run_id) / "run.log")
            run.remove()
            self.save_state(handle, torn_down=True)
        self.settings.target().stop_master()
