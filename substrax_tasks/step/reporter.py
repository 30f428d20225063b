"""doit's console reporter, plus one closing line that says what happened:
"nothing to do: all 3 tasks up to date", "ran 1 of 3 tasks", or after a
Ctrl-C "interrupted: ran 2 of 6 tasks, 1 up to date, 3 not done".

It also tells console.SWEEP which remote steps this doit was asked to run,
for each step's place (`[5/14]`) in its start and end lines."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from doit.reporter import ConsoleReporter

from substrax_tasks.console import SWEEP, hold_streams, release_streams
from substrax_tasks.interrupts import INTERRUPTED
from substrax_tasks.step import doit_db

# The public task of a remote step carries this in its doit `meta`.
REMOTE_STEP = "substrax_remote_step"


def selected_closure(tasks: dict[str, Any], selected: list[str] | None) -> list[Any]:
    """The tasks doit may run for `selected`: those and every task they
    depend on (task_dep, with doit's implicit file_dep -> target ones, and
    setup), each once."""
    seen: dict[str, Any] = {}
    todo = list(tasks if selected is None else selected)
    while todo:
        name = todo.pop()
        task = tasks.get(name)
        if task is None or name in seen:
            continue
        seen[name] = task
        todo.extend(task.task_dep)
        todo.extend(task.setup_tasks)
    return list(seen.values())


def _counted(task: Any) -> bool:
    """A task the closing line counts: one with actions, not hidden."""
    return bool(task.actions) and not task.name.startswith("_")


class SummaryReporter(ConsoleReporter):  # type: ignore[misc]  # doit is untyped
    def __init__(self, outstream: Any, options: Any) -> None:
        super().__init__(outstream, options)
        self._lock = threading.Lock()  # doit -n N -P thread reports from threads
        self._ran: set[str] = set()
        self._up_to_date: set[str] = set()
        self._selected: list[Any] = []
        self._planned: Callable[[], list[Any]] | None = None

    def initialize(self, tasks: Any, selected_tasks: Any) -> None:
        def planned() -> list[Any]:
            if not self._selected:
                self._selected = selected_closure(tasks, selected_tasks)
            return self._selected

        hold_streams()  # before any action swaps sys.stdout (console.py)
        # Counted when a step first starts, or at the end of an interrupted
        # doit: a no-op walks nothing.
        self._planned = planned
        SWEEP.plan(lambda: sorted(t.name for t in planned() if (t.meta or {}).get(REMOTE_STEP)))

    def add_success(self, task: Any) -> None:
        # On success, not as it starts: a task cut by Ctrl-C did not run.
        super().add_success(task)
        if _counted(task):
            with self._lock:
                self._ran.add(task.name)

    def skip_uptodate(self, task: Any) -> None:
        super().skip_uptodate(task)
        if not task.name.startswith("_"):
            with self._lock:
                self._up_to_date.add(task.name)
            if task.meta and task.meta.get(REMOTE_STEP):
                SWEEP.passed(task.name)

    def complete_run(self) -> None:
        try:
            self._complete_run()
        finally:  # doit's tasks are not held past its run (see Sweep.forget)
            self._planned, self._selected = None, []
            SWEEP.forget()
            release_streams()

    def _complete_run(self) -> None:
        super().complete_run()
        if doit_db.save_failed() or doit_db.ended_failed():
            # doit saved no DB, or a teardown found the disk full (each said
            # why): exit status 1 once its teardowns have run, which this is called after.
            raise SystemExit(1)
        # A serial doit is called here as Ctrl-C's KeyboardInterrupt passes
        # through doit's `finally`; under threads the signal set INTERRUPTED.
        # Said: the exit status of a Ctrl-C, either way, without doit's traceback.
        if isinstance(sys.exc_info()[1], KeyboardInterrupt) or INTERRUPTED.is_set():
            self._interrupted()
            raise SystemExit(128 + signal.SIGINT)
        total = len(self._ran | self._up_to_date)
        if self.failures or self.runtime_errors or not total:
            return
        if not self._ran:
            self.write(f"nothing to do: all {total} tasks up to date\n")
        else:
            self.write(f"ran {len(self._ran)} of {total} tasks\n")

    def _interrupted(self) -> None:
        total = sum(map(_counted, self._planned())) if self._planned is not None else 0
        total = max(total, len(self._ran | self._up_to_date))
        ran, fresh = len(self._ran), len(self._up_to_date - self._ran)
        said = f"interrupted: ran {ran} of {total} tasks"
        if fresh:
            said += f", {fresh} up to date"
        said += f", {total - ran - fresh} not done\n"
        self.write(said)
