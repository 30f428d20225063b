"""`substrax-compute steps`: the project at a glance, as a user runs it on a
project whose steps stand in every state (one run, one restored from the
cache another clone filled, one stale, one never run, one failed, one
running); `logs` of a restored step; and every command quiet on a closed
pipe (`| head -1`)."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from dodo_helpers import (
    COMPUTE,
    clean_env,
    compute,
    doit,
    doit_ok,
    make_project,
    needs_bwrap,
    popen_doit,
    popen_output,
    runs_of,
    show,
    status_records,
    stop,
    wait_for,
    write_pyproject,
)
from progress import wait_exit

BODY = """
def task_ran():
    yield from remote_step("ran", shell="mkdir -p out && cat data/r.txt > out/ran.txt",
                           inputs=["data/r.txt"], outputs=["out/ran.txt"])

def task_shared():
    yield from remote_step("shared", shell="echo made by the first clone && mkdir -p out && "
                           "cat data/s.txt > out/shared.txt",
                           inputs=["data/s.txt"], outputs=["out/shared.txt"])

def task_edited():
    yield from remote_step("edited", shell="mkdir -p out && cat data/e.txt > out/edited.txt",
                           inputs=["data/e.txt"], outputs=["out/edited.txt"])

def task_never():
    yield from remote_step("never", shell="mkdir -p out && echo n > out/never.txt", outputs=["out/never.txt"])

def task_broken():
    yield from remote_step("broken", shell="echo about to fail && exit 3", outputs=["out/broken.txt"])

def task_slow():
    yield from remote_step("slow", shell="sleep 60 && mkdir -p out && echo s > out/slow.txt",
                           outputs=["out/slow.txt"])
"""
FILES = {"data/r.txt": "r\n", "data/s.txt": "s\n", "data/e.txt": "e\n"}
ROW = re.compile(r"\s{2,}")  # the table's columns: two spaces or more between cells
TENTHS = re.compile(r"^\d+:\d\d\.\d$")  # m:ss.s


def clone(tmp_path: Path, name: str) -> Path:
    """A clone of the project; the run cache is on, in the test's XDG_CACHE_HOME (shared)."""
    (tmp_path / name).mkdir()
    root = make_project(tmp_path / name, BODY, files=FILES)
    write_pyproject(root, cache="")
    return root


def table_rows(stdout: str) -> dict[str, list[str]]:
    """`steps`'s table: the summary line, a blank line, the header, then one row per step."""
    lines = stdout.splitlines()
    assert lines[1] == "" and ROW.split(lines[2]) == ["step", "state", "backend", "run", "duration", "detail"]
    return {cells[0]: cells for cells in (ROW.split(line, maxsplit=5) for line in lines[3:])}


