"""The chain against interruptions and concurrency: a killed client, two
clients at once, doit's thread and process pools, SIGTERM/SIGINT."""

from __future__ import annotations

import resource
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from dodo_helpers import (
    DEFAULT_SANDBOX,
    DOIT,
    SANDBOXES,
    clean_env,
    compute,
    compute_status,
    doit,
    doit_ok,
    handles,
    make_project,
    pids_with,
    popen_doit,
    popen_output,
    run_count,
    run_dirs,
    show,
    status_records,
    step_ran,
    step_skipped,
    stop,
    stop_marked,
    wait_for,
    worker_pids,
)
from progress import wait_exit

# A step whose command writes its output, then waits for gate/go (a folder
# of the project, declared as an input so that the sandbox shows it) before
# it exits. "$0" is a
# marker that finds every process of the run in /proc.
GATED = """
MARKER = {marker!r}

def task_step():
    yield from remote_step(
        "step",
        command=["/bin/sh", "-c",
                 "echo started > out/res.txt; while [ ! -e gate/go ]; do sleep 0.05; done; "
                 "echo done >> out/res.txt", MARKER],
        inputs=["gate/"],
        outputs=["out/"],
    )
"""


@pytest.fixture
def marker() -> Iterator[str]:
    value = f"substrax-chain-test-{uuid.uuid4().hex}"
    yield value
    stop_marked(value)


def gated_project(tmp_path: Path, marker: str, sandbox: str = DEFAULT_SANDBOX) -> Path:
    root = make_project(tmp_path, GATED.format(marker=marker), ["step"], sandbox)
    (root / "gate").mkdir()
    return root


def running(root: Path) -> bool:
    return any(r.get("state") == "running" for r in status_records(root))


def open_gate(root: Path) -> None:
    (root / "gate" / "go").write_text("")


def close_gate(root: Path) -> None:
    """The gate, an input, as it was at launch: the run's key holds again."""
    (root / "gate" / "go").unlink()


# The gate is an input the command reads: opened while its run goes, it is
# an input edited mid-run, so that run is not recorded up to date (issue
# 28, docs/steps.md "What a run sees"). The next doit, the gate still open,
# runs the step once more, then it is up to date.
EDITED = "gate/go changed while the run went"


def runs_once_more_then_is_up_to_date(root: Path, *args: str, steps: tuple[str, ...] = ("step",)) -> None:
    again = doit_ok(root, *args)
    assert all(step_ran(again, step) for step in steps) and EDITED not in show(again), show(again)
    last = doit_ok(root, *args)
    assert all(step_skipped(last, step) for step in steps), show(last)


# ------------------------------------------------- a client killed mid-run


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_rerun_after_sigkill_of_the_client_reattaches(tmp_path: Path, marker: str, sandbox: str) -> None:
    root = gated_project(tmp_path, marker, sandbox)
    proc = popen_doit(root)
    try:
        wait_for(lambda: running(root), "the run to start")
        proc.send_signal(signal.SIGKILL)  # the doit client only, by its pid
        proc.wait(timeout=30)
    finally:
        stop(proc)
    # The run goes on without its client (the worker is detached).
    assert worker_pids(root), "the worker died with its client"
    assert pids_with(marker)
    second = popen_doit(root)
    try:
        wait_for(lambda: "reattaching" in popen_output(root), "the rerun to reattach")
        open_gate(root)
        code = wait_exit(second, "the doit to end", 60)
    finally:
        stop(second)
    text = popen_output(root)
    assert code == 0, text
    assert "reattaching to run" in text
    assert run_count(root) == 1  # no second run
    assert (root / "out" / "res.txt").read_text() == "started\ndone\n"
    assert [r["state"] for r in compute_status(root)] == ["succeeded"]
    assert EDITED in text, text
    runs_once_more_then_is_up_to_date(root)
    assert not pids_with(marker)


