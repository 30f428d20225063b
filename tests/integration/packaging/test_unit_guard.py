"""The `unit` marker is a promise the conftest keeps: a test marked unit that
starts a process or opens a connection fails, even when it catches the
error, and so does one whose module fixture does; unmarked tests may. Both
that and the time limit of every test hold when `make test` runs the suite
on pytest-xdist's workers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from local_runs import REPO

PROBE = '''
import os, socket, subprocess
import pytest

@pytest.fixture(scope="module")
def started():
    subprocess.run(["true"], check=True)

@pytest.mark.unit
def test_spawns():
    subprocess.run(["true"])

@pytest.mark.unit
def test_forks():
    os.fork()

@pytest.mark.unit
def test_catches_the_error():
    try:
        subprocess.run(["true"])
    except Exception:
        pass

@pytest.mark.unit
def test_connects():
    socket.create_connection(("127.0.0.1", 9), timeout=1)

@pytest.mark.unit
def test_uses_a_fixture_that_spawns(started):
    pass

@pytest.mark.unit
def test_stays_in_this_process(tmp_path):
    (tmp_path / "f").write_text("x")

def test_unmarked_may_spawn():
    subprocess.run(["true"], check=True)

def test_hangs():
    import time
    time.sleep(3600)
'''


@pytest.mark.parametrize("workers", [[], ["-n", "2", "--dist", "loadfile"]], ids=["serial", "xdist"])
def test_a_unit_test_that_starts_a_process_or_connects_fails_and_a_hung_one_times_out(
    tmp_path: Path, workers: list[str]
) -> None:
    (tmp_path / "test_probe.py").write_text(PROBE)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider",
         "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path), "-q", "-rA",
         "-o", "timeout=2", *workers, "test_probe.py"],
        cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "tests")},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    outcomes = {
        line.split("::")[1].split()[0]: line.split()[0]
        for line in done.stdout.splitlines()
        if line.startswith(("PASSED", "FAILED", "ERROR")) and "::" in line
    }
    assert outcomes == {
        "test_spawns": "FAILED",
        "test_forks": "FAILED",
        "test_catches_the_error": "FAILED",
        "test_connects": "FAILED",
        "test_uses_a_fixture_that_spawns": "ERROR",
        "test_stays_in_this_process": "PASSED",
        "test_unmarked_may_spawn": "PASSED",
        "test_hangs": "FAILED",
    }, done.stdout + done.stderr
    assert "is marked unit (no processes, no network) but called" in done.stdout
    assert "test_hangs - Failed: Timeout (>2.0s) from pytest-timeout" in done.stdout
