"""remote_step() on the ssh backend through the real `doit` and the real
`substrax-compute`, against a real sshd in a network namespace of its own
(tests/support/testbeds/sshd_host.py), real rsync, and real bubblewrap on the host.

The host runs on this machine: its "remote" folders are real folders here
(read directly to check remote state), and its processes are found in
/proc by a marker in their argv.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from dodo_helpers import (
    compute,
    compute_status,
    doit,
    doit_ok,
    pid_alive,
    popen_doit,
    popen_output,
    run_count,
    show,
    step_ran,
    step_skipped,
    stop,
    tree_files,
    wait_for,
)
from local_runs import describe, kill_pid, marked_pids, stubborn_tree
from lost_tree import kill_recorded, kill_worker, overlap, step_argv, wait_tree_up, write_command
from progress import wait_exit
from ssh_helpers import (
    CLIENT_MEMORY_BOUND,
    GATED_STEP,
    GATED_SWEEP,
    SANDBOX,
    build_wheel,
    doit_killed_mid_run,
    fresh_user,
    launched_status,
    live_handles,
    make_ssh_project,
    needs_bwrap,
    needs_root,
    needs_sshd,
    one_step,
    only_handle,
    remote_run_dir,
    remote_status,
    ssh_settings,
    wait_bounded,
    write_ssh_pyproject,
)
from testbeds.sshd_host import SshHost, descendants, is_alive, kill_sshd, reboot, restart_sshd, running_host

from substrax_tasks.backends.ssh.settings import SshSettings
from substrax_tasks.store.project import Project

pytestmark = [needs_sshd, needs_root]


def control_master_pids(handle: dict[str, Any]) -> list[int]:
    """Local ssh processes (the multiplexing master) of the run's target."""
    target = SshSettings.model_validate(handle["settings"]).target()
    return marked_pids(Path(target.control_path()).name)


# ------------------------------------------------------------ end to end

E2E_COMMAND = r"""
set -e
mkdir -p out
cp data/in.txt out/copy.txt
tr '\0' ' ' < /proc/1/cmdline > out/pid1.txt
if touch data/in.txt 2>/dev/null; then echo writable; else echo read-only; fi > out/project.txt
ls -A "$HOME" > out/home.txt
ls -A > out/listing.txt
echo "remote says hello as $(id -un)"
echo done > res.txt
"""
E2E_STEP = one_step(shell=E2E_COMMAND, inputs=["data/in.txt"], outputs=["out/", "res.txt"])
SETUP = ["echo preparing the image as $(id -un)", "command -v rsync"]


@pytest.mark.parametrize("user", ["test-user", "root"])
def test_full_chain_then_a_noop_rerun_that_connects_to_nothing(
    tmp_path: Path, request: pytest.FixtureRequest, user: str
) -> None:
    target: SshHost = request.getfixturevalue("host" if user == "test-user" else "root_host")
    # the test user's remote root is relative to its home (the default);
    # root's goes to the scratch folder, not into this machine's /root
    remote_root = None if user == "test-user" else str(target.scratch / "remote")
    if user == "test-user":
        (target.remote_home / "secret-of-the-user.txt").write_text("")  # hidden from the task
    root = make_ssh_project(
        tmp_path, target, E2E_STEP,
        files={"data/in.txt": "hello\n", "notes/todo.txt": "private\n", "scratch.tmp": "junk\n"},
        copy={"excludes": ["notes", "*.tmp"]},
        setup_commands=SETUP, remote_root=remote_root,
    )  # fmt: skip
    done = doit_ok(root)
    assert step_ran(done, "step") and "new run" in done.stdout, show(done)
    run = only_handle(root)
    state = run["state"]

    # the outputs came home, made on the host under bubblewrap
    assert tree_files(root / "out")["copy.txt"] == "hello\n"
    assert (root / "res.txt").read_text() == "done\n"
    assert f"remote says hello as {target.user}" in done.stdout  # the log, streamed
    if SANDBOX == "bwrap":
        assert "bwrap" in (root / "out" / "pid1.txt").read_text()  # pid 1 of its own pid namespace
        assert (root / "out" / "project.txt").read_text() == "read-only\n"
        seen_home = set((root / "out" / "home.txt").read_text().split())
        real_home = set(os.listdir(target.remote_home)) - {".substrax-remote"}
        assert not seen_home & real_home, "the user's home is visible in the sandbox"
    # the inputs were uploaded, nothing else of the project (a run sees its inputs only)
    listing = set((root / "out" / "listing.txt").read_text().split())
    assert "data" in listing, listing
    assert not {"dodo.py", "pyproject.toml", "notes", "scratch.tmp", ".substrax"} & listing, listing

    # setup commands ran on the host, logged in the store
    setup_log = (root / ".substrax" / "runs" / run["run_id"] / "setup.log").read_text()
    assert f"$ {SETUP[0]}\npreparing the image as {target.user}\n" in setup_log
    assert "$ command -v rsync" in setup_log

    # one summary line per transfer when not on a terminal, no progress bars
    assert len(re.findall(r"^upload: \d+ files, .* MB/s\)$", done.stderr, re.M)) == 1, show(done)
    assert len(re.findall(r"^fetch: 6 files, .* MB/s\)$", done.stderr, re.M)) == 1, show(done)
    # each says when it starts, before it ends
    said = done.stderr
    assert re.search(r"^upload: started, \d+ files to \S+$", said, re.M), show(done)
    assert re.search(r"^fetch: started, \d+ outputs from \S+$", said, re.M), show(done)
    assert said.index("fetch: started, ") < said.index("fetch: 6 files, "), show(done)
    assert "\r" not in done.stderr and "\x1b" not in done.stderr

    # verified, promoted, torn down: the remote run folder is gone
    assert state["phase"] == "promoted" and run["backend_state"]["torn_down"] is True
    assert not remote_run_dir(run).exists()
    expected_root = Path(remote_root) if remote_root else target.remote_home / ".substrax-remote"
    assert remote_run_dir(run).parent == expected_root / "runs" and expected_root.is_dir()
    watchdog = run["backend_state"]["watchdog"]
    assert isinstance(watchdog["pid"], int)
    assert not control_master_pids(run), describe(control_master_pids(run))

    # the CLI: status, logs kept after teardown, and a finished run left alone
    (record,) = compute_status(root)
    assert record["state"] == "succeeded" and record["exit_code"] == 0
    logs = compute(root, "logs", run["run_id"])
    assert logs.returncode == 0 and f"remote says hello as {target.user}" in logs.stdout, show(logs)
    cancelled = compute(root, "cancel", run["run_id"])
    assert cancelled.returncode == 0 and "already finished (succeeded)" in cancelled.stdout, show(cancelled)

    # the no-op rerun connects to nothing: with sshd dead it still says up to date
    kill_sshd(target)
    try:
        again = doit(root)
        assert again.returncode == 0, show(again)
        assert step_skipped(again, "step") and "nothing to do" in again.stdout, show(again)
        assert run_count(root) == 1
    finally:
        restart_sshd(target)
    # the lifetime timer ends by itself once the run folder is gone
    wait_for(lambda: not is_alive(watchdog["pid"], watchdog["start_ticks"]), "the watchdog to exit", 15)