@pytest.fixture
def every_state(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """The project `b` with a step in each state, `slow` running under a
    `doit` started in the background; the first clone `a`."""
    first = clone(tmp_path, "a")
    doit_ok(first, "shared")
    root = clone(tmp_path, "b")
    assert "restored from cache entry" in doit_ok(root, "shared").stdout
    doit_ok(root, "ran", "edited")
    failed = doit(root, "broken")
    assert failed.returncode != 0, show(failed)
    (root / "data" / "e.txt").write_text("edited\n")
    slow = popen_doit(root, "slow")
    try:
        wait_for(lambda: any(r.get("state") == "running" for r in status_records(root)), "slow to run")
        yield first, root
    finally:
        stop(slow)
        popen_output(root)


@needs_bwrap  # a run without the sandbox is never kept in the run cache
def test_steps_shows_every_step_with_its_state_and_a_summary(every_state: tuple[Path, Path]) -> None:
    first, root = every_state
    made_by = runs_of(first, "shared")[0]["run_id"]
    assert runs_of(root, "shared") == []  # restored: no run here
    done = compute(root, "steps")
    assert done.returncode == 0, show(done)
    summary = "1 up to date, 1 restored, 1 stale, 1 running, 1 failed, 1 never run"
    assert done.stdout.splitlines()[0] == summary
    rows = table_rows(done.stdout)
    assert list(rows) == ["ran", "shared", "edited", "never", "broken", "slow"]  # as declared

    ran = rows["ran"]
    assert ran[1:4] == ["up to date", "local", runs_of(root, "ran")[0]["run_id"]]
    assert TENTHS.match(ran[4]), ran
    shared = rows["shared"]
    assert shared[1:4] == ["restored", "local", made_by]
    assert re.match(r"from cache entry [0-9a-f]{16} in \S+ \(the run ran on local, ", shared[5]), shared
    assert TENTHS.match(shared[4]), shared  # the duration of the run that made it
    assert rows["edited"][1] == "stale"
    assert rows["edited"][5] == "input changed: data/e.txt"  # `why`'s first reason
    assert rows["never"][1:5] == ["never run", "local", "-", "-"]
    broken = rows["broken"]
    assert broken[1:4] == ["failed", "local", runs_of(root, "broken")[0]["run_id"]]
    assert broken[5].startswith("failed: ") and "3" in broken[5], broken
    assert rows["slow"][1:4] == ["running", "local", runs_of(root, "slow")[0]["run_id"]]

    # `why` says the same of the stale step: one function answers both
    assert "input changed: data/e.txt" in compute(root, "why", "edited").stdout


@needs_bwrap
def test_steps_json_says_the_same(every_state: tuple[Path, Path]) -> None:
    first, root = every_state
    done = compute(root, "steps", "--json")
    assert done.returncode == 0, show(done)
    data = json.loads(done.stdout)
    assert data["summary"] == {"up_to_date": 1, "restored": 1, "stale": 1, "running": 1, "failed": 1,
                               "never_run": 1}  # fmt: skip
    steps = {s["step"]: s for s in data["steps"]}
    assert {name: s["state"] for name, s in steps.items()} == {
        "ran": "up_to_date", "shared": "restored", "edited": "stale", "never": "never_run",
        "broken": "failed", "slow": "running",
    }  # fmt: skip
    assert steps["shared"]["run_id"] == runs_of(first, "shared")[0]["run_id"]
    assert steps["shared"]["restored_from"].startswith("cache entry ")
    assert steps["edited"]["detail"] == "input changed: data/e.txt"
    assert steps["broken"]["exit_code"] == 3
    assert isinstance(steps["ran"]["duration_seconds"], float)
    assert steps["never"]["run_id"] is None and steps["never"]["duration_seconds"] is None

    # status's durations are to a tenth of a second too, and its JSON keeps its keys
    table = compute(root, "status")
    ran_id = runs_of(root, "ran")[0]["run_id"]
    row = next(line for line in table.stdout.splitlines() if line.startswith(ran_id))
    assert TENTHS.match(ROW.split(row)[-1]), row
    status = json.loads(compute(root, "status", "--json").stdout)
    assert set(status) == {"runs", "groups", "unreadable", "leaked"}


@needs_bwrap
def test_logs_of_a_restored_step_show_the_log_of_the_run_that_made_it(tmp_path: Path) -> None:
    first = clone(tmp_path, "a")
    doit_ok(first, "shared")
    made_by = runs_of(first, "shared")[0]["run_id"]
    root = clone(tmp_path, "b")
    assert "restored from cache entry" in doit_ok(root, "shared").stdout
    done = compute(root, "logs", "shared")
    assert done.returncode == 0, show(done)
    assert "made by the first clone" in done.stdout
    assert "shared: restored from cache entry" in done.stderr and f"run {made_by} on local" in done.stderr

    # the entry gone (a trim, `cache forget`): the log with it, and `logs` says so
    forgot = compute(first, "cache", "forget", "shared")
    assert forgot.returncode == 0, show(forgot)
    gone = compute(root, "logs", "shared")
    assert gone.returncode == 1
    assert f"made by run {made_by}, and its log cannot be shown" in gone.stderr
    assert "is in the cache no more" in gone.stderr and "`doit -a shared`" in gone.stderr
    assert "Traceback" not in gone.stderr


SWEEP = """
def task_fit():
    for m in ["a", "b", "c"]:
        script = 'echo "log of $1"; echo "$1" > "fit-$1.txt"'
        yield from remote_step(f"fit:{m}", command=["/bin/sh", "-c", script, "fit", m],
                               outputs=[f"fit-{m}.txt"])
"""


@needs_bwrap
def test_logs_of_a_group_shows_the_kept_log_of_each_restored_member(tmp_path: Path) -> None:
    """`logs GROUP` where every member was restored (no run here at all),
    then where one ran here since: each member under its header, the kept
    log of the run that made it or the log of its run here."""
    roots = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        roots.append(make_project(tmp_path / name, SWEEP))
        write_pyproject(roots[-1], cache="")
    first, root = roots
    doit_ok(first, "fit")
    assert doit_ok(root, "fit").stdout.count("restored from cache entry") == 3
    done = compute(root, "logs", "fit")
    assert done.returncode == 0, show(done)
    sections = {s.split(" ", 1)[0]: s for s in done.stdout.split("==> ")[1:]}
    assert sorted(sections) == ["fit:a", "fit:b", "fit:c"], done.stdout
    for m in "abc":
        assert "(restored: cache entry " in sections[f"fit:{m}"] and f"log of {m}\n" in sections[f"fit:{m}"]
    doit_ok(root, "-a", "fit:c")  # runs here: its own log, under its run id
    (run_c,) = [r["run_id"] for r in runs_of(root, "fit:c")]
    done = compute(root, "logs", "fit")
    assert done.returncode == 0, show(done)
    assert done.stdout.startswith(f"==> fit:c ({run_c}) <==\nlog of c\n"), done.stdout
    assert done.stdout.count("(restored: cache entry ") == 2 and "log of a\n" in done.stdout


CHATTY = """
def task_chatty():
    yield from remote_step("chatty", shell="seq 1 40000 && mkdir -p out && echo c > out/c.txt",
                           outputs=["out/c.txt"])
"""


@needs_bwrap
def test_a_cache_entry_keeps_only_the_end_of_a_long_log(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    first = make_project(tmp_path / "a", CHATTY)
    write_pyproject(first, cache="")
    doit_ok(first, "chatty")
    (tmp_path / "b").mkdir()
    root = make_project(tmp_path / "b", CHATTY)
    write_pyproject(root, cache="")
    assert "restored from cache entry" in doit_ok(root, "chatty").stdout
    done = compute(root, "logs", "chatty")
    assert done.returncode == 0, show(done)
    whole = "".join(f"{n}\n" for n in range(1, 40001))  # 228,894 bytes
    note, _, kept = done.stdout.partition("\n")
    assert note == f"[substrax: the last 64 KiB of the run's log of {len(whole)} bytes]"
    assert len(kept) == 64 << 10 and whole.endswith(kept)


def test_status_says_where_restored_steps_are_shown_when_it_has_no_runs(tmp_path: Path) -> None:
    root = clone(tmp_path, "a")
    done = compute(root, "status")
    assert done.returncode == 0 and done.stdout.strip() == "no runs yet"
    assert "`substrax-compute steps` shows every step" in done.stderr


LONG_LOG = """
def task_chatty():
    for member in ("a", "b"):
        yield from remote_step(f"chatty:{member}", shell="seq 1 300000 && mkdir -p out && "
                               f"echo x > out/{member}.txt", outputs=[f"out/{member}.txt"])
"""


@pytest.mark.parametrize("word", ["chatty:a", "chatty"], ids=["step", "group"])
def test_a_closed_pipe_ends_a_command_quietly(tmp_path: Path, word: str) -> None:
    """`logs WORD | head -1`, a real pipe: `head` leaves after one line, and
    the rest of the 2 MB log meets a closed pipe."""
    root = make_project(tmp_path, LONG_LOG)
    doit_ok(root, "chatty")
    with subprocess.Popen(
        [str(COMPUTE), "--project", str(root), "logs", word],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env(),
    ) as logs:  # fmt: skip
        assert logs.stdout is not None and logs.stderr is not None
        head = subprocess.run(["head", "-1"], stdin=logs.stdout, capture_output=True, timeout=60, check=False)
        logs.stdout.close()  # head has it: ours closed, so head's exit closes the pipe
        stderr = logs.stderr.read().decode()
        code = wait_exit(logs, "`logs` to end", 60)
    header = f"==> chatty:a ({runs_of(root, 'chatty:a')[0]['run_id']}) <==\n"
    assert head.stdout.decode() == ("1\n" if word == "chatty:a" else header)
    for noise in ("Traceback", "BrokenPipeError", "Exception ignored"):
        assert noise not in stderr, stderr
    assert code == 1
