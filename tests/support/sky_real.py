"""The real SkyPilot, offline: its python, a throwaway HOME, fixture catalogs,
a network namespace, and a local API server stopped and cleaned up by pid.

SkyPilot lives in its own virtualenv (`make sky-venv`): SUBSTRAX_SKY_PYTHON,
else <repo>/.sky-venv/bin/python. Nothing here imports `sky`; everything that
needs it runs in that python, as its own process, with

* HOME set to a fresh folder (`import sky` writes ~/.sky), holding small
  fixture catalogs under ~/.sky/catalogs/v8/ (`write_catalogs`): SkyPilot
  otherwise downloads its catalogs on the first accelerator, instance type or
  region lookup;
* a small environment of its own (`sky_env`): no cloud credentials or API
  server endpoint leak in from this machine, usage collection off;
* no network (`offline_python`): each process in a fresh network namespace
  (`unshare -n`), so a catalog SkyPilot would download fails loudly instead;
* for the API server (`SkyServer`), one network namespace shared by the
  server and its clients, with loopback only.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from testbeds.sshd_host import _stat as proc_stat

REPO = Path(__file__).resolve().parents[2]
SKY_VERSION = "0.14.1"
CATALOG_VERSION = "v8"  # sky.skylet.constants.CATALOG_SCHEMA_VERSION in 0.14
DRIVER_TIMEOUT = 240.0


# ------------------------------------------------------------ SkyPilot itself


def sky_python_path() -> Path:
    configured = os.environ.get("SUBSTRAX_SKY_PYTHON")
    return Path(configured) if configured else REPO / ".sky-venv" / "bin" / "python"


def _sky_problem() -> str | None:
    python = sky_python_path()
    if not os.access(python, os.X_OK):
        return (
            f"no SkyPilot python at {python}: run `make sky-venv` (SkyPilot {SKY_VERSION} in "
            f"{REPO / '.sky-venv'}) or set SUBSTRAX_SKY_PYTHON to the python it is installed in"
        )
    return None


def _netns_problem() -> str | None:
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return "unshare/nsenter (util-linux) are missing"
    probe = subprocess.run([*_unshare(), "true"], capture_output=True, timeout=30, check=False)
    if probe.returncode != 0:
        return f"cannot make a network namespace here: {probe.stderr.decode(errors='replace').strip()}"
    return None


def _unshare() -> list[str]:
    """A new network namespace (and, unprivileged, the user namespace it needs)."""
    return ["unshare", "--net"] if os.geteuid() == 0 else ["unshare", "--map-root-user", "--net"]


SKY_PROBLEM = _sky_problem()
NETNS_PROBLEM = _netns_problem()
needs_sky = pytest.mark.skipif(SKY_PROBLEM is not None, reason=f"SKYPILOT NOT TESTED: {SKY_PROBLEM}")
_OFFLINE_PROBLEM = SKY_PROBLEM or (
    f"{NETNS_PROBLEM} (these tests keep SkyPilot off the network in a namespace of its own)"
    if NETNS_PROBLEM
    else None
)
needs_offline_sky = pytest.mark.skipif(
    _OFFLINE_PROBLEM is not None, reason=f"SKYPILOT NOT TESTED: {_OFFLINE_PROBLEM}"
)
# The API server's namespace needs its loopback brought up.
_SERVER_PROBLEM = _OFFLINE_PROBLEM or (
    None
    if shutil.which("ip") or os.access("/usr/sbin/ip", os.X_OK)
    else "`ip` (iproute2) is missing: apt-get install iproute2"
)
needs_sky_server = pytest.mark.skipif(
    _SERVER_PROBLEM is not None, reason=f"SKYPILOT API SERVER NOT TESTED: {_SERVER_PROBLEM}"
)


def sky_python() -> Path:
    """SkyPilot's python, or skip the test loudly."""
    if SKY_PROBLEM is not None:
        pytest.skip(f"SKYPILOT NOT TESTED: {SKY_PROBLEM}")
    return sky_python_path()


