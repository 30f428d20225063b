"""The local backend: the step runs on this machine, under bubblewrap.

The run's folder in the store is also its working folder; the worker is
started detached (its own session, double-forked), so it goes on if the
client exits, and `substrax-compute cancel` reaches it by pid.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from substrax_tasks import _procs
from substrax_tasks._atomic import write_json_atomic
from substrax_tasks._remote_files import remote_script
from substrax_tasks.backends.base import Backend, RunStatus
from substrax_tasks.errors import BackendError
from substrax_tasks.handle import RunHandle
from substrax_tasks.worker_job import STAGING_DIR, WorkerPaths, build_job, status_from_record

START_TIMEOUT_SECONDS = 30.0  # worker start-up; bubblewrap probe included
CANCEL_MARGIN_SECONDS = 10.0  # beyond the grace period, for the SIGKILL and reap


class LocalSettings(BaseModel):
    """`[tool.substrax.compute.backends.local]`"""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sandbox: Literal["auto", "bwrap", "none"] = Field(
        "auto",
        description="bwrap: always sandbox (error if bubblewrap is missing); auto: when "
        "bubblewrap is usable, noted in the run's log otherwise; none: no sandbox.",
    )
    network_isolation: bool = Field(False, description="Run the command with no network.")
    grace_seconds: float = Field(
        5.0, gt=0, description="Time between SIGTERM and SIGKILL when a run is stopped."
    )


class LocalBackend(Backend):
    name = "local"
    Settings = LocalSettings
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
        )
        write_json_atomic(Path(paths.job), job)
        return self.store.update_state(handle, phase="launched")

    def start(self, handle: RunHandle) -> RunHandle:
        paths = self.paths(handle)
        argv = [sys.executable, str(remote_script("worker.py")), paths.job, "--detach"]
        try:
            # The worker forks and returns once its command has started.
            done = subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
                timeout=START_TIMEOUT_SECONDS,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise BackendError(f"run {handle.run_id}: the worker did not start within {START_TIMEOUT_SECONDS:.0f} s") from None
        status = self.poll(handle)
        if done.returncode != 0 or status.state == "pending":
            tail = self.read_log(handle, 0)[-2000:].decode(errors="replace")
            raise BackendError(
                f"run {handle.run_id}: the worker failed to start "
                f"(exit {done.returncode}): {done.stderr.decode(errors='replace')}{tail}"
            )
        return self.store.update_state(handle, phase="started")

    def _record(self, handle: RunHandle) -> dict[str, object] | None:
        try:
            data = json.loads(Path(self.paths(handle).status).read_text())
        except FileNotFoundError:
            return None
        return data if isinstance(data, dict) else None

    def poll(self, handle: RunHandle) -> RunStatus:
        record = self._record(handle)
        if record is None or record.get("state") not in ("running", "starting"):
            return status_from_record(record, worker_alive=False)
        alive = _procs.same_process_alive(_int(record.get("worker_pid")), _int(record.get("worker_start_ticks")))
        if not alive:
            record = self._record(handle)  # it may have just written its end
        return status_from_record(record, worker_alive=alive)

    def cancel(self, handle: RunHandle) -> bool:
        status = self.poll(handle)
        if status.final:
            return False
        record = self._record(handle) or {}
        if status.state == "pending" and not record:
            self._write_end(handle, "cancelled", "cancelled before the command started")
            return True
        if status.state == "lost":
            # No worker to do it: kill the task's group ourselves.
            _procs.signal_if_same(_int(record.get("pid")), _int(record.get("start_ticks")), signal.SIGKILL, group=True)
            self._write_end(handle, "cancelled", "cancelled after its worker was lost")
            return True
        _procs.signal_if_same(
            _int(record.get("worker_pid")), _int(record.get("worker_start_ticks")), signal.SIGTERM
        )
        limit = self.settings.grace_seconds + CANCEL_MARGIN_SECONDS
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if self.poll(handle).final:
                return True
            time.sleep(0.01)
        raise BackendError(
            f"run {handle.run_id}: the worker (pid {record.get('worker_pid')}) did not stop "
            f"within {limit:.0f} s of SIGTERM"
        )

    def _write_end(self, handle: RunHandle, state: str, message: str) -> None:
        record = {**(self._record(handle) or {}), "state": state, "message": message}
        write_json_atomic(Path(self.paths(handle).status), record)

    def read_log(self, handle: RunHandle, offset: int) -> bytes:
        try:
            with open(self.paths(handle).log, "rb") as f:
                f.seek(offset)
                return f.read(1 << 20)
        except FileNotFoundError:
            return b""

    def teardown(self, handle: RunHandle) -> None:
        if not self.poll(handle).final:
            self.cancel(handle)
        work = self.store.run_dir(handle.run_id) / STAGING_DIR.split("/")[0]
        shutil.rmtree(work, ignore_errors=True)
        if work.exists():
            raise BackendError(f"run {handle.run_id}: could not remove {work}")


def _int(value: object) -> int | None:
    return value if isinstance(value, int) else None

