"""The scenarios of tests/test_stamp_prefetch.py that drive the module as
a check does, each run by that test in a fresh interpreter: the child is
forked only in a process without other threads, and pytest's process has
some by then (paramiko's transports, SkyPilot's client pools).

Not collected by pytest (the name does not start with test_). Each
scenario takes a scratch folder and raises AssertionError when it fails.
"""

from __future__ import annotations

import os
import select
import threading
from pathlib import Path
from typing import Any

from doit.task import Task

from substrax_tasks import stamp_prefetch

STEPS = 5


class _Run:
    """Stands for doit's dependency manager: one object per doit run."""


def _steps(tmp_path: Path, count: int = STEPS) -> tuple[list[stamp_prefetch.OutputsJob], dict[str, Task]]:
    """`count` steps with a folder output of a few files each; their jobs
    and doit tasks."""
    root = str(tmp_path)
    jobs, tasks = [], {}
    for i in range(count):
        out = tmp_path / "out" / f"s{i}"
        (out / "sub").mkdir(parents=True)
        for j in range(3):
            (out / f"f{j}.txt").write_text(f"{i} {j}\n")
        (out / "sub" / "g.txt").write_text("g\n")
        jobs.append(stamp_prefetch.register(root, f"s{i}", [f"out/s{i}/"]))
        tasks[f"s{i}"] = Task(f"s{i}", None)
    return jobs, tasks


def _walked(tmp_path: Path, i: int) -> tuple[bytes, int]:
    return stamp_prefetch.walk(str(tmp_path), [f"out/s{i}/"])


def _child_done(prefetch: Any) -> None:
    """Wait until the child has exited (its pidfd turns readable), unreaped."""
    ready, _, _ = select.select([prefetch.pidfd], [], [], 30)
    assert ready, "the child did not finish its walk in 30 s"


def _first_check(
    jobs: list[stamp_prefetch.OutputsJob], tasks: dict[str, Task], state: tuple[_Run, dict[str, Task]]
) -> tuple[Any, int]:
    """The first check of a run, which forks the child; once the child has
    walked everything, the prefetch and how many stamps of the child's that
    check took (the child can get to its step first)."""
    stamp_prefetch.outputs_stamp(jobs[0], tasks["s0"], state)
    prefetch = stamp_prefetch._CURRENT
    assert prefetch is not None
    _child_done(prefetch)
    return prefetch, prefetch.used


