"""Load a project's dodo.py the way doit does, to find its remote steps."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from doit import doit_cmd
from doit.dependency import Dependency, SqliteDB
from doit.loader import get_module, load_tasks

from substrax_tasks.errors import SubstraxError
from substrax_tasks.run.step_driver import StepDriver
from substrax_tasks.step.tasks import DRIVERS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]


@contextlib.contextmanager
def _cwd(path: Path) -> Iterator[None]:
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


@dataclasses.dataclass(frozen=True)
class LoadedDodo:
    """A project's dodo file as loaded now: its remote steps' drivers, in
    the order declared, and doit's saved values of each (None for a step
    whose values cannot be known: no sqlite3 dependency file)."""

    file: Path
    drivers: dict[str, StepDriver]
    values: dict[str, dict[str, Any] | None]


def load_dodo(project: Path, dodo: Path | None = None) -> LoadedDodo:
    """Every remote step the project's dodo file declares now, and doit's
    saved values of each when doit's dependency file can be read (so `why`
    sees a `doit forget`). Loading declares tasks only: no signal handler or
    exit hook is installed."""
    dodo_file = (dodo or project / "dodo.py").resolve()
    if not dodo_file.is_file():
        raise SubstraxError(f"no dodo file at {dodo_file}; give one with --dodo FILE")
    if doit_cmd._CMDLINE_VARS is None:
        doit_cmd.reset_vars()  # get_var() gives its default, as under `doit` without NAME=VALUE
    # doit imports the file by its bare name ("dodo"): a module of that name
    # imported earlier in this process (another project's) would be taken
    sys.modules.pop(dodo_file.stem, None)
    with _cwd(dodo_file.parent):
        module = get_module(str(dodo_file), seek_parent=False)
        members = dict(inspect.getmembers(module))
        load_tasks(members, allow_delayed=False)
    root = str(project.resolve())
    drivers = {name: driver for (proj, name), driver in DRIVERS.items() if proj == root}
    values = _saved_values(dodo_file.parent, members.get("DOIT_CONFIG"), list(drivers))
    return LoadedDodo(dodo_file, drivers, values)


def find_step(project: Path, step: str, dodo: Path | None = None) -> tuple[StepDriver, dict[str, Any] | None]:
    """The driver of `step`, as declared by the project's dodo file now, and
    doit's saved values of the step (see load_dodo)."""
    loaded = load_dodo(project, dodo)
    driver = loaded.drivers.get(step)
    if driver is None:
        raise SubstraxError(
            f"{loaded.file} declares no remote step {step!r}; its remote steps: "
            f"{', '.join(sorted(loaded.drivers)) or 'none'}"
        )
    return driver, loaded.values[step]


def _saved_values(folder: Path, doit_config: Any, tasks: list[str]) -> dict[str, dict[str, Any] | None]:
    """doit's saved values of each of `tasks`, if its dependency file is an
    sqlite3 one that exists; None for each when they cannot be known."""
    unknown: dict[str, dict[str, Any] | None] = dict.fromkeys(tasks)
    settings: dict[str, Any] = dict(doit_table(folder))
    if isinstance(doit_config, dict):
        settings.update(doit_config)
    dep_file = folder / str(settings.get("dep_file", ".doit.db"))
    if settings.get("backend") not in ("sqlite3", "substrax-sqlite3") or not dep_file.is_file():
        return unknown
    try:
        dep = Dependency(SqliteDB, str(dep_file))
        try:
            return {task: dep.get_values(task) for task in tasks}
        finally:
            dep.backend._conn.close()  # read only: nothing to write back
    except Exception:  # noqa: BLE001 - an unreadable DB only means "unknown"
        return unknown


def doit_table(folder: Path) -> dict[str, Any]:
    """`[tool.doit]` of the pyproject.toml beside the dodo file."""
    path = folder / "pyproject.toml"
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    table = data.get("tool", {}).get("doit", {})
    return table if isinstance(table, dict) else {}
