"""The bubblewrap sandbox: the argv remote/sandbox.py builds (no bubblewrap
needed), then local runs under real bubblewrap.

In the second part the task tries each thing and prints ALLOWED/DENIED per
attempt; the test reads that from the log and checks the host's files too.
"""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest
from dodo_helpers import doit, doit_ok, make_project, show, write_pyproject
from local_runs import (
    GRACE,
    PY38,
    WORKER,
    connections_made,
    log_text,
    needs_bwrap,
    outputs_root,
    run_dir,
    submit,
    wait_final,
)
from sandbox_beds import ATTEMPT, verdicts

from substrax_tasks.backends.job import WorkerPaths, build_job
from substrax_tasks.step.spec import make_spec
from substrax_tasks.store.project import Project

# ------------------------------------------------- the argv, without bubblewrap


# The filter's verdicts, from linux/seccomp.h and asm-generic/errno.h.
ALLOW, ENOSYS, EAFNOSUPPORT = 0x7FFF0000, 0x00050000 | 38, 0x00050000 | 97


# ------------------------------------------------------ runs under bubblewrap


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


# Probes of a task in Python: "ALLOWED NAME" or "DENIED NAME" and the error.
PROBES = """
import multiprocessing, os, socket, subprocess, sys

def attempt(name, probe):
    try:
        probe()
        print("ALLOWED", name)
    except Exception as exc:
        print("DENIED", name)
        print(name, "said:", exc)

def serve_and_connect(address):
    with socket.socket(socket.AF_UNIX) as server, socket.socket(socket.AF_UNIX) as client:
        server.bind(address)
        server.listen(1)
        client.connect(address)

def loopback_tcp():
    with socket.create_server(("127.0.0.1", 0)) as server:
        with socket.create_connection(server.getsockname()) as client:
            connection, _ = server.accept()
            client.sendall(b"over tcp")
            assert connection.recv(8) == b"over tcp"
            connection.close()

def socketpair():
    left, right = socket.socketpair()
    left.sendall(b"pair")
    assert right.recv(4) == b"pair"

def fork_pool():
    with multiprocessing.get_context("fork").Pool(2) as pool:
        assert pool.map(abs, [-1, -2, -3]) == [1, 2, 3]
"""


def host_makes_vsocks() -> bool:
    try:
        socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM).close()
    except OSError:
        return False
    return True


@needs_bwrap
@pytest.mark.parametrize("isolated", [True, False], ids=["network_isolation", "network"])
def test_network_isolation_refuses_path_and_abstract_unix_sockets_alike(
    project: Project, marker: str, isolated: bool
) -> None:
    script = PROBES + f"""
attempt("path-socket", lambda: serve_and_connect("/tmp/own.sock"))
attempt("abstract-socket", lambda: serve_and_connect("\\0{marker}"))
attempt("vsock", lambda: socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM).close())
"""
    handle = submit(project, ["python3", "-c", script], sandbox="bwrap", network_isolation=isolated)
    assert wait_final(project, handle) == "succeeded"
    log = log_text(project, handle)
    expected = "DENIED" if isolated else "ALLOWED"  # without it, as before: a regression guard
    # a vsock (the hypervisor's host, inside a VM) where this machine has them at all
    vsock = expected if isolated or host_makes_vsocks() else "DENIED"
    assert verdicts(log) == {"path-socket": expected, "abstract-socket": expected, "vsock": vsock}, log
    if isolated:
        for probe in ("path-socket", "abstract-socket", "vsock"):
            assert f"{probe} said: [Errno 97] Address family not supported by protocol" in log, log


@needs_bwrap
def test_under_network_isolation_pairs_fork_pools_subprocesses_and_loopback_tcp_still_work(
    project: Project,
) -> None:
    script = PROBES + """
attempt("socketpair", socketpair)
attempt("multiprocessing-fork-pool", fork_pool)
attempt("subprocess", lambda: subprocess.run(["true"], check=True))
attempt("tcp-on-loopback", loopback_tcp)
"""
    handle = submit(project, ["python3", "-c", script], sandbox="bwrap", network_isolation=True)
    assert wait_final(project, handle) == "succeeded"
    log = log_text(project, handle)
    assert verdicts(log) == dict.fromkeys(
        ["socketpair", "multiprocessing-fork-pool", "subprocess", "tcp-on-loopback"], "ALLOWED"), log