# ------------------------------------------------------------------ cancel


@pytest.mark.parametrize("sandbox", ["none", pytest.param("bwrap", marks=needs_bwrap)])
def test_cancel_mid_run_leaves_no_remote_process(
    tmp_path: Path, host: SshHost, marker: str, sandbox: str
) -> None:
    """The task ignores SIGTERM and leaves a double-forked setsid grandchild
    that ignores it too: `substrax-compute cancel` stops them all."""
    root = make_ssh_project(
        tmp_path,
        host,
        one_step(command=stubborn_tree(marker, "grandchild"), outputs=["out/"]),
        sandbox=sandbox,
    )
    proc = popen_doit(root)
    try:

        def both_ready() -> bool:
            status = launched_status(root)
            if not status or not status.get("outputs_root"):
                return False
            out = Path(status["outputs_root"]) / "out"
            return (out / "task.ready").exists() and (out / "grandchild.ready").exists()

        wait_for(both_ready, "the remote task and its setsid grandchild")
        assert len(marked_pids(marker)) >= 2, describe(marked_pids(marker))
        run = only_handle(root)
        began = time.monotonic()
        done = compute(root, "cancel", run["run_id"])
        took = time.monotonic() - began
        assert done.returncode == 0 and "cancelled" in done.stdout, show(done)
        assert not marked_pids(marker), describe(marked_pids(marker))
        assert wait_exit(proc, "the doit to end", 60) == 1, popen_output(root)
        assert "cancelled" in popen_output(root)
    finally:
        stop(proc)
    print(f"\n[cancel, sandbox={sandbox}] remote tree gone in {took:.2f} s")
    assert compute_status(root)[0]["state"] == "cancelled"
    assert not remote_run_dir(run).exists()  # doit's teardown removed it
    assert not (root / "out").exists()


# ------------------------------------------------------- network isolation

REACH = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), 3).close()
    answer = "reached"
except OSError as exc:
    answer = type(exc).__name__
