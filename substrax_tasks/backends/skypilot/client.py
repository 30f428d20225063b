"""Calling SkyPilot: `helper/sky_sdk.py` in SkyPilot's own interpreter.

substrax_tasks never imports `sky`: each operation is one process of the
helper script under `sky_python` (by default the python beside the `sky`
command on PATH), with a JSON request on stdin and one JSON answer line on
stdout. SkyPilot's exceptions come back by class name and are raised here
as SkyCallError with that name, so callers can tell ClusterDoesNotExist
from RequestCancelled without parsing text.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from substrax_tasks.console import emit
from substrax_tasks.errors import BackendError, ConfigError
from substrax_tasks.interrupts import check_interrupted

SETTING = "[tool.substrax.compute.backends.skypilot] sky_python"
# Run by path, never imported (it imports `sky`); in a wheel as in a checkout.
SKY_SDK_SCRIPT = Path(__file__).parent / "helper" / "sky_sdk.py"
# The helper's own start-up (import sky) is a few seconds; a call that
# waits on a request (launch, down) gets no limit.
DEFAULT_TIMEOUT = 300.0

# SkyPilot's JobStatus, as substrax reads it. Any other value raises.
JOB_STATES = {
    "INIT": "running", "PENDING": "running", "SETTING_UP": "running", "RUNNING": "running",
    "SUCCEEDED": "succeeded", "FAILED": "failed", "FAILED_SETUP": "failed",
    "FAILED_DRIVER": "failed", "CANCELLED": "cancelled",
}  # fmt: skip
REQUEST_LIVE = ("PENDING", "WAITING", "RUNNING")
NO_CLUSTER = "ClusterDoesNotExist"
# The cluster is INIT, STOPPED or AUTOSTOPPING (an autodown under way): its
# queue cannot be read, and there is nothing left to cancel in it.
CLUSTER_GONE = (NO_CLUSTER, "ClusterNotUpError")


class SkyCallError(BackendError):
    """A SkyPilot SDK call raised `kind` (e.g. ClusterDoesNotExist)."""

    def __init__(self, operation: str, kind: str, message: str) -> None:
        super().__init__(f"SkyPilot {operation}: {kind}: {message}")
        self.operation = operation
        self.kind = kind
        self.detail = message


def job_state(value: object) -> str:
    """SkyPilot's job status -> substrax's run state; unknown values raise."""
    if not isinstance(value, str) or value not in JOB_STATES:
        raise BackendError(
            f"SkyPilot reported job status {value!r}, which this release does not know; "
            "refusing to read it as either running or finished"
        )
    return JOB_STATES[value]


def resolve_sky_python(configured: str | None) -> str:
    """The interpreter SkyPilot is installed in, or a ConfigError naming the setting."""
    if configured:
        path = shutil.which(str(Path(configured).expanduser()))
        if path is None:
            raise ConfigError(f"{SETTING} = {configured!r}: no such program; point it at SkyPilot's python")
        return path
    sky = shutil.which("sky")
    if sky is None:
        raise ConfigError(
            "SkyPilot is not installed here: no `sky` command on PATH. Install it in its own "
            f"virtualenv (python3 -m venv ~/.sky-venv && ~/.sky-venv/bin/pip install 'skypilot==0.14.*') "
            f'and set {SETTING} = "~/.sky-venv/bin/python", or put its bin folder on PATH'
        )
    beside = Path(sky).resolve().parent / "python"
    if not beside.exists():
        beside = Path(sky).parent / "python"
    if not beside.exists():
        raise ConfigError(f"found `sky` at {sky} but no python beside it; set {SETTING}")
    return str(beside)


class SkyClient:
    """One method per helper operation; each call is one helper process."""

    def __init__(self, sky_python: str | None, env: dict[str, str] | None = None) -> None:
        self.configured = sky_python
        self.env = env

    def python(self) -> str:
        return resolve_sky_python(self.configured)

    def call(
        self,
        operation: str,
        request: dict[str, Any],
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
        while_waiting: Callable[[], None] | None = None,
    ) -> Any:
        """Run one operation; `while_waiting` is called about twice a second
        while the helper runs (to relay a launch log, say)."""
        argv = [self.python(), str(SKY_SDK_SCRIPT), operation]
        started = time.monotonic()
        try:
            proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env
            )
        except OSError as exc:
            raise ConfigError(f"{SETTING}: cannot run {argv[0]}: {exc}") from None
        try:
            payload = json.dumps(request).encode()
            stdout, stderr = _communicate(proc, payload, timeout, started, while_waiting)
        except BaseException:
            proc.kill()
            proc.communicate()  # reaps it and closes its pipes
            raise
        return self._answer(operation, argv[0], proc.returncode, stdout, stderr)

    def down(self, cluster: str) -> None:
        """Take `cluster` down; one already gone is no error."""
        try:
            self.call("down", {"cluster_name": cluster}, timeout=None)
        except SkyCallError as exc:
            if exc.kind != NO_CLUSTER:
                raise

    def cluster_names(self) -> list[str]:
        """Every cluster of this user's that SkyPilot knows."""
        records = self.call("cluster_status", {})
        return [r["name"] for r in records or [] if isinstance(r, dict) and isinstance(r.get("name"), str)]

    def request_state(self, rid: str) -> str | None:
        """The status of API server request `rid` (None: not known)."""
        records = self.call("request_status", {"request_ids": [rid]})
        for record in records or []:
            if isinstance(record, dict) and record.get("request_id") == rid:
                return str(record.get("status"))
        return None

    def _answer(self, operation: str, python: str, code: int, stdout: bytes, stderr: bytes) -> Any:
        lines = stdout.decode(errors="replace").strip().splitlines()
        try:
            answer = json.loads(lines[-1])
        except (ValueError, IndexError):
            tail = stderr.decode(errors="replace").strip()[-1500:]
            if "No module named 'sky'" in tail or "No module named sky" in tail:
                raise ConfigError(
                    f"{SETTING}: {python} has no SkyPilot (`import sky` failed); point it at the "
                    "python of the virtualenv SkyPilot is installed in"
                ) from None
            raise BackendError(f"SkyPilot {operation}: the helper failed (exit {code}): {tail}") from None
        if not isinstance(answer, dict):
            raise BackendError(f"SkyPilot {operation}: unexpected answer {answer!r}")
        if answer.get("ok"):
            return answer.get("result")
        error = answer.get("error") or {}
        raise SkyCallError(operation, str(error.get("type", "Error")), str(error.get("message", "")))


def _communicate(
    proc: subprocess.Popen[bytes],
    payload: bytes,
    timeout: float | None,
    started: float,
    while_waiting: Callable[[], None] | None,
) -> tuple[bytes, bytes]:
    if while_waiting is None:
        try:
            return proc.communicate(payload, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise BackendError(f"SkyPilot did not answer within {timeout:g} s") from None
    sent: bytes | None = payload
    while True:
        try:
            out, err = proc.communicate(sent, timeout=0.5)
        except subprocess.TimeoutExpired:  # retried without input: nothing is lost
            sent = None
            check_interrupted()  # a launch under threads gives up as it would serially
            while_waiting()
            if timeout is not None and time.monotonic() - started > timeout:
                raise BackendError(f"SkyPilot did not answer within {timeout:g} s") from None
            continue
        while_waiting()
        return out, err


class LogRelay:
    """Shows what a SkyPilot request writes to its log while it is waited on."""

    def __init__(self, path: Path, prefix: str) -> None:
        self.path = path
        self.prefix = prefix
        self.offset = path.stat().st_size if path.exists() else 0
        self.partial = b""

    def __call__(self) -> None:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        for line in lines:
            text = line.decode(errors="replace").rstrip()
            if text:
                emit(f"{self.prefix}{text}")
