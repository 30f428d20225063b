"""A run whose machine is lost while its command runs, on the local backend
(`remote_step(..., preemptions=N)`), as a user drives it with `doit`: its
worker SIGKILLed (the run reads `lost`, as after a machine went away), the
run is relaunched on this machine and its command starts again from the
checkpoints it left, each attempt recorded in the handle; a command that
fails or times out is never relaunched; two steps under threads keep their
attempts apart; without a sandbox the lost attempt's tree is stopped before
the relaunch starts; a relaunch never runs on inputs edited since the run
started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from checkpoint_parts import COUNT_PY, count_step, kept_state, result_of, starts
from dodo_helpers import (
    DEFAULT_SANDBOX,
    DOIT,
    EXEC_WITH_DEFAULT_SIGNALS,
    SANDBOXES,
    clean_env,
    compute,
    doit,
    make_project,
    pid_alive,
    popen_doit,
    popen_output,
    run_dirs,
    runs_of,
    show,
    step_skipped,
    stop,
    wait_for,
    write_dodo,
    write_pyproject,
)
from lost_tree import (
    frozen,
    kill_recorded,
    kill_worker,
    overlap,
    recorded_pids,
    status_of,
    step_argv,
    wait_tree_up,
    write_command,
)
from progress import wait_exit

from substrax_tasks._remote import control
from substrax_tasks.cli.status_view import seconds_between

PAUSE = 0.3


def counting_project(tmp_path: Path, body: str, sandbox: str = DEFAULT_SANDBOX) -> Path:
    return make_project(tmp_path, "def task_all():\n" + body, sandbox=sandbox,
                        files={"count.py": COUNT_PY, "data.txt": "one\n"})  # fmt: skip


def counted(root: Path, step: str) -> int:
    """The count the step's checkpoint holds now: in the store (bound into
    the sandbox), or without a sandbox in the project, where the command
    writes it."""
    in_project = root / "ckpt" / "state.json"
    states: list[dict[str, Any]] = [kept_state(root, step) or {}]
    if in_project.exists():
        states.append(json.loads(in_project.read_text()))
    return max(int(state.get("i", 0)) for state in states)


def live_worker(root: Path, step: str) -> int | None:
    """The pid of the worker running `step`'s command now, if any."""
    for handle in runs_of(root, step):
        record = control.read_json(str(root / ".substrax" / "runs" / handle["run_id"] / "status.json")) or {}
        pid = record.get("worker_pid")
        if record.get("state") == "running" and isinstance(pid, int) and control.alive(
                pid, record.get("worker_start_ticks")):  # fmt: skip
            return pid
    return None


def kill_worker_once_counted(root: Path, step: str, at_least: int) -> int:
    """SIGKILL `step`'s worker once its checkpoint holds `at_least` counts
    (as a machine lost mid-run leaves it: no final status); the count kept."""
    wait_for(lambda: counted(root, step) >= at_least and live_worker(root, step),
             f"{step}'s worker and {at_least} counts checkpointed")  # fmt: skip
    pid = live_worker(root, step)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    return counted(root, step)


def attempts_of(root: Path, step: str) -> list[dict[str, Any]]:
    (handle,) = runs_of(root, step)
    attempts: list[dict[str, Any]] = handle["state"]["attempts"]
    return attempts


