"""`[tool.substrax.compute]`: read from pyproject.toml, the SUBSTRAX_CONFIG
overlay and SUBSTRAX_BACKEND, and where the resolution a no-op `doit` uses
is cached (read and written by runs.Project.open).

A dodo file is loaded on every `doit`, and each remote step needs its
backend's validated settings for its up-to-date key. Validating (settings.py)
means importing pydantic, which was most of a no-op run's own cost. So the
validated result is kept in a small JSON file, valid while pyproject.toml,
the overlay, SUBSTRAX_BACKEND, $HOME and this package's version are
unchanged. This module therefore imports settings.py only where it validates.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from substrax_tasks import __version__
from substrax_tasks.constants import BACKEND_ENV, CACHE_FOLDER, CONFIG_ENV, SUBSTRAX_TABLES, TABLE
from substrax_tasks.errors import ConfigError, not_valid_toml
from substrax_tasks.private import private_path

# Which copy of the package validated a configuration: its version and where
# it is installed. Two working trees of the project share a version string
# (a release bumps it, a checkout does not) but never a folder, so one tree's
# cached settings are never handed to the other's code (an A/B of two commits).
RELEASE = (__version__, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # noqa: PTH100, PTH120

if TYPE_CHECKING:
    from substrax_tasks.config.settings import ComputeConfig



def read_toml(path: Path) -> dict[str, Any]:
    """A TOML file's contents ({} when absent)."""
    # here, not at the top: a no-op doit reads the cache below, not TOML
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.10 only
        import tomli as tomllib

    if not path.is_file():
        return {}
    try:
        data: dict[str, Any] = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(not_valid_toml(path, exc)) from None
    return data


def read_table(path: Path) -> dict[str, Any]:
    """`[tool.substrax.compute]` of one TOML file ({} when absent). What
    else is under [tool.substrax], or a [tool.*] table spelled close to it,
    is refused: a mistyped table would otherwise be ignored without a word."""
    tool = read_toml(path).get("tool", {})
    if not isinstance(tool, dict):
        return {}
    if "substrax" not in tool:
        import difflib  # here: only a config being validated needs it, never a no-op

        near = difflib.get_close_matches("substrax", list(tool), n=1, cutoff=0.75)
        if near:
            raise ConfigError(
                f"{path}: [tool.{near[0]}] is not a table substrax reads; did you mean [tool.substrax]?"
            )
        return {}
    ours = tool["substrax"]
    if not isinstance(ours, dict):
        raise ConfigError(f"{path}: tool.substrax must be a table, as [{TABLE}]")
    unknown = sorted(set(ours) - set(SUBSTRAX_TABLES))
    if unknown:  # each named: fixing one should not reveal the next
        problems = [_unknown_under_substrax(name, ours[name]) for name in unknown]
        raise ConfigError(f"{path}: " + "; ".join(problems))
    table = ours.get(TABLE.rsplit(".", 1)[1], {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [{TABLE}] must be a table")
    return table


def _unknown_under_substrax(name: str, value: Any) -> str:
    """What to say of `name` under [tool.substrax], which holds tables only."""
    tables = ", ".join(f"[tool.substrax.{t}]" for t in SUBSTRAX_TABLES)
    if isinstance(value, dict):
        import difflib

        near = difflib.get_close_matches(name, SUBSTRAX_TABLES, n=1, cutoff=0.6)
        guess = f"did you mean [tool.substrax.{near[0]}]? " if near else ""
        return f"[tool.substrax.{name}] is not a table substrax reads; {guess}its tables: {tables}"
    return f"{name} directly under [tool.substrax] is not read; did you mean {name} under [{TABLE}]?"


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` laid on `base`, table by table."""
    result = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merged(result[key], value)
        else:
            result[key] = value
    return result


def read_pyproject_table(project: Path) -> dict[str, Any]:
    """The project's table with the SUBSTRAX_CONFIG overlay laid over it."""
    table = read_table(project / "pyproject.toml")
    overlay = os.environ.get(CONFIG_ENV)
    if overlay:
        extra = Path(overlay)
        if not extra.is_file():
            raise ConfigError(f"{CONFIG_ENV}={overlay}: no such file; point it at a TOML file or unset it")
        table = merged(table, read_table(extra))
    return table


def find_project(start: Path) -> Path:
    """The project `start` is in: the nearest folder, `start` or above it,
    that holds a dodo.py or a pyproject.toml with a [tool.substrax] table;
    `start` itself when none does, up to the filesystem root. As git finds
    its repository from a subfolder (doit itself looks only in the current
    folder). A pyproject.toml without that table is passed over: a package
    inside the project may have one of its own."""
    start = start.resolve()
    for folder in (start, *start.parents):
        if (folder / "dodo.py").is_file():
            return folder
        pyproject = folder / "pyproject.toml"
        if pyproject.is_file():
            try:
                tool = read_toml(pyproject).get("tool")
            except ConfigError as exc:
                raise ConfigError(f"{exc}, or name the project with --project DIR") from None
            if isinstance(tool, dict) and "substrax" in tool:
                return folder
    return start


def load_config(project: Path) -> ComputeConfig:
    """Read and validate the project's configuration (embedded defaults when absent)."""
    from substrax_tasks.config.settings import validate

    return validate(read_pyproject_table(project), project, os.environ.get(BACKEND_ENV))


def _file_stamp(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)  # noqa: PTH116 - a str: this runs for every step of every doit
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def config_key(root: Path) -> tuple[Any, ...]:
    """Everything the validated configuration depends on, hashable."""
    overlay = os.environ.get(CONFIG_ENV)
    text = str(root)
    return (
        RELEASE,
        text,
        _file_stamp(f"{text}/pyproject.toml"),
        overlay,
        _file_stamp(overlay) if overlay else None,
        os.environ.get(BACKEND_ENV),
        os.environ.get("HOME"),  # `~` in settings paths
    )


def config_stamp(root: Path, key: tuple[Any, ...] | None = None) -> list[Any]:
    """`config_key` as the cache file keeps it (JSON: lists, not tuples)."""
    return json.loads(json.dumps(config_key(root) if key is None else key))  # type: ignore[no-any-return]


def cache_file(root: Path) -> Path:
    # Outside the project: its state_dir is itself part of what is cached.
    # A private folder (_private.py): a cache someone else could write would
    # let them choose where our run records go.
    folder = private_path(CACHE_FOLDER)
    return folder / f"config-{hashlib.sha256(str(root).encode()).hexdigest()[:16]}.json"
