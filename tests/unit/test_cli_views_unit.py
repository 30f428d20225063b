"""The CLI's views as pure functions: durations and the steps' summary line."""

from __future__ import annotations

import pytest

from substrax_tasks.cli.status_view import clock
from substrax_tasks.cli.steps_view import StepState, summary


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [(0.04, "0:00.0"), (0.36, "0:00.4"), (1.95, "0:02.0"), (61.23, "1:01.2"), (3723.46, "1:02:03.5"),
     (-2, "0:00.0")],
)
def test_durations_are_shown_to_a_tenth_of_a_second(seconds: float, shown: str) -> None:
    assert clock(seconds) == shown


def test_a_timer_is_shown_in_whole_seconds() -> None:
    assert clock(61.9, tenths=False) == "1:01"


def test_the_summary_counts_every_state_even_none() -> None:
    states = [StepState("a", "up_to_date", "local"), StepState("b", "up_to_date", "local"),
              StepState("c", "stale", "ssh", detail="input changed: x")]  # fmt: skip
    assert summary(states) == "2 up to date, 0 restored, 1 stale, 0 running, 0 failed, 0 never run"
