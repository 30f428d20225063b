"""GPUs in the bubblewrap sandbox (issue 17), with no GPU needed.

The device nodes a GPU driver makes are made by the test with `mknod` on a
tmpfs mounted over /dev in a private mount namespace (`unshare --mount`),
and the real worker runs the real bwrap inside that namespace, as root and
as an unprivileged uid. A node with no driver behind it opens with ENXIO:
an open that gets that far has passed the mount's nodev flag (EACCES), the
file's mode (EACCES) and the lookup (ENOENT), which is what "bound and
permitted" means. The host's /dev is never touched.

A machine with a working `nvidia-smi` also runs it, and a CUDA device
query, inside the sandbox; elsewhere that test is skipped, loudly.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from local_runs import log_text, needs_bwrap, submit, wait_final
from sandbox_beds import (
    CUDA_QUERY,
    GPU_NODES,
    RENDER,
    SYSTEM_PYTHON,
    Bed,
    free_gid,
    free_uid,
    job_for,
    make_dev_script,
    nvidia_smi_gpus,
)

from substrax_tasks._remote import sandbox
from substrax_tasks.store.project import Project

pytestmark = needs_bwrap

# What `--dev /dev` gives every task, GPU or not.
MINIMAL_DEV = {"core", "fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin",
               "stdout", "tty", "urandom", "zero"}  # fmt: skip
SHM_BYTES = 128 << 20  # twice Docker's default /dev/shm, where data loaders die

# Runs inside the sandbox: each node's type, numbers and mode, the errno of
# opening it, what else /dev holds, and what the task may not do.
PROBE = r"""
import errno, json, multiprocessing, os, stat, sys
from multiprocessing import shared_memory
nodes = {}
for rel in json.loads(sys.argv[1]):
    path = "/dev/" + rel
    try:
        st = os.stat(path)
    except OSError as e:
        nodes[rel] = {"stat": errno.errorcode[e.errno]}
        continue
    try:
        os.close(os.open(path, os.O_RDONLY))
        opened = "opened"
    except OSError as e:
        opened = errno.errorcode[e.errno]
    nodes[rel] = {"chr": stat.S_ISCHR(st.st_mode), "rdev": [os.major(st.st_rdev), os.minor(st.st_rdev)],
                  "mode": stat.S_IMODE(st.st_mode), "open": opened}
try:
    os.mknod("/tmp/made", stat.S_IFCHR | 0o666, os.makedev(195, 0))
    mknod = "made"
except OSError as e:
    mknod = errno.errorcode[e.errno]
# A data loader's needs: a POSIX semaphore and a large shared segment.
lock = multiprocessing.Lock()
segment = shared_memory.SharedMemory(create=True, size=SHM_BYTES)
for offset in range(0, SHM_BYTES, 1 << 20):
    segment.buf[offset:offset + (1 << 20)] = b"\x01" * (1 << 20)
segment.close()
segment.unlink()
with open("/proc/net/dev") as table:
    netdevs = sorted(row.split(":")[0].strip() for row in table.read().splitlines()[2:])
caps = [line.split()[1] for line in open("/proc/self/status") if line.startswith(("CapEff", "CapPrm"))]
top = sorted(os.listdir("/dev"))
print("PROBE " + json.dumps({"nodes": nodes, "dev": top, "dri": sorted(os.listdir("/dev/dri"))
                             if os.path.isdir("/dev/dri") else [], "mknod": mknod, "shm": SHM_BYTES,
                             "netdevs": netdevs, "caps": caps, "uid": os.getuid()}))
""".replace("SHM_BYTES", str(SHM_BYTES))


def probe_result(log: str) -> dict[str, Any]:
    lines = [line for line in log.splitlines() if line.startswith("PROBE ")]
    assert len(lines) == 1, log
    found: dict[str, Any] = json.loads(lines[0][len("PROBE "):])
    return found






@pytest.fixture(params=["root", "unprivileged"])
def gpu_bed(request: pytest.FixtureRequest) -> Iterator[tuple[Bed, int]]:
    """A Bed whose worker runs in a mount namespace with GPU nodes in /dev,
    as root or as a uid with no account in the "render" group; and that
    group's gid."""
    if os.geteuid() != 0:
        pytest.skip("GPU SANDBOX NOT TESTED: making device nodes (mknod, mount) needs a root test run "
                    "(CI runs the tests as root)")
    missing = [tool for tool in ("unshare", "setpriv", "mknod") if shutil.which(tool) is None]
    if SYSTEM_PYTHON is None or missing:
        pytest.skip(f"GPU SANDBOX NOT TESTED: missing {missing or 'python3 in /usr/bin'}")
    render_gid = free_gid()
    uid = 0 if request.param == "root" else free_uid()
    as_user = [] if uid == 0 else ["setpriv", f"--reuid={uid}", f"--regid={uid}", f"--groups={render_gid}"]
    # The namespace ends with the worker (its only process), tmpfs and all.
    prefix = ["unshare", "--mount", "--propagation", "private", "sh", "-c", make_dev_script(render_gid),
              "make-gpu-dev", *as_user]  # fmt: skip
    base = Path(tempfile.mkdtemp(prefix="substrax-gpu-"))
    base.chmod(0o755)
    made = Bed(base, uid, prefix)
    (made.project / "data").mkdir(parents=True)
    (made.project / "data" / "in.txt").write_text("input\n")
    (made.project / "probe.py").write_text(PROBE)
    made.home.mkdir()
    try:
        yield made, render_gid
    finally:
        shutil.rmtree(base)


