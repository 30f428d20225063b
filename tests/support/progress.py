"""Deadlines that follow progress (a plugin of tests/conftest.py).

A test's wait fails after its timeout *without progress*, not after a fixed
wall clock: on a machine loaded ten times over (a CI runner, a second
`make test` beside this one) a run that takes 35 s alone takes minutes, and
a fixed deadline fails it although it moves all along. What moves is seen
in the test's folder (its tmp_path: the project, its run records, logs and
snapshots, doit's output beside it, the run cache): while anything there
changes, the deadline moves on; once nothing has changed for the whole
timeout, the wait fails as soon as it would on a quiet machine. Both the
tests' waits (`wait_for`) and pytest-timeout's per-test timeout follow it.
A run that moves forever (an endless log) still ends: after STRETCH times
the timeout in all.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

# The most a deadline is moved on: a wait of 30 s fails after 30 s with no
# progress, or after 30 s x STRETCH whatever moves (a log written forever).
STRETCH = 10
POLL = 0.02  # seconds between two looks at a wait's condition
WAIT = 30.0  # a wait's default timeout: seconds with no progress

# The test this process runs now (xdist runs one at a time per worker).
_running: list[pytest.Item] = []
# The state of a test's folder as its call begins, for its timeout's first look.
_AT_CALL = pytest.StashKey[object]()


def pytest_runtest_setup(item: pytest.Item) -> None:
    _running[:] = [item]


def pytest_runtest_call(item: pytest.Item) -> None:
    folder = _test_folder(item)
    item.stash[_AT_CALL] = None if folder is None else folder_state(folder)


def pytest_runtest_teardown(item: pytest.Item) -> None:
    _running.clear()


def folder_state(folder: Path) -> tuple[int, int, int]:
    """What changes while a run goes on in `folder`: how many entries it
    holds, their sizes summed and the newest change time (symlinks are not
    followed; entries that go while it looks are skipped)."""
    count = size = newest = 0
    for top, folders, files in os.walk(folder):
        for name in folders + files:
            try:
                info = os.lstat(os.path.join(top, name))
            except OSError:
                continue
            count += 1
            size += info.st_size
            newest = max(newest, info.st_mtime_ns, info.st_ctime_ns)
    return count, size, newest


def _test_folder(item: pytest.Item | None) -> Path | None:
    funcargs: dict[str, Any] = getattr(item, "funcargs", {})
    folder = funcargs.get("tmp_path")
    return folder if isinstance(folder, Path) else None


def running_test_state() -> object:
    """The state of the running test's tmp_path (None outside a test)."""
    folder = _test_folder(_running[0] if _running else None)
    return None if folder is None else folder_state(folder)


def wait_for(
    condition: Callable[[], object],
    what: str,
    timeout: float = WAIT,
    progress: Callable[[], object] | None = None,
) -> None:
    """Poll `condition` until it holds. Fails once `timeout` seconds passed
    in which `progress()` (by default the state of the test's tmp_path) did
    not change, or STRETCH x `timeout` in all."""
    watch = progress or running_test_state
    began = time.monotonic()
    seen = watch()
    deadline = began + timeout
    while not condition():
        now = time.monotonic()
        if now > deadline:
            state = watch()
            if state == seen:
                pytest.fail(f"waited {now - began:.0f} s for {what}; nothing moved in the last {timeout:g} s")
            if now - began > timeout * STRETCH:
                pytest.fail(f"waited {now - began:.0f} s for {what}, though its run moved all along")
            seen, deadline = state, now + timeout
        time.sleep(POLL)


def wait_exit(
    proc: subprocess.Popen[Any],
    what: str,
    timeout: float = WAIT,
    progress: Callable[[], object] | None = None,
) -> int:
    """Wait for a process this test started to end, as `wait_for` waits; its exit code."""
    wait_for(lambda: proc.poll() is not None, what, timeout, progress)
    return proc.returncode


# ------------------------------------------------------- pytest-timeout


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """pytest-timeout's per-test timeout (pyproject's `timeout`) as a
    deadline that follows progress: when it expires while the test's folder
    changed since the last look, it is set again; it fails the test (through
    pytest-timeout's own handler: stacks dumped, the test failed) once a
    whole timeout passed with no change, or STRETCH timeouts in all. Only
    the signal method is followed; the thread method stays pytest-timeout's."""
    if settings.method != "signal" or threading.current_thread() is not threading.main_thread():
        return None
    import pytest_timeout  # the plugin is loaded when this hook is called

    began = time.monotonic()
    # None until the test's call begins (its folder is made in its set-up);
    # after that the state it then had, and then the one of the last look.
    seen: list[object] = [None]

    def expired(signum: int, frame: FrameType | None) -> None:
        __tracebackhide__ = True
        folder = _test_folder(item)
        if seen[0] is None:
            seen[0] = item.stash.get(_AT_CALL, None)
        state = None if folder is None or not folder.exists() else folder_state(folder)
        if state is not None and state != seen[0] and time.monotonic() - began < settings.timeout * STRETCH:
            seen[0] = state
            signal.setitimer(signal.ITIMER_REAL, settings.timeout)
            return
        pytest_timeout.timeout_sigalrm(item, settings)

    def cancel() -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)

    item.cancel_timeout = cancel  # type: ignore[attr-defined]  # read by pytest-timeout's cancel hook
    signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, settings.timeout)
    return True


def run(
    argv: Sequence[str],
    *,
    timeout: float,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    progress: Callable[[], object] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(argv, capture_output=True, text=True)` whose timeout
    follows progress as `wait_for`'s does: the process is killed and
    TimeoutExpired raised once `timeout` seconds passed with nothing moving
    in the test's folder (or of `progress()`), or STRETCH x `timeout` in all."""
    watch = progress or running_test_state
    began = time.monotonic()
    seen = watch()
    with subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        while True:
            try:
                out, err = proc.communicate(timeout=timeout)
                break
            except subprocess.TimeoutExpired:
                state = watch()
                if state == seen or time.monotonic() - began > timeout * STRETCH:
                    proc.kill()
                    proc.communicate()
                    raise
                seen = state  # it moved: communicate again (Popen keeps what it read so far)
    return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
