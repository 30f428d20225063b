"""The bubblewrap sandbox: the argv remote/sandbox.py builds (no bubblewrap
needed), then local runs under real bubblewrap.

In the second part the task tries each thing and prints ALLOWED/DENIED per
attempt; the test reads that from the log and checks the host's files too.
"""

from __future__ import annotations

import os
import re
import socket
import stat
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    WORKER,
    connections_made,
    log_text,
    needs_bwrap,
    outputs_root,
    run_dir,
    submit,
    wait_final,
)

from substrax_tasks._remote_files import remote_module
from substrax_tasks.runs import Project
from substrax_tasks.spec import make_spec
from substrax_tasks.worker_job import WorkerPaths, build_job

sandbox = remote_module("sandbox")

# ------------------------------------------------- the argv, without bubblewrap


def job_for(project: Path, outputs: Sequence[str], *, network_isolation: bool = False,
            hide: Sequence[str] = (), extra_ro: Sequence[str] = ()) -> dict[str, Any]:
    """A job file's content, made by the code the backends use."""
    spec = make_spec("step", ["true"], project, outputs=outputs)
    paths = WorkerPaths(project=str(project), run_dir=str(project / ".substrax" / "runs" / "r1"))
    return build_job(spec, paths, sandbox="bwrap", network_isolation=network_isolation,
                     grace_seconds=1.0, hide=list(hide), extra_ro=list(extra_ro))


def pairs(argv: list[str], option: str) -> list[tuple[str, str]]:
    """(source, destination) of every `option SOURCE DEST` in argv."""
    return [(argv[i + 1], argv[i + 2]) for i, arg in enumerate(argv) if arg == option]


@pytest.mark.unit
def test_bwrap_argv_system_read_only_own_namespaces_then_the_command(tmp_path: Path) -> None:
    argv = sandbox.bwrap_argv("/usr/bin/bwrap", job_for(tmp_path, []), "/staging")
    assert argv[:8] == ["/usr/bin/bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    assert {"--unshare-pid", "--unshare-ipc", "--die-with-parent", "--new-session"} <= set(argv)
    assert "--unshare-net" not in argv
    assert argv[8:10] == ["--tmpfs", "/tmp"]  # a private, empty /tmp
    assert argv[-3:] == ["--chdir", str(tmp_path), "--"]  # the command follows
    assert (str(tmp_path), str(tmp_path)) in pairs(argv, "--ro-bind")


@pytest.mark.unit
def test_bwrap_argv_network_isolation_unshares_the_network(tmp_path: Path) -> None:
    argv = sandbox.bwrap_argv("bwrap", job_for(tmp_path, [], network_isolation=True), "/staging")
    assert "--unshare-net" in argv


@pytest.mark.unit
def test_bwrap_argv_hides_home_yet_shows_a_project_inside_it(tmp_path: Path) -> None:
    home = tmp_path / "home"
    project = home / "work" / "project"
    project.mkdir(parents=True)
    python = tmp_path / "venv"
    python.mkdir()
    job = job_for(project, [], hide=[str(home), str(tmp_path / "no-such-folder")], extra_ro=[str(python)])
    argv = sandbox.bwrap_argv("bwrap", job, "/staging")
    tmpfs = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--tmpfs"]
    assert str(home) in tmpfs
    assert str(tmp_path / "no-such-folder") not in argv  # nothing to hide there
    binds = pairs(argv, "--ro-bind")
    assert (str(project), str(project)) in binds
    assert (str(python), str(python)) in binds
    # read-only only after the binds above made their mount points in it
    remount = argv.index("--remount-ro")
    assert argv[remount + 1] == str(home)
    assert remount > argv.index(str(python))


@pytest.mark.unit
def test_bwrap_argv_binds_output_folders_from_staging(tmp_path: Path) -> None:
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "old.txt").write_text("kept\n")
    (tmp_path / "results" / "metrics.json").write_text("earlier\n")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "stale.txt").write_text("earlier\n")
    argv = sandbox.bwrap_argv("bwrap", job_for(tmp_path, ["out/", "results/metrics.json"]), "/staging")
    assert pairs(argv, "--bind") == [
        ("/staging/out", str(tmp_path / "out")),
        ("/staging/results", str(tmp_path / "results")),
    ]
    ro = [dest for _src, dest in pairs(argv, "--ro-bind")]
    assert str(tmp_path / "results" / "old.txt") in ro  # beside a file output: visible, read-only
    assert str(tmp_path / "results" / "metrics.json") not in ro  # an earlier version of an output
    assert not [d for d in ro if d.startswith(str(tmp_path / "out"))]  # a folder output starts empty


