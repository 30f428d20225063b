"""Helpers for the SSH backend's tests: a throwaway SSH host (real sshd in a
network namespace, tests/support/testbeds/sshd_host.py), projects whose
pyproject.toml points the ssh backend at it, and looks at the host's folders.

The host runs on this machine, so its "remote" folders are real folders
here: a test reads the remote run folder directly and finds the remote
processes in /proc. Not collected by pytest (the name does not start with
test_).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import textwrap
import threading
import time
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from dodo_helpers import BWRAP, COMPUTE, DOIT, HEADER, clean_env, handles, popen_doit, stop, wait_for
from local_runs import kill_pid, marked_pids
from testbeds.sshd_host import SshHost, missing_tools, running_host

ROOT = os.geteuid() == 0
MISSING = missing_tools(netns=ROOT) + [tool for tool in ("rsync",) if shutil.which(tool) is None]
needs_sshd = pytest.mark.skipif(
    bool(MISSING),
    reason=f"SSH BACKEND NOT TESTED: missing {', '.join(MISSING)} "
    "(apt-get install openssh-server openssh-client rsync iproute2)",
)
needs_root = pytest.mark.skipif(
    not ROOT, reason="SSH BACKEND IN A NETWORK NAMESPACE / AS A TEST USER NOT TESTED: needs root"
)
needs_bwrap = pytest.mark.skipif(
    not BWRAP, reason="SSH SANDBOX NOT TESTED: bubblewrap is missing or unusable"
)
# The remote sandbox of most tests: bubblewrap where it works (as on CI).
SANDBOX = "bwrap" if BWRAP else "none"
GRACE = 0.5


def fresh_user() -> str:
    """A login user name of its own for each host: stop_host deletes the
    user it created, so two hosts (or two test sessions at once) must never
    share one."""
    return f"sxt{secrets.token_hex(4)}"


@contextlib.contextmanager
def ssh_host(base: Path, user: str | None, accept_env: str | None = None) -> Iterator[SshHost]:
    """A host for a fixture: in its own network namespace as root (user
    None: this process's user). Stopped by pid on the way out."""
    if MISSING:
        pytest.skip(f"SSH BACKEND NOT TESTED: missing {', '.join(MISSING)}")
    if user is not None and not ROOT:
        pytest.skip(f"SSH BACKEND AS USER {user} NOT TESTED: needs root")
    with running_host(base / "host", user=user, accept_env=accept_env) as host:
        yield host


# The two hosts of the session, shared by every test module (a plugin of
# tests/conftest.py): one costs ~1 s to start and stop. A test leaves the
# host as it found it: it may kill, restart or reboot it (it comes back at
# the same address with the same keys), and keeps what it makes in folders
# of its own name.


@pytest.fixture(scope="session")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshHost]:
    """A fresh non-root login user (fast: no ~/.bashrc)."""
    with ssh_host(tmp_path_factory.mktemp("sshd-user"), fresh_user()) as started:
        yield started


@pytest.fixture(scope="session")
def root_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshHost]:
    """A host that lets root in: the fake SkyPilot's jobs run as this
    process's user, so its clusters' ssh is root's. It takes the fake's
    cluster marker from the ssh config the fake writes, so what runs there
    over ssh is the cluster's (sky._cluster._write_ssh_config)."""
    with ssh_host(tmp_path_factory.mktemp("sshd-root"), None, accept_env="FAKESKY_CLUSTER_ID") as started:
        yield started


# What doit itself takes is about 100 MB, whatever a host sends it.
CLIENT_MEMORY_BOUND = 512 << 20