def sky_command() -> list[str]:
    """The `sky` CLI of that python."""
    python = sky_python()
    script = python.parent / "sky"
    if script.is_file():
        return [str(script)]
    return [str(python), "-c", "import sys; from sky.cli import cli; sys.argv[0] = 'sky'; sys.exit(cli())"]


# ------------------------------------------------------------- HOME, catalogs

# Headers as SkyPilot 0.14.1 reads them: common/accelerators.csv and
# common/metadata.csv (sky/utils/accelerator_registry.py), aws/vms.csv
# (USEFUL_COLUMNS in sky/catalog/data_fetchers/fetch_aws.py), aws/images.csv
# (the hosted catalog's header). GpuInfo is a
# Python literal (sky/catalog/common.py reads it with ast.literal_eval).
ACCELERATORS_CSV = """\
AcceleratorName,Clouds
A100,"['AWS', 'GCP', 'Vast']"
H100,"['AWS', 'GCP', 'RunPod', 'Vast']"
T4,"['AWS', 'GCP']"
"""
METADATA_CSV = """\
GPU,MemoryGB,Manufacturer
A100,40,NVIDIA
H100,80,NVIDIA
T4,16,NVIDIA
"""
_AWS_HEADER = (
    "InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,GpuInfo,Price,SpotPrice,Region,"
    "AvailabilityZone,Arch,LocalDiskType,NVMeSupported,LocalDiskSize,LocalDiskCount,MaximumEfaInterfaces"
)


def _gpu_info(name: str, count: int, mib: int) -> str:
    info = {
        "Gpus": [{"Name": name, "Manufacturer": "NVIDIA", "Count": count, "MemoryInfo": {"SizeInMiB": mib}}],
        "TotalGpuMemoryInMiB": count * mib,
    }
    return '"' + repr(info) + '"'


_AWS_ROWS = [
    # type, accelerator, count, vcpus, memory, gpu info, price, spot price, local disk
    ("m6i.xlarge", "", "", 4, 16, "", 0.192, 0.08, ",False,,,0"),
    ("m6i.2xlarge", "", "", 8, 32, "", 0.384, 0.15, ",False,,,0"),
    ("m6i.4xlarge", "", "", 16, 64, "", 0.768, 0.30, ",False,,,0"),
    ("p5.4xlarge", "H100", 1.0, 16, 256, _gpu_info("H100", 1, 81920), 6.88, 3.0, "ssd,True,3800,1,0"),
    ("p5.48xlarge", "H100", 8.0, 192, 2048, _gpu_info("H100", 8, 81920), 98.32, 40.0, "ssd,True,3800,8,32"),
]
_AWS_ZONES = [("us-east-1", "use1-az1"), ("us-east-1", "use1-az2"), ("us-west-2", "usw2-az1")]


# sky/catalog/common.py get_image_id_from_tag_impl: Tag, Region, ImageId.
AWS_IMAGE_TAG = "skypilot:gpu-ubuntu-2204"
AWS_IMAGES_CSV = "Tag,Region,OS,OSVersion,ImageId,CreationDate,BaseImageId\n" + "".join(
    f"{AWS_IMAGE_TAG},{region},ubuntu,22.04,ami-0{n}1234567890abcd,20250101,\n"
    for n, region in enumerate(("us-east-1", "us-west-2"))
)


def aws_vms_csv() -> str:
    lines = [_AWS_HEADER]
    for name, acc, count, cpus, mem, gpu, price, spot, disk in _AWS_ROWS:
        for region, zone in _AWS_ZONES:
            lines.append(
                f"{name},{acc},{count},{cpus}.0,{mem}.0,{gpu},{price},{spot},{region},{zone},x86_64,{disk}"
            )
    return "\n".join(lines) + "\n"