def attempt_logs(root: Path, step: str) -> list[str]:
    """The log of each attempt of the step's one run: the lost ones kept aside."""
    (handle,) = runs_of(root, step)
    folder = root / ".substrax" / "runs" / handle["run_id"]
    kept = sorted(folder.glob("attempt-*/run.log"))
    return [log.read_text() for log in [*kept, folder / "run.log"]]


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_a_killed_worker_is_relaunched_from_its_checkpoint(tmp_path: Path, sandbox: str) -> None:
    root = counting_project(tmp_path, count_step("count", 10, PAUSE, preemptions=1), sandbox)
    proc = popen_doit(root, "count")
    try:
        kept = kill_worker_once_counted(root, "count", 3)
        code = wait_exit(proc, "the doit to end", 120)
    finally:
        stop(proc)
    said = popen_output(root)
    assert code == 0, said
    run_id = runs_of(root, "count")[0]["run_id"]
    assert f"count: run {run_id}: attempt 1 lost its machine" in said, said
    assert "relaunching it, attempt 2 of at most 2" in said, said
    started = "starts from the checkpoints it last kept (1 file(s) left in its checkpoints folder)"
    assert started in said and "snapshot live" not in said, said
    first, second = attempt_logs(root, "count")
    assert starts(first) == [0], first
    # The second attempt started where the checkpoint was when the worker
    # died (a count the killed command made after the kill was read: none).
    (resumed,) = starts(second)
    assert resumed >= kept, (kept, second)
    reached, seen = result_of(root, "count")
    assert reached == 10 and seen == list(range(1, 11)), seen
    one, two = attempts_of(root, "count")
    assert (one["number"], one["outcome"]) == (1, "lost"), one
    assert "the worker stopped without recording an end" in one["message"], one
    assert one["started_at"] and one["ended_at"] and one["snapshot"] is None, one
    assert (two["number"], two["outcome"]) == (2, "succeeded"), two
    assert two["snapshot"] == "1 file(s) left in its checkpoints folder", two
    assert two["started_at"] and two["ended_at"], two
    assert one["machine"] == two["machine"] == os.uname().nodename

    status = compute(root, "status", run_id)
    assert status.returncode == 0, show(status)
    assert "attempt 1" in status.stdout and "lost" in status.stdout, show(status)
    from_kept = "from the checkpoints it last kept (1 file(s) left in its checkpoints folder)"
    assert "attempt 2" in status.stdout and from_kept in status.stdout, show(status)
    # The duration counts both attempts, as the cost counts both machines.
    ran = [seconds_between(a["started_at"], a["ended_at"]) or 0.0 for a in (one, two)]
    (row,) = [line for line in status.stdout.splitlines() if line.startswith(run_id)]
    assert " over 2 attempts" in row, show(status)
    shown = row.split(" over 2 attempts")[0].split()[-1]
    minutes, seconds = shown.split(":")
    # The two attempts' recorded times (the last as its worker reported it: a few tenths apart at most);
    # the first ran three counts of 0.3 s at least, so the last alone is further off than that.
    assert min(ran) > 0.85, ran
    assert abs(int(minutes) * 60 + float(seconds) - sum(ran)) < 0.8, (shown, ran)
    listed = compute(root, "status", run_id, "--json")
    (run,) = json.loads(listed.stdout)["runs"]
    assert [a["outcome"] for a in run["attempts"]] == ["lost", "succeeded"], run


def test_a_lost_run_without_preemptions_fails_saying_how_to_allow_them(tmp_path: Path) -> None:
    root = counting_project(tmp_path, count_step("count", 10, PAUSE))
    proc = popen_doit(root, "count")
    try:
        kill_worker_once_counted(root, "count", 2)
        code = wait_exit(proc, "the doit to end", 120)
    finally:
        stop(proc)
    said = popen_output(root)
    assert code == 1, said
    how = "its machine was lost while the command ran; remote_step('count', ..., preemptions=1) relaunches it"
    assert how in said, said
    assert "Traceback" not in said, said
    (attempt,) = attempts_of(root, "count")
    assert attempt["outcome"] == "lost", attempt


def test_a_command_that_exits_3_is_not_relaunched(tmp_path: Path) -> None:
    root = counting_project(tmp_path, count_step("count", 6, 0.01, "fail-fresh", preemptions=2))
    failed = doit(root, "count")
    assert failed.returncode == 1, show(failed)
    said = failed.stdout + failed.stderr
    assert "failed (exit code 3)" in said and "relaunching" not in said, show(failed)
    (attempt,) = attempts_of(root, "count")
    assert attempt["outcome"] == "failed", attempt


def test_a_timed_out_command_is_not_relaunched(tmp_path: Path) -> None:
    root = counting_project(tmp_path, count_step("count", 100, PAUSE, preemptions=2, timeout=1.5))
    failed = doit(root, "count")
    assert failed.returncode == 1, show(failed)
    said = failed.stdout + failed.stderr
    assert "timed_out" in said and "relaunching" not in said, show(failed)
    (attempt,) = attempts_of(root, "count")
    assert attempt["outcome"] == "timed_out", attempt