def wait_bounded(proc: subprocess.Popen[str], output: Path, timeout: float = 90,
                 max_output: int = 64 << 20) -> tuple[int, int]:  # fmt: skip
    """Wait for doit, killing it (a failure) if it outgrows CLIENT_MEMORY_BOUND
    or its output `max_output` bytes; its exit status and its own peak RSS in
    bytes: doit's high-water mark as last read before it exited, not
    wait4's ru_maxrss, which is the largest of doit and every descendant it
    reaped (a helper process's memory is not doit's)."""
    deadline = time.monotonic() + timeout
    grown = 0
    while True:
        pid, status, _ = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, grown
        with contextlib.suppress(OSError):
            peak = re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{proc.pid}/status").read_text())
            grown = max(grown, int(peak.group(1)) * 1024 if peak else 0)
            too_much = grown > CLIENT_MEMORY_BOUND or output.stat().st_size > max_output
            if too_much or time.monotonic() > deadline:
                kill_pid(proc.pid)
                pytest.fail(f"doit unbounded: {grown >> 20} MiB of memory, "
                            f"{output.stat().st_size >> 20} MiB of output")  # fmt: skip
        time.sleep(0.1)


# ------------------------------------------------------------------ projects


def toml_value(value: Any) -> str:
    """A TOML value for str, int, float, bool and lists of those (JSON's
    forms of these are valid TOML)."""
    if isinstance(value, (str, bool, int, float, list)):
        return json.dumps(value)
    raise TypeError(f"no TOML form for {value!r}")


def ssh_settings(host: SshHost, /, **overrides: Any) -> dict[str, Any]:
    """[tool.substrax.compute.backends.ssh] for `host`, from its record."""
    settings: dict[str, Any] = {
        "host": host.address,
        "port": host.port,
        "user": host.user,
        "identity_file": str(host.client_key),
        "known_hosts": str(host.known_hosts),
        "python": host.python,
        "sandbox": SANDBOX,
        "grace_seconds": GRACE,
        "lifetime_minutes": 10.0,
    }
    settings.update(overrides)
    return {k: v for k, v in settings.items() if v is not None}


def pyproject_text(settings: Mapping[str, Any], copy: Mapping[str, Any] | None = None) -> str:
    lines = ["[tool.substrax.compute]", 'default_backend = "ssh"', "", "[tool.substrax.compute.backends.ssh]"]
    lines += [f"{key} = {toml_value(value)}" for key, value in settings.items()]
    if copy:
        lines += ["", "[tool.substrax.compute.backends.ssh.copy]"]
        lines += [f"{key} = {toml_value(value)}" for key, value in copy.items()]
    return "\n".join(lines) + "\n"


def write_ssh_pyproject(
    root: Path, settings: Mapping[str, Any], copy: Mapping[str, Any] | None = None
) -> None:
    (root / "pyproject.toml").write_text(pyproject_text(settings, copy))


def write_ssh_dodo(root: Path, body: str, default_tasks: Sequence[str]) -> None:
    config = f"DOIT_CONFIG = doit_config(default_tasks={list(default_tasks)!r})\n"
    (root / "dodo.py").write_text(HEADER + config + "\n" + textwrap.dedent(body))


def make_ssh_project(
    base: Path,
    host: SshHost,
    body: str,
    default_tasks: Sequence[str] = ("step",),
    /,
    *,
    files: Mapping[str, str | bytes] | None = None,
    copy: Mapping[str, Any] | None = None,
    **settings: Any,
) -> Path:
    """base/proj with a pyproject.toml for the ssh backend on `host`
    (settings override ssh_settings), dodo.py (HEADER + body) and files."""
    root = base / "proj"
    root.mkdir(parents=True, exist_ok=True)
    write_ssh_pyproject(root, ssh_settings(host, **settings), copy)
    write_ssh_dodo(root, body, default_tasks)
    for rel, content in (files or {}).items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    return root


def one_step(name: str = "step", **kwargs: Any) -> str:
    """A dodo body with one remote_step(name, **kwargs)."""
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    return f"""
def task_{name}():
    yield from remote_step({name!r}, {args})
"""


# ------------------------------------------------------------ remote state


def live_handles(root: Path, step: str | None = None) -> list[dict[str, Any]]:
    """The handles readable now, of runs that `doit` may be creating while
    we look (a run folder exists a moment before its handle)."""
    found = []
    runs = root / ".substrax" / "runs"
    for folder in sorted(runs.iterdir()) if runs.is_dir() else []:
        try:
            data = json.loads((folder / "handle.json").read_text())
        except (OSError, ValueError):
            continue
        if step is None or data.get("step") == step:
            found.append(data)
    return sorted(found, key=lambda h: str(h["created_at"]))