def write_catalogs(home: Path) -> Path:
    """Fixture catalogs SkyPilot reads instead of downloading its own."""
    root = home / ".sky" / "catalogs" / CATALOG_VERSION
    for rel, text in {
        "common/accelerators.csv": ACCELERATORS_CSV,
        "common/metadata.csv": METADATA_CSV,
        "aws/vms.csv": aws_vms_csv(),
        "aws/images.csv": AWS_IMAGES_CSV,
    }.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def sky_env(home: Path, **extra: str) -> dict[str, str]:
    """The whole environment of a SkyPilot process: nothing of this machine's
    beyond PATH and the locale (no cloud credentials, no API endpoint)."""
    tmp = home / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env = {
        "HOME": str(home),
        "TMPDIR": str(tmp),
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "SKYPILOT_DISABLE_USAGE_COLLECTION": "1",
        "PYTHONUNBUFFERED": "1",
    }
    env.update(extra)
    return env


def make_sky_home(root: Path) -> Path:
    home = root / "sky-home"
    home.mkdir(parents=True, exist_ok=True)
    write_catalogs(home)
    return home


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def offline_python(folder: Path) -> Path:
    """A `sky_python` that runs SkyPilot's python with no network at all."""
    argv = " ".join([*_unshare(), "--", str(sky_python())])
    return _executable(folder / "sky-python-offline", f'#!/bin/sh\nexec {argv} "$@"\n')


# --------------------------------------------------------------------- driver

# Runs in SkyPilot's python: the SDK helper's (sky_sdk.py's) own `main` for each
# validation (so each answer is exactly what SkyClient would get), then what
# SkyPilot says about each cloud's features. One process: `import sky` is ~3 s.
DRIVER = r"""
import io, json, sys
sys.path.insert(0, sys.argv[1])
import sky
import sky_sdk
from sky.utils import registry

payload = json.load(open(sys.argv[2]))
answers = {}
real_stdin, real_stdout = sys.stdin, sys.stdout
for case_id, request in payload["validate"].items():
    sys.stdin, sys.stdout = io.StringIO(json.dumps(request)), io.StringIO()
    try:
        code = sky_sdk.main(["validate"])
    finally:
        out = sys.stdout.getvalue()
        sys.stdin, sys.stdout = real_stdin, real_stdout
    answer = json.loads(out.strip().splitlines()[-1])
    answer["exit_code"] = code
    answers[case_id] = answer

# Each cloud's _CLOUD_UNSUPPORTED_FEATURES, by feature name.
features = {}
if payload["features"]:
    wanted = {"STORAGE_MOUNTING", "AUTODOWN", "AUTOSTOP", "STOP"}
    for name, cloud in sorted(registry.CLOUD_REGISTRY.items()):
        table = getattr(type(cloud), "_CLOUD_UNSUPPORTED_FEATURES", None) or {}
        features[name] = {f.name: str(why) for f, why in table.items() if f.name in wanted}
with open(sys.argv[3], "w") as f:
    json.dump({"validate": answers, "features": features, "version": sky.__version__}, f)
"""


def run_driver(
    python: Path, env: dict[str, str], work: Path, validate: dict[str, dict[str, Any]], features: bool
) -> dict[str, Any]:
    """Every `validate` request answered by the SDK helper (sky_sdk.py) in one process."""
    from substrax_tasks.backends.skypilot.client import SKY_SDK_SCRIPT

    work.mkdir(parents=True, exist_ok=True)
    script = work / "driver.py"
    script.write_text(DRIVER)
    request, answer = work / "driver-request.json", work / "driver-answer.json"
    request.write_text(json.dumps({"validate": validate, "features": features}))
    done = subprocess.run(
        [str(python), str(script), str(SKY_SDK_SCRIPT.parent), str(request), str(answer)],
        env=env, capture_output=True, timeout=DRIVER_TIMEOUT, check=False,
    )  # fmt: skip
    if done.returncode != 0 or not answer.is_file():
        pytest.fail(
            f"the SkyPilot driver failed (exit {done.returncode}):\n"
            + done.stderr.decode(errors="replace")[-4000:]
        )
    result: dict[str, Any] = json.loads(answer.read_text())
    return result


# ------------------------------------------------------------------ processes


_stat_fields = proc_stat  # one reading of /proc/PID/stat, the test bed's


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    sid: int
    start: int


