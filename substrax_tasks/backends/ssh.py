"""The SSH backend: the step runs on a host you can ssh to.

paramiko runs the commands (host keys verified), rsync moves the files.
On the host, everything of a run lives in `<remote_root>/runs/<run-id>/`:

    job.json status.json run.log setup.log watchdog.json
    project/        the project's tracked files and the inputs (read-only to the task)
    work/outputs/   what the sandboxed task writes (the outputs' folders)

and `<remote_root>/bin-<digest>/` holds the stdlib-only scripts (worker,
manifest, control), `<remote_root>/envs/<lock digest>/` the environments,
reused while the lock file is unchanged.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from substrax_tasks._output import emit
from substrax_tasks._remote_files import REMOTE_SCRIPTS, remote_script
from substrax_tasks._ssh import SshConnection, connection
from substrax_tasks.backends.base import Backend, Fetched, RunStatus
from substrax_tasks.backends.ssh_watch import ManifestWatch, watched_fetch
from substrax_tasks.config import ENV_LOCK_FILES
from substrax_tasks.errors import BackendError, SubstraxError
from substrax_tasks.handle import RunHandle
from substrax_tasks.settings import SshSettings
from substrax_tasks.transports.rsync import RsyncTransport
from substrax_tasks.worker_job import KEEP_MANIFEST_FOR_FETCH, WorkerPaths, build_job, status_from_record

ALWAYS_EXCLUDED = (".git", ".venv", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache",
                   ".doit.db", ".doit.db.bak", ".doit.db.dat", ".doit.db.dir")


class SetupFailed(SubstraxError):
    """A setup command failed: the step fails with its output (not retried)."""


def scripts_digest() -> str:
    digest = hashlib.sha256()
    for name in REMOTE_SCRIPTS:
        digest.update(remote_script(name).read_bytes())
    return digest.hexdigest()[:12]


class SshBackend(Backend):
    name = "ssh"
    Settings = SshSettings
    settings: SshSettings

    # ---------------------------------------------------------- helpers
    @property
    def conn(self) -> SshConnection:
        return connection(self.settings.target())

    def transport(self) -> RsyncTransport:
        return RsyncTransport(self.settings.target(), excludes=self.settings.copy_.excludes)

    def _state(self, handle: RunHandle, key: str) -> str:
        value = handle.state.get(key)
        if not isinstance(value, str):
            raise BackendError(f"run {handle.run_id}: no {key} recorded yet (was it launched?)")
        return value

    def run_dir(self, handle: RunHandle) -> str:
        return self._state(handle, "remote_run_dir")

    def _python(self, handle: RunHandle, script: str, *args: str) -> list[str]:
        return [self.settings.python, f"{self._state(handle, 'remote_bin')}/{script}", *args]

    def _json(self, handle: RunHandle, script: str, *args: str, what: str) -> dict[str, Any]:
        result = self.conn.check(self._python(handle, script, *args), what)
        try:
            data = json.loads(result.text().strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise BackendError(f"{what}: unexpected answer {result.text()[:200]!r}") from None
        if not isinstance(data, dict):
            raise BackendError(f"{what}: unexpected answer {data!r}")
        return data

    # ----------------------------------------------------------- phases
    def launch(self, handle: RunHandle) -> RunHandle:
        conn = self.conn
        try:
            root = conn.sftp().normalize(".") if not self.settings.remote_root.startswith("/") else "/"
        except OSError as exc:
            raise BackendError(f"cannot read the home folder on {self.settings.host}: {exc}") from None
        remote_root = str(Path(root) / self.settings.remote_root)
        run_dir = f"{remote_root}/runs/{handle.run_id}"
        home = conn.check(["sh", "-c", 'printf %s "$HOME"'], "reading $HOME").text()
        conn.check(["mkdir", "-p", "-m", "700", f"{run_dir}/work/outputs", f"{run_dir}/project"], "mkdir")
        bin_dir = f"{remote_root}/bin-{scripts_digest()}"
        if conn.run(["test", "-f", f"{bin_dir}/.complete"]).returncode != 0:
            conn.check(["mkdir", "-p", "-m", "700", bin_dir], "mkdir")
            for name in REMOTE_SCRIPTS:
                conn.write_bytes(f"{bin_dir}/{name}", remote_script(name).read_bytes(), mode=0o700)
            conn.write_bytes(f"{bin_dir}/.complete", b"")
        return self.store.update_state(
            handle, remote_root=remote_root, remote_run_dir=run_dir, remote_bin=bin_dir, remote_home=home
        )

    def setup(self, handle: RunHandle) -> RunHandle:
        # The timer first: even if setup hangs, nothing outlives the lifetime.
        seconds = str(self.settings.lifetime_minutes * 60)
        watchdog = self._json(handle, "control.py", "watchdog", self.run_dir(handle), seconds, "--detach",
                              what="arming the lifetime timer")
        handle = self.store.update_state(handle, watchdog=watchdog)
        log = self.store.run_dir(handle.run_id) / "setup.log"
        for command in self.settings.setup_commands:
            result = self.conn.run(["sh", "-c", command], timeout=None)
            with log.open("ab") as f:
                f.write(f"$ {command}\n".encode() + result.stdout + result.stderr)
            if result.returncode != 0:
                raise SetupFailed(
                    f"setup command `{command}` failed on {self.settings.host} (exit {result.returncode}):\n"
                    + (result.stdout + result.stderr).decode(errors="replace").strip()[-2000:]
                )
        return handle

    def sync(self, handle: RunHandle) -> RunHandle:
        project = Path(str(handle.state["project"]))
        outputs = {o.rstrip("/") for o in handle.spec.outputs}
        files = [
            f for f in project_files(project, self.store.root, self.settings.copy_.excludes)
            if f not in outputs  # the sandbox hides them; the run makes them anew
        ]
        files += [i for i in handle.spec.inputs if i.rstrip("/") not in files]
        stats = self.transport().upload(project, files, f"{self.run_dir(handle)}/project")
        env_dir = self._sync_env(handle, project)
        return self.store.update_state(handle, env_dir=env_dir, uploaded=stats.files)

    def _sync_env(self, handle: RunHandle, project: Path) -> str | None:
        lock = next((name for name in ENV_LOCK_FILES if (project / name).is_file()), None)
        if lock is None:
            return None
        recipe = json.dumps([self.settings.python, self.settings.pip_args]).encode()
        hashed = hashlib.sha256((project / lock).read_bytes() + recipe)
        digest = hashed.hexdigest()[:16]
        env_dir = f"{self._state(handle, 'remote_root')}/envs/{digest}"
        if self.conn.run(["test", "-f", f"{env_dir}/.substrax-ready"]).returncode == 0:
            emit(f"{handle.step}: reusing the environment for {lock} ({digest})")
            return env_dir
        run_dir = self.run_dir(handle)
        remote_lock = f"{run_dir}/project/{lock}"
        if lock == "uv.lock":
            steps = [["env", f"UV_PROJECT_ENVIRONMENT={env_dir}", "uv", "sync", "--frozen",
                      "--project", f"{run_dir}/project"]]  # fmt: skip
        else:
            steps = [[self.settings.python, "-m", "venv", env_dir],
                     [f"{env_dir}/bin/pip", "install", "--disable-pip-version-check", "-q",
                      *self.settings.pip_args, "-r", remote_lock]]  # fmt: skip
        for argv in steps:
            # From the uploaded project, so relative paths in pip_args
            # (--find-links wheels/) and in the lock file resolve as they do here.
            in_project = ["sh", "-c", 'cd "$1" && shift && exec "$@"', "sh", f"{run_dir}/project"]
            self.conn.check([*in_project, *argv], f"syncing the environment from {lock}", timeout=None)
        self.conn.check(["touch", f"{env_dir}/.substrax-ready"], "marking the environment")
        return env_dir

    def start(self, handle: RunHandle) -> RunHandle:
        run_dir = self.run_dir(handle)
        paths = WorkerPaths(project=f"{run_dir}/project", run_dir=run_dir)
        env_dir = handle.state.get("env_dir")
        job = build_job(
            handle.spec,
            paths,
            sandbox=self.settings.sandbox,
            network_isolation=self.settings.copy_.network_isolation,
            grace_seconds=self.settings.grace_seconds,
            hide=[str(handle.state.get("remote_home") or "")],
            extra_ro=[env_dir] if isinstance(env_dir, str) else [],
        )
        if isinstance(env_dir, str):
            job["path_prepend"] = [f"{env_dir}/bin"]
            job["env"] = {**job["env"], "VIRTUAL_ENV": env_dir}
        job[KEEP_MANIFEST_FOR_FETCH] = True  # the fetch's watch sends it (manifest.settle)
        self.conn.write_bytes(paths.job, json.dumps(job, indent=1).encode())
        secrets = forwarded_env(handle)
        argv = self._python(handle, "worker.py", paths.job, "--detach")
        if secrets:
            argv.append("--env-stdin")
        result = self.conn.run(argv, stdin=json.dumps(secrets).encode() if secrets else None)
        if result.returncode != 0:
            raise BackendError(
                f"run {handle.run_id}: the worker did not start on {self.settings.host}: "
                + (result.stderr + result.stdout).decode(errors="replace")[-1500:]
            )
        return handle

    def _remote_status(self, handle: RunHandle) -> dict[str, Any]:
        return self._json(
            handle, "control.py", "status", self.run_dir(handle), what="reading the run's status"
        )

    def poll(self, handle: RunHandle) -> RunStatus:
        cached = handle.state.get("final_status")
        if isinstance(cached, dict):
            return RunStatus(**cached)
        if "remote_run_dir" not in handle.state:
            return RunStatus("pending")
        record = self._remote_status(handle)
        if record.get("state") is None:
            if not record.get("exists"):
                gone = "its remote folder is gone (torn down, or the lifetime ran out)"
                return RunStatus("lost", message=gone)
            return RunStatus("pending")
        status = status_from_record(record, worker_alive=bool(record.get("worker_alive")))
        if status.final and status.state != "lost":  # a lost run can still be cancelled
            # outputs_root too: the fetch then starts without asking for it
            root = record.get("outputs_root")
            noted = {"outputs_root": root} if isinstance(root, str) else {}
            self.store.update_state(handle, final_status=status.__dict__, **noted)
        return status

    def cancel(self, handle: RunHandle) -> bool:
        status = self.poll(handle)
        if status.final and status.state != "lost":
            return False
        if status.state == "lost" and not self._remote_status(handle).get("exists"):
            return False  # its folder is gone (torn down, or the lifetime ran out): nothing left
        # lost: its worker was killed, but the task's tree may still run
        wait = str(self.settings.grace_seconds + 10)
        answer = self._json(handle, "control.py", "cancel", self.run_dir(handle), "--wait", wait,
                            what="cancelling the run")
        if answer.get("reason") == "not started":
            return True
        if answer.get("reason") == "finished":  # it ended meanwhile: left alone
            self.poll(handle)
            return False
        if not answer.get("cancelled"):
            raise BackendError(
                f"run {handle.run_id}: cancel on {self.settings.host} failed: {answer.get('reason')}"
            )
        # Recorded from the answer, not polled again: a doit driving the run
        # may tear its folder down the moment it sees the end.
        with contextlib.suppress(BackendError):
            self.poll(handle)
        if "final_status" not in self.store.read(handle.run_id).state:
            ended = RunStatus(str(answer.get("state") or "cancelled"), message=answer.get("reason"))
            self.store.update_state(handle, final_status=ended.__dict__)
        return True

    def _kept_log(self, handle: RunHandle) -> Path:
        """The copy of the run's log that teardown keeps in the store."""
        return self.store.run_dir(handle.run_id) / "run.log"

    def read_log(self, handle: RunHandle, offset: int) -> bytes:
        kept = self._kept_log(handle)
        if kept.is_file():  # torn down: the remote folder and its log are gone
            with kept.open("rb") as f:
                f.seek(offset)
                return f.read(1 << 20)
        if "remote_run_dir" not in handle.state:
            return b""
        return self.conn.read_bytes(f"{self.run_dir(handle)}/run.log", offset) or b""

    def _keep_log(self, handle: RunHandle) -> None:
        """Copy the remote log into the store before the remote folder goes:
        teardown keeps the handle and the logs."""
        kept = self._kept_log(handle)
        partial = kept.with_name(kept.name + ".partial")
        offset = 0
        with partial.open("wb") as f:
            while chunk := self.conn.read_bytes(f"{self.run_dir(handle)}/run.log", offset):
                f.write(chunk)
                offset += len(chunk)
        partial.replace(kept)

    def _outputs_root(self, handle: RunHandle) -> str:
        """Where the run's outputs are on the host: noted when the run was
        seen to end, else read from its status."""
        root = handle.state.get("outputs_root")
        if not isinstance(root, str):
            root = self._remote_status(handle).get("outputs_root")
        if not isinstance(root, str):
            raise BackendError(f"run {handle.run_id}: its status names no outputs folder")
        return root

    def ready_for_fetch(self, handle: RunHandle) -> contextlib.AbstractContextManager[None]:
        """OpenSSH's master, held up while the run goes on: the fetch's rsync
        then starts on a live connection instead of paying a fresh ssh login
        after a run longer than ControlPersist."""
        return self.settings.target().master_held()

    def fetch(self, handle: RunHandle) -> Fetched:
        fetched = self.begin_fetch(handle)
        fetched.confirm()
        return fetched

    def begin_fetch(self, handle: RunHandle) -> Fetched:
        """rsync into local staging while the host takes the outputs'
        manifest; `confirm()` then asks the host whether the outputs held
        still all along. If they did not, nothing may be promoted and the
        remote stays (see ssh_watch.watched_fetch)."""
        root = self._outputs_root(handle)
        # The worker filled this hash cache as the command ended, and kept
        # its manifest beside it (manifest.settle): the host sends that at
        # once and checks it with a stat of each entry.
        cache = f"{self.run_dir(handle)}/manifest-cache.json"
        argv = self._python(handle, "manifest.py", root, *handle.spec.outputs, "--cache", cache, "--watch")
        watch = ManifestWatch(self.conn.open_command(argv), self.settings.host)
        staging = self.store.run_dir(handle.run_id) / "fetched"
        changed = (
            f"run {handle.run_id}: the outputs on {self.settings.host} changed while they were "
            "fetched; nothing was promoted and the remote folder is kept (`doit "
            f"{handle.step}` fetches them again, without rerunning the command)"
        )
        return watched_fetch(
            watch, self.transport(), root, list(handle.spec.outputs), staging=staging, changed=changed
        )

    def outputs_available(self, handle: RunHandle) -> bool:
        if handle.state.get("torn_down") or "remote_run_dir" not in handle.state:
            return False
        try:
            return bool(self._remote_status(handle).get("exists"))
        except BackendError:
            return False

    def teardown(self, handle: RunHandle, *, force: bool = False) -> None:
        if "remote_run_dir" not in handle.state or handle.state.get("torn_down"):
            self.settings.target().stop_master()
            return
        if not self.poll(handle).final:
            self.cancel(handle)
        if force or not self.settings.keep_remote:
            self._keep_log(handle)
            self._json(handle, "control.py", "remove", self.run_dir(handle), what="removing the run folder")
            self.store.update_state(handle, torn_down=True)
        self.settings.target().stop_master()


def project_files(project: Path, state_dir: Path, excludes: list[str]) -> list[str]:
    """The project's files to upload: git's tracked files when the project
    is a git work tree, otherwise every file but caches and the state dir."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(project), "ls-files", "-z", "--cached"],
            capture_output=True, check=True, timeout=60,
        ).stdout  # fmt: skip
        files = [p for p in listed.decode().split("\0") if p]
        if files:
            return files
    except (OSError, subprocess.SubprocessError):
        pass
    skip = {*ALWAYS_EXCLUDED, *excludes}
    try:
        state_rel = state_dir.resolve().relative_to(project.resolve()).parts[0]
        skip.add(state_rel)
    except (ValueError, IndexError):
        pass
    return sorted(entry.name for entry in project.iterdir() if entry.name not in skip)


def forwarded_env(handle: RunHandle) -> dict[str, str]:
    """The secrets named by the step, read from this process now: sent to
    the worker on stdin, never written to a file here or there."""
    return {name: os.environ[name] for name in handle.spec.forward_env if name in os.environ}

