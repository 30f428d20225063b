"""Signals while doit runs tasks: SIGTERM/SIGHUP as KeyboardInterrupt, and
a start that a signal cannot cut in half."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from substrax_tasks.errors import StartLater

_T = TypeVar("_T")
START_LATER_SECONDS = 1.0  # how often a run that must wait (its GPUs are held) tries to start again

# Set by a signal that came while steps ran in doit's worker threads
# (`-n N -P thread`): each thread then stops its own step as a serial run
# would (detach or cancel) and returns a failure to doit, whose main thread,
# waiting on its queue, is never interrupted (that ended in a traceback).
INTERRUPTED = threading.Event()
_threaded = [False]  # a phase has run in a worker thread of this process


def _interrupt(signum: int, _frame: object) -> None:
    if _threaded[0] and not INTERRUPTED.is_set():
        INTERRUPTED.set()
        return
    # Serially, or a second signal under threads: now, in the main thread.
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def map_termination_signals() -> None:
    """SIGTERM/SIGHUP become KeyboardInterrupt, so doit saves its DB and runs
    teardown (it does neither when killed by a signal it does not catch);
    SIGINT too, to be handled as above under threads. Called by the step's
    check in doit's main thread (doit checks a task before it runs it, `-a`
    or not), never when a dodo is merely loaded; a handler the program set
    itself is left alone. Called by a phase in a worker thread, it notes
    that steps run in threads.

    SIGINT ignored since the process started is taken back: a shell without
    job control (a script's `doit ... &`) starts its background jobs so, and
    Python, doit and make keep a signal ignored that they were started with.
    A Ctrl-C of that script then left doit driving its runs, paid machines
    among them, with no one to stop it; a doit that must outlive a Ctrl-C
    is started in a session of its own (`setsid doit`). SIGTERM and SIGHUP
    ignored (`nohup`) stay ignored: that is asked for by name."""
    if threading.current_thread() is not threading.main_thread():
        _threaded[0] = True
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            signal.signal(sig, _interrupt)
    if signal.getsignal(signal.SIGINT) in (signal.default_int_handler, signal.SIG_IGN):
        signal.signal(signal.SIGINT, _interrupt)


def check_interrupted() -> None:
    """In a worker thread: KeyboardInterrupt once a signal asked the threads
    to stop (see INTERRUPTED). Called where a step waits."""
    if INTERRUPTED.is_set() and threading.current_thread() is not threading.main_thread():
        raise KeyboardInterrupt("interrupted while steps ran in threads")


def started_holding_signals(start: Callable[[], _T]) -> _T:
    """start() (a backend's start of a run), with Ctrl-C/SIGTERM/SIGHUP held
    back until it returns: interrupted half-way, the worker could start its
    command after the client gave up on it, and nothing would cancel that run."""
    if threading.current_thread() is not threading.main_thread():
        return start()
    caught: list[int] = []
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    held = [sig for sig in signals if signal.getsignal(sig) is not None]
    previous = {sig: signal.getsignal(sig) for sig in held}
    for sig in held:
        signal.signal(sig, lambda signum, _frame: caught.append(signum))
    try:
        return start()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if caught:
            raise KeyboardInterrupt(f"signal {signal.Signals(caught[0]).name}")


def start_when_free(start: Callable[[], _T], say: Callable[[str], None]) -> _T:
    """start(), tried again every START_LATER_SECONDS while it raises
    StartLater (what the run needs is held by other runs: its GPUs), which
    is said once; Ctrl-C, or a signal under threads, stops the wait."""
    said = False
    while True:
        try:
            return start()
        except StartLater as exc:
            if not said:
                say(str(exc))
                said = True
        check_interrupted()
        time.sleep(START_LATER_SECONDS)