def live_processes() -> dict[int, Proc]:
    """Every live process (zombies excluded) but this one."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        fields = _stat_fields(int(entry))
        if fields is not None and fields[0] not in ("Z", "X"):
            pid = int(entry)
            table[pid] = Proc(pid, int(fields[1]), int(fields[3]), int(fields[19]))
    return table


def descendants(pid: int, table: dict[int, Proc]) -> set[int]:
    children: dict[int, list[int]] = {}
    for proc in table.values():
        children.setdefault(proc.ppid, []).append(proc.pid)
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _netns_id(pid: int) -> tuple[int, int] | None:
    try:
        st = os.stat(f"/proc/{pid}/ns/net")
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _fd_id(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino)


def describe(pids: Iterable[int]) -> str:
    lines = []
    for pid in sorted(pids):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            cmd = "(gone)"
        lines.append(f"  {pid}: {cmd[:160]}")
    return "\n".join(lines)


def _kill_exact(proc: Proc) -> None:
    """SIGKILL `proc` if that pid is still the same process (pid reuse)."""
    fields = _stat_fields(proc.pid)
    if fields is None or int(fields[19]) != proc.start:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGKILL)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


# ----------------------------------------------------------------- API server

HEALTH_PROBE = r"""
import json, sys, time, urllib.request
deadline = time.monotonic() + float(sys.argv[2])
while True:
    try:
        with urllib.request.urlopen(sys.argv[1], timeout=2) as r:
            print(r.read().decode()); sys.exit(0)
    except Exception as exc:
        if time.monotonic() > deadline:
            print(exc); sys.exit(1)
        time.sleep(0.2)
"""


@dataclass
class SkyServer:
    """A local SkyPilot API server in a network namespace of its own.

    `holder` keeps the namespace (loopback up, nothing else); the server and
    every client (`python`, a wrapper) enter it, so all their traffic stays on
    that loopback. The server runs `sky api start --foreground` as our own
    child: its pid is known from the start, and so is its session."""

    root: Path
    home: Path
    port: int
    env: dict[str, str]
    holder: subprocess.Popen[bytes]
    server: subprocess.Popen[bytes] | None = None
    server_start: int | None = None
    python: Path = field(default_factory=Path)
    log: Path = field(default_factory=Path)
    netns_fd: int | None = None  # keeps the namespace (and its inode number) ours
    left_after_stop: str = ""

    def enter(self) -> list[str]:
        """argv prefix that runs a command inside the server's namespace."""
        net = f"--net=/proc/{self.holder.pid}/ns/net"
        if os.geteuid() == 0:
            return ["nsenter", net, "--"]
        return ["nsenter", f"--user=/proc/{self.holder.pid}/ns/user", net, "--preserve-credentials", "--"]

    def run(self, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [*self.enter(), *argv], env=self.env, capture_output=True, timeout=timeout, check=False
        )

    # -- processes
    def ours(self) -> dict[int, Proc]:
        """Everything the server made: its descendants, its session, and any
        process in its network namespace (helpers that double-forked out of
        both); the namespace holder last, on its own."""
        table = live_processes()
        found: set[int] = set()
        server = table.get(self.server.pid) if self.server is not None else None
        if server is not None and server.start == self.server_start:
            # Only while it lives: then no other session can have its pid as id.
            found |= {server.pid} | descendants(server.pid, table)
            found |= {p.pid for p in table.values() if p.sid == server.pid}
        if self.netns_fd is not None:
            netns = _fd_id(self.netns_fd)
            found |= {pid for pid in table if _netns_id(pid) == netns}
        found.discard(self.holder.pid)
        return {pid: table[pid] for pid in found if pid in table}

    def _kill_ours(self, deadline: float) -> None:
        while True:
            left = self.ours()
            if not left:
                return
            for proc in left.values():
                _kill_exact(proc)
            if self.server is not None:
                self.server.poll()
            if time.monotonic() > deadline:
                raise AssertionError(f"SkyPilot processes survive SIGKILL:\n{describe(left)}")
            time.sleep(0.05)

    def kill_all(self, timeout: float = 20) -> None:
        """SIGKILL, by pid, all `ours`, then the holder; the namespace stays
        pinned by `netns_fd` until nothing is left in it."""
        deadline = time.monotonic() + timeout
        try:
            self._kill_ours(deadline)
            if self.server is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.server.wait(timeout=5)
            self.holder.kill()
            self.holder.wait(timeout=10)
            self._kill_ours(deadline)
        finally:
            if self.netns_fd is not None:
                os.close(self.netns_fd)
                self.netns_fd = None


