"""Checking the arguments a step is declared with, before any path in them
is looked at: each of a wrong type is named with what was expected and how
to write it in a dodo.py."""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Iterable, Mapping
from typing import Any

from substrax_tasks.errors import SpecError


def shown(value: object) -> str:
    """A wrongly typed argument as a message names it: "the string 'x'"."""
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, os.PathLike):
        return f"the path {os.fspath(value)!r}"
    if value is None or isinstance(value, bool):
        return str(value)
    if isinstance(value, numbers.Number):
        return f"the {type(value).__name__} {value!r}"
    return f"a {type(value).__name__}"


def literal(value: object) -> str:
    """`value` written as in a dodo.py, with the double quotes users type."""
    return json.dumps(value, ensure_ascii=False)


def _items(step: str, name: str, value: object, *, of: str, lone: tuple[type, ...],
           item_types: tuple[type, ...], example: str, each: str) -> list[Any]:
    """`value`, a list argument, as a list; a lone item (which iterating
    would take letter by letter) or another type is a SpecError that shows
    how to write it."""
    if isinstance(value, lone):
        fix = literal(os.fspath(value) if isinstance(value, os.PathLike) else value)
    elif isinstance(value, (bytes, Mapping)) or not isinstance(value, Iterable):
        fix = example
    else:
        items = list(value)
        for item in items:
            if not isinstance(item, item_types):
                raise SpecError(
                    f"step {step!r}: {name} must be a list of {of}, but it holds {shown(item)}: {each}"
                )
        return items
    raise SpecError(f"step {step!r}: {name} must be a list of {of}, got {shown(value)}: write {name}=[{fix}]")


def path_list(step: str, name: str, value: object) -> list[str | os.PathLike[str]]:
    """`value`, an argument that holds paths (inputs, outputs, file_dep)."""
    return _items(step, name, value, of="paths", lone=(str, os.PathLike), item_types=(str, os.PathLike),
                  example='"data/in.csv", "models/"', each="give each path as a str or a pathlib.Path")


def name_list(step: str, name: str, value: object, example: str) -> list[str]:
    """`value`, an argument that holds names (secrets, task_dep)."""
    return _items(step, name, value, of="names", lone=(str,), item_types=(str,),
                  example=literal(example), each="give each name as a string")


def argv_of(step: str, command: object) -> list[str]:
    """The command as a list of str, each item checked."""
    if isinstance(command, str):
        import shlex  # here: only this message needs it, never a no-op

        try:
            words = shlex.split(command)
        except ValueError:  # unbalanced quotes: show the plain split
            words = command.split()
        raise SpecError(
            f"step {step!r}: command must be a non-empty list of arguments, got {shown(command)}: "
            f"write command={literal(words)}, or shell={literal(command)} for a shell command line"
        )
    if isinstance(command, (bytes, Mapping)) or not isinstance(command, Iterable):
        raise SpecError(
            f"step {step!r}: command must be a non-empty list of arguments, got {shown(command)}: "
            'write command=["python", "train.py"]'
        )
    items = list(command)
    if not items:
        raise SpecError(
            f"step {step!r}: command must be a non-empty list of arguments, got an empty "
            f'{type(command).__name__}: write command=["python", "train.py"]'
        )
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (str, int, os.PathLike)):
            raise SpecError(
                f"step {step!r}: command item {item!r} is a {type(item).__name__}; "
                "use str, int or pathlib.Path"
            )
    return [os.fspath(item) if isinstance(item, os.PathLike) else str(item) for item in items]