def test_the_timeout_bounds_the_command_over_all_its_attempts(tmp_path: Path) -> None:
    """Attempt 1 runs for a while and is lost; attempt 2 gets only what is
    left of the timeout, so it times out sooner than the timeout alone."""
    root = counting_project(tmp_path, count_step("count", 1000, PAUSE, preemptions=1, timeout=6))
    proc = popen_doit(root, "count")
    try:
        kill_worker_once_counted(root, "count", 6)  # about 2 s of the 6 spent
        code = wait_exit(proc, "the doit to end", 120)
    finally:
        stop(proc)
    said = popen_output(root)
    assert code == 1 and "timed_out" in said, said
    one, two = attempts_of(root, "count")
    assert (one["outcome"], two["outcome"]) == ("lost", "timed_out"), (one, two)
    (handle,) = runs_of(root, "count")
    job = json.loads((root / ".substrax" / "runs" / handle["run_id"] / "job.json").read_text())
    assert job["timeout"] <= 6 - 6 * PAUSE, job["timeout"]  # at least the six counts' time is spent


def test_two_steps_under_threads_keep_their_attempts_apart(tmp_path: Path) -> None:
    root = counting_project(tmp_path, count_step("a", 8, PAUSE, preemptions=1)
                            + count_step("b", 12, PAUSE, preemptions=1))  # fmt: skip
    proc = popen_doit(root, "-n", "2", "-P", "thread", "a", "b")
    try:
        kill_worker_once_counted(root, "a", 2)
        kill_worker_once_counted(root, "b", 3)
        code = wait_exit(proc, "the doit to end", 180)
    finally:
        stop(proc)
    said = popen_output(root)
    assert code == 0, said
    assert result_of(root, "a") == (8, list(range(1, 9)))
    assert result_of(root, "b") == (12, list(range(1, 13)))
    for step in ("a", "b"):
        assert [a["outcome"] for a in attempts_of(root, step)] == ["lost", "succeeded"], step
        (handle,) = runs_of(root, step)
        assert f"run {handle['run_id']}: attempt 1 lost its machine" in said, said
    a_runs, b_runs = runs_of(root, "a"), runs_of(root, "b")
    assert a_runs[0]["run_id"] != b_runs[0]["run_id"]


def test_preemptions_are_not_part_of_the_steps_key(tmp_path: Path) -> None:
    """As `retries`: allowing more relaunches changes nothing of the result."""
    root = counting_project(tmp_path, count_step("count", 2, 0.01))
    assert doit(root, "count").returncode == 0
    write_dodo(root, "def task_all():\n" + count_step("count", 2, 0.01, preemptions=3), ())
    again = doit(root, "count")
    assert again.returncode == 0 and step_skipped(again, "count"), show(again)
    why = compute(root, "why", "count")
    assert why.returncode == 0 and why.stdout.strip() == "count: up to date", show(why)


def test_an_input_edited_before_the_relaunch_is_refused_not_run_under_the_old_key(tmp_path: Path) -> None:
    """data.txt, a declared input, is edited while attempt 1 runs, then its
    worker is killed: attempt 2 would run on the new data.txt while its
    outputs would be promoted, recorded and kept in the cache under the key
    of the old one. It is refused with the file named and the fix; nothing
    is promoted or kept; the next doit runs the step on the files as they
    are now."""
    root = counting_project(tmp_path, count_step("count", 8, PAUSE, preemptions=1))
    write_pyproject(root, cache=f'[tool.substrax.compute.cache]\npath = "{tmp_path / "cache"}"\n')
    proc = popen_doit(root, "count")
    try:
        wait_for(lambda: counted(root, "count") >= 2, "two counts checkpointed")
        (root / "data.txt").write_text("two\n")
        kill_worker_once_counted(root, "count", 2)
        code = wait_exit(proc, "the doit to end", 120)
    finally:
        stop(proc)
    said = popen_output(root)
    assert code == 1, said
    (handle,) = runs_of(root, "count")
    assert (f"run {handle['run_id']} lost its machine and data.txt changed since the run started; "
            "attempt 2 would run on other files than its outputs would be kept for, so it is not relaunched. "
            "Run `doit count` again") in said, said  # fmt: skip
    assert "Traceback" not in said, said
    assert starts("\n".join(attempt_logs(root, "count"))) == [0], "attempt 2 started"
    assert not (root / "count.txt").exists()
    one, two = attempts_of(root, "count")
    assert (one["outcome"], two["outcome"], two["started_at"]) == ("lost", "cancelled", None), (one, two)
    cached = compute(root, "cache", "status")
    assert cached.returncode == 0 and ": 0 entries" in cached.stdout, show(cached)

    again = doit(root, "count")
    assert again.returncode == 0, show(again)
    assert result_of(root, "count")[0] == 8
    assert len(runs_of(root, "count")) == 2
    why = compute(root, "why", "count")
    assert why.returncode == 0 and why.stdout.strip() == "count: up to date", show(why)
    cached = compute(root, "cache", "status")
    assert cached.returncode == 0 and ": 1 entries" in cached.stdout, show(cached)


