"""The CLI's commands and their arguments written as data: one
`add_argument` call as an `Arg`, one subcommand as a `command(...)` call."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from substrax_tasks.store.project import Project

Arg = tuple[tuple[str, ...], dict[str, Any]]
Command = Callable[["Project", argparse.Namespace, "Console", "Console"], int]


def arg(*flags: str, **options: Any) -> Arg:
    """One add_argument call of a command, as data."""
    return flags, options


def flag(*flags: str, help: str) -> Arg:
    return arg(*flags, action="store_true", help=help)


def command(commands: Any, name: str, func: Command, summary: str, description: str,
            *args: Arg) -> argparse.ArgumentParser:  # fmt: skip
    """A subcommand that `func` runs: `summary` in the program's help,
    `description` in its own."""
    parser: argparse.ArgumentParser = commands.add_parser(name, help=summary, description=description)
    for flags, options in args:
        parser.add_argument(*flags, **options)
    parser.set_defaults(func=func, parser=parser)
    return parser