open("out/reach.txt", "w").write(answer)
"""


@needs_bwrap
@pytest.mark.parametrize("isolated", [True, False], ids=["isolated", "not-isolated"])
def test_network_isolation_keeps_the_task_off_the_network(
    tmp_path: Path, host: SshHost, isolated: bool
) -> None:
    assert host.peer_address is not None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind((host.peer_address, 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        step = one_step(command=["python3", "-c", REACH, host.peer_address, str(port)], outputs=["out/"])
        root = make_ssh_project(tmp_path, host, step, sandbox="bwrap", copy={"network_isolation": isolated})
        doit_ok(root)
    answer = (root / "out" / "reach.txt").read_text()
    if isolated:
        assert answer != "reached" and answer.endswith("Error"), answer
    else:
        assert answer == "reached"


# ------------------------------------------- outputs changed while fetched

BIG = 64 * 1024 * 1024
BIG_STEP = one_step(
    shell=f"mkdir -p out && head -c {BIG} /dev/zero > out/big.bin && echo small > out/small.txt",
    outputs=["out/"],
)


def test_outputs_changed_on_the_host_after_the_run_promote_nothing_until_put_back(
    tmp_path: Path, host: SshHost
) -> None:
    """The copy is verified against the manifest the worker wrote as the
    command ended: outputs that grow on the host from then on, through the
    fetch, do not match it. Nothing is promoted and the run is kept, not
    judged; once they are as the command left them, a rerun fetches them
    without running the command again."""
    root = make_ssh_project(tmp_path, host, BIG_STEP)
    stop_writing = threading.Event()
    writes = [0]

    def keep_appending() -> None:
        """Wait until the run has finished, then keep growing its large
        output on the host until told to stop."""
        while not stop_writing.is_set():
            status = launched_status(root)
            if status and status.get("state") == "succeeded":
                break
            time.sleep(0.005)
        else:
            return
        big = Path(str(status["outputs_root"])) / "out" / "big.bin"
        while not stop_writing.is_set():
            with big.open("ab") as f:
                f.write(b"x" * 4096)
            writes[0] += 1
            time.sleep(0.002)

    writer = threading.Thread(target=keep_appending, daemon=True)
    writer.start()
    try:
        first = doit(root)
    finally:
        stop_writing.set()
        writer.join(timeout=30)
    assert writes[0] > 0, "the output was never changed: the test proves nothing"
    assert first.returncode != 0, show(first)
    text = first.stdout + first.stderr
    assert "do not match its manifest" in text and "nothing was promoted" in text, show(first)
    assert "changed content: out/big.bin" in text, show(first)
    assert "Traceback" not in text, show(first)
    assert not (root / "out").exists()
    run = only_handle(root)
    assert remote_run_dir(run).is_dir(), "the remote folder must stay for the next fetch"
    assert run["state"].get("verdict") is None, run["state"]
    big = Path(str(remote_status(run)["outputs_root"])) / "out" / "big.bin"  # type: ignore[index]
    os.truncate(big, BIG)  # as the command left it

    second = doit_ok(root)
    assert "fetching its outputs again" in second.stdout, show(second)
    assert run_count(root) == 1  # the command did not run again
    assert (root / "out" / "big.bin").stat().st_size == BIG
    assert (root / "out" / "small.txt").read_text() == "small\n"
    assert not remote_run_dir(run).exists()


# ------------------------------------------------- sshd killed mid-fetch

HUGE = 256 * 1024 * 1024
HUGE_STEP = one_step(
    shell=f"mkdir -p out && head -c {HUGE} /dev/zero > out/big.bin && echo small > out/small.txt",
    outputs=["out/"],
)


def test_sshd_killed_during_the_fetch_then_the_rerun_fetches_without_rerunning(
    tmp_path: Path, host: SshHost
) -> None:
    root = make_ssh_project(tmp_path, host, HUGE_STEP)
    proc = popen_doit(root)
    try:

        def copying() -> bool:
            runs = root / ".substrax" / "runs"
            return any(p.is_file() for p in runs.glob("*/fetched/out/*")) if runs.is_dir() else False

        wait_for(copying, "rsync to start copying the output", 60)
        kill_sshd(host)
        try:
            assert wait_exit(proc, "the doit to end", 60) != 0, popen_output(root)
        finally:
            restart_sshd(host)
    finally:
        stop(proc)
    text = popen_output(root)
    assert "rsync fetch with" in text and "keeping run" in text, text
    assert "Traceback" not in text, text
    assert not (root / "out").exists(), "nothing may be promoted from a broken copy"
    run = only_handle(root)
    assert remote_run_dir(run).is_dir()

    again = doit_ok(root)
    assert "fetching its outputs again" in again.stdout, show(again)
    assert run_count(root) == 1  # the command did not run again
    assert (root / "out" / "big.bin").stat().st_size == HUGE
    assert (root / "out" / "small.txt").read_text() == "small\n"
    assert not remote_run_dir(run).exists()


# ------------------------------------------------ a failing setup command


def test_failing_setup_command_is_a_clear_error_and_the_lifetime_timer_fires(
    tmp_path: Path, host: SshHost
) -> None:
    lifetime_minutes = 0.1  # 6 s
    failing = "echo the-driver-did-not-install >&2; exit 3"
    root = make_ssh_project(
        tmp_path, host, one_step(shell="echo never > out/x", outputs=["out/"]),
        setup_commands=["echo preparing", failing, "echo never-reached"],
        lifetime_minutes=lifetime_minutes,
        # Without it the chain removes the folder of a run whose setup
        # failed at once; kept, only the lifetime timer can remove it.
        keep_remote=True,
    )  # fmt: skip
    began = time.monotonic()
    done = doit(root)
    assert done.returncode == 1, show(done)
    text = done.stdout + done.stderr
    assert "setup command `echo the-driver-did-not-install >&2; exit 3` failed" in text, show(done)
    assert "(exit 3)" in text and "the-driver-did-not-install" in text, show(done)
    assert "Traceback" not in text and "never-reached" not in text, show(done)
    run = only_handle(root)
    folder = remote_run_dir(run)
    watchdog = run["backend_state"]["watchdog"]
    if time.monotonic() - began < lifetime_minutes * 60 - 1:
        assert folder.is_dir() and is_alive(watchdog["pid"], watchdog["start_ticks"]), "no timer armed"
    # nobody comes back: the timer removes the run folder by itself
    wait_for(lambda: not folder.exists(), "the lifetime timer to remove the run folder", 30)
    wait_for(lambda: not is_alive(watchdog["pid"], watchdog["start_ticks"]), "the watchdog to exit", 10)
    assert not (root / "out").exists()


# ------------------------------------------------- env sync from wheels

ENV_STEP = one_step(
    command=[
        "python3",
        "-c",
        "import sys, sxtiny; open('out/v.txt', 'w').write(sxtiny.VALUE + ' ' + sys.prefix)",
    ],
    inputs=["data/in.txt", "wheels/"],  # pip_args' wheel folder: uploaded as an input
    outputs=["out/"],
)


def test_env_sync_offline_from_a_wheel_folder_then_reused(tmp_path: Path, host: SshHost) -> None:
    remote_root = host.scratch / f"env-{tmp_path.name}"
    root = make_ssh_project(
        tmp_path, host, ENV_STEP,
        files={"data/in.txt": "1\n", "requirements.txt": "sxtiny==0.1\n"},
        pip_args=["--no-index", "--find-links", "wheels"], remote_root=str(remote_root),
    )  # fmt: skip
    build_wheel(root / "wheels", "sxtiny", "0.1", 'VALUE = "from-the-wheel"\n')
    first = doit_ok(root)
    value, prefix = (root / "out" / "v.txt").read_text().split()
    assert value == "from-the-wheel"
    assert Path(prefix).parent == remote_root / "envs"
    assert "reusing" not in first.stdout

    (root / "data" / "in.txt").write_text("2\n")  # a new run of the same step
    second = doit_ok(root)
    assert "new run" in second.stdout, show(second)
    assert "step: reusing the environment for requirements.txt" in second.stdout, show(second)
    assert run_count(root) == 2
    assert (root / "out" / "v.txt").read_text().split() == ["from-the-wheel", prefix]
    assert [p.name for p in (remote_root / "envs").iterdir() if p.is_dir()] == [Path(prefix).name]


# --------------------------------- the CLI uses the handle's pinned settings

PINNED = """
MARKER = {marker!r}

