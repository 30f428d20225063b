"""Following a sweep as it runs: each step's start and end lines (its place
`[i/N]`, backend, time and outcome), every line of a step running beside
others marked with its name (`fit:lr3 | ...`), coloured on a terminal
(tmux) and plain when piped or with NO_COLOR, and the closing line after
a Ctrl-C."""

from __future__ import annotations

import json
import re
import shlex
import signal
import uuid
from pathlib import Path

import pytest
from dodo_helpers import (
    DOIT,
    doit_ok,
    make_project,
    popen_doit,
    popen_output,
    run_dirs,
    stop,
    wait_for,
    write_pyproject,
)
from terminal import Terminal, needs_tmux

STEPS = 6
# Six steps, each printing two result lines and a last line with no newline
# (the log's end must still reach the terminal, marked).
SWEEP = """
def task_fit():
    for n in range({steps}):
        yield from remote_step(
            f"fit:lr{{n}}",
            command=["/bin/sh", "-c",
                     f"echo result lr{{n}} first; sleep 0.2; echo result lr{{n}} second; "
                     f"echo x > out{{n}}.txt; printf 'result lr{{n}} last'"],
            outputs=[f"out{{n}}.txt"],
        )
"""
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def sweep_project(tmp_path: Path) -> Path:
    return make_project(tmp_path, SWEEP.format(steps=STEPS), ["fit"])


def assert_followed(text: str) -> None:
    """Every line of each step's own output carries its name; each step has
    a start and an end line with the same place, all places 1..N once."""
    lines = text.splitlines()
    places = []
    for n in range(STEPS):
        name = f"fit:lr{n}"
        own = [line for line in lines if f"result lr{n} " in line]
        assert len(own) == 3, text
        assert all(line.startswith(f"{name} | result lr{n} ") for line in own), text
        started = [
            m
            for line in lines
            if (m := re.fullmatch(rf"{name} \| \[(\d+)/{STEPS}\] starting on local", line))
        ]
        ended = [
            m for line in lines
            if (m := re.fullmatch(rf"{name} \| \[(\d+)/{STEPS}\] succeeded on local in \d+\.\d s", line))
        ]  # fmt: skip
        assert len(started) == 1, text
        assert len(ended) == 1, text
        assert started[0].group(1) == ended[0].group(1), text
        places.append(int(started[0].group(1)))
    assert sorted(places) == list(range(1, STEPS + 1)), text
    assert f"ran {STEPS} of {STEPS} tasks" in text


def test_a_piped_sweep_under_threads_names_every_line_without_colour(tmp_path: Path) -> None:
    root = sweep_project(tmp_path)
    done = doit_ok(root, "-n", "3", "-P", "thread")
    text = done.stdout + done.stderr
    assert "\x1b" not in text, text
    assert_followed(text)


def test_a_serial_sweep_says_each_steps_place_and_time_unprefixed(tmp_path: Path) -> None:
    root = sweep_project(tmp_path)
    done = doit_ok(root)
    for n in range(STEPS):
        assert re.search(rf"^fit:lr{n}: \[{n + 1}/{STEPS}\] starting on local$", done.stdout, re.M), (
            done.stdout
        )
        assert re.search(rf"^fit:lr{n}: \[{n + 1}/{STEPS}\] succeeded on local in \d+\.\d s$", done.stdout,
                         re.M), done.stdout  # fmt: skip
        assert re.search(rf"^result lr{n} first$", done.stdout, re.M), done.stdout
    # Nothing ran: nothing said but doit's lines and the closing one.
    again = doit_ok(root)
    assert "starting" not in again.stdout
    assert f"nothing to do: all {STEPS} tasks up to date" in again.stdout


# --------------------------------------------------------------- a terminal


@needs_tmux
def test_a_sweep_on_a_terminal_colours_each_steps_name(tmp_path: Path) -> None:
    root = sweep_project(tmp_path)
    term = Terminal(root, "follow")
    try:
        term.type(f"{shlex.quote(str(DOIT))} -n 3 -P thread; echo doit-ended-$((0 + $?))")
        wait_for(lambda: re.search(r"doit-ended-\d", term.screen()), "doit to end in the terminal")
        screen = term.screen()
        assert "doit-ended-0" in screen, screen
        # Each step's name in its colour, reset before the line's text.
        colours = {}
        for n in range(STEPS):
            found = re.findall(rf"\x1b\[(\d+)m(fit:lr{n}) \|\x1b\[(?:0|39)?m result lr{n} first", screen)
            assert found, screen
            colours[n] = found[0][0]
        assert len(set(colours.values())) == STEPS, colours  # one colour per step
        assert_followed(ANSI.sub("", screen))
        # NO_COLOR: the same lines, no colour.
        for n in range(STEPS):
            (root / f"out{n}.txt").unlink()
        term.type(f"NO_COLOR=1 {shlex.quote(str(DOIT))} -n 3 -P thread; echo doit-ended-again-$((0 + $?))")
        wait_for(
            lambda: re.search(r"doit-ended-again-\d", term.screen()), "doit to end in the terminal again"
        )
        screen = term.screen().partition("doit-ended-0")[2]  # the second doit's lines
        assert "doit-ended-again-0" in screen, screen
        assert "\x1b[3" not in screen and "\x1b[9" not in screen, screen
        assert_followed(screen)
    finally:
        term.close()


