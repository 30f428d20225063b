"""A one-node Slurm cluster on this machine that SkyPilot can launch on.

`bed_up(root)` (root only) installs what is missing with apt-get (slurmd,
slurmctld, slurm-client, munge, openssh, rsync, curl, patchelf), then starts,
each as a child it tracks by pid and start time:

* a private munged: its own key, socket, pid and log files under root/munge;
* slurmctld and slurmd in the foreground (`-D`), one node named after this
  host's short name, every port a free one on loopback, all state, spool, pid
  and log files under root, `AuthInfo=socket=` the private munge socket,
  `ProctrackType=proctrack/linuxproc`, `TaskPlugin=task/none`,
  `SelectType=select/cons_tres`, CPUs from nproc;
* a throwaway cluster user (`sxslurm<hex>`, home root/home) and an sshd on
  127.0.0.1 that lets only that user in (tests/support/testbeds/sshd_host.py);
  and a second such sshd with a stock environment policy (`AcceptEnv LANG
  LC_*`, which drops SkyPilot's SetEnv SKY_CLUSTER_NAME);
* a SkyPilot client HOME (root/client) with `~/.slurm/config` naming the
  cluster twice: `substrax-e2e` through the first sshd, `substrax-e2e-stock`
  through the second, whose `slurm.cluster_configs.<name>.tmpdir` in
  ~/.sky/config.yaml puts SkyPilot's runtime in root/nodetmp; and a local API
  server on a port of its own (root/logs/api-server.log). `sky check slurm`
  must then enable both.

The cluster user's ~/.bashrc (bash reads it for every command sshd runs:
SkyPilot's `bash --login -c` commands, through ~/.bash_profile, and its
plain `ssh ... srun ... rsync` file transfers; srun and sbatch hand the
environment on to the jobs) carries the three workarounds that let
SkyPilot's runtime install work with no network but PyPI: a `curl` first on
PATH that answers only uv's install-script URL (with a script copying uv
from the PyPI `uv` wheel into $UV_INSTALL_DIR, i.e. the cluster's
$HOME/.local/bin, whatever the cluster's name) and hands every other call
to the real curl; a Python 3.10 (`uv venv --python 3.10`; pyenv's, linked
under root/tools with the binary copied and its RPATH set with patchelf,
since /root is mode 700); SSL_CERT_FILE and UV_NATIVE_TLS=1 so uv trusts
this machine's certificates. It also sets SLURM_CONF: there is no
/etc/slurm/slurm.conf, and the slurm commands find the private cluster by it.
Then, as Debian's stock ~/.bashrc, it returns for a shell that is not
interactive, so the `source ~/.sky_ssh_rc` SkyPilot appends (which moves
$HOME into the cluster's folder) never runs for a command over ssh.

`bed_down(root)` stops it all and is safe to run twice, or after a half-made
`up`: cancels the user's Slurm jobs, stops the API server (SIGINT and a
wait, so its semaphores in /dev/shm go with it; `sky api stop` if that
fails), then SIGTERM and SIGKILL,
by pid, every process the bed started and whatever they left: descendants,
the API server's session, processes carrying the bed's marker variable
(SUBSTRAX_SLURM_BED=<token>, set for the daemons, the API server and every
SkyPilot process run with `bed.sky_env()`; not in `env`'s exports, since
a shell is not the bed's), slurmstepd (double-forked by
slurmd; found by its cwd in the bed's spool folder or its open slurmd log)
and everything running as the cluster user. Then the sshd, the user, the
user's leftovers in /tmp, SkyPilot's ssh control folder /tmp/sky_ssh_<hash>,
and root.

Command line (the Makefile's `make test-e2e` uses it)::

    python tests/support/testbeds/slurm_cluster.py up --root DIR      # idempotent
    python tests/support/testbeds/slurm_cluster.py status --root DIR  # exit 1 if not healthy
    python tests/support/testbeds/slurm_cluster.py env --root DIR     # `export ...` lines for SkyPilot
    python tests/support/testbeds/slurm_cluster.py down --root DIR [--keep-logs]

`up` prints the record and writes it to DIR/testbed.json. DIR must be
reachable by another user (every parent folder o+x) and short (unix socket
paths live under it). A package registry that cannot be reached (the Debian
mirror, PyPI) is named as such in the error. Standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pwd
import re
import secrets
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: python tests/support/testbeds/slurm_cluster.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from testbeds import sshd_host
from testbeds.sshd_host import TestbedError, descendants, is_alive, start_ticks

REPO = Path(__file__).resolve().parents[3]
DEFAULT_SKY_VENV = REPO / ".sky-venv"
RECORD_NAME = "testbed.json"
MARKER_VAR = "SUBSTRAX_SLURM_BED"
CLUSTER_ALIAS = "substrax-e2e"  # the Host in ~/.slurm/config: SkyPilot's infra "slurm/substrax-e2e"
# The same cluster through a second login sshd with Debian's stock environment
# policy (SkyPilot's SetEnv SKY_CLUSTER_NAME is dropped there) and a
# SkyPilot `tmpdir` of its own: a site SkyPilot's defaults were not made for.
STOCK_ALIAS = f"{CLUSTER_ALIAS}-stock"
STOCK_ACCEPT_ENV = "LANG LC_*"
UV_REQUIREMENT = os.environ.get("SUBSTRAX_TESTBED_UV", "uv==0.13.9")
UV_INSTALL_URLS = ("https://astral.sh/uv/install.sh",)  # what SkyPilot 0.14 fetches (SKY_UV_INSTALL_CMD)
PYTHON310_CANDIDATES = ("/root/.pyenv/versions/3.10.13",)
PYTHON310_GLOB_ROOT = Path("/root/.pyenv/versions")
CERT_FILE_DEFAULT = "/etc/ssl/certs/ca-certificates.crt"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
MAX_ROOT_LEN = 60  # root/slurm/spool/<node>_<job>.<step> must stay under 108 bytes
DAEMON_START_TIMEOUT = 60.0
API_START_TIMEOUT = 120.0
SKY_CHECK_TIMEOUT = 300.0
STOP_TIMEOUT = 30.0
TERM_GRACE = 3.0
API_STOP_TIMEOUT = 60.0  # SIGINT: ~6 s of SkyPilot's drain, then its executors stop
API_EXIT_GRACE = 3.0  # then the server may exit by itself
# tool -> Debian package; each is installed when missing.
PACKAGES = {
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "sinfo": "slurm-client",
    "munged": "munge",
    "patchelf": "patchelf",
    "sshd": "openssh-server",
    "ssh": "openssh-client",
    "rsync": "rsync",
    "curl": "curl",
}
# What apt-get and pip print when the registry cannot be reached.
UNREACHABLE_PATTERNS = re.compile(
    r"Temporary failure resolving|Could not resolve|Failed to fetch|Unable to connect|"
    r"Could not connect|Connection failed|Network is unreachable|Connection timed out|"
    r"NewConnectionError|Max retries exceeded|Name or service not known|"
    r"Temporary failure in name resolution|No route to host",
)

# Daemons this process started, reaped when they are stopped.
_SPAWNED: dict[int, subprocess.Popen[bytes]] = {}


@dataclasses.dataclass
class Proc:
    pid: int
    ticks: int  # start time in clock ticks: a reused pid is never signalled

    def alive(self) -> bool:
        return is_alive(self.pid, self.ticks)


@dataclasses.dataclass
class SlurmBed:
    """A running one-node Slurm cluster, its login user and a SkyPilot client HOME."""

    root: Path
    token: str
    node: str  # the Slurm node name (this host's short name)
    cluster_alias: str  # Host in ~/.slurm/config
    cpus: int
    real_memory_mb: int
    slurmctld_port: int
    slurmd_port: int
    api_port: int
    user: str
    uid: int
    home: Path
    created_user: bool
    sshd_dir: Path  # sshd_host's folder (host.json, keys)
    ssh_port: int
    sky_venv: Path
    uv_version: str
    python310: str  # the cluster user's python3.10
    processes: dict[str, Proc]
    api_sid: int | None  # the API server's session (it runs start_new_session)
    timings: dict[str, float]
    state: str  # "starting" or "up"
    created_root: bool
    stock_ssh_port: int = 0  # the stock login sshd (STOCK_ALIAS)

    # ------------------------------------------------------------- paths

    @property
    def slurm_dir(self) -> Path:
        return self.root / "slurm"

    @property
    def slurm_conf(self) -> Path:
        return self.slurm_dir / "slurm.conf"

    @property
    def spool(self) -> Path:
        return self.slurm_dir / "spool"

    @property
    def munge_dir(self) -> Path:
        return self.root / "munge"

    @property
    def munge_socket(self) -> Path:
        return self.munge_dir / "munge.socket.2"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def tools(self) -> Path:
        return self.root / "tools"

    @property
    def tools_bin(self) -> Path:
        return self.tools / "bin"

    @property
    def client_home(self) -> Path:
        return self.root / "client"

    @property
    def tmpdir(self) -> Path:
        return self.root / "tmp"

    @property
    def client_key(self) -> Path:
        return self.sshd_dir / "client_ed25519"

    @property
    def stock_sshd_dir(self) -> Path:
        return self.root / "sshd-stock"

    @property
    def node_tmpdir(self) -> Path:
        """STOCK_ALIAS's `slurm.cluster_configs.<name>.tmpdir` (SkyPilot's runtime folders)."""
        return self.root / "nodetmp"

    @property
    def infra(self) -> str:
        """The `infra` of a SkyPilot task that runs here."""
        return f"slurm/{self.cluster_alias}"

    @property
    def stock_infra(self) -> str:
        """The same, through the stock login sshd and with SkyPilot's `tmpdir` set."""
        return f"slurm/{STOCK_ALIAS}"

    @property
    def sky_python(self) -> Path:
        return self.sky_venv / "bin" / "python"

    @property
    def sky(self) -> Path:
        return self.sky_venv / "bin" / "sky"

    # ------------------------------------------------------------ environments

    def slurm_env(self) -> dict[str, str]:
        """For running the slurm commands (sinfo, scontrol, scancel) here as root."""
        return {"PATH": SYSTEM_PATH, "LANG": "C.UTF-8", "SLURM_CONF": str(self.slurm_conf)}

    def sky_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment to run SkyPilot (its python, `sky`) with against this bed:
        the client HOME, the bed's own API server port and TMPDIR, no usage
        collection, and the marker `down` finds leftover processes by."""
        env = dict(os.environ if base is None else base)
        for name in list(env):  # no other API server or SkyPilot setting leaks in
            if name.startswith("SKYPILOT_") or name in ("SKY_API_SERVER_URL",):
                del env[name]
        env.update(
            {
                "HOME": str(self.client_home),
                "TMPDIR": str(self.tmpdir),
                "SKYPILOT_API_SERVER_LOCAL_PORT": str(self.api_port),
                "SKYPILOT_DISABLE_USAGE_COLLECTION": "1",
                MARKER_VAR: self.token,
                "PATH": f"{self.sky_venv / 'bin'}:{env.get('PATH', SYSTEM_PATH)}",
            }
        )
        env.pop("PYTHONPATH", None)
        return env

    # ------------------------------------------------------------------- record

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, Path):
                value = str(value)
            elif field.name == "processes":
                value = {name: dataclasses.asdict(proc) for name, proc in value.items()}
            data[field.name] = value
        data["slurm_conf"] = str(self.slurm_conf)
        data["client_home"] = str(self.client_home)
        data["client_key"] = str(self.client_key)
        data["infra"] = self.infra
        data["marker"] = f"{MARKER_VAR}={self.token}"
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SlurmBed:
        names = {field.name for field in dataclasses.fields(cls)}
        values = {key: value for key, value in data.items() if key in names}
        for key in ("root", "home", "sshd_dir", "sky_venv"):
            values[key] = Path(values[key])
        values["processes"] = {name: Proc(**proc) for name, proc in values["processes"].items()}
        return cls(**values)

    def save(self) -> None:
        target = self.root / RECORD_NAME
        partial = target.with_name(RECORD_NAME + ".partial")
        partial.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        partial.replace(target)


# ------------------------------------------------------------------ helpers


def _run(
    argv: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    timeout: float = 60.0,
    input: str | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            list(argv),
            env=env,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd=cwd,
        )
    except subprocess.TimeoutExpired as exc:
        raise TestbedError(f"{shlex.join(argv)} did not finish within {timeout:.0f} s") from exc
    except OSError as exc:
        raise TestbedError(f"{shlex.join(argv)}: {exc}") from exc


def _check(argv: Sequence[str], **kwargs: Any) -> str:
    done = _run(argv, **kwargs)
    if done.returncode != 0:
        detail = (done.stderr + done.stdout).strip()[-3000:]
        raise TestbedError(f"{shlex.join(argv)} failed ({done.returncode}): {detail}")
    return done.stdout


def _log_tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no {path.name})"
    return "\n".join(text.splitlines()[-lines:])


def _wait_for(what: str, ready: Callable[[], bool], timeout: float, detail: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TestbedError(f"{what} within {timeout:.0f} s:\n{detail()}")
        time.sleep(0.2)


def _free_ports(count: int) -> list[int]:
    """`count` distinct free loopback ports: every socket stays bound until
    all are picked, so the kernel cannot hand the same port out twice."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def _short_hostname() -> str:
    return socket.gethostname().split(".")[0]