LOST_STEP = """
def task_work():
    yield from remote_step("work", command={argv!r}, outputs=["out/result.txt"], preemptions=1)
"""


def test_without_a_sandbox_the_lost_attempts_tree_is_stopped_before_the_relaunch_starts(
    tmp_path: Path, marker: str
) -> None:
    """sandbox = "none": the worker killed by SIGKILL while doit follows the
    run leaves its command, a grandchild that double-forked into a session
    of its own and a child with no environment running. The relaunch stops
    them all before attempt 2's command starts (which records any of them
    it finds alive), and neither attempt leaves its cgroup behind."""
    flags = tmp_path / "flags"
    write_command(flags)
    root = make_project(tmp_path, LOST_STEP.format(argv=step_argv(flags, marker, "out/result.txt")),
                        ["work"], sandbox="none")  # fmt: skip
    proc = popen_doit(root)
    try:
        old = wait_tree_up(flags)
        (run,) = run_dirs(root)
        first = status_of(root, run)
        kill_worker(first)
        code = wait_exit(proc, "the doit to end", 120)
    finally:
        stop(proc)
        kill_recorded(flags, marker)
    said = popen_output(root)
    assert code == 0, said
    assert "attempt 1 lost its machine" in said and "relaunching it, attempt 2 of at most 2" in said, said
    assert overlap(flags) == [], "attempt 2 started while these of attempt 1's tree ran"
    assert not [pid for pid in old if pid_alive(pid)], old
    assert (root / "out" / "result.txt").read_text() == "done\n"
    assert [a["outcome"] for a in attempts_of(root, "work")] == ["lost", "succeeded"]
    second = status_of(root, run)
    made = [c for c in (first.get("cgroup"), second.get("cgroup")) if isinstance(c, str)]
    assert not [c for c in made if Path(c).exists()], f"cgroups left: {made}"
    print(f"\n[relaunch without a sandbox] cgroups made: {made or 'none (no cgroup v2 here)'}")


# Four steps; each appends "start M"/"end M" to one shared file around its
# wait for the gate (appends are atomic: the file's order is the order the
# commands started and ended in). Unsandboxed: the stamps and the gate are
# outside the project.
FOUR_GATED = """
def task_fit():
    for m in range(4):
        yield from remote_step(
            f"fit:m{{m}}", outputs=[f"out-{{m}}.txt"], preemptions=1,
            command=["/bin/sh", "-c", f"echo start {{m}} >> {stamps}; "
                     f"while [ ! -e {gate} ]; do sleep 0.05; done; "
                     f"echo end {{m}} >> {stamps}; echo {{m}} > out-{{m}}.txt", {marker!r}],
        )
"""


def most_at_once(stamps: Path) -> int:
    """The most commands running at once. A step's start while it runs
    already is its relaunch, not one more: its lost attempt's command is
    stopped before the new one starts (test_without_a_sandbox_...), and
    killed it writes no end."""
    running: set[str] = set()
    most = 0
    for line in stamps.read_text().splitlines():
        what, step = line.split()
        if what == "start":
            running.add(step)
        else:
            running.discard(step)
        most = max(most, len(running))
    return most


