"""substrax-tasks: doit steps that run here, on an SSH host or on a cloud GPU."""

from __future__ import annotations

__version__ = "0.1.0"

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from substrax_tasks.step.tasks import remote_step

__all__ = ["__version__", "doit_config", "remote_step"]


def doit_config(**overrides: Any) -> dict[str, Any]:
    """A DOIT_CONFIG for dodo files with remote steps: the sqlite3 DB (dbm
    is lossy on some builds and json was corrupted by kills; doit's own,
    which on a full disk says so, see doit_db.py), plus yours.
    Set default_tasks: plain `doit` otherwise runs every task. The reporter
    adds a closing line saying how many tasks ran."""
    from substrax_tasks.step.reporter import SummaryReporter

    return {"dep_file": ".doit.db", "backend": "substrax-sqlite3", "reporter": SummaryReporter, **overrides}


def __getattr__(name: str) -> Any:
    # Lazy, so that the CLI does not import doit and the chain to print a table.
    if name == "remote_step":
        from substrax_tasks.step.tasks import remote_step

        return remote_step
    raise AttributeError(f"module 'substrax_tasks' has no attribute {name!r}")
