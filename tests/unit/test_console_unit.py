"""What console.py makes of a step's lines: the prefix, its colour, the
place in the sweep, the time."""

from __future__ import annotations

import io
import sys

import pytest

from substrax_tasks import console
from substrax_tasks.console import COLOURS, MAX_HELD_LINE, StepLines, Sweep, TextSink, elapsed


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_each_line_is_prefixed_once_and_padded_to_the_sweeps_longest_name() -> None:
    lines = StepLines("fit:a", 7, COLOURS[0])
    said = lines.mark("fit:a: new run r1 on local\nmodel a r2 0.5\n\nlast", io.StringIO())
    assert said == "fit:a   | new run r1 on local\nfit:a   | model a r2 0.5\n\nfit:a   | last"


def test_the_prefix_is_coloured_on_a_terminal_unless_no_color(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    lines = StepLines("fit:a", 5, "36")
    assert lines.mark("x", Terminal()) == "\x1b[36mfit:a |\x1b[0m x"
    monkeypatch.setenv("NO_COLOR", "1")
    assert lines.mark("x", Terminal()) == "fit:a | x"


def test_a_place_is_given_once_per_step_in_the_order_steps_are_reached() -> None:
    sweep = Sweep()
    assert sweep.reached("a") == ""  # no doit said what it runs
    asked: list[int] = []

    def steps() -> list[str]:
        asked.append(1)
        return ["a", "b", "c"]

    sweep.plan(steps)
    assert not asked  # counted only when a step asks
    sweep.passed("c")  # up to date: placed, nothing counted
    assert not asked
    assert sweep.reached("b") == "[2/3]"
    assert sweep.reached("a") == "[3/3]"
    assert sweep.reached("b") == "[2/3]"
    assert asked == [1]


def test_elapsed_is_to_a_tenth_of_a_second() -> None:
    assert elapsed(0.04) == "0.0 s"
    assert elapsed(4.25) == "4.2 s"
    assert elapsed(187.5) == "3 min 7.5 s"


class Captured(io.StringIO):
    """doit's capture of a Python action's stdout (doit.action.Writer): a copy
    kept in memory, and the stream beneath it."""

    def __init__(self, orig_stream: io.StringIO) -> None:
        super().__init__()
        self.orig_stream = orig_stream


def test_a_line_without_end_is_written_in_bounded_pieces_beside_other_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    terminal = io.StringIO()
    captured = Captured(terminal)
    monkeypatch.setattr(sys, "stdout", captured)
    monkeypatch.setattr(console._current, "step", StepLines("fit", 3, COLOURS[0]), raising=False)
    sink = TextSink()
    for _ in range(64):  # 4 MiB of one line, as a host's endless follower sends it
        sink.write(b"0" * (1 << 16))
    written = terminal.getvalue()
    assert len(written) >= (4 << 20) - MAX_HELD_LINE  # not held back to the line's end
    assert {len(line) for line in written.splitlines()} == {len("fit | ") + MAX_HELD_LINE}
    assert captured.getvalue() == ""  # no copy of the log in doit's memory
    sink.write(b"1\n2")
    sink.close()
    assert terminal.getvalue().endswith("0" * 10 + "1\nfit | 2\n")


def test_a_serial_steps_log_goes_beneath_doits_capture_and_its_last_line_is_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    terminal = io.StringIO()
    captured = Captured(terminal)
    monkeypatch.setattr(sys, "stdout", captured)
    sink = TextSink()
    sink.write(b"a\nb")
    sink.close()
    assert terminal.getvalue() == "a\nb\n"
    assert captured.getvalue() == ""