def test_run_that_ended_while_no_client_was_there_is_fetched_not_rerun(tmp_path: Path, marker: str) -> None:
    root = gated_project(tmp_path, marker)
    proc = popen_doit(root)
    try:
        wait_for(lambda: running(root), "the run to start")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        stop(proc)
    open_gate(root)
    wait_for(lambda: [r.get("state") for r in status_records(root)] == ["succeeded"], "the run to end")
    close_gate(root)
    assert not (root / "out" / "res.txt").exists() or DEFAULT_SANDBOX == "none"
    done = doit_ok(root)
    assert step_ran(done, "step"), show(done)
    assert "fetching its outputs again" in done.stdout
    assert run_count(root) == 1
    assert (root / "out" / "res.txt").read_text() == "started\ndone\n"
    assert step_skipped(doit_ok(root), "step")


def test_a_killed_run_is_not_reattached_but_run_again(tmp_path: Path, marker: str) -> None:
    """A run cancelled (here: with the CLI) while no client was there is
    not taken as done: the next `doit` starts a new run."""
    root = gated_project(tmp_path, marker)
    proc = popen_doit(root)
    try:
        wait_for(lambda: running(root), "the run to start")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        stop(proc)
    (run,) = handles(root)
    cancelled = compute(root, "cancel", run["run_id"])
    assert cancelled.returncode == 0, show(cancelled)
    assert not pids_with(marker)
    open_gate(root)
    done = doit_ok(root)
    assert "new run" in done.stdout, show(done)
    assert run_count(root) == 2
    assert (root / "out" / "res.txt").read_text() == "started\ndone\n"


# ------------------------------------------------------ two clients at once


def test_two_doit_at_once_never_make_two_runs(tmp_path: Path, marker: str) -> None:
    root = gated_project(tmp_path, marker)
    first = popen_doit(root)
    try:
        wait_for(lambda: running(root), "the first run to start")
        second = doit(root, "step")
        assert second.returncode == 1, show(second)
        text = second.stdout + second.stderr
        assert "being run by another process" in text
        assert f"pid {first.pid}" in text  # names the holder
        assert run_count(root) == 1
        open_gate(root)
        assert wait_exit(first, "the doit to end", 60) == 0, popen_output(root)
    finally:
        stop(first)
    assert run_count(root) == 1
    assert EDITED in popen_output(root), popen_output(root)
    runs_once_more_then_is_up_to_date(root, "step")


def test_lock_of_a_killed_client_is_free_again(tmp_path: Path, marker: str) -> None:
    """The step lock is released by the kernel when its holder dies."""
    root = gated_project(tmp_path, marker)
    open_gate(root)
    body_blocker = popen_doit(root)
    try:
        wait_for(lambda: status_records(root), "the first run to start")
        body_blocker.send_signal(signal.SIGKILL)
        body_blocker.wait(timeout=30)
    finally:
        stop(body_blocker)
    done = doit_ok(root)
    assert run_count(root) == 1, show(done)
    assert (root / "out" / "res.txt").read_text() == "started\ndone\n"


# ------------------------------------------------------------- doit pools

TWO_STEPS = """
import substrax_tasks.backends.local.backend as _local

_real_teardown = _local.LocalBackend.teardown

def _counting_teardown(self, handle):
    # a spy: notes each teardown of a run, then does the real one
    with open({log!r}, "a") as f:
        f.write(handle.run_id + "\\n")
    return _real_teardown(self, handle)

_local.LocalBackend.teardown = _counting_teardown

def task_steps():
    for name in ("one", "two"):
        yield from remote_step(
            name,
            command=["/bin/sh", "-c",
                     "echo " + name + " > res/" + name + ".txt; "
                     "while [ ! -e gate/go ]; do sleep 0.05; done", {marker!r}],
            inputs=["gate/"],
            outputs=["res/" + name + ".txt"],
        )
"""


