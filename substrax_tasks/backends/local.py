"""The local backend: the step runs on this machine, under bubblewrap.

The run's folder in the store is also its working folder; the worker is
started detached (its own session, double-forked), so it goes on if the
client exits. Status and cancel are `remote/control.py`'s, as for every
backend, called here in this process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from substrax_tasks import manifest_cache
from substrax_tasks._atomic import write_json_atomic
from substrax_tasks._remote_files import control, remote_module, remote_script
from substrax_tasks.backends.base import Backend, Capabilities, Fetched, RunStatus
from substrax_tasks.errors import BackendError
from substrax_tasks.handle import RunHandle
from substrax_tasks.settings import LocalSettings
from substrax_tasks.worker_job import STAGING_DIR, WorkerPaths, build_job, status_from_record

START_TIMEOUT_SECONDS = 30.0  # worker start-up; bubblewrap probe included
CANCEL_MARGIN_SECONDS = 10.0  # beyond the grace period, for the SIGKILL and reap


class LocalBackend(Backend):
    name = "local"
    Settings = LocalSettings
    capabilities = Capabilities(interrupt_cancels=True)
    settings: LocalSettings

    def paths(self, handle: RunHandle) -> WorkerPaths:
        return WorkerPaths(
            project=str(handle.state["project"]),
            run_dir=str(self.store.run_dir(handle.run_id)),
        )

    def launch(self, handle: RunHandle) -> RunHandle:
        if self.settings.sandbox == "bwrap" and shutil.which("bwrap") is None:
            raise BackendError(
                'sandbox = "bwrap" in [tool.substrax.compute.backends.local] but bubblewrap '
                "is not installed; install it (apt-get install bubblewrap) or set "
                'sandbox = "auto" to run without it'
            )
        project = handle.state.get("project")
        if not project:
            raise BackendError(f"run {handle.run_id}: its handle names no project folder")
        paths = self.paths(handle)
        Path(paths.staging).mkdir(parents=True, exist_ok=True)
        job = build_job(
            handle.spec,
            paths,
            sandbox=self.settings.sandbox,
            network_isolation=self.settings.network_isolation,
            grace_seconds=self.settings.grace_seconds,
            hide=[str(Path.home())],
            extra_ro=interpreter_paths(),
            cache_dirs=self.settings.cache_dirs,
            cache_root=str(self.store.home_cache),
        )
        write_json_atomic(Path(paths.job), job)
        return self.store.update_state(handle, phase="launched")

    def start(self, handle: RunHandle) -> RunHandle:
        paths = self.paths(handle)
        argv = [sys.executable, str(remote_script("worker.py")), paths.job, "--detach"]
        # The worker holds only what its task may see (the task can read its
        # /proc/<pid>/environ without a sandbox): the plain settings, the
        # step's secrets, and substrax's own SUBSTRAX_* settings.
        env = {
            **remote_module("sandbox").plain_settings(os.environ),
            **{name: value for name, value in os.environ.items() if name.startswith("SUBSTRAX_")},
            **{name: os.environ[name] for name in handle.spec.forward_env if name in os.environ},
        }
        try:
            # The worker forks and returns once its command has started.
            done = subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
                env=env,
                timeout=START_TIMEOUT_SECONDS,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise BackendError(
                f"run {handle.run_id}: the worker did not start within {START_TIMEOUT_SECONDS:.0f} s"
            ) from None
        status = self.poll(handle)
        if done.returncode != 0 or status.state == "pending":
            tail = self.read_log(handle, 0)[-2000:].decode(errors="replace")
            raise BackendError(
                f"run {handle.run_id}: the worker failed to start "
                f"(exit {done.returncode}): {done.stderr.decode(errors='replace')}{tail}"
            )
        return self.store.update_state(handle, phase="started")

    def _record(self, handle: RunHandle) -> dict[str, Any] | None:
        return control().read_json(self.paths(handle).status)

    def poll(self, handle: RunHandle) -> RunStatus:
        record = control().status(str(self.store.run_dir(handle.run_id)))
        if record.get("state") is None:
            return RunStatus("pending")
        return status_from_record(record, worker_alive=bool(record.get("worker_alive")))

    def cancel(self, handle: RunHandle) -> bool:
        status = self.poll(handle)
        if status.final and status.state != "lost":  # a lost run's tree may still be alive
            return False
        wait = self.settings.grace_seconds + CANCEL_MARGIN_SECONDS
        answer = control().cancel(str(self.store.run_dir(handle.run_id)), wait)
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
        manifest = self._worker_manifest(handle) or manifest_cache.build_manifest(Path(root), outputs)
        if record.get("sandbox") == "none":  # written in place: the root is the project's own
            return Fetched(Path(root), manifest)
        fetched = self.store.run_dir(handle.run_id) / "fetched"
        shutil.rmtree(fetched, ignore_errors=True)
        for out in outputs:
            link_tree(Path(root) / out.rstrip("/"), fetched / out.rstrip("/"))
        return Fetched(fetched, manifest)

    def _worker_manifest(self, handle: RunHandle) -> dict[str, Any] | None:
        """The manifest the worker took as the command ended, if any."""
        path = self.store.run_dir(handle.run_id) / "manifest.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) and "digest" in data else None

    def outputs_available(self, handle: RunHandle) -> bool:
        """Until teardown empties it (the chain does, after promotion), the
        sandbox's staging folder holds the outputs."""
        record = self._record(handle) or {}
        root = record.get("outputs_root")
        return record.get("sandbox") != "none" and isinstance(root, str) and Path(root).is_dir()

    def teardown(self, handle: RunHandle, *, force: bool = False) -> None:
        self.cancel(handle)  # leaves a finished run alone
        work = self.store.run_dir(handle.run_id) / STAGING_DIR.split("/")[0]
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(self.store.run_dir(handle.run_id) / "fetched", ignore_errors=True)
        if work.exists():
            raise BackendError(f"run {handle.run_id}: could not remove {work}")


def link_tree(source: Path, dest: Path) -> None:
    """Hard-link a file or tree (symlinks copied as links; copies across
    file systems). What is already at `dest` stays."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir() and not source.is_symlink():
        shutil.copytree(source, dest, symlinks=True, copy_function=_link_or_copy, dirs_exist_ok=True)
    elif source.exists() or source.is_symlink():
        _link_or_copy(str(source), str(dest))


def _link_or_copy(source: str, dest: str) -> None:
    if os.path.lexists(dest):
        return
    if Path(source).is_symlink():
        Path(dest).symlink_to(Path(source).readlink())
        return
    try:
        os.link(source, dest)
    except OSError:
        shutil.copy2(source, dest)


def interpreter_paths() -> list[str]:
    """The Python running doit stays visible when $HOME is hidden (a venv,
    pyenv or conda interpreter often lives there), read-only."""
    paths = {sys.prefix, sys.base_prefix, str(Path(sys.executable).resolve().parent.parent)}
    return sorted(paths)