def fake_dev(root: Path, nodes: Sequence[str]) -> Path:
    """A folder standing for /dev, holding character devices at `nodes`
    (making one needs root: the test is skipped otherwise)."""
    if os.geteuid() != 0:
        pytest.skip("GPU DISCOVERY NOT UNIT-TESTED: making a device node needs root (CI runs as root)")
    dev = root / "dev"
    for rel in nodes:
        (dev / rel).parent.mkdir(parents=True, exist_ok=True)
        os.mknod(dev / rel, stat.S_IFCHR | 0o666, os.makedev(195, 0))
    return dev


@pytest.mark.unit
def test_gpu_devices_finds_nvidia_and_amd_nodes(tmp_path: Path) -> None:
    gpus = ["nvidia0", "nvidia12", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset",
            "nvidia-caps/nvidia-cap1", "kfd", "dri/card0", "dri/renderD128"]  # fmt: skip
    dev = fake_dev(tmp_path, [*gpus, "null", "nvidia-foo", "nvidiactl2", "kfd0", "sda"])
    (dev / "nvidia7").write_text("a file, not a node\n")
    (dev / "dri" / "by-path").mkdir()
    (dev / "dri" / "by-path" / "pci-0000:00:04.0-render").symlink_to("../renderD128")
    (dev / "nvidia3").symlink_to("nvidia0")
    assert sandbox.gpu_devices(str(dev)) == sorted(gpus)
    assert sandbox.gpu_devices(str(tmp_path / "none")) == []


@pytest.mark.unit
def test_gpu_argv_binds_each_node_with_device_access(tmp_path: Path) -> None:
    dev = fake_dev(tmp_path, ["nvidia0", "dri/renderD128"])
    driver_info = tmp_path / "proc-driver-nvidia"
    assert sandbox.gpu_argv(str(dev), str(driver_info)) == [
        "--dev-bind", str(dev / "dri" / "renderD128"), "/dev/dri/renderD128",
        "--dev-bind", str(dev / "nvidia0"), "/dev/nvidia0",
    ]  # fmt: skip
    driver_info.mkdir()
    shown = sandbox.gpu_argv(str(dev), str(driver_info))
    assert shown[-3:] == ["--ro-bind", str(driver_info), str(driver_info)]
    # In the whole argv: after the minimal /dev it lands in, before the command.
    argv = sandbox.bwrap_argv("bwrap", job_for(tmp_path, []), "/staging", dev=str(dev))
    assert argv.index("--dev-bind") > argv.index("--dev")
    assert pairs(argv, "--dev-bind") == [(str(dev / "dri" / "renderD128"), "/dev/dri/renderD128"),
                                         (str(dev / "nvidia0"), "/dev/nvidia0")]  # fmt: skip
    assert argv[-3:] == ["--chdir", str(tmp_path), "--"]


@pytest.mark.unit
def test_writable_dirs_outer_folders_first() -> None:
    outputs = [{"path": "a/b/c", "kind": "dir"}, {"path": "top.txt", "kind": "file"},
               {"path": "a/x.txt", "kind": "file"}, {"path": "z", "kind": "dir"}]
    assert sandbox.writable_dirs(outputs) == [".", "a", "z", "a/b/c"]


# ------------------------------------------------------ runs under bubblewrap

# attempt NAME SHELL-CODE: runs the code, prints "ALLOWED NAME" or "DENIED NAME"
ATTEMPT = 'attempt() { if sh -c "$2" >/dev/null 2>&1; then echo "ALLOWED $1"; else echo "DENIED $1"; fi; }\n'


def verdicts(log: str) -> dict[str, str]:
    return {m.group(2): m.group(1) for m in re.finditer(r"^(ALLOWED|DENIED) (\S+)$", log, re.MULTILINE)}