def task_fast():
    yield from remote_step(
        "fast", shell="mkdir -p out && echo fast-log && echo f > out/f.txt", outputs=["out/"]
    )

def task_slow():
    yield from remote_step(
        "slow", command=["/bin/sh", "-c", "echo slow-log; while :; do sleep 0.1; done", MARKER],
        outputs=["slow/"],
    )
"""


def test_status_logs_fetch_cancel_teardown_use_the_pinned_settings(
    tmp_path: Path, host: SshHost, marker: str
) -> None:
    root = make_ssh_project(tmp_path, host, PINNED.format(marker=marker), ["fast"], keep_remote=True)
    doit_ok(root, "fast")
    fast = only_handle(root, "fast")
    proc = popen_doit(root, "slow")
    try:

        def slow_logged() -> bool:
            runs = [h for h in live_handles(root, "slow") if h["backend_state"].get("remote_run_dir")]
            log = remote_run_dir(runs[0]) / "run.log" if runs else None
            return log is not None and log.exists() and "slow-log" in log.read_text()

        wait_for(slow_logged, "the slow run to start")
        slow = only_handle(root, "slow")
        # the project now names a host that does not exist
        write_ssh_pyproject(
            root, ssh_settings(host, host="bogus.invalid", port=2, known_hosts=str(tmp_path / "nowhere"))
        )
        states = {r["step"]: r["state"] for r in compute_status(root)}
        assert states == {"fast": "succeeded", "slow": "running"}
        for run, text in ((fast, "fast-log"), (slow, "slow-log")):
            logs = compute(root, "logs", run["run_id"])
            assert logs.returncode == 0 and text in logs.stdout, show(logs)
        project = Project.open(root)
        assert project.config.backends["ssh"]["host"] == "bogus.invalid"
        handle = project.store.read(fast["run_id"])
        fetched = project.backend_for(handle).fetch(handle)
        assert fetched.manifest["digest"] == handle.state.manifest_digest
        assert (fetched.root / "out" / "f.txt").read_text() == "f\n"

        cancelled = compute(root, "cancel", slow["run_id"])
        assert cancelled.returncode == 0 and "cancelled" in cancelled.stdout, show(cancelled)
        assert not marked_pids(marker), describe(marked_pids(marker))
        assert wait_exit(proc, "the doit to end", 60) == 1, popen_output(root)
    finally:
        stop(proc)
    # keep_remote = true (pinned) keeps the remote folder through the chain's
    # teardown; the explicit `substrax-compute teardown` removes it anyway
    assert remote_run_dir(fast).is_dir()
    torn = compute(root, "teardown", fast["run_id"])
    assert torn.returncode == 0, show(torn)
    assert not remote_run_dir(fast).is_dir()


def test_outputs_changed_here_are_fetched_again_from_the_kept_run_each_time_as_a_phase_of_its_own(
    tmp_path: Path, host: SshHost
) -> None:
    step = one_step(shell="mkdir -p out; echo made > out/a.txt", outputs=["out/"])
    root = make_ssh_project(tmp_path, host, step, keep_remote=True)
    doit_ok(root)
    run_id = only_handle(root)["run_id"]
    for refetches in (1, 2):
        (root / "out" / "a.txt").write_text("edited here\n")
        again = doit_ok(root)
        said = again.stdout + again.stderr
        assert f"outputs changed here; fetching run {run_id} again" in said, show(again)
        assert (root / "out" / "a.txt").read_text() == "made\n"
        state = only_handle(root)["state"]  # the same run, its command not run again
        # The refetch is recorded as a round of its own, not as the run's start again.
        assert (state["phase"], state["refetches"]) == ("promoted", refetches), state


SWEEP = """
def task_fit():
    for m in range(8):
        yield from remote_step(
            f"fit:m{m}", shell=f"cat data/in.txt > fit-{m}.txt; echo m{m} >> fit-{m}.txt",
            inputs=["data/in.txt"], outputs=[f"fit-{m}.txt"],
        )