@needs_bwrap
def test_a_run_failing_on_a_refused_unix_socket_is_told_why_and_the_fixes(tmp_path: Path) -> None:
    # forkserver (the default start method from Python 3.14) listens on a Unix socket
    pool = "import multiprocessing as m; m.get_context('forkserver').Pool(1).map(abs, [-1])"
    root = make_project(tmp_path, f"""
def task_train():
    yield from remote_step("train", command=["python3", "-c", {pool!r}], outputs=["out/"])
""", default_tasks=["train"], sandbox="bwrap")  # fmt: skip
    write_pyproject(root, "bwrap", extra="network_isolation = true\n")
    done = doit(root)
    assert done.returncode != 0, show(done)
    assert (
        "failed (exit code 1): the sandbox refused a Unix socket (Address family not supported by protocol): "
        "with network_isolation = true a task may not make one, so that no socket of the host is reachable; "
        'use multiprocessing\'s "fork" or "spawn" start method (not "forkserver", the default from '
        'Python 3.14) and no Manager, call torch.multiprocessing.set_sharing_strategy("file_system") for '
        "DataLoader workers, or set network_isolation = false"
        in done.stdout + done.stderr
    ), show(done)
    write_pyproject(root, "bwrap")  # the fix: the same command without network_isolation
    doit_ok(root)


@needs_bwrap
def test_the_worker_on_python_3_8_loads_the_filter(tmp_path: Path) -> None:
    if not PY38.exists():
        pytest.skip(f"NOT TESTED on Python 3.8: {PY38} is missing (remote hosts may run 3.8)")
    project, run = tmp_path / "project", tmp_path / "run"
    project.mkdir()
    run.mkdir()
    script = PROBES + """
attempt("path-socket", lambda: serve_and_connect("/tmp/own.sock"))
attempt("tcp-on-loopback", loopback_tcp)
"""
    spec = make_spec("step", ["python3", "-c", script], project, outputs=["out/"])
    paths = WorkerPaths(project=str(project), run_dir=str(run))
    job = build_job(spec, paths, sandbox="bwrap", network_isolation=True, grace_seconds=GRACE, hide=[])
    Path(paths.job).write_text(json.dumps(job))
    done = subprocess.run([str(PY38), str(WORKER), paths.job], capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    log = Path(paths.log).read_text()
    assert json.loads(Path(paths.status).read_text())["state"] == "succeeded", log
    assert verdicts(log) == {"path-socket": "DENIED", "tcp-on-loopback": "ALLOWED"}, log


def test_a_bubblewrap_check_that_does_not_end_never_runs_the_command_without_its_sandbox(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check of whether bubblewrap works timed out on a loaded machine
    and read as "not usable": with sandbox = "auto" the command then ran
    without its sandbox (and with "bwrap" the run failed as if bubblewrap
    were broken). A check that does not end is no answer: the run is
    refused with the reason, never run unsandboxed."""
    from substrax_tasks._remote import sandbox

    slow = tmp_path / "bin" / "bwrap"
    slow.parent.mkdir()
    slow.write_text("#!/bin/sh\nexec sleep 30\n")
    slow.chmod(0o755)
    monkeypatch.setenv("PATH", f"{slow.parent}:/usr/bin:/bin")
    monkeypatch.setattr(sandbox, "PROBE_SECONDS", 0.5, raising=False)  # (before: 10 s, then read as unusable)
    sandbox.bwrap_usable.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="too busy to tell whether the sandbox works"):
            sandbox.sandboxed_command({"sandbox": "auto", "argv": ["true"]}, print, {})
    finally:
        sandbox.bwrap_usable.cache_clear()
