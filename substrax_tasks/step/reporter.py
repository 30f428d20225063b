"""doit's console reporter, plus one closing line that says what happened:
"nothing to do: all 3 tasks up to date" or "ran 1 of 3 tasks"."""

from __future__ import annotations

import threading
from typing import Any

from doit.reporter import ConsoleReporter

from substrax_tasks.step import doit_db


class SummaryReporter(ConsoleReporter):  # type: ignore[misc]  # doit is untyped
    def __init__(self, outstream: Any, options: Any) -> None:
        super().__init__(outstream, options)
        self._lock = threading.Lock()  # doit -n N -P thread reports from threads
        self._ran: set[str] = set()
        self._up_to_date: set[str] = set()

    def execute_task(self, task: Any) -> None:
        super().execute_task(task)
        if task.actions and not task.name.startswith("_"):
            with self._lock:
                self._ran.add(task.name)

    def skip_uptodate(self, task: Any) -> None:
        super().skip_uptodate(task)
        if not task.name.startswith("_"):
            with self._lock:
                self._up_to_date.add(task.name)

    def complete_run(self) -> None:
        super().complete_run()
        if doit_db.save_failed():
            # doit saved no DB (doit_db said why): exit status 1 once its
            # teardowns have run, which this is called after.
            raise SystemExit(1)
        total = len(self._ran | self._up_to_date)
        if self.failures or self.runtime_errors or not total:
            return
        if not self._ran:
            self.write(f"nothing to do: all {total} tasks up to date\n")
        else:
            self.write(f"ran {len(self._ran)} of {total} tasks\n")