def _mem_total_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    raise TestbedError("no MemTotal in /proc/meminfo")


def _ancestors(pid: int) -> set[int]:
    found: set[int] = set()
    while pid > 1:
        found.add(pid)
        fields = sshd_host._stat(pid)
        if fields is None:
            break
        pid = int(fields[1])
    return found


def _registry_reachable(url: str, timeout: float = 10.0) -> str | None:
    """None when `url` answers; otherwise why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            answer.read(1)
    except (urllib.error.URLError, OSError) as exc:
        return str(getattr(exc, "reason", exc))
    return None


# ----------------------------------------------------------------- packages


def missing_packages() -> list[str]:
    """Debian packages whose tools are missing here."""
    missing = []
    for tool, package in PACKAGES.items():
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            missing.append(package)
    return missing


def ensure_packages() -> list[str]:
    """apt-get install what is missing (as root); returns what it installed.
    Raises TestbedError, naming the Debian mirror when it cannot be reached."""
    missing = missing_packages()
    if not missing:
        return []
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise TestbedError(f"missing {', '.join(missing)}; as root: apt-get install -y {' '.join(missing)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    lock = ["-o", "DPkg::Lock::Timeout=300"]
    steps = [
        ["apt-get", *lock, "update"],
        ["apt-get", *lock, "install", "-y", "--no-install-recommends", *missing],
    ]
    for argv in steps:
        done = _run(argv, env=env, timeout=900)
        output = done.stdout + done.stderr
        # apt-get update exits 0 on some fetch failures: look at its words too.
        failed = done.returncode != 0 or (argv[-1] == "update" and "Failed to fetch" in output)
        if not failed:
            continue
        if UNREACHABLE_PATTERNS.search(output):
            raise TestbedError(
                f"the Debian package mirror is unreachable, so {', '.join(missing)} cannot be "
                f"installed ({shlex.join(argv)}):\n{output.strip()[-1500:]}"
            )
        if argv[-1] == "update":
            continue  # stale lists may still hold the packages
        raise TestbedError(f"{shlex.join(argv)} failed ({done.returncode}):\n{output.strip()[-2000:]}")
    if still := missing_packages():
        raise TestbedError(f"still missing after apt-get install: {', '.join(still)}")
    return missing


# -------------------------------------------------------------------- tools


def _fetch_uv(bed: SlurmBed) -> None:
    """The uv binary from the PyPI `uv` wheel, into root/tools/uv/."""
    wheels = bed.tools / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
        "--retries", "2", "--timeout", "30",
        "--only-binary=:all:", "--dest", str(wheels), UV_REQUIREMENT,
    ]  # fmt: skip
    done = _run(argv, timeout=300)
    if done.returncode != 0:
        output = (done.stdout + done.stderr).strip()[-1500:]
        why = _registry_reachable("https://pypi.org/simple/uv/")
        if why is not None or UNREACHABLE_PATTERNS.search(output):
            raise TestbedError(
                f"PyPI is unreachable ({why or 'see pip'}), so the `uv` wheel the cluster's "
                f"runtime install needs cannot be fetched:\n{output}"
            )
        raise TestbedError(f"{shlex.join(argv)} failed ({done.returncode}):\n{output}")
    found = sorted(wheels.glob("uv-*.whl"))
    if not found:
        raise TestbedError(f"pip download {UV_REQUIREMENT} left no uv wheel in {wheels}")
    wheel = found[-1]
    bed.uv_version = wheel.name.split("-")[1]
    target = bed.tools / "uv"
    target.mkdir(exist_ok=True)
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            name = Path(info.filename)
            if len(name.parts) == 3 and name.parts[1] == "scripts" and name.name in ("uv", "uvx"):
                (target / name.name).write_bytes(archive.read(info))
                (target / name.name).chmod(0o755)
    if not (target / "uv").exists():
        raise TestbedError(f"{wheel.name} holds no uv binary")
    shutil.rmtree(wheels, ignore_errors=True)


def _python310_source() -> Path:
    found = [Path(name) for name in PYTHON310_CANDIDATES]
    found += sorted(PYTHON310_GLOB_ROOT.glob("3.10.*"), reverse=True)
    for folder in found:
        if (folder / "bin" / "python3.10").exists():
            return folder
    raise TestbedError(
        "no Python 3.10 here (looked for /root/.pyenv/versions/3.10.*): SkyPilot's runtime runs "
        "`uv venv --python 3.10`, and uv cannot download one offline"
    )


def _copy_python310(bed: SlurmBed) -> None:
    """pyenv's 3.10 where the cluster user can run it. Files are hard links
    (readable: /root is only closed at the top) except the binary, which is
    copied and gets RPATH $ORIGIN/../lib with patchelf."""
    source = _python310_source()
    target = bed.tools / "python3.10"

    def link_or_copy(src: str, dst: str) -> object:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
        return dst

    ignore = shutil.ignore_patterns("test", "idlelib", "turtledemo", "__pycache__", "*.a")
    shutil.copytree(source, target, symlinks=True, ignore=ignore, copy_function=link_or_copy)
    binary = target / "bin" / "python3.10"
    binary.unlink()
    shutil.copy2(source / "bin" / "python3.10", binary)
    _check(["patchelf", "--set-rpath", "$ORIGIN/../lib", str(binary)])
    bed.python310 = str(binary)


def _write_tools(bed: SlurmBed, real_curl: str) -> None:
    bed.tools_bin.mkdir(parents=True, exist_ok=True)
    install_script = bed.tools / "uv-install.sh"
    install_script.write_text(
        "#!/bin/sh\n"
        "# substrax Slurm test bed: stands in for astral.sh's uv installer (no network but PyPI).\n"
        "set -eu\n"
        'dest="${UV_INSTALL_DIR:-${XDG_BIN_HOME:-$HOME/.local/bin}}"\n'
        'mkdir -p "$dest"\n'
        "for tool in uv uvx; do\n"
        f'  cp "{bed.tools}/uv/$tool" "$dest/.$tool.$$" && mv -f "$dest/.$tool.$$" "$dest/$tool"\n'
        "done\n"
        f'echo "installing to $dest (uv {bed.uv_version} from the PyPI wheel, substrax test bed)"\n'
    )
    cases = "|".join(UV_INSTALL_URLS)
    curl = bed.tools_bin / "curl"
    curl.write_text(
        "#!/bin/sh\n"
        "# substrax Slurm test bed: answers uv's install-script URL from a local script,\n"
        "# hands every other call to the real curl.\n"
        'for arg in "$@"; do\n'
        '  case "$arg" in\n'
        f'    {cases}) exec cat "{install_script}" ;;\n'
        "  esac\n"
        "done\n"
        f'exec {shlex.quote(real_curl)} "$@"\n'
    )
    curl.chmod(0o755)
    install_script.chmod(0o755)
    link = bed.tools_bin / "python3.10"
    with contextlib.suppress(FileNotFoundError):
        link.unlink()
    link.symlink_to(bed.python310)


def _profile_text(bed: SlurmBed) -> str:
    cert = os.environ.get("SSL_CERT_FILE") or CERT_FILE_DEFAULT
    lines = [
        "# substrax Slurm test bed: the cluster user's login environment.",
        "# Read by every bash sshd starts; srun and sbatch pass it on to the jobs.",
        f'export PATH="{bed.tools_bin}:$PATH"',
        f"export SLURM_CONF={shlex.quote(str(bed.slurm_conf))}",
        f"export SSL_CERT_FILE={shlex.quote(cert)}",
        "export UV_NATIVE_TLS=1",
        "export UV_PYTHON_DOWNLOADS=never",
    ]
    for name in ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY"):
        if name in os.environ:
            lines.append(f"export {name}={shlex.quote(os.environ[name])}")
    # Debian's stock ~/.bashrc returns here for a shell that is not
    # interactive, and so does this one: what SkyPilot appends below (its
    # `source ~/.sky_ssh_rc`, which moves $HOME into the cluster's folder)
    # never runs for a command over ssh, as on such a site.
    lines += ["# If not running interactively, don't do anything", "case $- in *i*) ;; *) return;; esac"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- processes


def _daemon_env(bed: SlurmBed) -> dict[str, str]:
    return {**bed.slurm_env(), "HOME": "/root", MARKER_VAR: bed.token}


def _spawn(bed: SlurmBed, name: str, argv: list[str], *, env: dict[str, str], cwd: Path) -> Proc:
    log = bed.logs / f"{name}.out"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,  # a Ctrl-C meant for the caller leaves it to `down`
        )
    _SPAWNED[proc.pid] = proc
    ticks = start_ticks(proc.pid)
    record = Proc(proc.pid, -1 if ticks is None else ticks)
    bed.processes[name] = record
    bed.save()
    if ticks is None:
        raise TestbedError(f"{name} exited at once:\n{_log_tail(log)}")
    return record


def _reap() -> None:
    for pid, proc in list(_SPAWNED.items()):
        if proc.poll() is not None:
            del _SPAWNED[pid]


def _environ_has(pid: int, needle: bytes) -> bool:
    try:
        return needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def _uses_path_under(pid: int, folder: str, files: tuple[str, ...]) -> bool:
    """The process's cwd is under `folder`, or it holds one of `files` open."""
    with contextlib.suppress(OSError):
        if os.readlink(f"/proc/{pid}/cwd").startswith(folder):
            return True
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}") in files:
                return True
    return False