def seconds_of(step: str, timeout: object) -> float | None:
    """The timeout, a positive finite number of seconds, kept as given (an
    int stays an int: the spec's digest must not change) or made a plain
    int or float from another number type (numpy's)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        try:
            number = float(timeout) if isinstance(timeout, str) else math.nan
        except ValueError:
            number = math.nan
        fix = (f"timeout={int(number) if number.is_integer() else number}" if math.isfinite(number)
               else "timeout=3600 (seconds)")  # fmt: skip
        raise SpecError(
            f"step {step!r}: timeout must be a number of seconds, got {shown(timeout)}: write {fix}"
        )
    value = timeout if isinstance(timeout, (int, float)) else (
        int(timeout) if isinstance(timeout, numbers.Integral) else float(timeout))  # fmt: skip
    if not (value > 0 and math.isfinite(value)):
        raise SpecError(f"step {step!r}: timeout must be a positive number of seconds, got {timeout}")
    return value


def max_cost_of(step: str, max_cost: object) -> float | None:
    """remote_step's max_cost: a positive finite number of USD, or None
    (the backend's setting holds)."""
    if max_cost is None:
        return None
    number = isinstance(max_cost, numbers.Real) and not isinstance(max_cost, bool)
    value = float(max_cost) if number else math.nan  # type: ignore[arg-type]
    if not (value > 0 and math.isfinite(value)):
        raise SpecError(
            f"step {step!r}: max_cost must be a positive number of US dollars, got {shown(max_cost)}: "
            "write max_cost=5.0 (or leave it out to use the backend's max_cost setting)"
        )
    return value


def env_of(step: str, env: object) -> dict[str, str]:
    """The step's env, a mapping of names to strings, or a SpecError."""
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        # ["A=1", "B=2"] is shown as the mapping it meant.
        items = [env] if isinstance(env, str) else list(env) if isinstance(env, (list, tuple)) else []
        pairs = [item.partition("=") for item in items if isinstance(item, str)]
        meant = len(pairs) == len(items) > 0 and all(eq for _k, eq, _v in pairs)
        hint = {k: v for k, _eq, v in pairs} if meant else {"NAME": "value"}
        raise SpecError(
            f"step {step!r}: env must be a mapping of variable names to strings, got {shown(env)}: "
            f"write env={literal(hint)}"
        )
    checked: dict[str, str] = {}
    for key, value in env.items():
        if not isinstance(key, str):
            raise SpecError(f"step {step!r}: env names must be strings, got {shown(key)}")
        if not isinstance(value, str):
            raise SpecError(
                f"step {step!r}: env[{key!r}] must be a string, got {shown(value)}: "
                f"write env={{{literal(key)}: {literal(str(value))}, ...}}"
            )
        checked[key] = value
    return checked


def check_doit_arguments(name: str, *, backend: object, shell: object, retries: object, preemptions: object,
                          uptodate: object, project: object) -> None:
    """The arguments make_spec does not see, each of the type documented."""
    if backend is not None and not isinstance(backend, str):
        raise SpecError(
            f"step {name!r}: backend must be a backend's name or None, got {shown(backend)}: "
            'write backend="local" (or "ssh", "skypilot")'
        )
    if shell is not None and not isinstance(shell, str):
        raise SpecError(
            f"step {name!r}: shell must be one command line (a string), got {shown(shell)}: "
            'write shell="python train.py > log.txt", or command=[...] for an argv'
        )
    check_count(name, "retries", retries, 2)
    check_count(name, "preemptions", preemptions, 1)
    if isinstance(uptodate, (str, bytes, Mapping)) or not isinstance(uptodate, Iterable):
        raise SpecError(
            f"step {name!r}: uptodate must be a list (doit's uptodate items), got {shown(uptodate)}: "
            f"write uptodate=[{uptodate!r}]"
        )
    if project is not None and not isinstance(project, (str, os.PathLike)):
        raise SpecError(
            f"step {name!r}: project must be a folder (a str or pathlib.Path) or None, "
            f"got {shown(project)}"
        )


def check_count(name: str, argument: str, value: object, example: int) -> None:
    """`argument` (retries, preemptions) is a whole number, 0 or more."""
    if isinstance(value, bool) or not isinstance(value, int):
        number = value.strip() if isinstance(value, str) else ""
        fix = f"{argument}={number}" if number.isdigit() else f"{argument}={example}"
        raise SpecError(f"step {name!r}: {argument} must be a whole number, got {shown(value)}: write {fix}")
    if value < 0:
        raise SpecError(f"step {name!r}: {argument} must be 0 or more, got {value}")