def _reaped(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def the_childs_stamps_are_those_of_a_walk_in_line(tmp_path: Path) -> None:
    jobs, tasks = _steps(tmp_path)
    state = (_Run(), tasks)
    # the first check starts the child (and walks its own step, unless the
    # child got to it before this process claimed it)
    assert stamp_prefetch.outputs_stamp(jobs[0], tasks["s0"], state) == _walked(tmp_path, 0)
    prefetch = stamp_prefetch._CURRENT
    assert prefetch is not None
    _child_done(prefetch)
    first = prefetch.used
    for i in range(1, STEPS):
        assert stamp_prefetch.outputs_stamp(jobs[i], tasks[f"s{i}"], state) == _walked(tmp_path, i)
    assert prefetch.used == first + STEPS - 1  # every one after the first came from the child
    # every slot taken: the child is reaped and the pipe closed
    assert prefetch.closed
    assert _reaped(prefetch.pid)


def a_stamp_taken_twice_is_walked_again(tmp_path: Path) -> None:
    jobs, tasks = _steps(tmp_path)
    state = (_Run(), tasks)
    prefetch, first = _first_check(jobs, tasks, state)
    assert stamp_prefetch.outputs_stamp(jobs[3], tasks["s3"], state) == _walked(tmp_path, 3)
    assert prefetch.used == first + 1
    (tmp_path / "out" / "s3" / "f0.txt").write_text("changed since the first check\n")
    assert stamp_prefetch.outputs_stamp(jobs[3], tasks["s3"], state) == _walked(tmp_path, 3)
    assert prefetch.used == first + 1


def no_stamp_of_the_child_once_a_task_before_the_check_has_run(tmp_path: Path) -> None:
    jobs, tasks = _steps(tmp_path)
    tasks["prepare"] = Task("prepare", None)
    tasks["s4"].task_dep.append("s3")
    tasks["s3"].task_dep.append("prepare")  # s4 waits on prepare through s3
    state = (_Run(), tasks)
    prefetch, first = _first_check(jobs, tasks, state)
    prefetch._drain()
    seen_by_child = prefetch.stamps[jobs[4].slot]
    # `prepare` runs and rewrites an output of s4 after the child walked it
    tasks["prepare"].executed = True
    (tmp_path / "out" / "s4" / "f1.txt").write_text("rewritten by prepare, longer than before\n")
    now = _walked(tmp_path, 4)
    assert now != seen_by_child  # so the child's stamp would have hidden the change
    assert stamp_prefetch.outputs_stamp(jobs[4], tasks["s4"], state) == now
    # from then on every check walks in line, and the child is gone
    assert prefetch.closed
    assert _reaped(prefetch.pid)
    assert stamp_prefetch.outputs_stamp(jobs[1], tasks["s1"], state) == _walked(tmp_path, 1)
    assert prefetch.used == first


def no_child_while_another_thread_runs(tmp_path: Path) -> None:
    jobs, tasks = _steps(tmp_path)
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    run = (_Run(), tasks)
    try:
        assert stamp_prefetch.outputs_stamp(jobs[0], tasks["s0"], run) == _walked(tmp_path, 0)
        assert stamp_prefetch._CURRENT is None
    finally:
        release.set()
        other.join()
    # decided once a run: no child for its later checks either
    assert stamp_prefetch.outputs_stamp(jobs[1], tasks["s1"], run) == _walked(tmp_path, 1)
    assert stamp_prefetch._CURRENT is None


def each_doit_run_has_its_own_child(tmp_path: Path) -> None:
    """A second doit run in one process (a new dependency manager) must not
    take stamps walked for the first: the first child is reaped."""
    jobs, tasks = _steps(tmp_path)
    stamp_prefetch.outputs_stamp(jobs[0], tasks["s0"], (_Run(), tasks))
    first = stamp_prefetch._CURRENT
    assert first is not None
    _child_done(first)
    (tmp_path / "out" / "s2" / "new.txt").write_text("added between the runs\n")
    second_run = (_Run(), tasks)
    stamp_prefetch.outputs_stamp(jobs[0], tasks["s0"], second_run)
    assert first.closed
    assert _reaped(first.pid)
    second = stamp_prefetch._CURRENT
    assert second is not None
    assert second is not first
    _child_done(second)
    before = second.used
    assert stamp_prefetch.outputs_stamp(jobs[2], tasks["s2"], second_run) == _walked(tmp_path, 2)
    assert second.used == before + 1


def without_doits_state_it_walks_in_line(tmp_path: Path) -> None:
    jobs, _ = _steps(tmp_path)
    assert stamp_prefetch.outputs_stamp(jobs[2], None, None) == _walked(tmp_path, 2)
    assert stamp_prefetch._CURRENT is None


def closing_reaps_a_child_whatever_it_was_doing(tmp_path: Path) -> None:
    jobs, tasks = _steps(tmp_path, 40)
    stamp_prefetch.outputs_stamp(jobs[0], tasks["s0"], (_Run(), tasks))
    prefetch = stamp_prefetch._CURRENT
    assert prefetch is not None
    prefetch.close()  # at once: the child may be mid-walk
    assert _reaped(prefetch.pid)
    prefetch.close()  # twice is harmless


def a_step_declared_again_takes_no_stamp_walked_for_the_old_declaration(tmp_path: Path) -> None:
    jobs, tasks = _steps(tmp_path)
    state = (_Run(), tasks)
    prefetch, first = _first_check(jobs, tasks, state)
    # the dodo is loaded again in this process, s2 now with another output
    again = stamp_prefetch.register(str(tmp_path), "s2", ["out/s3/"])
    assert again.slot == jobs[2].slot
    assert stamp_prefetch.outputs_stamp(again, tasks["s2"], state) == _walked(tmp_path, 3)
    assert prefetch.used == first