def bed_processes(bed: SlurmBed) -> set[int]:
    """Every live process of the bed (never this one or its ancestors)."""
    table = sshd_host._live_pids()
    found: set[int] = set()
    for proc in bed.processes.values():
        if proc.alive():
            found |= {proc.pid} | descendants(proc.pid, table)
    needle = f"{MARKER_VAR}={bed.token}".encode()
    api = bed.processes.get("api-server")
    api_leader_alive = api is not None and api.alive()
    spool = str(bed.spool) + os.sep
    daemon_logs = tuple(str(bed.logs / name) for name in ("slurmd.log", "slurmd.out", "slurmctld.log"))
    for pid in table:
        if (
            _environ_has(pid, needle)
            or (bed.created_user and sshd_host._real_uid(pid) == bed.uid)
            or (api_leader_alive and bed.api_sid is not None and _getsid(pid) == bed.api_sid)
            or _uses_path_under(pid, spool, daemon_logs)
        ):
            found.add(pid)
    for pid in list(found):
        found |= descendants(pid, table)
    return found - _ancestors(os.getpid())


def _getsid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _snapshot(bed: SlurmBed) -> dict[int, int]:
    """The bed's processes now, by pid and start time: once a parent dies its
    children get a new one, so descendants are taken before anything stops."""
    return {pid: t for pid in bed_processes(bed) if (t := start_ticks(pid)) is not None}


