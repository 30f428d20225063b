"""The fake SkyPilot bed: a cluster host reached over a real sshd, and `Sky`, a project using it."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dodo_helpers import (
    COMPUTE,
    clean_env,
)
from fakesky_cleanup import cleanup, fakesky_env, leftovers
from progress import run as progress_run
from ssh_helpers import (
    SANDBOX,
    toml_value,
    write_ssh_dodo,
)
from testbeds.sshd_host import SshHost

STEP = """
def task_step():
    yield from remote_step(
        "step", shell=COMMAND, inputs=["data/in.txt"], outputs=["out/", "res.txt"],
        resources={"cpus": 1},
    )
"""


COMMAND = r"""
set -e
mkdir -p out
cp data/in.txt out/copy.txt
if touch data/in.txt 2>/dev/null; then echo writable; else echo read-only; fi > out/project.txt
echo "hello from the cluster"
echo done > res.txt
"""


@pytest.fixture
def cluster_host(root_host: SshHost) -> SshHost:
    """The clusters' ssh: root on a host in a network namespace (the fake's
    jobs run as root on this machine, so its folders are the host's)."""
    return root_host


class Sky:
    """A project on the skypilot backend, the fake's HOME and environment."""

    def __init__(self, base: Path, host: SshHost) -> None:
        self.base = base
        self.home = base / "skyhome"
        self.home.mkdir()
        self.root = base / "proj"
        self.root.mkdir()
        self.remote = base / "remote"
        self.env = fakesky_env(
            self.home,
            FAKESKY_SSH_HOST=host.address,
            FAKESKY_SSH_PORT=str(host.port),
            FAKESKY_SSH_USER=host.user or "root",
            FAKESKY_SSH_IDENTITY=str(host.client_key),
            FAKESKY_MINUTE_SECONDS="20",  # idle_minutes = 1: the cluster waits 20 s for a fetch
            FAKESKY_CANCEL_GRACE="1",
        )
        self.env["PATH"] = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"

    def configure(self, sky_python: str = sys.executable, copy: dict[str, Any] | None = None,
                  bucket: dict[str, Any] | None = None, **settings: Any) -> None:  # fmt: skip
        values: dict[str, Any] = {
            "sky_python": sky_python, "remote_root": str(self.remote), "sandbox": SANDBOX,
            "grace_seconds": 0.5, "poll_seconds": 0.3, "idle_minutes": 1,
            "setup_commands": ["echo setting up the node"],
        }  # fmt: skip
        values.update(settings)
        lines = ["[tool.substrax.compute]", 'default_backend = "skypilot"', "",
                 "[tool.substrax.compute.backends.skypilot]"]  # fmt: skip
        lines += [f"{k} = {toml_value(v)}" for k, v in values.items()]
        if bucket is not None:
            lines += ["", "[tool.substrax.compute.backends.skypilot.bucket]"]
            lines += [f"{k} = {toml_value(v)}" for k, v in bucket.items()]
        else:
            lines += ["", "[tool.substrax.compute.backends.skypilot.copy]"]
            lines += [f"{k} = {toml_value(v)}" for k, v in (copy or {"lifetime_minutes": 10.0}).items()]
        (self.root / "pyproject.toml").write_text("\n".join(lines) + "\n")

    def project(self, body: str = STEP, command: str = COMMAND) -> Path:
        self.configure()
        write_ssh_dodo(self.root, f"COMMAND = {command!r}\n" + body, ["step"])
        (self.root / "data").mkdir(exist_ok=True)
        (self.root / "data" / "in.txt").write_text("hello\n")
        return self.root

    def compute(self, *args: str, timeout: float = 120) -> Any:

        return progress_run([str(COMPUTE), "--project", str(self.root), *args], cwd=self.root,
                            env=clean_env(self.env), timeout=timeout)  # fmt: skip

    def clusters(self) -> list[str]:
        folder = self.home / ".fakesky" / "clusters"
        return sorted(p.name for p in folder.glob("*") if (p / "cluster.json").exists())

    def requests(self) -> int:
        folder = self.home / ".fakesky" / "requests"
        return len(list(folder.iterdir())) if folder.is_dir() else 0

    def run_file(self, handle: dict[str, Any], name: str) -> Path:
        return self.root / ".substrax" / "runs" / str(handle["run_id"]) / name


def remove_job_homes(home: Path) -> None:
    """The files the leases of the fake's clusters under `home` wrote in
    the login's home (remote/lease.py: a relative remote_root), left there
    when the fake took a cluster down by killing its lease."""
    login = Path(pwd.getpwuid(os.getuid()).pw_dir)
    for path in login.glob("*/job-homes/*"):
        with contextlib.suppress(OSError):
            if path.read_text().startswith(str(home.resolve()) + "/"):
                path.unlink()


@pytest.fixture
def sky(tmp_path: Path, cluster_host: SshHost) -> Iterator[Sky]:
    host = cluster_host
    made = Sky(tmp_path, host)
    try:
        yield made
    finally:
        cleanup(made.home)
        remove_job_homes(made.home)
    assert leftovers(made.home) == [], "the fake left processes running"


FAKE_SMI = """#!/bin/sh
[ "$1" = "-L" ] || exit 2
echo "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-1d6e2b7a-0000-0000-0000-000000000000)"
echo "GPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-9a41c3f0-0000-0000-0000-000000000000)"
"""


def two_gpu_python(base: Path) -> str:
    """The cluster's python3, with a fake `nvidia-smi` listing two GPUs first on its PATH."""
    bin_dir = base / "fake-gpu-bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    python = base / "python-with-gpus"
    python.write_text(f'#!/bin/sh\nPATH={bin_dir}:$PATH exec {shutil.which("python3")} "$@"\n')
    python.chmod(0o755)
    return str(python)