def launched_status(root: Path, step: str | None = None) -> dict[str, Any] | None:
    """The remote status file of the step's first launched run, if any yet."""
    runs = [h for h in live_handles(root, step) if h["backend_state"].get("remote_run_dir") is not None]
    return remote_status(runs[0]) if runs else None


def only_handle(root: Path, step: str | None = None) -> dict[str, Any]:
    found = [h for h in handles(root) if step is None or h["step"] == step]
    assert len(found) == 1, [h["run_id"] for h in found]
    return found[0]


def last_handle(root: Path, step: str | None = None) -> dict[str, Any]:
    found = [h for h in handles(root) if step is None or h["step"] == step]
    assert found, f"no run of {step or 'any step'} in {root}"
    return found[-1]


def remote_run_dir(handle: Mapping[str, Any]) -> Path:
    """The run's folder on the host: a real folder on this machine."""
    return Path(str(handle["backend_state"]["remote_run_dir"]))


def remote_status(handle: Mapping[str, Any]) -> dict[str, Any] | None:
    try:
        data = json.loads((remote_run_dir(handle) / "status.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def user_pids(uid: int) -> list[int]:
    """Live processes whose real uid is `uid` (the host's test user)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        if "State:\tZ" in status:
            continue
        for line in status.splitlines():
            if line.startswith("Uid:") and int(line.split()[1]) == uid:
                found.append(int(entry))
    return found


def held_sessions(host: SshHost) -> list[int]:
    """The host user's sessions that its ~/.ssh/rc holds (sshd runs it as
    `sh .ssh/rc`): matched by uid too, as another xdist worker's host may
    hold sessions of its own user at the same moment."""
    return sorted(set(marked_pids(".ssh/rc")) & set(user_pids(host.uid)))


# -------------------------------------------------------------------- wheel



@contextlib.contextmanager
def every_session_held(conn: Any) -> Iterator[None]:
    """Every session one connection may hold, held by a long-lived `cat`
    (its stdin stays open) in a thread each, until the block ends; each
    then ends as Ctrl-C in a doit thread ends its follower."""
    from substrax_tasks.backends.ssh.connection import MAX_STREAMS

    release = threading.Event()

    def tick() -> None:
        if release.is_set():
            raise KeyboardInterrupt  # as Ctrl-C in a doit thread: the channel closes

    def held() -> None:
        with contextlib.suppress(KeyboardInterrupt):
            conn.stream(["cat"], lambda chunk: None, tick)

    streams = [threading.Thread(target=held) for _ in range(MAX_STREAMS)]
    for thread in streams:
        thread.start()
    try:
        yield
    finally:
        release.set()
        for thread in streams:
            thread.join(timeout=30)


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(folder: Path, name: str, version: str, module_text: str) -> Path:
    """A minimal pure-Python wheel of one module package `name`, made by
    hand (METADATA, WHEEL, RECORD): pip installs it with --no-index."""
    folder.mkdir(parents=True, exist_ok=True)
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": module_text.encode(),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: substrax-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = "".join(f"{path},{_record_hash(data)},{len(data)}\n" for path, data in files.items())
    record += f"{info}/RECORD,,\n"
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, data in files.items():
            zf.writestr(path, data)
        zf.writestr(f"{info}/RECORD", record)
    return wheel


# Four steps of one group whose commands wait for the file {gate} (then
# write their output); {marker} names their processes. Filled in with
# str.format, hence the doubled braces.
GATED_SWEEP = """
def task_fit():
    for m in range(4):
        yield from remote_step(
            f"fit:m{{m}}", outputs=[f"fit-{{m}}.txt"],
            command=["/bin/sh", "-c", "echo started; while [ ! -e {gate} ]; do sleep 0.05; done; "
                     "echo " + str(m) + " > fit-" + str(m) + ".txt", {marker!r}],
        )
"""


# One step whose command waits for the file {gate}, then writes out.txt;
# {marker} names its processes, {resources} its resources. Filled in with
# str.format.
GATED_STEP = """
def task_step():
    yield from remote_step(
        "step", outputs=["out.txt"], resources={resources},
        command=["/bin/sh", "-c", "echo started; while [ ! -e {gate} ]; do sleep 0.05; done; "
                 "echo made > out.txt", {marker!r}],
    )
"""


def doit_killed_mid_run(root: Path, marker: str, env: Mapping[str, str] | None = None) -> None:
    """`doit` in `root`, SIGKILLed once the processes marked `marker` run."""
    proc = popen_doit(root, env=env)
    try:
        wait_for(lambda: marked_pids(marker), "the run to be going", timeout=120)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        stop(proc)


# ------------------------------------------- two clients at one project path

# A client's own view: its project folder bind-mounted at the one path two
# clients use (as CI jobs or containers at /workspace), in a mount namespace
# of its own (root only), then argv run there.
IN_VIEW = 'mount --bind "$1" "$2" && cd "$2" && shift 2 && exec "$@"'


def in_view(project: Path, at: Path, argv: Sequence[str]) -> list[str]:
    namespace = ["unshare", "-m", "--propagation", "private"]
    return [*namespace, "sh", "-c", IN_VIEW, "sh", str(project), str(at), *argv]


def compute_in_view(
    project: Path, at: Path, *args: str, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    argv = in_view(project, at, [str(COMPUTE), "--project", str(at), *args])
    return subprocess.run(argv, env=clean_env(env), capture_output=True, text=True, timeout=120, check=False)


def popen_doit_in_view(
    project: Path, at: Path, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(in_view(project, at, [str(DOIT)]), env=clean_env(env), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip


def doit_killed_mid_run_in_view(
    project: Path, at: Path, marker: str, env: Mapping[str, str] | None = None
) -> None:
    """doit_killed_mid_run, in the project's view at `at`."""
    proc = popen_doit_in_view(project, at, env)
    try:
        wait_for(lambda: marked_pids(marker), "the run to be going", timeout=120)
    finally:
        kill_pid(proc.pid)
        proc.wait(timeout=30)


# ------------------------------------------- a remote root other runs share


@contextlib.contextmanager
def shared_remote_root(owner: str | None = None) -> Iterator[Path]:
    """A remote root outside /tmp and any home (a shared scratch disk's,
    where the sandbox empties neither), owned by the login `owner` (None:
    this process's user); removed with all in it on the way out."""
    import pwd
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="substrax-shared-root-", dir="/srv"))
    if owner is not None:
        login = pwd.getpwnam(owner)
        os.chown(folder, login.pw_uid, login.pw_gid)
    try:
        yield folder
    finally:
        shutil.rmtree(folder)


def other_runs_probe(root: Path, secret: str, output: str) -> str:
    """A step's shell command that looks, by absolute path, for what other
    runs under `root` hold: each file under it whose content it can read
    holding `secret` ("read PATH"), and a write into each of the root's
    folders ("wrote PATH"); then "probed", all into `output`. The pattern
    searched for is `secret` with its last letter in brackets: the
    command's own job.json, which holds this text, does not match it."""
    pattern = f"{secret[:-1]}[{secret[-1]}]"
    return f"""{{
for f in $(find {root} -type f 2>/dev/null); do
    if grep -q '{pattern}' "$f" 2>/dev/null; then echo "read $f"; fi
done
for d in {root} {root}/* {root}/leases/*; do
    if [ -d "$d" ] && touch "$d/probe-written" 2>/dev/null; then echo "wrote $d/probe-written"; fi
done
echo probed
}} > {output}"""


def probe_reads(probe: str) -> list[str]:
    """What other_runs_probe's output says the command could read; it ended and wrote nothing."""
    assert probe.endswith("probed\n") and "wrote " not in probe, probe
    return [line.removeprefix("read ") for line in probe.splitlines() if line.startswith("read ")]