@pytest.fixture
def fake_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """$HOME for this test (and the runs it starts): a folder with a secret."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "secret.txt").write_text("credentials\n")
    monkeypatch.setenv("HOME", str(home))
    assert Path.home() == home
    return home


@needs_bwrap
def test_sandbox_allows_writes_only_to_declared_outputs(
    project: Project, fake_home: Path, marker: str
) -> None:
    root = project.root
    (root / "code.txt").write_text("original\n")
    (root / "notes.txt").write_text("not declared\n")
    (root / "data").mkdir()
    (root / "data" / "in.txt").write_text("input\n")
    (root / "results").mkdir()
    (root / "results" / "old.txt").write_text("kept\n")  # beside a declared file output
    (root / "results" / "metrics.json").write_text("earlier version\n")
    (root / "out").mkdir()
    (root / "out" / "stale.txt").write_text("earlier version\n")
    scratch = f"/tmp/{marker}"
    script = ATTEMPT + f"""
attempt read-project 'cat code.txt'
attempt read-undeclared 'cat notes.txt'
attempt read-input 'cat data/in.txt'
attempt read-beside-output 'cat results/old.txt'
attempt write-project 'echo x > code.txt'
attempt new-file-in-project 'echo x > new.txt'
attempt write-input 'echo x > data/in.txt'
attempt write-beside-output 'echo x > results/old.txt'
attempt write-home 'echo x > "$HOME/planted"'
attempt read-home 'cat "$HOME/secret.txt"'
attempt see-earlier-file-output 'cat results/metrics.json'
attempt see-earlier-folder-output 'test -e out/stale.txt'
attempt write-folder-output 'echo result > out/result.txt'
attempt write-file-output 'echo "{{}}" > results/metrics.json'
attempt write-private-tmp 'echo x > {scratch}'
"""
    handle = submit(
        project,
        ["sh", "-c", script],
        sandbox="bwrap",
        # a run sees its inputs only: code.txt and results/old.txt are read, so declared
        inputs=["data/in.txt", "code.txt", "results/old.txt"],
        outputs=["out/", "results/metrics.json"],
    )
    assert wait_final(project, handle) == "succeeded"
    assert verdicts(log_text(project, handle)) == {
        "read-project": "ALLOWED",
        "read-undeclared": "DENIED",
        "read-input": "ALLOWED",
        "read-beside-output": "ALLOWED",
        "write-project": "DENIED",
        "new-file-in-project": "DENIED",
        "write-input": "DENIED",
        "write-beside-output": "DENIED",
        "write-home": "ALLOWED",  # the run's own home, not the real one
        "read-home": "DENIED",
        "see-earlier-file-output": "DENIED",
        "see-earlier-folder-output": "DENIED",
        "write-folder-output": "ALLOWED",
        "write-file-output": "ALLOWED",
        "write-private-tmp": "ALLOWED",
    }
    # Nothing outside the outputs changed on the host.
    assert (root / "code.txt").read_text() == "original\n"
    assert not (root / "new.txt").exists()
    assert (root / "data" / "in.txt").read_text() == "input\n"
    assert (root / "results" / "old.txt").read_text() == "kept\n"
    assert not (fake_home / "planted").exists()
    assert not (run_dir(project, handle) / "work" / "home").exists()  # gone with the run
    assert not Path(scratch).exists()
    # The outputs landed at their relative paths in the run's staging folder.
    staging = outputs_root(project, handle)
    assert staging == run_dir(project, handle) / "work" / "outputs"
    assert (staging / "out" / "result.txt").read_text() == "result\n"
    assert (staging / "results" / "metrics.json").read_text() == "{}\n"
    assert (root / "results" / "metrics.json").read_text() == "earlier version\n"
    assert not (root / "out" / "result.txt").exists()


@needs_bwrap
def test_sandbox_project_inside_home_stays_visible_read_only(
    tmp_path: Path, fake_home: Path
) -> None:
    root = fake_home / "work" / "project"
    root.mkdir(parents=True)
    (root / "code.txt").write_text("original\n")
    project = Project.open(root)
    script = ATTEMPT + """
