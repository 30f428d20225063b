"""The sandbox's test beds: a job for the worker, the verdicts of escape attempts, a second uid
and a fake GPU node (shared by the sandbox, escape, GPU and home tests)."""

from __future__ import annotations

import grp
import json
import os
import pwd
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from local_runs import (
    GRACE,
    WORKER,
)

from substrax_tasks._remote import runfiles
from substrax_tasks.backends.job import WorkerPaths, build_job
from substrax_tasks.backends.local.program import show_toolchains
from substrax_tasks.step.spec import make_spec


def job_for(project: Path, outputs: Sequence[str], *, network_isolation: bool = False,
            hide: Sequence[str] = (), extra_ro: Sequence[str] = ()) -> runfiles.Job:
    """A job file's content, made by the code the backends use."""
    spec = make_spec("step", ["true"], project, outputs=outputs)
    paths = WorkerPaths(project=str(project), run_dir=str(project / ".substrax" / "runs" / "r1"))
    return build_job(spec, paths, sandbox="bwrap", network_isolation=network_isolation,
                     grace_seconds=1.0, hide=list(hide), extra_ro=list(extra_ro))


# attempt NAME SHELL-CODE: runs the code, prints "ALLOWED NAME" or "DENIED NAME"
ATTEMPT = 'attempt() { if sh -c "$2" >/dev/null 2>&1; then echo "ALLOWED $1"; else echo "DENIED $1"; fi; }\n'


def verdicts(log: str) -> dict[str, str]:
    return {m.group(2): m.group(1) for m in re.finditer(r"^(ALLOWED|DENIED) (\S+)$", log, re.MULTILINE)}


SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")  # one every uid can run
SYSTEM_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


TOOLS = ("mount", "umount", "nsenter", "unshare", "bash")


SECRET = "substrax-undeclared-secret-value"


def free_uid() -> int:
    """A uid no account has: the unprivileged user of these tests. Each
    xdist worker starts from a uid of its own (the tests use this one and
    the next), so two workers' tasks never share a uid that could signal
    or read the other's."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    taken = {entry.pw_uid for entry in pwd.getpwall()}
    return next(uid for uid in range(42420 + 4 * worker, 42520) if uid not in taken)


@dataclass
class Bed:
    """A project, a hidden home and a run folder, owned by the user that
    runs the worker, under a folder every uid can reach."""

    base: Path
    uid: int
    prefix: list[str]  # what runs the worker as that user

    @property
    def project(self) -> Path:
        return self.base / "project"

    @property
    def home(self) -> Path:
        return self.base / "home"

    def start(self, script: str, marker: str, *, network_isolation: bool,
              path: str = SYSTEM_PATH) -> tuple[subprocess.Popen[str], WorkerPaths]:  # fmt: skip
        """Start `script` through the worker (which returns when it ends),
        with `path` as the PATH of doit and the task (its toolchains shown
        as the local backend shows them)."""
        run_dir = self.base / "runs" / marker[-8:]
        run_dir.mkdir(parents=True)
        spec = make_spec("escape", ["sh", "-c", script, marker], self.project,
                         inputs=["data/in.txt"], outputs=["out/"])  # fmt: skip
        paths = WorkerPaths(project=str(self.project), run_dir=str(run_dir))
        job = build_job(spec, paths, sandbox="bwrap", network_isolation=network_isolation,
                        grace_seconds=GRACE, hide=[str(self.home)])  # fmt: skip
        env = {"PATH": path, "HOME": str(self.home), "SUBSTRAX_LEAK": SECRET}
        show_toolchains(job, env)
        Path(paths.job).write_text(json.dumps(job))
        chown_tree(self.base, self.uid)
        assert SYSTEM_PYTHON is not None
        worker = subprocess.Popen(
            [*self.prefix, SYSTEM_PYTHON, str(WORKER), paths.job], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        return worker, paths

    @staticmethod
    def finish(worker: subprocess.Popen[str], paths: WorkerPaths) -> tuple[str, dict[str, object]]:
        """Wait for the worker; the run's log and final status."""
        try:
            _out, err = worker.communicate(timeout=120)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        assert worker.returncode == 0, err
        return Path(paths.log).read_text(errors="replace"), json.loads(Path(paths.status).read_text())

    def run(self, script: str, marker: str, *, network_isolation: bool,
            path: str = SYSTEM_PATH) -> tuple[str, dict[str, object]]:  # fmt: skip
        """Run `script` through the worker; its log and final status."""
        return self.finish(*self.start(script, marker, network_isolation=network_isolation, path=path))


