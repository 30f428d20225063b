"""The unit tier's guard (a plugin of tests/conftest.py): a test marked
`unit` that starts a process or reaches a network fails, even when it
catches the error. Not collected by pytest (the name does not start with
test_)."""

from __future__ import annotations

import _posixsubprocess  # subprocess forks through it
import contextlib
import os
import socket
import subprocess
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

# What a test marked `unit` may not do: start a process or reach a network.
# subprocess, multiprocessing and pty all end in one of these calls. Which
# tests are unit is found, not guessed: mark them all, run `pytest -m unit`,
# and drop the marker of each test that fails.
_SPAWNERS: tuple[tuple[object, str], ...] = (
    (subprocess.Popen, "_execute_child"),
    (_posixsubprocess, "fork_exec"),
    (os, "fork"),
    (os, "forkpty"),
    (os, "posix_spawn"),
    (os, "posix_spawnp"),
    (os, "system"),
)
_NETWORK: tuple[tuple[object, str], ...] = (
    (socket.socket, "connect"),
    (socket.socket, "connect_ex"),
    (socket.socket, "sendto"),
    (socket, "getaddrinfo"),
)


class UnitTierViolation(RuntimeError):
    """A test marked `unit` started a process or opened a connection."""


_TRIED = pytest.StashKey[list[str]]()


@contextlib.contextmanager
def _unit_guard(item: pytest.Item) -> Iterator[None]:
    """For a test marked `unit`: the calls above raise, and are noted."""
    if item.get_closest_marker("unit") is None:
        yield
        return
    tried = item.stash.setdefault(_TRIED, [])

    def refuse(what: str) -> Callable[..., Any]:
        def refused(*args: object, **kwargs: object) -> Any:
            message = (
                f"{item.nodeid} is marked unit (no processes, no network) "
                f"but called {what}; drop the marker or the call"
            )
            tried.append(message)
            raise UnitTierViolation(message)

        return refused

    patch = pytest.MonkeyPatch()
    try:
        for owner, name in _SPAWNERS + _NETWORK:
            if hasattr(owner, name):
                label = getattr(owner, "__name__", type(owner).__name__)
                patch.setattr(owner, name, refuse(f"{label}.{name}"))
        yield
    finally:
        patch.undo()


TESTS = Path(__file__).resolve().parents[1]  # the repository's tests/
UNIT_FOLDER = TESTS / "unit"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The unit tier is a folder: every test in tests/unit/ is guarded as
    `unit`, and a test marked `unit` elsewhere in tests/ is refused, so that
    `pytest tests/unit` runs the whole tier and nothing else."""
    misplaced = []
    for item in items:
        path = Path(item.path).resolve()
        if not path.is_relative_to(TESTS):
            continue  # a session the tests start in a folder of their own
        in_unit = path.is_relative_to(UNIT_FOLDER)
        if in_unit and item.get_closest_marker("unit") is None:
            item.add_marker(pytest.mark.unit)
        elif not in_unit and item.get_closest_marker("unit") is not None:
            misplaced.append(item.nodeid)
    if misplaced:
        raise pytest.UsageError(
            "tests marked unit live in tests/unit/; move these there: " + ", ".join(misplaced)
        )


# The guard covers a unit test's setup (a module or session fixture made for
# it counts too) and its call; not its teardown, which may stop what another
# test's fixture started.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    with _unit_guard(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    with _unit_guard(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A unit test that caught the guard's error still fails."""
    report = yield
    tried = item.stash.get(_TRIED, [])
    if tried and report.when in ("setup", "call") and report.passed:
        report.outcome = "failed"
        report.longrepr = tried[0]
    return report