def test_max_parallel_holds_through_a_relaunch_and_a_kill_9_of_doit_then_the_rerun(
    tmp_path: Path, marker: str
) -> None:
    """max_parallel = 2, four steps with preemptions=1 under `doit -n 4 -P
    thread`: two run, two wait. The worker of one running step is killed:
    its run, lost, keeps its slot while it is relaunched, and the two others
    wait on. Then the other running step's worker is killed, and doit with
    SIGKILL as that relaunch goes; the rerun picks up every run, and never
    more than two commands run at once."""
    root = tmp_path / "proj"
    root.mkdir()
    stamps, gate = tmp_path / "stamps.txt", tmp_path / "gate"
    stamps.touch()
    write_dodo(root, FOUR_GATED.format(stamps=stamps, gate=gate, marker=marker))
    write_pyproject(root, "none", "max_parallel = 2\n")
    first = popen_doit(root, "-n", "4", "-P", "thread", "fit")
    again = None
    try:
        wait_for(lambda: stamps.read_text().count("start") == 2 and popen_output(root).count(
            "waits for a free slot") == 2, "two steps to run and two to wait", timeout=120)  # fmt: skip
        one, other = (f"fit:m{line.split()[1]}" for line in stamps.read_text().splitlines())
        os.kill(live_worker(root, one) or 0, signal.SIGKILL)
        wait_for(lambda: stamps.read_text().count("start") >= 3 and live_worker(root, one),
                 f"{one}'s attempt 2 to start")  # fmt: skip
        # As a user looks meanwhile: two runs run, the relaunched one among them.
        status = compute(root, "status")
        assert status.returncode == 0 and status.stdout.count(" running ") == 2, show(status)
        assert most_at_once(stamps) <= 2, stamps.read_text()
        os.kill(live_worker(root, other) or 0, signal.SIGKILL)
        wait_for(lambda: popen_output(root).count("relaunching it, attempt 2 of at most 2") == 2,
                 f"{other}'s relaunch")  # fmt: skip
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        assert most_at_once(stamps) <= 2, stamps.read_text()
        again = popen_doit(root, "-n", "4", "-P", "thread", "fit")
        wait_for(lambda: popen_output(root).count("waits for a free slot") >= 2 or most_at_once(stamps) > 2,
                 "the rerun's slots", timeout=120)  # fmt: skip
        gate.touch()
        assert wait_exit(again, "the doit to end", 300) == 0, popen_output(root)
    finally:
        gate.touch()
        stop(first)
        if again is not None:
            stop(again)
    assert most_at_once(stamps) <= 2, stamps.read_text()
    for m in range(4):
        assert (root / f"out-{m}.txt").read_text() == f"{m}\n"


def test_a_lost_attempts_process_that_will_not_stop_keeps_the_relaunch_from_starting_beside_it(
    tmp_path: Path, marker: str
) -> None:
    """sandbox = "none", the worker killed: one process of the command's
    tree cannot be stopped (frozen: a SIGKILL waits until it thaws). The
    relaunch does not start attempt 2 beside it: the step fails naming the
    process. Once it is gone, the next doit stops what is left and runs the
    step anew, leaving no cgroup."""
    flags = tmp_path / "flags"
    write_command(flags)
    root = make_project(tmp_path, LOST_STEP.format(argv=step_argv(flags, marker, "out/result.txt")),
                        ["work"], sandbox="none")  # fmt: skip
    proc = popen_doit(root)
    try:
        old = wait_tree_up(flags)
        stuck = old[1]
        (run,) = run_dirs(root)
        with frozen(stuck, f"substrax-test-{marker}"):
            record = status_of(root, run)
            kill_worker(record)
            code = wait_exit(proc, "the doit to end", 120)
            started = recorded_pids(flags)
        wait_for(lambda: not pid_alive(stuck), "the thawed process to end by the SIGKILL it was sent")
        said = popen_output(root)
        assert code == 2, said
        assert f"process(es) of its command (pid {stuck}) did not stop" in said, said
        assert "Traceback" not in said, said
        assert len(started) == 3, "attempt 2 started beside the lost attempt's process"
        again = doit(root, timeout=120)
        assert again.returncode == 0, show(again)
        assert "was lost" in again.stdout and "stopped what was left of it" in again.stdout, show(again)
        assert overlap(flags) == [], "the new run started beside the lost one's tree"
        assert (root / "out" / "result.txt").read_text() == "done\n"
        made = record.get("cgroup")
        assert not (isinstance(made, str) and Path(made).exists()), f"its cgroup {made} was left"
    finally:
        stop(proc)
        kill_recorded(flags, marker)


