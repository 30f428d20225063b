"""max_parallel: steps beyond a backend's limit wait for a slot, across two
concurrent `doit -n 2 -P thread` of one project, on the local backend and on
a real sshd in a network namespace; a client killed with SIGKILL frees its
slots."""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from dodo_helpers import (
    DOIT,
    EXEC_WITH_DEFAULT_SIGNALS,
    clean_env,
    doit,
    show,
    stop,
    stop_marked,
    wait_for,
    write_dodo,
)
from ssh_helpers import needs_root, needs_sshd, ssh_settings, write_ssh_pyproject
from testbeds.sshd_host import SshHost

# Two groups of two steps; each step leaves a flag as it starts, then waits
# for the gate. Unsandboxed: the flags and the gate are outside the project.
SWEEPS = """
def task_a():
    yield from gated("a")

def task_b():
    yield from gated("b")

def gated(group):
    for m in range(2):
        name = f"{{group}}-{{m}}"
        yield from remote_step(
            f"{{group}}:m{{m}}", outputs=[f"out-{{name}}.txt"],
            command=["/bin/sh", "-c", f"touch {flags}/{{name}}; while [ ! -e {gate} ]; do sleep 0.05; done; "
                     f"echo {{name}} > out-{{name}}.txt", {marker!r}],
        )
"""


@pytest.fixture
def marker() -> Iterator[str]:
    value = f"substrax-slots-test-{uuid.uuid4().hex}"
    yield value
    stop_marked(value)


@pytest.fixture
def host(root_host: SshHost) -> SshHost:
    """This module's host: root's."""
    return root_host


def popen(root: Path, name: str, *args: str) -> subprocess.Popen[str]:
    """`doit ARGS` in the background, its output in base/<name>.out."""
    with (root.parent / f"{name}.out").open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-c", EXEC_WITH_DEFAULT_SIGNALS, str(DOIT), *args], cwd=root,
            env=clean_env(), stdout=out, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip


def said(root: Path, name: str) -> str:
    return (root.parent / f"{name}.out").read_text()


def project(tmp_path: Path, marker: str, backend: str, request: pytest.FixtureRequest) -> tuple[Path, str]:
    """The project, and where its steps are said to wait for a slot."""
    root = tmp_path / "proj"
    root.mkdir()
    (tmp_path / "flags").mkdir()
    gate = tmp_path / "gate"
    write_dodo(root, SWEEPS.format(flags=tmp_path / "flags", gate=gate, marker=marker))
    if backend == "local":
        (root / "pyproject.toml").write_text(
            '[tool.substrax.compute.backends.local]\nsandbox = "none"\ngrace_seconds = 0.5\n'
            "max_parallel = 2\n"
        )
        return root, "this machine"
    host: SshHost = request.getfixturevalue("host")
    write_ssh_pyproject(root, ssh_settings(host, sandbox="none", max_parallel=2))
    return root, host.address


@pytest.mark.parametrize("backend", ["local", pytest.param("ssh", marks=[needs_sshd, needs_root])])
def test_steps_beyond_max_parallel_wait_across_two_doit_and_a_killed_client_frees_its_slots(
    tmp_path: Path, marker: str, backend: str, request: pytest.FixtureRequest
) -> None:
    root, where = project(tmp_path, marker, backend, request)
    flags = tmp_path / "flags"
    first = popen(root, "first", "-n", "2", "-P", "thread", "a")
    second = None
    try:
        wait_for(lambda: len(list(flags.iterdir())) == 2, "the first doit's two steps to start", timeout=120)
        second = popen(root, "second", "-n", "2", "-P", "thread", "b")
        wait_for(lambda: said(root, "second").count("waits for a free slot on") == 2,
                 "the second doit's steps to wait", timeout=120)  # fmt: skip
        assert f"b:m0 waits for a free slot on {where} (2 running)" in said(root, "second"), said(
            root, "second"
        )
        assert sorted(p.name for p in flags.iterdir()) == ["a-0", "a-1"]  # b's are held back
        first.send_signal(signal.SIGKILL)  # its slots are freed by the kernel
        first.wait(timeout=30)
        wait_for(lambda: len(list(flags.iterdir())) == 4, "the second doit's steps to start", timeout=120)
        (tmp_path / "gate").touch()
        assert second.wait(timeout=300) == 0, said(root, "second")
    finally:
        stop(first)
        if second is not None:
            stop(second)
    for name in ("b-0", "b-1"):
        assert (root / f"out-{name}.txt").read_text() == f"{name}\n"
    # The killed client's runs went on; a rerun fetches them, within the limit.
    again = doit(root, "-n", "2", "-P", "thread", "a", timeout=300)
    assert again.returncode == 0, show(again)
    for name in ("a-0", "a-1"):
        assert (root / f"out-{name}.txt").read_text() == f"{name}\n"


@pytest.mark.parametrize("threads", [[], ["-n", "2", "-P", "thread"]], ids=["serial", "threads"])
def test_ctrl_c_ends_a_wait_for_a_slot_without_a_traceback(
    tmp_path: Path, marker: str, request: pytest.FixtureRequest, threads: list[str]
) -> None:
    root, _ = project(tmp_path, marker, "local", request)
    flags = tmp_path / "flags"
    first = popen(root, "first", "-n", "2", "-P", "thread", "a")
    second = None
    try:
        wait_for(lambda: len(list(flags.iterdir())) == 2, "the first doit's two steps to start", timeout=120)
        second = popen(root, "second", *threads, "b")
        waiting = 2 if threads else 1  # serially, b:m1 is not reached
        wait_for(lambda: said(root, "second").count("waits for a free slot") == waiting,
                 "the second doit to wait")  # fmt: skip
        second.send_signal(signal.SIGINT)
        assert second.wait(timeout=30) != 0
    finally:
        (tmp_path / "gate").touch()
        if second is not None:
            stop(second)
        assert first.wait(timeout=120) == 0, said(root, "first")
    assert "Traceback" not in said(root, "second"), said(root, "second")
    assert "step 'b:m0': interrupted" in said(root, "second"), said(root, "second")
    assert sorted(p.name for p in flags.iterdir()) == ["a-0", "a-1"]  # b's steps never started
