"""Escape attempts from the bubblewrap sandbox (issue 15), made by the task
as root and as an unprivileged user: each must fail, and the host must show
that nothing changed. The one difference between the two: root's task reads
root's own closed files (its uid, as outside), never another user's.

The real worker (remote/worker.py under the system python3) runs the real
bwrap; the unprivileged user is a uid with no account, reached with setpriv.
The task prints ALLOWED/DENIED per attempt; probes that must succeed (read
the project, write an output) keep the others from passing by accident.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from local_runs import connections_made, needs_bwrap, wait_for
from sandbox_beds import ATTEMPT, SECRET, SYSTEM_PYTHON, Bed, free_uid, verdicts
from testbeds.sshd_host import SshHost

pytestmark = needs_bwrap










@pytest.fixture
def closed_files(marker: str) -> Iterator[dict[str, Path]]:
    """Mode-600 files outside the project: one of root's, one of another
    user's. What a task may read of the system is what its uid may read,
    with no capability to pass over a mode: root reads root's files, not
    another user's."""
    if os.geteuid() != 0:
        yield {}  # only root can make a file of root's and of another uid
        return
    # Not under /tmp or /var/tmp: the sandbox empties those.
    folder = Path(tempfile.mkdtemp(prefix=f"substrax-closed-{marker[-8:]}-", dir="/srv"))
    folder.chmod(0o755)
    other = free_uid() + 1
    files = {"root": folder / "root-only", "other": folder / "other-only"}
    try:
        for owner, path in files.items():
            path.write_text("closed\n")
            path.chmod(0o600)
            uid = 0 if owner == "root" else other
            os.chown(path, uid, uid)
        yield files
    finally:
        shutil.rmtree(folder)