def chown_tree(root: Path, uid: int) -> None:
    for folder, dirs, files in os.walk(root):
        for name in [folder, *(os.path.join(folder, n) for n in dirs + files)]:
            os.lchown(name, uid, uid)


@pytest.fixture(params=["root", "unprivileged"])
def bed(request: pytest.FixtureRequest) -> Iterator[Bed]:
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if SYSTEM_PYTHON is None or missing:
        pytest.skip(f"ESCAPE PROBES NOT RUN: missing {missing or 'python3 in /usr/bin'}")
    prefix: list[str] = []  # none: the worker runs as the test's own user
    if os.geteuid() != 0:
        if request.param == "root":
            pytest.skip("ROOT ESCAPE PROBES NOT RUN: the tests do not run as root (CI runs them as root)")
        uid = os.geteuid()
    elif request.param == "root":
        uid = 0
    else:
        if shutil.which("setpriv") is None:
            pytest.skip("UNPRIVILEGED ESCAPE PROBES NOT RUN: setpriv (util-linux) is not installed")
        uid = free_uid()
        prefix = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    base = Path(tempfile.mkdtemp(prefix="substrax-escape-"))
    base.chmod(0o755)
    made = Bed(base, uid, prefix)
    (made.project / "data").mkdir(parents=True)
    (made.project / "code.txt").write_text("original\n")
    (made.project / "data" / "in.txt").write_text("input\n")
    made.home.mkdir()
    (made.home / "secret.txt").write_text("credentials\n")
    yield made
    shutil.rmtree(base)


# The nodes bubblewrap's --dev binds from the host's /dev.
USUAL_NODES = [("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8), ("urandom", 1, 9),
               ("tty", 5, 0)]  # fmt: skip


# (path under /dev, major, minor, mode, group): the numbers the drivers use.
# nvidia-uvm, nvidia-caps and kfd get a dynamic major on real machines;
# AMD's nodes and the DRM ones belong to root and the "render" group.
RENDER = "render"


GPU_NODES = [
    ("nvidia0", 195, 0, 0o666, "root"),
    ("nvidia1", 195, 1, 0o666, "root"),
    ("nvidiactl", 195, 255, 0o666, "root"),
    ("nvidia-modeset", 195, 254, 0o666, "root"),
    ("nvidia-uvm", 510, 0, 0o666, "root"),
    ("nvidia-uvm-tools", 510, 1, 0o666, "root"),
    ("nvidia-caps/nvidia-cap1", 509, 1, 0o400, "root"),  # MIG config: root only
    ("nvidia-caps/nvidia-cap2", 509, 2, 0o444, "root"),
    ("kfd", 508, 0, 0o660, RENDER),
    ("dri/card0", 226, 0, 0o660, RENDER),
    ("dri/renderD128", 226, 128, 0o660, RENDER),
]


def free_gid() -> int:
    taken = {entry.gr_gid for entry in grp.getgrall()}
    return next(gid for gid in range(42520, 42620) if gid not in taken)


def make_dev_script(render_gid: int) -> str:
    """Shell code, run in the test's own mount namespace: a tmpfs over /dev
    holding the usual nodes, the GPU nodes, a link as udev makes in
    dri/by-path, and a disk node that must stay out of the sandbox."""
    lines = ["set -e", "mount -t tmpfs -o mode=755 substrax-test-dev /dev", "mkdir /dev/nvidia-caps /dev/dri"]
    for name, major, minor in USUAL_NODES:
        lines.append(f"mknod -m 666 /dev/{name} c {major} {minor}")
    for rel, major, minor, mode, group in GPU_NODES:
        lines.append(f"mknod -m {mode:o} /dev/{rel} c {major} {minor}")
        lines.append(f"chgrp {render_gid if group == RENDER else 0} /dev/{rel}")
    lines += ["mkdir /dev/dri/by-path", "ln -s ../renderD128 /dev/dri/by-path/pci-0000:00:04.0-render",
              "mknod -m 660 /dev/sda b 8 0"]
    return "\n".join(lines) + '\nexec "$@"\n'


CUDA_QUERY = """
import ctypes
cuda = ctypes.CDLL("libcuda.so.1")
count = ctypes.c_int()
print("CUDA", cuda.cuInit(0), cuda.cuDeviceGetCount(ctypes.byref(count)), count.value)
"""


def nvidia_smi_gpus() -> list[str] | None:
    """The GPUs `nvidia-smi -L` lists on this machine; None without one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    gpus = [line for line in listed.stdout.splitlines() if line.startswith("GPU ")]
    return gpus if listed.returncode == 0 and gpus else None