def _kill_all(bed: SlurmBed, before: dict[int, int] | None = None) -> set[int]:
    """SIGTERM the daemons, then SIGKILL every bed process (and whatever of
    `before` still lives) until none is left; returns what survived."""
    first = {**(before or {}), **_snapshot(bed)}
    for proc in bed.processes.values():
        if proc.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + TERM_GRACE
    while any(proc.alive() for proc in bed.processes.values()) and time.monotonic() < deadline:
        _reap()
        time.sleep(0.05)
    left = sshd_host._kill_until_gone(
        lambda: bed_processes(bed) | {p for p, t in first.items() if is_alive(p, t)}, STOP_TIMEOUT
    )
    for pid in [p for p in _SPAWNED if p in {proc.pid for proc in bed.processes.values()}]:
        child = _SPAWNED.pop(pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=STOP_TIMEOUT)
    _reap()
    return left


# ------------------------------------------------------------------ daemons


def _write_munge_key(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    with os.fdopen(fd, "wb") as out:
        out.write(secrets.token_bytes(1024))


def _start_munged(bed: SlurmBed) -> None:
    bed.munge_dir.mkdir(mode=0o755)
    bed.munge_dir.chmod(0o755)  # the cluster user's slurm commands reach the socket
    key = bed.munge_dir / "munge.key"
    _write_munge_key(key)
    argv = [
        "munged", "--foreground", "--force",
        f"--key-file={key}",
        f"--socket={bed.munge_socket}",
        f"--pid-file={bed.munge_dir / 'munged.pid'}",
        f"--seed-file={bed.munge_dir / 'munged.seed'}",
        f"--log-file={bed.logs / 'munged.log'}",
    ]  # fmt: skip
    proc = _spawn(bed, "munged", argv, env=_daemon_env(bed), cwd=bed.munge_dir)
    log = bed.logs / "munged.out"

    def ready() -> bool:
        if not proc.alive():
            raise TestbedError(f"munged exited:\n{_log_tail(log)}")
        if not bed.munge_socket.exists():
            return False
        cred = _run(["munge", "-n", "-S", str(bed.munge_socket)], timeout=10)
        if cred.returncode != 0:
            return False
        return _run(["unmunge", "-S", str(bed.munge_socket)], input=cred.stdout, timeout=10).returncode == 0

    _wait_for("munged did not answer", ready, DAEMON_START_TIMEOUT, lambda: _log_tail(log))


def _slurm_conf_text(bed: SlurmBed) -> str:
    s = bed.slurm_dir
    lines = [
        "# substrax Slurm test bed: one node, everything under this folder.",
        f"ClusterName=sxt{bed.token}",
        f"SlurmctldHost={bed.node}(127.0.0.1)",
        f"SlurmctldPort={bed.slurmctld_port}",
        f"SlurmdPort={bed.slurmd_port}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={bed.munge_socket}",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={s / 'state'}",
        f"SlurmdSpoolDir={bed.spool}",
        f"SlurmctldPidFile={s / 'slurmctld.pid'}",
        f"SlurmdPidFile={s / 'slurmd.pid'}",
        f"SlurmctldLogFile={bed.logs / 'slurmctld.log'}",
        f"SlurmdLogFile={bed.logs / 'slurmd.log'}",
        f"PlugStackConfig={s / 'plugstack.conf'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/backfill",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "ReturnToService=2",
        "MailProg=/bin/true",
        "KillWait=5",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=60",
        "InactiveLimit=0",
        "MinJobAge=60",
        f"NodeName={bed.node} NodeAddr=127.0.0.1 CPUs={bed.cpus} RealMemory={bed.real_memory_mb} "
        "State=UNKNOWN",
        # DefaultTime: SkyPilot then sends no --time, and a leaked job ends within the hour.
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE DefaultTime=01:00:00 State=UP",
    ]
    return "\n".join(lines) + "\n"


def _start_slurm(bed: SlurmBed) -> None:
    for folder in (bed.slurm_dir / "state", bed.spool):
        folder.mkdir(parents=True, mode=0o755)
    bed.slurm_dir.chmod(0o755)  # the cluster user reads slurm.conf
    (bed.slurm_dir / "plugstack.conf").write_text("")
    bed.slurm_conf.write_text(_slurm_conf_text(bed))
    env = _daemon_env(bed)
    conf = str(bed.slurm_conf)
    ctld = _spawn(
        bed, "slurmctld", ["slurmctld", "-D", "-i", "-f", conf], env=env, cwd=bed.slurm_dir / "state"
    )
    _spawn(bed, "slurmd", ["slurmd", "-D", "-f", conf, "-N", bed.node], env=env, cwd=bed.spool)

    def detail() -> str:
        return "\n".join(
            f"--- {name}:\n{_log_tail(bed.logs / name)}"
            for name in ("slurmctld.out", "slurmctld.log", "slurmd.out", "slurmd.log")
        )

    def ctld_up() -> bool:
        for name in ("slurmctld", "slurmd"):
            if not bed.processes[name].alive():
                raise TestbedError(f"{name} exited:\n{detail()}")
        return "UP" in _run(["scontrol", "ping"], env=bed.slurm_env(), timeout=20).stdout

    _wait_for("slurmctld did not answer `scontrol ping`", ctld_up, DAEMON_START_TIMEOUT, detail)
    assert ctld.alive()

    def node_idle() -> bool:
        if not bed.processes["slurmd"].alive():
            raise TestbedError(f"slurmd exited:\n{detail()}")
        out = _run(["sinfo", "-h", "-N", "-o", "%N %t"], env=bed.slurm_env(), timeout=20).stdout.split()
        return out[:2] == [bed.node, "idle"]

    _wait_for(f"node {bed.node} did not become idle in sinfo", node_idle, DAEMON_START_TIMEOUT, detail)


# ----------------------------------------------------------------- the user


def _create_user(bed: SlurmBed) -> None:
    home = bed.home
    # -p "*": no password, yet not locked ("!"), which sshd refuses without PAM
    _check(
        ["useradd", "-M", "-d", str(home), "-s", "/bin/bash", "-p", "*", "-c", "substrax slurm bed", bed.user]
    )
    bed.created_user = True
    entry = pwd.getpwnam(bed.user)
    bed.uid = entry.pw_uid
    bed.save()
    home.mkdir(mode=0o755)
    os.chown(home, entry.pw_uid, entry.pw_gid)
    # ~/.bashrc: bash reads it for every command sshd runs, login shell or not
    # (SkyPilot's rsync runs `ssh ... srun ... rsync` with no login shell);
    # ~/.bash_profile (login shells: SkyPilot's `bash --login -c`) reads it too.
    files = {
        ".bashrc": _profile_text(bed),
        ".bash_profile": "# substrax Slurm test bed\n[ -f ~/.bashrc ] && . ~/.bashrc\n",
    }
    for name, text in files.items():
        (home / name).write_text(text)
        os.chown(home / name, entry.pw_uid, entry.pw_gid)


def _start_sshd(bed: SlurmBed) -> None:
    host = sshd_host.start_host(bed.sshd_dir, netns=False, user=bed.user)
    bed.ssh_port = host.port
    bed.save()
    stock = sshd_host.start_host(bed.stock_sshd_dir, netns=False, user=bed.user, accept_env=STOCK_ACCEPT_ENV)
    bed.stock_ssh_port = stock.port
    bed.save()


def _load_sshd(bed: SlurmBed) -> sshd_host.SshHost | None:
    try:
        return sshd_host.load_host(bed.sshd_dir)
    except (OSError, ValueError, KeyError):
        return None


def cluster_ssh_argv(bed: SlurmBed, command: str) -> list[str]:
    """ssh as the cluster user, running `command` in a login shell as SkyPilot does."""
    host = _load_sshd(bed)
    if host is None:
        raise TestbedError(f"no sshd recorded in {bed.sshd_dir}")
    return sshd_host.ssh_argv(host, "bash", "--login", "-c", shlex.quote(command))


def _check_cluster_user(bed: SlurmBed) -> None:
    """What SkyPilot will need, seen over ssh as the cluster user: in a login
    shell (SkyPilot's commands) and in a plain one (its `ssh ... srun ...
    rsync` file transfers)."""
    probe = (
        "set -e; sinfo -h -o %P; python3.10 -c 'import ssl, sys; print(sys.version_info[:2])'; "
        "curl -LsSf https://astral.sh/uv/install.sh | head -n 2 | tail -n 1"
    )
    out = _check(cluster_ssh_argv(bed, probe), timeout=60)
    if "(3, 10)" not in out or "substrax" not in out or "debug" not in out:
        raise TestbedError(f"the cluster user's login shell is not as expected:\n{out}")
    host = _load_sshd(bed)
    assert host is not None
    plain = _check(sshd_host.ssh_argv(host, "srun --version && sinfo -h -o %P"), timeout=60)
    if "debug" not in plain:
        raise TestbedError(f"a plain ssh command of the cluster user does not reach Slurm:\n{plain}")


# ----------------------------------------------------------------- SkyPilot


def _write_client_home(bed: SlurmBed) -> None:
    slurm = bed.client_home / ".slurm"
    slurm.mkdir(parents=True, mode=0o700)
    logins = [(bed.cluster_alias, bed.ssh_port, bed.client_key),
              (STOCK_ALIAS, bed.stock_ssh_port, bed.stock_sshd_dir / "client_ed25519")]  # fmt: skip
    text = f"# substrax Slurm test bed: the login nodes are this machine's sshds for {bed.user}.\n"
    for alias, port, key in logins:
        text += f"Host {alias}\n  HostName 127.0.0.1\n  Port {port}\n  User {bed.user}\n"
        text += f"  IdentityFile {key}\n  IdentitiesOnly yes\n"
    (slurm / "config").write_text(text)
    # Node-local scratch for SkyPilot's runtime on STOCK_ALIAS: any user may
    # make a folder in it, as in /tmp.
    bed.node_tmpdir.mkdir(mode=0o1777, exist_ok=True)
    bed.node_tmpdir.chmod(0o1777)
    sky = bed.client_home / ".sky"
    sky.mkdir(exist_ok=True)
    (sky / "config.yaml").write_text(
        f"# substrax Slurm test bed\nslurm:\n  cluster_configs:\n    {STOCK_ALIAS}:\n"
        f"      tmpdir: {json.dumps(str(bed.node_tmpdir))}\n"
    )
    bed.tmpdir.mkdir(mode=0o700, exist_ok=True)


def _api_healthy(bed: SlurmBed) -> bool:
    url = f"http://127.0.0.1:{bed.api_port}/api/health"
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return bool(answer.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _start_api_server(bed: SlurmBed) -> None:
    argv = [str(bed.sky), "api", "start", "--foreground", "--host", "127.0.0.1", "--port", str(bed.api_port)]
    proc = _spawn(bed, "api-server", argv, env=bed.sky_env(), cwd=bed.client_home)
    bed.api_sid = proc.pid  # start_new_session: it leads its own session
    bed.save()
    log = bed.logs / "api-server.out"

    def ready() -> bool:
        if not proc.alive():
            raise TestbedError(f"the SkyPilot API server exited:\n{_log_tail(log)}")
        return _api_healthy(bed)

    _wait_for("the SkyPilot API server did not answer", ready, API_START_TIMEOUT, lambda: _log_tail(log))


def _sky_check(bed: SlurmBed) -> str:
    done = _run(
        [str(bed.sky), "check", "slurm"], env=bed.sky_env(), timeout=SKY_CHECK_TIMEOUT, cwd=bed.tmpdir
    )
    output = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)
    (bed.logs / "sky-check.out").write_text(output)
    enabled = all(
        re.search(rf"\b{re.escape(alias)}(?![\w-]).*\benabled\b", output)
        and not re.search(rf"\b{re.escape(alias)}(?![\w-]).*\bdisabled\b", output)
        for alias in (bed.cluster_alias, STOCK_ALIAS)
    )
    if done.returncode != 0 or not enabled:
        raise TestbedError(f"`sky check slurm` did not enable Slurm ({done.returncode}):\n{output[-3000:]}")
    return output


# -------------------------------------------------------------------- up/down


def _check_root_dir(root: Path) -> None:
    if len(str(root)) > MAX_ROOT_LEN:
        raise TestbedError(f"{root}: longer than {MAX_ROOT_LEN} characters; unix socket paths live under it")
    for folder in [root, *root.parents]:
        if folder.exists() and not folder.stat().st_mode & stat.S_IXOTH:
            if folder == root:
                continue  # made traversable below
            raise TestbedError(
                f"{folder} is closed to other users (mode {oct(folder.stat().st_mode & 0o777)}); the "
                f"cluster user must reach {root}: pick a folder under /tmp"
            )


def load_bed(root: Path) -> SlurmBed | None:
    try:
        data = json.loads((Path(root) / RECORD_NAME).read_text())
    except FileNotFoundError:
        return None
    return SlurmBed.from_json(data)


def bed_status(bed: SlurmBed) -> dict[str, Any]:
    processes = {name: proc.alive() for name, proc in bed.processes.items()}
    host = _load_sshd(bed)
    sshd = host is not None and is_alive(host.pid, host.pid_start_ticks)
    ping = False
    if processes.get("slurmctld"):
        with contextlib.suppress(TestbedError):
            ping = "UP" in _run(["scontrol", "ping"], env=bed.slurm_env(), timeout=20).stdout
    api = processes.get("api-server", False) and _api_healthy(bed)
    healthy = bed.state == "up" and all(processes.values()) and sshd and ping and api
    return {
        "healthy": healthy,
        "state": bed.state,
        "processes": processes,
        "sshd": sshd,
        "slurmctld_ping": ping,
        "api_server": api,
        "bed_processes": len(bed_processes(bed)),
    }


def bed_up(root: Path, *, sky_venv: Path | None = None, log: Callable[[str], None] | None = None) -> SlurmBed:
    """Bring the bed up in `root`, or return the one already up there (a
    half-made or broken one is taken down first). Raises TestbedError, with
    everything it started stopped again, when it cannot."""
    say = log or (lambda message: None)
    root = Path(root).absolute()
    existing = load_bed(root)
    if existing is not None:
        if bed_status(existing)["healthy"]:
            say(f"already up in {root}")
            return existing
        say(f"a broken or half-made bed in {root}: taking it down first")
        bed_down(root)
    if os.geteuid() != 0:
        raise TestbedError("the Slurm test bed needs root (daemons, a new user, apt-get)")
    sky_venv = Path(sky_venv or DEFAULT_SKY_VENV).absolute()
    if not (sky_venv / "bin" / "sky").exists():
        raise TestbedError(f"no SkyPilot in {sky_venv}: run `make sky-venv` first")
    _check_root_dir(root)
    started = time.monotonic()
    timings: dict[str, float] = {}
    installed = ensure_packages()
    timings["packages"] = round(time.monotonic() - started, 2)
    if installed:
        say(f"installed {' '.join(installed)}")
    created_root = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    if [entry.name for entry in root.iterdir()] == ["logs"]:  # kept by an earlier `down --keep-logs`
        shutil.rmtree(root / "logs")
    if any(root.iterdir()):
        raise TestbedError(f"{root} is not empty and holds no test bed: pick an empty or new folder")
    root.chmod(0o755)
    token = secrets.token_hex(4)
    slurmctld_port, slurmd_port, api_port = _free_ports(3)
    bed = SlurmBed(
        root=root,
        token=token,
        node=_short_hostname(),
        cluster_alias=CLUSTER_ALIAS,
        cpus=os.cpu_count() or 1,
        real_memory_mb=max(512, _mem_total_mb() - 256),
        slurmctld_port=slurmctld_port,
        slurmd_port=slurmd_port,
        api_port=api_port,
        user=f"sxslurm{token[:6]}",
        uid=-1,
        home=root / "home",
        created_user=False,
        sshd_dir=root / "sshd",
        ssh_port=0,
        sky_venv=sky_venv,
        uv_version="",
        python310="",
        processes={},
        api_sid=None,
        timings=timings,
        state="starting",
        created_root=created_root,
    )
    bed.logs.mkdir()
    bed.save()

    def step(name: str, action: Callable[[], object]) -> None:
        begun = time.monotonic()
        action()
        timings[name] = round(time.monotonic() - begun, 2)
        bed.save()
        say(f"{name}: {timings[name]:.1f} s")

    try:
        real_curl = shutil.which("curl", path=SYSTEM_PATH)
        if real_curl is None:
            raise TestbedError("curl is missing")
        step("uv", lambda: _fetch_uv(bed))
        step("python3.10", lambda: _copy_python310(bed))
        step("tools", lambda: _write_tools(bed, real_curl))
        step("munged", lambda: _start_munged(bed))
        step("slurm", lambda: _start_slurm(bed))
        step("user", lambda: _create_user(bed))
        step("sshd", lambda: _start_sshd(bed))
        step("login-check", lambda: _check_cluster_user(bed))
        step("client-home", lambda: _write_client_home(bed))
        step("api-server", lambda: _start_api_server(bed))
        step("sky-check", lambda: _sky_check(bed))
    except BaseException:
        with contextlib.suppress(Exception):
            bed_down(root, keep_logs=True)
        raise
    timings["total"] = round(time.monotonic() - started, 2)
    bed.state = "up"
    bed.save()
    return bed


def _remove_user_leftovers(bed: SlurmBed) -> None:
    """What the cluster user left in /tmp (uv's cache, SkyPilot's runtime dirs)
    and SkyPilot's ssh control folder for this client."""
    if bed.created_user and bed.uid >= 0:
        for entry in Path("/tmp").iterdir():
            with contextlib.suppress(OSError):
                if entry.lstat().st_uid == bed.uid:
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry, ignore_errors=True)
                    else:
                        entry.unlink()
    with contextlib.suppress(OSError):
        user_hash = (bed.client_home / ".sky" / "user_hash").read_text().strip()
        if re.fullmatch(r"[0-9a-f]{8,64}", user_hash):
            shutil.rmtree(f"/tmp/sky_ssh_{user_hash}", ignore_errors=True)


