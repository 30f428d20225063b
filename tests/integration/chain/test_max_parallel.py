"""max_parallel: steps beyond a backend's limit wait for a slot, across two
concurrent `doit -n 2 -P thread` of one project, on the local backend and on
a real sshd in a network namespace; the runs of a client killed with SIGKILL
keep their slots while their commands run, and a rerun that reattaches to
them keeps the limit."""

from __future__ import annotations

import re
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
from progress import wait_exit
from ssh_helpers import needs_root, needs_sshd, ssh_settings, write_ssh_pyproject
from testbeds.sshd_host import SshHost

# Two groups of two steps; each step leaves a flag as it starts and appends
# start/end lines to one file around its wait for the gate (appends are
# atomic: the file's order is the order the commands started and ended in).
# Unsandboxed: the flags, the stamps and the gate are outside the project.
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
            command=["/bin/sh", "-c", f"touch {flags}/{{name}}; echo start >> {stamps}; "
                     f"while [ ! -e {gate} ]; do sleep 0.05; done; "
                     f"echo end >> {stamps}; echo {{name}} > out-{{name}}.txt", {marker!r}],
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
    (tmp_path / "stamps.txt").touch()
    write_dodo(root, SWEEPS.format(flags=tmp_path / "flags", gate=gate, marker=marker,
                                   stamps=tmp_path / "stamps.txt"))  # fmt: skip
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
def test_steps_beyond_max_parallel_wait_across_two_doit_and_a_killed_clients_runs_keep_their_slots(
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
        # Its locks go with it, but its runs go on: they keep their slots.
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        (tmp_path / "gate").touch()
        assert wait_exit(second, "the doit to end", 300) == 0, said(root, "second")
    finally:
        (tmp_path / "gate").touch()
        stop(first)
        if second is not None:
            stop(second)
    assert most_at_once(tmp_path / "stamps.txt") <= 2, (tmp_path / "stamps.txt").read_text()
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
        assert second.wait(timeout=30) == 130  # a Ctrl-C's, serially or under threads
    finally:
        (tmp_path / "gate").touch()
        if second is not None:
            stop(second)
        assert wait_exit(first, "the doit to end", 120) == 0, said(root, "first")
    assert "Traceback" not in said(root, "second"), said(root, "second")
    # said once, on the step's own line; not listed again as a failure
    assert re.search(r"^b:m0(:| \|) \[1/2\] interrupted on local in ", said(root, "second"), re.M), said(
        root, "second")
    assert "interrupted: ran 0 of 2 tasks, 2 not done" in said(root, "second"), said(root, "second")
    assert "TaskError" not in said(root, "second"), said(root, "second")
    assert sorted(p.name for p in flags.iterdir()) == ["a-0", "a-1"]  # b's steps never started


# Four steps; each appends "start"/"end" lines to one shared file around its
# wait for the gate (appends are atomic: the file's order is the order the
# commands started and ended in).
FOUR = """
def task_fit():
    for m in range(4):
        yield from remote_step(
            f"fit:m{{m}}", outputs=[f"out-{{m}}.txt"],
            command=["/bin/sh", "-c", f"echo start {{m}} >> {stamps}; "
                     f"while [ ! -e {gate} ]; do sleep 0.05; done; "
                     f"echo end {{m}} >> {stamps}; echo {{m}} > out-{{m}}.txt", {marker!r}],
        )
"""


def most_at_once(stamps: Path) -> int:
    running = most = 0
    for line in stamps.read_text().splitlines():
        running += 1 if line.startswith("start") else -1
        most = max(most, running)
    return most


def test_after_kill_9_of_doit_the_rerun_keeps_max_parallel_with_the_runs_it_reattaches_to(
    tmp_path: Path, marker: str
) -> None:
    """max_parallel = 2, four steps under `doit -n 4 -P thread`: doit is
    killed with SIGKILL while two run and two wait. The rerun reattaches to
    all four; the two whose commands run hold their slots though no client
    did, so the other two wait for them, and all four finish."""
    root = tmp_path / "proj"
    root.mkdir()
    stamps, gate = tmp_path / "stamps.txt", tmp_path / "gate"
    stamps.touch()
    write_dodo(root, FOUR.format(stamps=stamps, gate=gate, marker=marker))
    (root / "pyproject.toml").write_text(
        '[tool.substrax.compute.backends.local]\nsandbox = "none"\ngrace_seconds = 0.5\nmax_parallel = 2\n'
    )
    first = popen(root, "first", "-n", "4", "-P", "thread", "fit")
    again = None
    try:
        wait_for(lambda: stamps.read_text().count("start") == 2 and said(root, "first").count(
            "waits for a free slot") == 2, "two steps to run and two to wait", timeout=120)  # fmt: skip
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        again = popen(root, "again", "-n", "4", "-P", "thread", "fit")
        # The two waiting runs wait again (or, beyond the limit, start).
        wait_for(lambda: said(root, "again").count("waits for a free slot") == 2
                 or stamps.read_text().count("start") > 2, "the rerun's slots", timeout=120)  # fmt: skip
        gate.touch()
        assert wait_exit(again, "the doit to end", 300) == 0, said(root, "again")
    finally:
        gate.touch()
        stop(first)
        if again is not None:
            stop(again)
    assert most_at_once(stamps) <= 2, stamps.read_text()
    assert stamps.read_text().count("end") == 4, stamps.read_text()
    for m in range(4):
        assert (root / f"out-{m}.txt").read_text() == f"{m}\n"
