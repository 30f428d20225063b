"""The deadline of one answer read from a command (transports/openssh.py,
the way a SkyPilot cluster's helpers answer over OpenSSH): a fixed one
ends a command that sends a line every half second, a moving one lets it
finish, and a command that sends nothing is given up on either way. Real
processes (sh), read as the ssh client's would be."""

from __future__ import annotations

import subprocess
import time

import pytest

from substrax_tasks.transports.openssh import AnswerOverdue, _bounded_answer

# Twelve progress lines half a second apart: 6 s in all (more on a loaded
# machine), never near DEADLINE quiet.
TALKING = "for i in 1 2 3 4 5 6 7 8 9 10 11 12; do echo working >&2; sleep 0.5; done; echo done"
DEADLINE = 5.0


def answer(script: str, timeout: float, moving: bool) -> tuple[bytes, bytes]:
    with subprocess.Popen(["sh", "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as proc:  # fmt: skip
        try:
            return _bounded_answer(proc, b"", timeout, "host", 1 << 20, moving)
        finally:
            proc.kill()


def test_a_moving_deadline_follows_the_progress_of_a_long_answer() -> None:
    out, err = answer(TALKING, DEADLINE, moving=True)
    assert out == b"done\n"
    assert err == b"working\n" * 12


def test_a_fixed_deadline_ends_the_same_answer() -> None:
    with pytest.raises(AnswerOverdue, match="host sent no whole answer within 5 s"):
        answer(TALKING, DEADLINE, moving=False)


def test_a_moving_deadline_gives_up_on_silence() -> None:
    began = time.monotonic()
    with pytest.raises(AnswerOverdue, match="host sent nothing more within 1 s"):
        answer("echo started >&2; exec sleep 60", 1.0, moving=True)
    assert time.monotonic() - began < 30  # not the command's 60 s


def test_progress_without_end_is_bounded_by_the_longest_an_answer_may_take() -> None:
    # What a run's lifetime sets for a long answer (RemoteRun.lifetime_end).
    began = time.monotonic()
    endless = "while :; do echo working >&2; sleep 0.2; done"
    with subprocess.Popen(["sh", "-c", endless], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as proc:  # fmt: skip
        try:
            with pytest.raises(AnswerOverdue, match="host sent no whole answer within 2 s"):
                _bounded_answer(proc, b"", DEADLINE, "host", 1 << 20, True, 2.0)
        finally:
            proc.kill()
    assert time.monotonic() - began < DEADLINE + 20
