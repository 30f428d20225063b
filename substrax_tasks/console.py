"""What the user is told while steps run: one writer at a time, each line
of a step named when several steps print at once, and each step's place in
the sweep.

Under `doit -n N -P thread` several steps print at once, and concurrent
writes to one text stream crashed CPython 3.11 (SIGSEGV in TextIOWrapper,
gh-119506): every line goes through this lock.

Steps running in doit's worker threads (`-n N -P thread`) have every line
they print (their progress lines, their command's log, the `upload:` and
`fetch:` lines) prefixed with their name, `fit:lr3 | ...`, as docker
compose and Nextflow do, so that interleaved lines can be told apart. The
name is coloured, one colour per step, on a terminal, and plain when the
stream is piped or NO_COLOR is set (https://no-color.org). A serial doit
prints one step at a time under doit's own `.  step` lines, unprefixed.

doit swaps `sys.stdout` and `sys.stderr` for a `Writer` of its own around
each Python action it captures and puts back what it found; under `-P
thread` the swaps of concurrent actions interleave and a stale `Writer` is
put back, which the next action wraps (a chain ~1,000 deep after 6,000
steps: RecursionError in `isatty()`, issue 40). The steps' tasks have doit
capture nothing (step/tasks.py), and while doit runs every line here goes
to the streams `sys.stdout` and `sys.stderr` were as its run started
(`hold_streams`), whatever a user's Python task beside the steps leaves there.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TextIO

OUTPUT_LOCK = threading.Lock()

# docker compose's colours for its service prefixes: cyan, yellow, green,
# magenta, blue, and their bright variants (red is left to failures).
COLOURS = ("36", "33", "32", "35", "34", "96", "93", "92", "95", "94")
_RESET = "\033[0m"

_current = threading.local()  # .step: the StepLines of the step this thread drives
_held: dict[str, TextIO] = {}  # "out", "err": the streams of the doit that runs (hold_streams)


def hold_streams() -> None:
    """doit's run starts (its reporter is told, in the main thread, before
    any action runs): the lines of its steps go to the streams `sys.stdout`
    and `sys.stderr` are now, not to what doit's swaps leave there later."""
    _held["out"], _held["err"] = sys.stdout, sys.stderr


def release_streams() -> None:
    """doit's run ended (every action and teardown done): `sys.stdout` and
    `sys.stderr` are the held streams again where doit left one of its
    `Writer`s there. Python flushes both at exit, down a chain of Writers
    that interleaved swaps grew: ~1,000 deep, the flush failed and the
    process exited 120 with nothing said, after a sweep that succeeded."""
    from doit.action import Writer  # console is a leaf: doit is imported once a doit has run

    if "out" in _held and isinstance(sys.stdout, Writer):
        sys.stdout = _held["out"]
    if "err" in _held and isinstance(sys.stderr, Writer):
        sys.stderr = _held["err"]
    _held.clear()


def stdout() -> TextIO:
    """Where a step's lines go: the stream held while doit runs."""
    return _held.get("out") or sys.stdout


def stderr() -> TextIO:
    return _held.get("err") or sys.stderr


class StepLines:
    """How the lines of one step running beside others are marked: its name,
    padded to the longest name of the sweep, and its colour."""

    def __init__(self, name: str, width: int, colour: str) -> None:
        self.name = name
        self.label = name.ljust(width)
        self.colour = colour
        self._own = f"{name}: "

    def mark(self, text: str, stream: TextIO) -> str:
        """`text` with each of its lines prefixed; a line that names the step
        already (`fit:lr3: new run ...`) is not named twice."""
        prefix = (
            f"\033[{self.colour}m{self.label} |{_RESET} " if coloured(stream) else f"{self.label} | "
        )
        lines = text.split("\n")
        return "\n".join(
            prefix + (line[len(self._own):] if line.startswith(self._own) else line) if line else line
            for line in lines
        )  # fmt: skip


def coloured(stream: TextIO) -> bool:
    """Colour on a terminal only, and never with NO_COLOR set or TERM=dumb."""
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a stream doit swapped in, or one closed
        return False


@contextlib.contextmanager
def lines_of(step: str) -> Iterator[None]:
    """While a phase of `step` runs in a worker thread of `doit -n N -P
    thread`, every line this thread prints is marked with the step's name.
    In the main thread (a serial doit) nothing changes."""
    if threading.current_thread() is threading.main_thread():
        yield
        return
    _current.step = SWEEP.lines(step)
    try:
        yield
    finally:
        _current.step = None


def marking() -> bool:
    """Whether this thread's lines are marked (a step runs beside others):
    a progress bar, which redraws its own line, is not drawn then."""
    return getattr(_current, "step", None) is not None


def emit(text: str, *, err: bool = False) -> None:
    with OUTPUT_LOCK:
        stream = stderr() if err else stdout()
        step: StepLines | None = getattr(_current, "step", None)
        if step is not None:
            text = step.mark(text, stream)
        stream.write(text if text.endswith("\n") else text + "\n")
        stream.flush()