def test_thread_pool_runs_steps_concurrently_with_one_teardown_each(tmp_path: Path, marker: str) -> None:
    log = tmp_path / "teardowns.log"
    root = make_project(tmp_path, TWO_STEPS.format(log=str(log), marker=marker), ["one", "two"])
    (root / "gate").mkdir()
    proc = popen_doit(root, "-n", "2", "-P", "thread")
    try:
        # Both commands are running at once, or this times out.
        wait_for(lambda: sum(r.get("state") == "running" for r in status_records(root)) == 2,
                 "both runs to be going at once")
        open_gate(root)
        code = wait_exit(proc, "the doit to end", 60)
    finally:
        stop(proc)
    assert code == 0, popen_output(root)
    assert (root / "res" / "one.txt").read_text() == "one\n"
    assert (root / "res" / "two.txt").read_text() == "two\n"
    torn = log.read_text().split()
    assert sorted(torn) == sorted(h["run_id"] for h in handles(root)), torn  # once each
    for run_dir in run_dirs(root):
        assert not (run_dir / "work").exists()
    assert run_count(root) == 2
    runs_once_more_then_is_up_to_date(root, "-n", "2", "-P", "thread", steps=("one", "two"))


def test_process_pool_is_refused_clearly(tmp_path: Path, marker: str) -> None:
    log = tmp_path / "teardowns.log"
    root = make_project(tmp_path, TWO_STEPS.format(log=str(log), marker=marker), ["one", "two"])
    (root / "gate").mkdir()
    open_gate(root)
    done = doit(root, "-n", "2")
    assert done.returncode != 0, show(done)
    text = done.stdout + done.stderr
    assert "-P thread" in text
    assert "cannot run in doit's worker processes" in text
    assert run_count(root) == 0
    assert not pids_with(marker)
    # Threads work on the same project afterwards.
    doit_ok(root, "-n", "2", "-P", "thread")
    assert run_count(root) == 2


PLAIN_THEN_REMOTE = """
def task_prepare():
    return {"actions": ["echo prepared > prepared.txt"], "targets": ["prepared.txt"]}

def task_train():
    yield from remote_step("train", command=["cp", "prepared.txt", "out.txt"], inputs=["prepared.txt"],
                           outputs=["out.txt"], task_dep=["prepare"])
"""


@pytest.mark.parametrize("pool", [["-n", "2"], ["-n", "2", "-P", "process"]], ids=["n-2", "P-process"])
def test_a_process_pool_is_refused_before_any_task_runs(tmp_path: Path, pool: list[str]) -> None:
    """Issue 39, item 6: the phases refused the pool only once reached, after
    the plain tasks before them had run in it."""
    root = make_project(tmp_path, PLAIN_THEN_REMOTE, ["train"])
    done = doit(root, *pool)
    assert not (root / "prepared.txt").exists(), show(done)  # the plain task did not run
    assert done.returncode == 2, show(done)
    assert "substrax: error: remote steps cannot run in doit's worker processes" in done.stderr, show(done)
    assert "`doit -n N -P thread`" in done.stderr and "Traceback" not in done.stderr, show(done)
    assert run_count(root) == 0
    # A pool that runs no remote step is doit's as ever; threads run the rest.
    doit_ok(root, *pool, "prepare")
    assert (root / "prepared.txt").read_text() == "prepared\n"
    doit_ok(root, "-n", "2", "-P", "thread")
    assert (root / "out.txt").read_text() == "prepared\n" and run_count(root) == 1