def _cancel_jobs(bed: SlurmBed) -> None:
    """scancel the cluster user's jobs (SkyPilot's clusters) and give their
    cleanup traps a moment, while slurmctld still runs."""
    ctld = bed.processes.get("slurmctld")
    if ctld is None or not ctld.alive() or not bed.created_user:
        return
    _run(["scancel", f"--user={bed.user}"], env=bed.slurm_env(), timeout=30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        out = _run(["squeue", "-h", f"--user={bed.user}"], env=bed.slurm_env(), timeout=20)
        if out.returncode == 0 and not out.stdout.strip():
            return
        time.sleep(0.5)


def _api_session(bed: SlurmBed) -> dict[int, int]:
    """The API server's session now, by pid and start time (zombies aside)."""
    if bed.api_sid is None:
        return {}
    return {
        pid: ticks
        for pid in sshd_host._live_pids()
        if _getsid(pid) == bed.api_sid and (ticks := start_ticks(pid)) is not None
    }


def _is_resource_tracker(pid: int) -> bool:
    try:
        return b"multiprocessing.resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _stop_api_server(bed: SlurmBed) -> None:
    """Stop the API server with SIGINT, as a Ctrl-C on `sky api start
    --foreground` would, and wait until its executors have exited; then
    `sky api stop` for whatever is left.

    Not `sky api stop` alone: it SIGKILLs the server's tree, executors and
    multiprocessing resource tracker too, so the ten named semaphores
    (/dev/shm/sem.mp-*) the server makes for its executors at start are
    never unlinked. Not SIGTERM: uvicorn drains, then re-raises SIGTERM
    with the default action, which skips the server's `finally` that stops
    the executors (they stay, orphaned). SIGINT drains the same way and
    comes back as KeyboardInterrupt: the `finally` stops the executors and
    the semaphores are unlinked. The server itself may then hang at exit
    (SkyPilot 0.14.1 joins a thread that never ends): once nothing but it
    and its resource tracker is left, it holds no semaphore, and `sky api
    stop` (or the kill step) ends it."""
    api = bed.processes.get("api-server")
    if api is None or not api.alive():
        return
    # SkyPilot's graceful shutdown elects a coordinator with this lock file
    # and leaves it; removed below only if it is this stop that made it.
    lock = Path("/tmp/skypilot_graceful_shutdown.lock")
    lock_was_there = lock.exists()
    with contextlib.suppress(ProcessLookupError):
        os.kill(api.pid, signal.SIGINT)
    deadline = time.monotonic() + API_STOP_TIMEOUT

    def helpers() -> list[int]:
        """The session's processes other than the server and its tracker."""
        _reap()
        if not api.alive():
            return []
        return sorted(p for p in _api_session(bed) if p != api.pid and not _is_resource_tracker(p))

    while helpers() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = helpers()
    exit_by = time.monotonic() + API_EXIT_GRACE
    while api.alive() and time.monotonic() < exit_by:
        _reap()
        time.sleep(0.1)
    if not lock_was_there:
        lock.unlink(missing_ok=True)
    if api.alive():
        _check([str(bed.sky), "api", "stop"], env=bed.sky_env(), timeout=120, cwd=bed.client_home)
    if left:
        raise TestbedError(f"the API server's helpers outlived SIGINT by {API_STOP_TIMEOUT:.0f} s: {left}")


def _kill_bed(bed: SlurmBed, before: dict[int, int]) -> None:
    left = _kill_all(bed, before)
    if left:
        raise TestbedError(f"processes survived SIGKILL: {sorted(left)}")


def _stop_sshd(bed: SlurmBed) -> None:
    for folder in (bed.sshd_dir, bed.stock_sshd_dir):
        with contextlib.suppress(OSError, ValueError, KeyError):
            host = sshd_host.load_host(folder)
            if host is not None:
                sshd_host.stop_host(host)


def _remove_user(bed: SlurmBed) -> None:
    if bed.created_user:
        left = sshd_host._kill_until_gone(
            lambda: {p for p in sshd_host._live_pids() if sshd_host._real_uid(p) == bed.uid}, STOP_TIMEOUT
        )
        if left:
            raise TestbedError(f"processes of {bed.user} survived SIGKILL: {sorted(left)}")
    _remove_user_leftovers(bed)
    if not bed.created_user:
        return
    with contextlib.suppress(KeyError):
        if pwd.getpwnam(bed.user).pw_uid == bed.uid:
            _check(["userdel", bed.user])
    bed.created_user = False
    bed.save()


def bed_down(root: Path, *, keep_logs: bool = False, log: Callable[[str], None] | None = None) -> None:
    """Stop everything the bed in `root` started and remove what it made.
    Safe to run twice, and on a bed that only half started. Raises
    TestbedError naming what could not be stopped or removed (the record
    stays then, for another try)."""
    say = log or (lambda message: None)
    root = Path(root).absolute()
    bed = load_bed(root)
    if bed is None:
        say(f"no test bed recorded in {root}")
        return
    errors: list[str] = []
    # Taken first: the API server's helpers outlive `sky api stop` by ~30 s,
    # orphaned; they are killed by pid and start time with the rest.
    before = _snapshot(bed)
    # (name, action, whether a failure leaves something behind)
    steps: list[tuple[str, Callable[[SlurmBed], None], bool]] = [
        ("scancel", _cancel_jobs, False),  # while slurmctld and the API server still run
        ("api-server-stop", _stop_api_server, False),  # the kill step follows anyway
        ("kill", lambda bed: _kill_bed(bed, before), True),
        ("sshd", _stop_sshd, True),
        ("user", _remove_user, True),
    ]
    for name, action, fatal in steps:
        begun = time.monotonic()
        try:
            action(bed)
        except TestbedError as exc:
            if fatal:
                errors.append(f"{name}: {exc}")
            else:
                say(f"down {name} failed (going on): {exc}")
        say(f"down {name}: {time.monotonic() - begun:.1f} s")
    if errors:
        raise TestbedError("test bed not fully stopped:\n" + "\n".join(errors))
    for entry in root.iterdir():
        if keep_logs and entry.name == "logs":
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    if bed.created_root and not keep_logs:
        with contextlib.suppress(OSError):
            root.rmdir()
    say(f"test bed in {root} is down")


@contextlib.contextmanager
def running_bed(root: Path, *, sky_venv: Path | None = None) -> Iterator[SlurmBed]:
    """bed_up, then bed_down on the way out, also on failure. For a fixture:
    `with running_bed(root) as bed: yield bed`."""
    bed = bed_up(root, sky_venv=sky_venv)
    try:
        yield bed
    finally:
        bed_down(root)


def env_exports(bed: SlurmBed) -> str:
    """`export` lines for a shell. Without the marker: `down` kills what
    carries it, and a shell is not the bed's."""
    env = bed.sky_env(base={})
    env.pop("PATH", None)
    env.pop(MARKER_VAR, None)
    lines = [f"export {name}={shlex.quote(value)}" for name, value in sorted(env.items())]
    lines.append(f'export PATH={shlex.quote(str(bed.sky_venv / "bin"))}:"$PATH"')
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------ CLI


def _say(message: str) -> None:
    with contextlib.suppress(OSError):  # a closed stderr must not stop a `down` halfway
        print(f"slurm_cluster: {message}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A one-node Slurm cluster for SkyPilot, on this machine.")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="bring the bed up (idempotent); print its record as JSON")
    down = commands.add_parser("down", help="stop all the bed started and remove what it made")
    status = commands.add_parser("status", help="print the record and its health (exit 1 if not healthy)")
    env = commands.add_parser("env", help="print `export` lines that point SkyPilot at the bed")
    for sub in (up, down, status, env):
        sub.add_argument("--root", type=Path, required=True, help="the bed's folder (holds testbed.json)")
    up.add_argument("--sky-venv", type=Path, default=None, help=f"SkyPilot's virtualenv ({DEFAULT_SKY_VENV})")
    down.add_argument("--keep-logs", action="store_true", help="keep ROOT/logs")
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            started = time.monotonic()
            bed = bed_up(args.root, sky_venv=args.sky_venv, log=_say)
            print(json.dumps(bed.to_json(), indent=2))
            _say(f"up in {time.monotonic() - started:.1f} s: infra {bed.infra}, HOME={bed.client_home}")
            return 0
        if args.command == "down":
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not stop it halfway
            started = time.monotonic()
            bed_down(args.root, keep_logs=args.keep_logs, log=_say)
            _say(f"down took {time.monotonic() - started:.1f} s")
            return 0
        recorded = load_bed(args.root)
        if recorded is None:
            _say(f"no test bed recorded in {args.root}")
            return 1
        if args.command == "env":
            print(env_exports(recorded), end="")
            return 0
        health = bed_status(recorded)
        print(json.dumps({**recorded.to_json(), "status": health}, indent=2))
        return 0 if health["healthy"] else 1
    except TestbedError as exc:
        _say(f"error: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