def _semaphores_of(pid: int) -> set[Path]:
    """The named POSIX semaphores process `pid` has mapped (glibc maps them
    from /dev/shm/sem.NAME)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return set()
    found = set()
    for line in maps.splitlines():
        name = line.rsplit(None, 1)[-1] if line.count(" ") >= 5 else ""
        if name.startswith("/dev/shm/sem.mp-"):
            found.add(Path(name))
    return found


def _ip() -> str:
    return shutil.which("ip") or "/usr/sbin/ip"


def _port_in_use_by_a_sky_server(port: int) -> bool:
    """`sky api stop` stops every server whose argv says --port=PORT, in any
    namespace: never pick the port of someone else's."""
    needle = f"--port={port}".encode()
    for pid in live_processes():
        with contextlib.suppress(OSError):
            if needle in Path(f"/proc/{pid}/cmdline").read_bytes():
                return True
    return False


def start_server(root: Path, *, path_prepend: Iterable[Path] = (), timeout: float = 120) -> SkyServer:
    """`sky api start` in a fresh HOME and network namespace; ready when its
    /api/health answers."""
    home = make_sky_home(root)
    port = free_port()
    while _port_in_use_by_a_sky_server(port):
        port = free_port()
    env = sky_env(home, SKYPILOT_API_SERVER_LOCAL_PORT=str(port))
    env["PATH"] = os.pathsep.join([*map(str, path_prepend), env["PATH"]])
    holder = subprocess.Popen(
        [*_unshare(), "--", "sh", "-c", f"{_ip()} link set lo up && echo up && exec sleep 86400"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    assert holder.stdout is not None
    with holder.stdout:
        ready = holder.stdout.readline().strip() == b"up"
    holder.stdout = None
    server = SkyServer(root=root, home=home, port=port, env=env, holder=holder)
    try:
        server.netns_fd = os.open(f"/proc/{holder.pid}/ns/net", os.O_RDONLY)
    except OSError:
        ready = False
    if not ready:
        server.kill_all()
        pytest.fail("could not make the API server's network namespace (loopback up)")
    server.python = _executable(
        root / "sky-python-netns", "#!/bin/sh\nexec " + " ".join(server.enter()) + f' {sky_python()} "$@"\n'
    )
    server.log = root / "api-server.log"
    try:
        with server.log.open("wb") as log:
            server.server = subprocess.Popen(
                [*server.enter(), *sky_command(), "api", "start", "--foreground"],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        fields = _stat_fields(server.server.pid)
        server.server_start = int(fields[19]) if fields else None
        probe = server.run(
            [str(sky_python()), "-c", HEALTH_PROBE, f"http://127.0.0.1:{port}/api/health", str(timeout)],
            timeout=timeout + 30,
        )
        if probe.returncode != 0 or server.server.poll() is not None:
            pytest.fail(
                f"the SkyPilot API server did not come up ({probe.stdout.decode(errors='replace')}):\n"
                + _tail(server.log)
            )
    except BaseException:
        server.kill_all()
        raise
    return server


def _is_resource_tracker(pid: int) -> bool:
    try:
        return b"multiprocessing.resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _interrupt_server(server: SkyServer, timeout: float = 60, exit_grace: float = 3) -> None:
    """SIGINT the server, as a Ctrl-C on `sky api start --foreground` would,
    and wait until its children but the resource tracker have exited.

    `sky api stop` alone SIGKILLs the server's tree, resource tracker too,
    so the named semaphores (/dev/shm/sem.mp-*) the server makes for its
    executors are never unlinked. SIGTERM skips the server's `finally`
    (uvicorn re-raises it with the default action); SIGINT comes back as
    KeyboardInterrupt, the `finally` stops the executors, and their
    semaphores are unlinked. The server may then hang at exit (SkyPilot
    0.14.1 joins a thread that never ends), holding no semaphore:
    `sky api stop` and kill_all end it."""
    if server.server is None or server.server.poll() is not None:
        return
    pid = server.server.pid
    # SkyPilot's graceful shutdown elects a coordinator with this lock file
    # and leaves it; removed below only if it is this stop that made it.
    lock = Path("/tmp/skypilot_graceful_shutdown.lock")
    lock_was_there = lock.exists()
    with contextlib.suppress(ProcessLookupError):
        server.server.send_signal(signal.SIGINT)
    deadline = time.monotonic() + timeout

    def helpers() -> set[int]:
        if server.server is None or server.server.poll() is not None:
            return set()
        return {p for p in descendants(pid, live_processes()) if not _is_resource_tracker(p)}

    while helpers() and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.server.wait(timeout=exit_grace)
    if not lock_was_there:
        lock.unlink(missing_ok=True)


def stop_server(server: SkyServer) -> None:
    """SIGINT and a wait (see _interrupt_server), `sky api stop`, then
    SIGKILL, by pid, whatever the server left."""
    try:
        _interrupt_server(server)
        server.run([*sky_command(), "api", "stop"], timeout=120)
        if server.server is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.server.wait(timeout=20)
        server.left_after_stop = describe(server.ours())
        (server.root / "left-after-api-stop.txt").write_text(server.left_after_stop + "\n")
    finally:
        server.kill_all()


@contextlib.contextmanager
def running_server(root: Path, *, path_prepend: Iterable[Path] = ()) -> Iterator[SkyServer]:
    server = start_server(root, path_prepend=path_prepend)
    try:
        yield server
    finally:
        held = {sem for pid in server.ours() for sem in _semaphores_of(pid)}
        stop_server(server)
    # Only when the body passed: a stop that SIGKILLs the resource tracker
    # leaves these, and every run would add to /dev/shm.
    left = sorted(str(sem) for sem in held if sem.exists())
    if left:
        pytest.fail(f"the stopped API server left its semaphores: {left}")


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


SSH_STARTED = "ssh-started"


def blocking_ssh(folder: Path) -> tuple[Path, Path]:
    """A folder to put first on the server's PATH, holding an `ssh` that
    appends its pid to the returned file and then waits (10 min). SkyPilot's
    Slurm credential check runs `ssh` to the login node: with this one it
    blocks, no traffic at all, its request RUNNING until cancelled. (A real
    ssh gives up after SkyPilot's ConnectTimeout of 30 s, too short on a
    busy machine.)"""
    bin_dir = folder / "blocking-ssh"
    bin_dir.mkdir(parents=True, exist_ok=True)
    started = folder / SSH_STARTED
    _executable(bin_dir / "ssh", f'#!/bin/sh\necho "$$" >> {started}\nexec sleep 600\n')
    return bin_dir, started


def slurm_login_node(home: Path) -> None:
    """~/.slurm/config with one login node: SkyPilot's check then runs ssh."""
    folder = home / ".slurm"
    folder.mkdir(parents=True, exist_ok=True)
    key = folder / "id_unused"
    key.write_text("")
    key.chmod(0o600)
    (folder / "config").write_text(
        f"Host substrax-test-slurm\n  HostName 127.0.0.1\n  Port 9\n  User nobody\n  IdentityFile {key}\n"
    )


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def wait_for_log(log: Path, line: str, timeout: float) -> None:
    """Wait for `line` in the server's log (its stdout)."""
    deadline = time.monotonic() + timeout
    while line not in log.read_text(errors="replace"):
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout:.0f} s for {line!r} in {log}:\n{_tail(log)}")
        time.sleep(0.2)


def wait_path(path: Path, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout:.0f} s for {what} ({path})")
        time.sleep(0.05)