"""


def test_a_sweep_of_eight_steps_under_four_threads_on_one_host_finishes(
    tmp_path: Path, host: SshHost
) -> None:
    """The threads share the host's connection and its ssh master: every
    step runs, comes home and verifies, and the host is left clean."""
    root = make_ssh_project(tmp_path, host, SWEEP, ["fit"], files={"data/in.txt": "in\n"})
    done = doit(root, "-n", "4", "-P", "thread", timeout=300)
    assert done.returncode == 0, show(done)
    for m in range(8):
        assert (root / f"fit-{m}.txt").read_text() == f"in\nm{m}\n"
    assert run_count(root) == 8
    assert all(h["backend_state"].get("torn_down") for h in live_handles(root)), live_handles(root)
    # every run folder of this sweep torn down (the module's host is shared:
    # other tests keep theirs on purpose)
    assert not [h["run_id"] for h in live_handles(root) if remote_run_dir(h).exists()]
    again = doit_ok(root, "-n", "4", "-P", "thread")
    assert all(step_skipped(again, f"fit:m{m}") for m in range(8)), show(again)


def test_a_sweep_under_four_threads_on_a_host_refusing_sessions_waits_for_them_and_finishes(
    tmp_path: Path
) -> None:
    """sshd refuses a connection's sessions past MaxSessions (busy hosts,
    or a host set low): the threads' commands wait for a free one, however
    many are refused at once, and no thread takes a refusal for a broken
    connection and closes the connection the others' commands run on (they
    failed with exit -1, the step with them)."""
    with running_host(tmp_path / "sshd", user=fresh_user()) as host:
        config = host.config.read_text()
        assert "MaxSessions 64" in config
        host.config.write_text(config.replace("MaxSessions 64", "MaxSessions 2"))
        restart_sshd(host)
        sweep = SWEEP.replace("range(8)", "range(4)")  # one step a thread
        root = make_ssh_project(tmp_path, host, sweep, ["fit"], files={"data/in.txt": "in\n"})
        done = doit(root, "-n", "4", "-P", "thread", timeout=300)
        assert done.returncode == 0, show(done)
        assert "broke off" not in done.stdout + done.stderr, show(done)
        for m in range(4):
            assert (root / f"fit-{m}.txt").read_text() == f"in\nm{m}\n"


def test_ctrl_c_under_four_threads_detaches_every_run_and_the_rerun_reattaches(
    tmp_path: Path, host: SshHost, marker: str
) -> None:
    # On the host, where the runs go on while doit is gone; unsandboxed, as
    # the sandbox's private /tmp would hide the gate from the commands.
    gate = host.scratch / f"gate-{marker}"
    sweep = GATED_SWEEP.format(gate=str(gate), marker=marker)
    root = make_ssh_project(tmp_path, host, sweep, ["fit"], sandbox="none")
    proc = popen_doit(root, "-n", "4", "-P", "thread")
    try:
        try:
            wait_for(lambda: len(marked_pids(marker)) >= 4, "the four runs to be going on the host", 60)
        except pytest.fail.Exception:  # a step that failed leaves three going: say why
            pytest.fail(f"{len(marked_pids(marker))} of the four runs going on the host after 60 s; "
                        f"doit said:\n{popen_output(root)}")
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=30)
        took = time.monotonic() - started
    finally:
        stop(proc)
    said = popen_output(root)
    assert code != 0, said
    assert "Traceback" not in said, said
    assert said.count("detached from run fit-m") == 4, said
    assert len(marked_pids(marker)) >= 4, "the runs did not go on after doit detached"
    gate.touch()
    done = doit(root, "-n", "4", "-P", "thread", timeout=120)
    assert done.returncode == 0, show(done)
    assert "new run" not in done.stdout, show(done)  # reattached to the same four runs
    for m in range(4):
        assert (root / f"fit-{m}.txt").read_text() == f"{m}\n"
    assert run_count(root) == 4
    wait_for(lambda: not marked_pids(marker), "the runs to end on the host")
    assert took < 30  # bounded by the wait above; it detaches within seconds


LOG_SWAPPED = """
def task_step():
    yield from remote_step(
        "step", outputs=["out.txt"],
        command=["/bin/sh", "-c", "echo started; while :; do sleep 0.05; done", {marker!r}],
    )