attempt read-project 'cat code.txt'
attempt write-project 'echo x > code.txt'
attempt read-home 'cat "$HOME/secret.txt"'
attempt write-home 'echo x > "$HOME/planted"'
attempt write-output 'echo result > out/result.txt'
echo "HOME HOLDS: $(ls -A "$HOME" | tr '\\n' ' ')"
"""
    handle = submit(project, ["sh", "-c", script], sandbox="bwrap", inputs=["code.txt"], outputs=["out/"])
    assert wait_final(project, handle) == "succeeded"
    log = log_text(project, handle)
    assert verdicts(log) == {
        "read-project": "ALLOWED",
        "write-project": "DENIED",
        "read-home": "DENIED",
        "write-home": "ALLOWED",
        "write-output": "ALLOWED",
    }
    assert "HOME HOLDS: planted work \n" in log  # what it wrote, and the way to the project
    assert (root / "code.txt").read_text() == "original\n"
    assert not (fake_home / "planted").exists()
    assert (outputs_root(project, handle) / "out" / "result.txt").read_text() == "result\n"


@needs_bwrap
@pytest.mark.parametrize("isolated", [True, False], ids=["network_isolation", "network"])
def test_network_isolation_removes_the_network(
    project: Project, tcp_server: socket.socket, isolated: bool
) -> None:
    port = tcp_server.getsockname()[1]
    connect = f"bash -c 'exec 3<>/dev/tcp/127.0.0.1/{port}'"
    script = f"if {connect}; then echo CONNECTED; else echo NO-CONNECTION; fi"
    handle = submit(project, ["sh", "-c", script], sandbox="bwrap", network_isolation=isolated)
    assert wait_final(project, handle) == "succeeded"
    log = log_text(project, handle)
    if isolated:
        assert "NO-CONNECTION" in log
        assert connections_made(tcp_server) == 0
    else:
        assert "CONNECTED" in log
        assert "NO-CONNECTION" not in log
        assert connections_made(tcp_server) == 1


# A socket bound in the project, listed by host_sockets() and then removed
# before bubblewrap starts: the race a service that restarts can win.
RACE = """
import os, socket, sys
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import sandbox, worker
listed, calls = sandbox.host_sockets, []

def then_gone():
    calls.append(1)
    if len(calls) > 1:
        return listed()
    server = socket.socket(socket.AF_UNIX)
    server.bind(sys.argv[3])
    found = listed()
    server.close()
    os.unlink(sys.argv[3])
    return found

sandbox.host_sockets = then_gone
sys.exit(worker.main([sys.argv[2]]))
"""


@pytest.mark.unit
def test_a_socket_gone_before_bubblewrap_started_is_told_apart(tmp_path: Path) -> None:
    path = tmp_path / "app.sock"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        argv = sandbox.bwrap_argv("bwrap", job_for(tmp_path, [], network_isolation=True), "/staging")
    assert ("/dev/null", str(path)) in pairs(argv, "--ro-bind")
    said = f"task output\nbwrap: Can't create file at {path}: Read-only file system\n"
    path.touch()  # still there: bubblewrap failed for another reason
    assert sandbox.socket_gone(argv, said) is None
    path.unlink()
    assert sandbox.socket_gone(argv, said) == str(path)
    assert sandbox.socket_gone(argv, said + "the command's own last line\n") is None
    other = said.replace(str(path), str(tmp_path / "not-covered"))
    assert sandbox.socket_gone(argv, other) is None


@needs_bwrap
def test_a_socket_removed_before_bubblewrap_starts_does_not_fail_the_run(project: Project) -> None:
    (project.root / "in").mkdir()  # the socket appears in an input folder: in the run's view
    spec = make_spec("race", ["sh", "-c", "echo ran > out/x"], project.root, inputs=["in/"], outputs=["out/"])
    handle = project.new_run(spec, settings={"sandbox": "bwrap", "network_isolation": True})
    handle = project.backend_for(handle).launch(handle)
    job = run_dir(project, handle) / "job.json"
    sock = project.root / "in" / "s.sock"  # short: a socket path holds at most 107 bytes
    done = subprocess.run([sys.executable, "-c", RACE, str(WORKER), str(job), str(sock)],
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    log = log_text(project, handle)
    assert f"bwrap: Can't create file at {sock}" in log  # the race happened
    assert "a socket to hide, went away as the sandbox started; starting it again" in log
    assert wait_final(project, handle) == "succeeded", log
    assert (outputs_root(project, handle) / "out" / "x").read_text() == "ran\n"