# The longest part of a line a step's log output holds back while it runs
# beside others (to mark whole lines): a longer line is written in pieces of
# this size, each marked. A log without a newline (a progress bar's
# carriage returns, or a host sending zeros) is then held in bounded memory.
MAX_HELD_LINE = 1 << 16


def uncaptured(stream: TextIO) -> TextIO:
    """The terminal (or file) beneath doit's capture: doit keeps a copy of
    all a Python action writes in memory until the task ends, which a run's
    log, up to MAX_LOG_BYTES, is not worth (the task's verbosity 2 never
    shows that copy)."""
    original = getattr(stream, "orig_stream", None)
    return original if original is not None else stream


class TextSink:
    """Log bytes to doit's (possibly captured, text-only) stdout. When the
    step runs beside others, whole lines only (up to MAX_HELD_LINE), each
    marked with its name. `close()` ends a last line the log did not end.
    What it holds is bounded whatever the log holds: a log of one endless
    line once made doit grow by the whole log, and copy it at each chunk."""

    def __init__(self) -> None:
        self._step: StepLines | None = getattr(_current, "step", None)
        self._partial = ""  # the last line's start, not written yet (marked lines only)
        self._open_line = False  # the last thing written did not end its line
        self.written = 0  # bytes of the log written: where following it again goes on from

    def write(self, data: bytes) -> int:
        self.written += len(data)
        text = data.decode(errors="replace")
        if not text:
            return len(data)
        with OUTPUT_LOCK:
            out = uncaptured(stdout())
            if self._step is None:
                out.write(text)
                self._open_line = not text.endswith("\n")
                return len(data)
            *whole, self._partial = (self._partial + text).split("\n")
            while len(self._partial) > MAX_HELD_LINE:
                whole.append(self._partial[:MAX_HELD_LINE])
                self._partial = self._partial[MAX_HELD_LINE:]
            if whole:
                out.write(self._step.mark("\n".join(whole), out) + "\n")
            self._open_line = bool(self._partial)
        return len(data)

    def flush(self) -> None:
        with OUTPUT_LOCK:
            uncaptured(stdout()).flush()

    def close(self) -> None:
        with OUTPUT_LOCK:
            out = uncaptured(stdout())
            if self._open_line:  # the log's last line had no newline: end it, so the next line is a line
                out.write(self._step.mark(self._partial, out) + "\n" if self._step else "\n")
                self._partial, self._open_line = "", False
            out.flush()


class Sweep:
    """The remote steps this doit was asked to run (the selected tasks and
    what they depend on), for each step's place, `[5/14]`: the 5th of the
    14 to be reached, by running or by being found up to date. doit's
    reporter says which tasks are selected before any runs; they are counted
    only when a step first asks, so a no-op counts nothing."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._planned: Callable[[], list[str]] | None = None
        self._names: list[str] | None = None
        self._places: dict[str, int] = {}

    def plan(self, steps: Callable[[], list[str]]) -> None:
        with self._lock:
            self._planned, self._names, self._places = steps, None, {}

    def forget(self) -> None:
        """doit's run ended: hold nothing of its tasks (held, the whole task
        graph of a 1,000-step no-op was left to the interpreter's exit to
        free, +0.1 s); the names already counted stay."""
        with self._lock:
            self._planned = None

    def _steps(self) -> list[str]:
        """The planned steps' names (lock held); [] outside a planned doit."""
        if self._names is None:
            self._names = self._planned() if self._planned is not None else []
        return self._names

    def _place(self, step: str) -> int:
        """The step's place (lock held): given the first time it is asked
        for, in the order steps are reached, and kept."""
        return self._places.setdefault(step, len(self._places) + 1)

    def reached(self, step: str) -> str:
        """`[i/N]` for a step that starts or is found up to date now (its
        place kept if it was reached before); "" when the sweep is unknown
        (a dodo run with another reporter than substrax's)."""
        with self._lock:
            total = len(self._steps())
            if not total:
                return ""
            return f"[{min(self._place(step), total)}/{total}]"

    def passed(self, step: str) -> None:
        """A step found up to date: it takes its place, and nothing is
        counted (a no-op doit walks no task list)."""
        with self._lock:
            self._place(step)

    def lines(self, step: str) -> StepLines:
        """How `step`'s lines are marked: its name padded to the longest of
        the sweep, its colour by its place (which this gives it, as its
        first phase starts: two steps starting at once get two colours)."""
        with self._lock:
            width = max([len(step), *map(len, self._steps())])
            place = self._place(step)
        return StepLines(step, width, COLOURS[(place - 1) % len(COLOURS)])


SWEEP = Sweep()


def elapsed(seconds: float) -> str:
    """A step's time, to a tenth of a second: `4.2 s`, `3 min 7.5 s`."""
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)} min {rest:.1f} s" if minutes else f"{rest:.1f} s"