# Two (fake) GPUs: `nvidia-smi -L` as the real one lists them.
FAKE_SMI = """#!/bin/sh
[ "$1" = "-L" ] || exit 2
echo "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-1d6e2b7a-0000-0000-0000-000000000000)"
echo "GPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-9a41c3f0-0000-0000-0000-000000000000)"
"""
# b, given one GPU, writes which, and the pids of a's first attempt (the
# first three recorded) it finds alive as it starts.
B_CHECKS = """
import os, sys
flags = sys.argv[1]
def alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
first = [int(line) for line in open(os.path.join(flags, "pids.txt")).read().split()][:3]
open(os.path.join(flags, "b-overlap.txt"), "w").write("".join("%d\\n" % p for p in first if alive(p)))
open("out_b/gpus.txt", "w").write(os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))
"""
GPU_STEPS = """
def task_a():
    yield from remote_step("a", command={argv!r}, outputs=["out_a/result.txt"],
                           resources={{"accelerators": "A100:2"}}, preemptions=1)

def task_b():
    yield from remote_step("b", command={b_argv!r}, outputs=["out_b/"],
                           resources={{"accelerators": "A100:1"}})
"""


def test_the_gpus_of_a_lost_attempts_tree_go_to_no_one_until_it_is_stopped(
    tmp_path: Path, marker: str
) -> None:
    """Without a sandbox, a (both GPUs, preemptions=1) has its worker
    killed while b, in another doit, waits for a GPU: the lost attempt's
    command and its descendants still run on them. Neither b nor a's
    attempt 2 is started on them while any of those lives: the relaunch
    stops them first, then b and attempt 2 take the GPUs in turn."""
    bin_dir, home = tmp_path / "fake-bin", tmp_path / "home"
    bin_dir.mkdir()
    home.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(home)}
    flags = tmp_path / "flags"
    write_command(flags)
    (flags / "b.py").write_text(B_CHECKS)
    body = GPU_STEPS.format(argv=step_argv(flags, marker, "out_a/result.txt"),
                            b_argv=[sys.executable, str(flags / "b.py"), str(flags), marker])  # fmt: skip
    root = make_project(tmp_path, body, sandbox="none")
    a = popen_doit(root, "a", env=env)
    b = None
    try:
        old = wait_tree_up(flags)
        (run,) = run_dirs(root)
        record = status_of(root, run)
        assert record["gpus"] == ["0", "1"], record
        with (tmp_path / "b.out").open("w") as out:
            argv = [sys.executable, "-c", EXEC_WITH_DEFAULT_SIGNALS, str(DOIT), "b"]
            b = subprocess.Popen(argv, cwd=root, env=clean_env(env), stdout=out, stderr=subprocess.STDOUT,
                                 text=True)  # fmt: skip
        wait_for(lambda: "waiting" in (tmp_path / "b.out").read_text(), "b to wait for a GPU")
        kill_worker(record)
        assert wait_exit(a, "doit a to end", 120) == 0, popen_output(root)
        assert wait_exit(b, "doit b to end", 120) == 0, (tmp_path / "b.out").read_text()
    finally:
        stop(a)
        if b is not None:
            stop(b)
        kill_recorded(flags, marker)
    assert overlap(flags) == [], "a's attempt 2 started on the GPUs while these of attempt 1 ran"
    assert (flags / "b-overlap.txt").read_text() == "", "b started on a GPU while a's attempt 1 ran"
    assert not [pid for pid in old if pid_alive(pid)], old
    assert (root / "out_b" / "gpus.txt").read_text() in ("0", "1")
    assert [a["outcome"] for a in attempts_of(root, "a")] == ["lost", "succeeded"]