@pytest.mark.parametrize("isolated", [True, False], ids=["network_isolation", "network"])
def test_sandbox_shows_gpu_nodes_openable(gpu_bed: tuple[Bed, int], marker: str, isolated: bool) -> None:
    bed, _render_gid = gpu_bed
    names = [rel for rel, *_ in GPU_NODES]
    log, status = bed.run(f"python3 probe.py '{json.dumps(names)}'", marker, network_isolation=isolated)
    assert status["state"] == "succeeded", log
    found = probe_result(log)
    assert found["uid"] == bed.uid
    for rel, major, minor, mode, group in GPU_NODES:
        node = found["nodes"][rel]
        assert node["chr"] and node["rdev"] == [major, minor] and node["mode"] == mode, (rel, node)
        # The file's mode still counts: a uid other than root's gets
        # nowhere with a root-only node (nvidia-cap1), nor would it without
        # the render group with AMD's (it is in that group here).
        closed = bed.uid != 0 and not mode & 0o004 and group != RENDER
        assert node["open"] == ("EACCES" if closed else "ENXIO"), (rel, node)
    # Nothing else of the host's /dev: no disk, no link folder.
    assert set(found["dev"]) == MINIMAL_DEV | {"dri", "kfd", "nvidia-caps", "nvidia-modeset", "nvidia-uvm",
                                               "nvidia-uvm-tools", "nvidia0", "nvidia1", "nvidiactl"}, found
    assert found["dri"] == ["card0", "renderD128"]
    # The hardening is unchanged: no capability, so no device of its own.
    assert found["caps"] == ["0000000000000000", "0000000000000000"]
    assert found["mknod"] == "EPERM"
    assert found["netdevs"] == (["lo"] if isolated else found["netdevs"])
    if not isolated:
        assert found["netdevs"] != ["lo"]


def test_without_gpu_nodes_nothing_extra_is_bound(project: Project) -> None:
    present = sandbox.gpu_devices("/dev")
    if present or os.path.isdir(sandbox.NVIDIA_PROC):
        pytest.skip(f"NO-GPU CASE NOT TESTED: this machine has GPU nodes {present}")
    argv = sandbox.bwrap_argv("bwrap", job_for(project.root, ["out/"]), "/staging")
    assert "--dev-bind" not in argv
    assert sandbox.NVIDIA_PROC not in argv
    (project.root / "probe.py").write_text(PROBE)
    handle = submit(project, ["python3", "probe.py", json.dumps(["nvidia0", "kfd"])], sandbox="bwrap",
                    inputs=["probe.py"], outputs=["out/"])  # fmt: skip
    assert wait_final(project, handle) == "succeeded", log_text(project, handle)
    found = probe_result(log_text(project, handle))
    assert set(found["dev"]) == MINIMAL_DEV
    assert found["nodes"] == {"nvidia0": {"stat": "ENOENT"}, "kfd": {"stat": "ENOENT"}}
    assert found["shm"] == SHM_BYTES  # the segment was made and filled






def test_nvidia_smi_and_cuda_inside_the_sandbox(project: Project) -> None:
    gpus = nvidia_smi_gpus()
    if gpus is None:
        pytest.skip("REAL GPU NOT TESTED: no working nvidia-smi on this machine (runs on a GPU host)")
    smi = shutil.which("nvidia-smi")
    assert smi is not None
    (project.root / "cuda_query.py").write_text(CUDA_QUERY)
    script = f"{smi} -L && python3 cuda_query.py"
    handle = submit(project, ["sh", "-c", script], sandbox="bwrap", network_isolation=True)
    state = wait_final(project, handle, timeout=120)
    log = log_text(project, handle)
    assert state == "succeeded", log
    assert [line for line in log.splitlines() if line.startswith("GPU ")] == gpus, log
    assert f"CUDA 0 0 {len(gpus)}" in log, log