"""


def test_a_run_whose_log_a_host_swaps_for_a_device_fails_with_a_message_and_goes(
    tmp_path: Path, host: SshHost, marker: str
) -> None:
    """A hostile host links the log to /dev/zero mid-run: the client reads
    none of it, the run fails naming the log, and nothing of it is left."""
    root = make_ssh_project(tmp_path, host, LOG_SWAPPED.format(marker=marker), ["step"], sandbox="none")
    proc = popen_doit(root)
    try:

        def logging() -> bool:
            runs = [h for h in live_handles(root) if h["backend_state"].get("remote_run_dir") is not None]
            log = remote_run_dir(runs[0]) / "run.log" if runs else None
            return log is not None and log.exists() and "started" in log.read_text()

        wait_for(logging, "the run to log")
        log = remote_run_dir(only_handle(root)) / "run.log"
        log.unlink()
        log.symlink_to("/dev/zero")
        code = wait_exit(proc, "the doit to end", 60)
    finally:
        stop(proc)
    said = popen_output(root)
    assert code == 1, said
    assert f"{log} on {host.address} is not a regular file" in said, said
    assert [r["state"] for r in compute_status(root)] == ["failed"]
    wait_for(lambda: not marked_pids(marker), "the run's processes to be gone")
    assert not remote_run_dir(only_handle(root)).exists()


# ------------------------------------------------- the host restarted

def test_a_host_restarted_under_a_killed_client_loses_the_run_and_the_rerun_launches_anew(
    tmp_path: Path, host: SshHost, marker: str
) -> None:
    # The gate outside the scratch folder, which the restart empties;
    # unsandboxed, as the sandbox would hide it.
    assert host.user_dir is not None
    gate = host.user_dir / f"gate-{marker}"
    body = GATED_STEP.format(gate=str(gate), marker=marker, resources={})
    root = make_ssh_project(tmp_path, host, body, sandbox="none", remote_root=str(host.scratch / "remote"))
    doit_killed_mid_run(root, marker)
    first = only_handle(root)
    try:
        reboot(host)  # its processes, network and scratch disk gone; back with the same key
        assert not marked_pids(marker) and not remote_run_dir(first).exists()
        gate.touch()
        done = doit(root, timeout=120)
        assert done.returncode == 0, show(done)
        said = f"run {first['run_id']} was lost (its remote folder is gone"
        assert said in done.stdout and "launching a new run" in done.stdout, show(done)
        assert "new run" in done.stdout and "reattaching" not in done.stdout, show(done)
        assert (root / "out.txt").read_text() == "made\n"
        assert run_count(root) == 2
        lost, second = compute_status(root)
        assert lost["run_id"] == first["run_id"] and lost["state"] == "lost", lost
        assert second["state"] == "succeeded", second
    finally:
        gate.unlink(missing_ok=True)
        for pid in control_master_pids(first):  # the killed client's, if its master outlived it
            kill_pid(pid)


def test_a_master_whose_connection_died_is_replaced_and_the_next_doit_works(
    tmp_path: Path, host: SshHost
) -> None:
    root = make_ssh_project(tmp_path, host, one_step(shell="echo made > out.txt", outputs=["out.txt"]),
                            sandbox="none")  # fmt: skip
    target = SshSettings.model_validate(ssh_settings(host)).target()
    # A master as a killed client leaves it (ControlPersist: it outlives its client).
    argv = [*target.ssh_argv(), target.host, "true"]
    started = subprocess.run(argv, capture_output=True, timeout=30, check=False)
    assert started.returncode == 0, started.stderr
    masters = marked_pids(Path(target.control_path()).name)
    assert masters, "no master"
    link = ["ip", "-n", str(host.netns), "link", "set", "eth0"]
    subprocess.run([*link, "down"], check=True)
    try:
        # The host forgets the connection while no packet can say so: the
        # master's connection is dead, and the master does not know it.
        sessions = descendants(host.pid)
        for pid in sessions:
            kill_pid(pid)
        subprocess.run(["ip", "netns", "exec", str(host.netns), "ss", "-K", "dst", str(host.peer_address)],
                       capture_output=True, check=True)  # fmt: skip
    finally:
        subprocess.run([*link, "up"], check=True)
    try:
        done = doit(root, timeout=120)
        assert done.returncode == 0, show(done)
        assert (root / "out.txt").read_text() == "made\n"
        assert not control_master_pids(only_handle(root)), describe(control_master_pids(only_handle(root)))
    finally:
        for pid in marked_pids(Path(target.control_path()).name):
            kill_pid(pid)


# ----------------------------------------- a host that changes its scripts

# control.py as a hostile host rewrote it: itself for every operation but
# `follow`, which prints without end (what made doit write 4 GiB and never end).
ENDLESS_FOLLOWER = (
    "import os, sys\n"
    "if sys.argv[1:2] == ['follow']:\n"
    "    while True:\n"
    "        sys.stdout.write('x' * 65536)\n"
    "real = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'real_control.py')\n"
    "exec(compile(open(real).read(), real, 'exec'))\n"
)
# Run once, by the first run's setup: the host edits the script it was sent
# (its copy of the real one kept outside the bin folder: a module beside the
# scripts is refused by name as well, and teardown removes it).
TAMPER = (
    'cd "$1"/bin-* && if [ ! -e ../real_control.py ]; then cp control.py ../real_control.py && '
    'printf %s "$2" > control.py; fi'
)
def test_a_host_that_rewrites_control_py_after_the_install_is_refused_as_damaged_and_teardown_repairs_it(
    tmp_path: Path, host: SshHost
) -> None:
    remote_root = host.scratch / f"damaged-{tmp_path.name}"
    body = one_step("step", command=["sh", "-c", "sleep 3; echo made > out.txt"], outputs=["out.txt"])
    root = make_ssh_project(tmp_path, host, body, remote_root=str(remote_root),
                            setup_commands=[f"sh -c {shlex.quote(TAMPER)} sh {remote_root} "
                                            f"{shlex.quote(ENDLESS_FOLLOWER)}"])  # fmt: skip
    proc = popen_doit(root)
    try:
        code, peak = wait_bounded(proc, root.parent / "doit.out")
    finally:
        stop(proc)
    said = popen_output(root)
    run_id = only_handle(root)["run_id"]
    assert code == 1, said
    assert peak < CLIENT_MEMORY_BOUND and len(said) < 1 << 20, (peak, len(said))
    assert f"control.py in {remote_root}/bin-" in said, said
    assert f"on {host.address} are not the ones this client installed" in said, said
    assert f"`substrax-compute teardown {run_id}`" in said, said
    assert f"step 'step': run {run_id}: the script(s) control.py" in said, said  # the run named once
    assert not (tmp_path / "proj" / "out.txt").exists()

    done = compute(root, "teardown", run_id)  # the fix the message names
    assert done.returncode == 0, show(done)
    assert not remote_run_dir(only_handle(root)).exists()
    installed = next(remote_root.glob("bin-*/control.py")).read_bytes()
    assert installed == (Path(__file__).resolve().parents[3] / "remote" / "control.py").read_bytes()
    doit_ok(root)  # the scripts put back: the next run is the host's as before
    assert (root / "out.txt").read_text() == "made\n"


def test_a_host_that_rewrites_control_py_while_the_run_is_followed_ends_doit_with_the_run_named_once(
    tmp_path: Path, host: SshHost, marker: str
) -> None:
    """The issue's case 3 as it was seen: the helper changed while doit
    follows the run. doit ends at once, bounded, with one message."""
    remote_root = host.scratch / f"followed-{tmp_path.name}"
    gate = host.scratch / f"gate-{tmp_path.name}"  # never made: the run waits until stopped
    body = GATED_STEP.format(gate=gate, marker=marker, resources="{}")
    root = make_ssh_project(tmp_path, host, body, remote_root=str(remote_root))
    proc = popen_doit(root)
    try:
        wait_for(lambda: marked_pids(marker), "the run's command to start", timeout=120)
        for control in remote_root.glob("bin-*/control.py"):
            control.write_text(ENDLESS_FOLLOWER.partition("real = ")[0])  # follow answers without end
        code, peak = wait_bounded(proc, root.parent / "doit.out")
    finally:
        stop(proc)
    said = popen_output(root)
    run_id = only_handle(root)["run_id"]
    assert code == 1 and peak < CLIENT_MEMORY_BOUND, said
    assert f"step 'step': run {run_id}: the script(s) control.py in {remote_root}/bin-" in said, said
    assert f"`substrax-compute teardown {run_id}`" in said, said
    torn = compute(root, "teardown", run_id)
    assert torn.returncode == 0, show(torn)
    wait_for(lambda: not marked_pids(marker), "the run's command to be stopped")


# ------------------------------------------- a worker killed without ending its run

LOST_STEP = """
def task_work():
    yield from remote_step("work", command={argv!r}, outputs=["out/result.txt"])