def test_escape_attempts_fail(bed: Bed, marker: str, tcp_server: socket.socket, closed_files: dict[str, Path],
                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("SUBSTRAX_LEAK", SECRET)  # an undeclared variable of "doit"
    pid, port, project = os.getpid(), tcp_server.getsockname()[1], bed.project
    host_tmp = Path(f"/tmp/{marker}")
    Path(f"{host_tmp}-host").write_text("on the host\n")
    script = ATTEMPT + f"""
attempt read-project 'cat code.txt'
attempt write-output 'echo result > out/result.txt'
attempt remount-project 'mount -o remount,rw {project} && echo x > {project}/code.txt'
attempt remount-root 'mount -o remount,rw / && echo x > {project}/planted.txt'
attempt new-file-in-project 'echo x > {project}/planted.txt'
attempt write-input 'echo x > {project}/data/in.txt'
attempt nested-userns-remount 'unshare -rm sh -c "mount -o remount,rw {project} && echo x > code.txt"'
attempt umount-home 'umount -l "$HOME"; cat "$HOME/secret.txt"'
attempt umount-project 'umount -l {project}; echo x > {project}/planted.txt'
attempt see-host-tmp 'umount -l /tmp; test -e {host_tmp}-host'
attempt write-tmp 'umount -l /tmp; echo x > {host_tmp}'
attempt umount-proc 'umount -l /proc; test -e /proc/{pid}'
attempt read-doit-environ 'umount -l /proc; grep -q {SECRET} /proc/{pid}/environ'
attempt read-any-environ 'grep -qs {SECRET} /proc/[0-9]*/environ'
attempt nsenter-net 'nsenter --net=/proc/{pid}/ns/net bash -c "exec 3<>/dev/tcp/127.0.0.1/{port}"'
attempt nsenter-mount 'nsenter --mount=/proc/{pid}/ns/mnt sh -c "echo x > {project}/planted.txt"'
attempt host-loopback 'bash -c "exec 3<>/dev/tcp/127.0.0.1/{port}"'
echo "CAPS $(grep -E '^Cap(Eff|Prm)' /proc/self/status | tr -s '\\t\\n' '  ')"
"""
    script += "".join(f"attempt read-{owner}-file 'cat {path}'\n" for owner, path in closed_files.items())
    try:
        log, status = bed.run(script, marker, network_isolation=True)
    finally:
        Path(f"{host_tmp}-host").unlink()
    assert status["state"] == "succeeded", log
    assert status["sandbox"] == "bwrap"
    allowed = {name for name, verdict in verdicts(log).items() if verdict == "ALLOWED"}
    expected = {"read-project", "write-output", "write-tmp"}  # write-tmp: into the private /tmp
    if closed_files and bed.uid == 0:
        expected.add("read-root-file")  # root's own: its uid reads it, as outside
    assert allowed == expected, log
    assert len(verdicts(log)) == 17 + len(closed_files), log  # every attempt was made
    assert "CAPS CapPrm: 0000000000000000 CapEff: 0000000000000000" in log, log
    # The host shows it too: nothing written, nothing connected.
    assert (project / "code.txt").read_text() == "original\n"
    assert (project / "data" / "in.txt").read_text() == "input\n"
    assert not (project / "planted.txt").exists()
    assert not host_tmp.exists()
    assert connections_made(tcp_server) == 0
    # The task ran as the same user: its output belongs to the worker's uid.
    result = Path(str(status["outputs_root"])) / "out" / "result.txt"
    assert result.read_text() == "result\n"
    assert result.stat().st_uid == bed.uid


@pytest.fixture
def unix_servers(bed: Bed, marker: str) -> Iterator[dict[str, socket.socket]]:
    """Listening mode-666 Unix sockets where services keep theirs (/run),
    elsewhere on the system (/srv), and in the project."""
    if os.geteuid() != 0:
        pytest.skip("UNIX SOCKET PROBES NOT RUN: making sockets in /run and /srv needs a root test run")
    paths = {"run": Path(f"/run/{marker}.sock"), "elsewhere": Path(f"/srv/{marker}.sock"),
             "project": bed.project / "app.sock"}  # fmt: skip
    servers = {}
    try:
        for name, path in paths.items():
            servers[name] = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            servers[name].bind(str(path))
            path.chmod(0o666)
            servers[name].listen(8)
        yield servers
    finally:
        for name, server in servers.items():
            server.close()
            paths[name].unlink(missing_ok=True)


CONNECT = "import socket, sys; socket.socket(socket.AF_UNIX).connect(sys.argv[1])"


@pytest.mark.parametrize("isolated", [True, False], ids=["network_isolation", "network"])
def test_network_isolation_hides_host_unix_sockets(
    bed: Bed, marker: str, unix_servers: dict[str, socket.socket], isolated: bool
) -> None:
    script = ATTEMPT + "".join(
        f"attempt connect-{name} '{SYSTEM_PYTHON} -c \"{CONNECT}\" {server.getsockname()}'\n"
        for name, server in unix_servers.items()
    )
    script += "attempt write-output 'echo x > out/x'\n"
    log, status = bed.run(script, marker, network_isolation=isolated)
    assert status["state"] == "succeeded", log
    expected = "DENIED" if isolated else "ALLOWED"
    connects = {f"connect-{name}": expected for name in unix_servers}
    assert verdicts(log) == {**connects, "write-output": "ALLOWED"}, log
    for name, server in unix_servers.items():
        assert (connections_made(server) > 0) is not isolated, name


# A service on a host Unix socket: it binds PATH (mode 666), says
# "listening", binds it again on each line read (a service restarting), and
# at the end of its stdin says how many connections it got, then goes.
LISTENER = """
import os, socket, sys
path = sys.argv[1]

def serve():
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    os.chmod(path, 0o666)
    server.listen(8)
    server.setblocking(False)
    print("listening", flush=True)
    return server

def accepted(server):
    count = 0
    while True:
        try:
            server.accept()[0].close()
        except BlockingIOError:
            return count
        count += 1

server, connections = serve(), 0
for line in sys.stdin:
    connections += accepted(server)
    server.close()
    os.unlink(path)
    server = serve()
connections += accepted(server)
server.close()
os.unlink(path)
print("connections", connections, flush=True)
"""


class Listener:
    """LISTENER run by the test (as root), optionally in another network
    namespace (`prefix`: `ip netns exec NAME`)."""

    def __init__(self, path: Path, prefix: list[str]) -> None:
        assert SYSTEM_PYTHON is not None
        self.process = subprocess.Popen([*prefix, SYSTEM_PYTHON, "-c", LISTENER, str(path)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        self.listening()

    def listening(self) -> None:
        assert self.process.stdout is not None
        assert self.process.stdout.readline() == "listening\n"

    def rebind(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("rebind\n")
        self.process.stdin.flush()
        self.listening()

    def connections(self) -> int:
        """Stop it; the connections it got."""
        out, _ = self.process.communicate(timeout=30)
        assert out.startswith("connections "), out
        return int(out.split()[1])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def network_namespace(marker: str) -> Iterator[str]:
    """A network namespace of the test's own, deleted after."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("OTHER-NAMESPACE SOCKET PROBE NOT RUN: `ip netns add` needs root and iproute2")
    name = f"substrax-{marker[-8:]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True)


# Where the service's socket appears while the run goes on: each defeats a
# list of sockets taken as the sandbox starts.
SOCKET_CASES = ["bound-after-the-start", "bound-again-during-the-run", "bound-in-another-network-namespace",
                "hard-linked-into-the-project"]  # fmt: skip


@pytest.mark.parametrize("case", SOCKET_CASES)
def test_network_isolation_reaches_no_host_unix_socket_whenever_and_wherever_bound(
    bed: Bed, marker: str, case: str, request: pytest.FixtureRequest
) -> None:
    if os.geteuid() != 0:
        pytest.skip("UNIX SOCKET PROBES NOT RUN: the service's listener and its link need a root test run")
    prefix = []
    if case == "bound-in-another-network-namespace":
        prefix = ["ip", "netns", "exec", request.getfixturevalue("network_namespace")]
    target = bed.project / "svc.sock"  # where the task connects; short: a socket path holds 107 bytes
    bound = bed.home / "agent.sock" if case == "hard-linked-into-the-project" else target
    script = ATTEMPT + f"""
echo started > out/started
while [ ! -e go ]; do sleep 0.05; done
attempt connect '{SYSTEM_PYTHON} -c "{CONNECT}" {target}'
"""
    listener = None
    try:
        if case != "bound-after-the-start":
            listener = Listener(bound, prefix)
            if bound != target:
                os.link(bound, target)  # the service's socket, shown in the project
        worker, paths = bed.start(script, marker, network_isolation=True)
        try:
            wait_for(Path(paths.staging, "out", "started").exists, "the task to start")
            if listener is None:
                listener = Listener(bound, prefix)
            elif case == "bound-again-during-the-run":
                listener.rebind()
        finally:
            (bed.project / "go").write_text("")
        log, status = bed.finish(worker, paths)
        assert status["state"] == "succeeded", log
        assert verdicts(log) == {"connect": "DENIED"}, log
        assert listener.connections() == 0, log
    finally:
        if listener is not None:
            listener.stop()
        target.unlink(missing_ok=True)


@pytest.fixture
def namespace_host(root_host: SshHost) -> SshHost:
    """A host with an address of its own (as root: sshd in a network
    namespace of its own, reached over a veth pair)."""
    return root_host


@pytest.mark.parametrize("isolated", [True, False], ids=["network_isolation", "network"])
def test_network_isolation_leaves_no_way_to_a_namespace_host(
    bed: Bed, marker: str, namespace_host: SshHost, isolated: bool
) -> None:
    address, port = namespace_host.address, namespace_host.port
    with socket.create_connection((address, port), timeout=10) as probe:  # reachable from here
        assert probe.recv(4).startswith(b"SSH-")
    script = ATTEMPT + f"attempt connect-namespace-host 'bash -c \"exec 3<>/dev/tcp/{address}/{port}\"'\n"
    log, status = bed.run(script, marker, network_isolation=isolated)
    assert status["state"] == "succeeded", log
    assert verdicts(log) == {"connect-namespace-host": "DENIED" if isolated else "ALLOWED"}, log