# ------------------------------------------------------------------ Ctrl-C

# `prep` runs first (its output is the others' input); the three `fit:`
# steps wait for gate/go, which never comes.
GATED = """
def task_prep():
    yield from remote_step("prep", command=["/bin/sh", "-c", "echo p > prep.txt"], outputs=["prep.txt"])

def task_fit():
    for n in "abc":
        yield from remote_step(
            f"fit:{{n}}",
            command=["/bin/sh", "-c",
                     f"echo going {{n}}; while [ ! -e gate/go ]; do sleep 0.05; done; echo x > out{{n}}.txt",
                     {marker!r}],
            inputs=["prep.txt", "gate/"],
            outputs=[f"out{{n}}.txt"],
        )
"""


def running_fits(root: Path) -> int:
    """How many runs of the gated `fit:` steps are running."""
    return sum(
        d.name.startswith("fit-")
        and (d / "status.json").exists()
        and json.loads((d / "status.json").read_text()).get("state") == "running"
        for d in run_dirs(root)
    )


@pytest.mark.parametrize("threads", [[], ["-n", "2", "-P", "thread"]], ids=["serial", "threads"])
def test_ctrl_c_mid_sweep_says_interrupted_and_how_many_ran(tmp_path: Path, threads: list[str]) -> None:
    marker = f"substrax-follow-{uuid.uuid4().hex}"
    root = make_project(tmp_path, GATED.format(marker=marker), ["prep", "fit"])
    (root / "gate").mkdir()
    proc = popen_doit(root, *threads)
    going = 2 if threads else 1
    try:
        wait_for(lambda: running_fits(root) == going, "the gated runs to be going")
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=30)
    finally:
        stop(proc)
    said = popen_output(root)
    assert code != 0, said
    assert "Traceback" not in said, said
    assert "ran 1 of 4 tasks, 3 not done" in said, said
    assert re.search(r"^interrupted: ran 1 of 4 tasks, 3 not done$", said, re.M), said
    assert not re.search(r"^ran \d+ of \d+ tasks$", said, re.M), said
    # Each step cut short says so, with its place and time.
    assert (
        len(re.findall(r"fit:[abc](?::| \|) \[[234]/4\] interrupted on local in \d+\.\d s", said)) == going
    ), said


# ------------------------------------------------------------- long phases

TWO_WITH_AN_ENVIRONMENT = """
def task_fit():
    for n in "ab":
        yield from remote_step(f"fit:{n}", command=["/bin/sh", "-c", f"echo x > out{n}.txt"],
                               outputs=[f"out{n}.txt"])
"""


def test_an_environment_build_says_when_it_starts(tmp_path: Path) -> None:
    root = make_project(tmp_path, TWO_WITH_AN_ENVIRONMENT, ["fit"], files={"requirements.txt": "# none\n"})
    done = doit_ok(root, "-n", "2", "-P", "thread")
    lines = done.stdout.splitlines()
    starts = [
        i
        for i, line in enumerate(lines)
        if re.fullmatch(r"fit:[ab] \| building the environment from requirements.txt", line)
    ]
    built = [
        i
        for i, line in enumerate(lines)
        if re.fullmatch(r"fit:[ab] \| built the environment from requirements.txt \(\w+\)", line)
    ]
    assert starts and built, done.stdout
    assert min(starts) < min(built), done.stdout
    # Built: the next doit reuses it and says no build starts.
    for n in "ab":
        (root / f"out{n}.txt").unlink()
    again = doit_ok(root, "-n", "2", "-P", "thread")
    assert "building the environment" not in again.stdout, again.stdout
    assert (
        len(re.findall(r"^fit:[ab] \| reusing the environment for requirements.txt", again.stdout, re.M)) == 2
    )


def test_a_step_restored_from_the_cache_says_so_in_its_end_line(tmp_path: Path) -> None:
    root = sweep_project(tmp_path)
    write_pyproject(root, cache="[tool.substrax.compute.cache]\n")  # on, as users get it
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg-cache")}  # the test's own cache folder
    doit_ok(root, "-n", "3", "-P", "thread", env=env)
    for n in range(STEPS):
        (root / f"out{n}.txt").unlink()
    done = doit_ok(root, "-n", "3", "-P", "thread", env=env)
    for n in range(STEPS):
        assert re.search(
            rf"^fit:lr{n} \| \[\d/{STEPS}\] restored from the cache on local in \d+\.\d s$", done.stdout, re.M
        ), done.stdout
    assert "result lr" not in done.stdout, done.stdout  # nothing ran