"""


@pytest.mark.parametrize("user", ["test-user", "root"])
def test_a_tree_left_by_a_killed_worker_on_the_host_is_stopped_by_the_next_doit_before_its_new_command(
    tmp_path: Path, request: pytest.FixtureRequest, marker: str, user: str
) -> None:
    """As on local (test_local_backend.py), on an ssh host with sandbox =
    "none": doit killed, then the worker on the host (by the pid its
    status.json gives), its command, a setsid grandchild and a child with
    no environment go on. The next doit stops them before its new command
    starts, and no cgroup of the run is left on the host. The test user can
    make no cgroup (none is delegated to it): its tree is found by the
    run's mark. Root, on a host on loopback (`ip netns exec` gives sshd a
    /sys with no cgroup v2 mounted), makes one: its tree is found by it."""
    with contextlib.ExitStack() as stack:
        if user == "test-user":
            target: SshHost = request.getfixturevalue("host")
        else:
            target = stack.enter_context(running_host(tmp_path / "sshd", netns=False))
        lost_tree_on(target, tmp_path, marker, user)


def remove_cgroup(path: Path) -> None:
    """Kill what is in a cgroup the test's run made, and remove it. Any
    worker starting meanwhile may remove it first (it sweeps the stale
    empty ones beside its own)."""

    def emptied() -> bool:
        try:
            return not (path / "cgroup.procs").read_text().strip()
        except FileNotFoundError:
            return True

    with contextlib.suppress(FileNotFoundError):
        (path / "cgroup.kill").write_text("1")
        wait_for(emptied, f"{path} to empty")
        path.rmdir()


def lost_tree_on(target: SshHost, tmp_path: Path, marker: str, user: str) -> None:
    flags = target.scratch / f"flags-{marker}"  # the command writes here, as the host's user
    write_command(flags)
    os.chown(flags, target.uid, -1)
    argv = step_argv(flags, marker, "out/result.txt", python=target.python)
    remote_root = target.scratch / f"remote-{marker}"
    root = make_ssh_project(tmp_path, target, LOST_STEP.format(argv=argv), ["work"], sandbox="none",
                            remote_root=str(remote_root))  # fmt: skip
    first = popen_doit(root)
    handle: dict[str, Any] | None = None
    made: object = None
    try:
        old = wait_tree_up(flags)
        stop(first)  # the client goes first, as the OOM killer may take it too
        handle = only_handle(root)
        record = remote_status(handle)
        assert record is not None, handle
        kill_worker(record)
        made = record.get("cgroup")
        if user == "root" and made is None:
            pytest.skip("NO CGROUP V2 COULD BE MADE ON THE HOST: the cgroup case is not tested over ssh")
        assert all(pid_alive(pid) for pid in old)  # the tree outlived its worker
        again = doit(root, timeout=120)
        assert again.returncode == 0, show(again)
        assert overlap(flags) == [], "the new command started while these of the old tree ran"
        assert not [pid for pid in old if pid_alive(pid)], describe(old)
        assert "was lost" in again.stdout and "stopped what was left of it" in again.stdout, show(again)
        assert (root / "out" / "result.txt").read_text() == "done\n"
        if isinstance(made, str):
            assert not Path(made).exists(), f"the run's cgroup {made} was left on the host"
        print(f"\n[lost tree on ssh, {user}] cgroup: {made}")
    finally:
        stop(first)
        kill_recorded(flags, marker)
        if isinstance(made, str) and Path(made).is_dir():  # left by a failure: emptied, then removed
            remove_cgroup(Path(made))
        shutil.rmtree(flags, ignore_errors=True)
        shutil.rmtree(remote_root, ignore_errors=True)
        for pid in control_master_pids(handle) if handle is not None else []:
            kill_pid(pid)


MAKES_24 = "mkdir -p out-{0} && for i in $(seq 24); do echo $i > out-{0}/$i; done; ls -A"
CHAIN_OF_THREE = f"""
def task_a():
    yield from remote_step("a", shell={MAKES_24.format("a")!r}, inputs=["data/in.txt"], outputs=["out-a/"])

