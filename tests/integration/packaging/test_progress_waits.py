"""The tests' deadlines follow progress (tests/support/progress.py): a wait,
and pytest-timeout's limit of a whole test, go on past their timeout while
the test's folder changes (a run slowed down by a loaded machine), and fail
at their timeout once nothing there moves (a stuck run), as on a quiet
machine. Run in a pytest of its own, serially and on xdist's workers as
`make test` runs the suite."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from local_runs import REPO
from progress import STRETCH

PROBE = '''
import itertools, subprocess, sys, time
import pytest
from progress import run, wait_for

# Writes to the test's folder every 0.1 s for 4 s, then says it is done.
WRITER = """
import sys, time
for i in range(40):
    open(sys.argv[1], "a").write("%d\\\\n" % i)
    time.sleep(0.1)
open(sys.argv[2], "w").close()
"""

def test_a_wait_goes_on_while_the_run_writes(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path / "log"), str(tmp_path / "done")])
    try:
        wait_for(lambda: (tmp_path / "done").exists(), "the writer to be done", timeout=1)
    finally:
        proc.kill()
        proc.wait()

def test_a_wait_with_nothing_moving_fails_at_its_timeout(tmp_path):
    wait_for(lambda: False, "what never comes", timeout=1)

def test_a_wait_whose_run_moves_forever_ends(tmp_path):
    counter = itertools.count()
    wait_for(lambda: False, "what never comes", timeout=0.1, progress=lambda: next(counter))

def test_a_process_run_goes_on_while_it_writes(tmp_path):
    done = run([sys.executable, "-c", WRITER, str(tmp_path / "log"), str(tmp_path / "done")], timeout=1)
    assert done.returncode == 0 and (tmp_path / "done").exists()

def test_a_process_run_with_nothing_moving_is_killed_at_its_timeout(tmp_path):
    began = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=1)
    assert time.monotonic() - began < 10

def test_a_test_that_writes_outlives_its_timeout(tmp_path):
    for i in range(40):  # 4 s, twice the timeout
        (tmp_path / "log").write_text(str(i))
        time.sleep(0.1)

def test_hangs(tmp_path):
    time.sleep(3600)
'''


@pytest.mark.parametrize("workers", [[], ["-n", "2", "--dist", "loadfile"]], ids=["serial", "xdist"])
def test_a_deadline_moves_on_while_the_test_folder_changes_and_fails_once_nothing_moves(
    tmp_path: Path, workers: list[str]
) -> None:
    (tmp_path / "test_probe.py").write_text(PROBE)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider",
         "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path), "-q", "-rA",
         "-o", "timeout=2", *workers, "test_probe.py"],
        cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "tests")},
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    outcomes = {
        line.split("::")[1].split()[0]: line.split()[0]
        for line in done.stdout.splitlines()
        if line.startswith(("PASSED", "FAILED", "ERROR")) and "::" in line
    }
    said = done.stdout + done.stderr
    assert outcomes == {
        "test_a_wait_goes_on_while_the_run_writes": "PASSED",
        "test_a_wait_with_nothing_moving_fails_at_its_timeout": "FAILED",
        "test_a_wait_whose_run_moves_forever_ends": "FAILED",
        "test_a_process_run_goes_on_while_it_writes": "PASSED",
        "test_a_process_run_with_nothing_moving_is_killed_at_its_timeout": "PASSED",
        "test_a_test_that_writes_outlives_its_timeout": "PASSED",
        "test_hangs": "FAILED",
    }, said
    # a stuck wait fails at its first timeout, not after it was moved on up to STRETCH times
    took = re.search(r"waited ([0-9]+) s for what never comes; nothing moved in the last 1 s", said)
    assert took is not None and 1 <= int(took[1]) < STRETCH, said
    assert "for what never comes, though its run moved all along" in said
    assert "test_hangs - Failed: Timeout (>2.0s) from pytest-timeout" in said