# ------------------------------------------------------ SIGTERM and Ctrl-C


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_signal_to_doit_cancels_the_local_run(tmp_path: Path, marker: str, sig: signal.Signals) -> None:
    root = gated_project(tmp_path, marker)
    proc = popen_doit(root)
    try:
        wait_for(lambda: running(root), "the run to start")
        assert pids_with(marker)
        proc.send_signal(sig)
        code = proc.wait(timeout=30)
    finally:
        stop(proc)
    text = popen_output(root)
    assert code != 0, text
    assert "cancelling local run" in text
    # No process of the run is left, the worker included.
    wait_for(lambda: not pids_with(marker), "the run's processes to be gone", timeout=10)
    assert not worker_pids(root)
    assert [r["state"] for r in compute_status(root)] == ["cancelled"]
    assert not (root / "out" / "res.txt").exists() or DEFAULT_SANDBOX == "none"
    # doit saved its DB and the lock is free: the next run starts afresh.
    open_gate(root)
    done = doit_ok(root)
    assert "new run" in done.stdout
    assert run_count(root) == 2
    assert (root / "out" / "res.txt").read_text() == "started\ndone\n"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_under_the_thread_pool_cancels_every_local_run(
    tmp_path: Path, marker: str, sig: signal.Signals
) -> None:
    log = tmp_path / "teardowns.log"
    root = make_project(tmp_path, TWO_STEPS.format(log=str(log), marker=marker), ["one", "two"])
    (root / "gate").mkdir()
    proc = popen_doit(root, "-n", "2", "-P", "thread")
    try:
        wait_for(lambda: sum(r.get("state") == "running" for r in status_records(root)) == 2,
                 "both runs to be going at once")
        proc.send_signal(sig)
        code = proc.wait(timeout=30)
    finally:
        stop(proc)
    said = popen_output(root)
    assert code != 0, said
    assert "Traceback" not in said, said
    assert said.count("cancelling local run") == 2, said
    wait_for(lambda: not pids_with(marker), "the runs' processes to be gone", timeout=10)
    assert not worker_pids(root)
    assert sorted(r["state"] for r in compute_status(root)) == ["cancelled", "cancelled"]
    open_gate(root)
    doit_ok(root, "-n", "2", "-P", "thread")
    assert run_count(root) == 4


# Trivial steps, as many as a sweep has: each writes its one output.
SWEEP = """
NAMES = ["s%04d" % i for i in range({steps})]

def task_sweep():
    for name in NAMES:
        yield from remote_step(name, command=["/bin/sh", "-c", "echo x > out/%s.txt" % name],
                               outputs=["out/%s.txt" % name])
"""


def sweep_project(tmp_path: Path, steps: int) -> Path:
    names = [f"s{i:04d}" for i in range(steps)]
    return make_project(tmp_path, SWEEP.format(steps=steps), names)


# Exec doit with a soft limit of open files (as `ulimit -Sn`), holding
# `held` descriptors open from its start (as a child of a process with many
# files): opened lowest first, they leave doit none free below their number.
EXEC_WITH_FILES = """
import os, resource, sys
soft, held = int(sys.argv[1]), int(sys.argv[2])
if soft:
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
for _ in range(held):
    os.set_inheritable(os.open(os.devnull, os.O_RDONLY), True)
os.execv(sys.argv[3], sys.argv[3:])
"""


def doit_with_files(
    root: Path, *args: str, soft_limit: int = 0, held: int = 0
) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-c", EXEC_WITH_FILES, str(soft_limit), str(held), str(DOIT), *args]
    return subprocess.run(argv, cwd=root, env=clean_env(), capture_output=True, text=True, timeout=600,
                          check=False)  # fmt: skip


def test_a_sweep_holds_open_files_per_step_in_flight_not_per_step_run(tmp_path: Path) -> None:
    """Each step's lock, slot and run folder go as its chain ends: 160 steps
    run under a limit of 128 open files (with their locks held until doit
    ended, the build died at about the limit)."""
    root = sweep_project(tmp_path, 160)
    done = doit_with_files(root, "-n", "4", "-P", "thread", soft_limit=128)
    assert done.returncode == 0, show(done)
    assert len(list((root / "out").iterdir())) == 160
    for run_dir in run_dirs(root):  # torn down as each chain ended
        assert not (run_dir / "work").exists(), run_dir
    again = doit_with_files(root, "-n", "4", "-P", "thread", soft_limit=128)
    assert again.returncode == 0, show(again)
    assert run_count(root) == 160  # all up to date: no run again


def test_steps_run_when_doit_holds_descriptors_past_select_s_bound(tmp_path: Path) -> None:
    """A doit whose descriptors pass 1,024 (a sweep of thousands, or a parent
    that holds many files) waits for its runs with poll: select() refused them
    ("filedescriptor out of range in select()")."""
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 1200:
        pytest.fail("this test needs a hard limit of open files of at least 1,200 (ulimit -Hn)")
    root = sweep_project(tmp_path, 3)
    done = doit_with_files(root, "-n", "2", "-P", "thread", held=1100)
    assert done.returncode == 0, show(done)
    assert sorted(p.name for p in (root / "out").iterdir()) == ["s0000.txt", "s0001.txt", "s0002.txt"]