def task_b():
    yield from remote_step("b", shell={MAKES_24.format("b")!r}, inputs=["data/in.txt"], outputs=["out-b/"],
                           task_dep=["a"])

def task_c():
    yield from remote_step("c", shell={MAKES_24.format("c")!r}, inputs=["data/in.txt"], outputs=["out-c/"],
                           task_dep=["b"])
"""


def test_each_step_uploads_its_view_only_not_the_earlier_steps_outputs(tmp_path: Path, host: SshHost) -> None:
    """A project outside git, three steps in a row: each uploads its
    declared inputs only (before, each upload held the outputs the steps
    before it had brought home: 217 -> 241 -> 265 files)."""
    root = make_ssh_project(tmp_path, host, CHAIN_OF_THREE, ["c"], files={"data/in.txt": "in\n"})
    assert not (root / ".git").exists()
    done = doit_ok(root)
    uploads = [int(n) for n in re.findall(r"^upload: (\d+) files, ", done.stderr, re.M)]
    assert uploads == [1, 1, 1], show(done)  # data/in.txt, each time
    for step in "abc":
        assert len(list((root / f"out-{step}").iterdir())) == 24
    # c's `ls -A` sees no earlier step's output
    assert "out-a" not in done.stdout.split("c: new run")[-1], show(done)
