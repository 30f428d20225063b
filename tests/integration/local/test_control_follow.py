"""remote/control.py's follower (`control.py follow RUN_DIR OFFSET LIMIT`),
run as the ssh backend runs it: a real process with a real run folder, under
this Python and Python 3.8 (remote hosts may run 3.8)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from local_runs import PY38, WAIT

CONTROL = Path(__file__).resolve().parents[3] / "remote" / "control.py"
PYTHONS = [sys.executable, pytest.param(str(PY38), marks=pytest.mark.skipif(
    not PY38.exists(), reason=f"NOT TESTED on Python 3.8: {PY38} is missing"))]  # fmt: skip


def start_ticks(pid: int) -> int:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return int(raw[raw.rfind(")") + 2 :].split()[19])


@pytest.fixture
def worker() -> Iterator[subprocess.Popen[bytes]]:
    """A live process standing in for the run's worker."""
    proc = subprocess.Popen(["sleep", "600"])
    yield proc
    proc.kill()
    proc.wait()


def write_status(run_dir: Path, worker: subprocess.Popen[bytes], state: str) -> None:
    record = {"state": state, "worker_pid": worker.pid, "worker_start_ticks": start_ticks(worker.pid)}
    (run_dir / "status.json.tmp").write_text(json.dumps(record))
    (run_dir / "status.json.tmp").replace(run_dir / "status.json")


def follower(python: str, run_dir: Path, offset: int = 0, limit: int = 1 << 20) -> subprocess.Popen[bytes]:
    argv = [python, str(CONTROL), "follow", str(run_dir), str(offset), str(limit)]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.parametrize("python", PYTHONS)
def test_the_follower_streams_the_log_as_it_grows_and_exits_with_the_whole_log_at_the_end(
    tmp_path: Path, worker: subprocess.Popen[bytes], python: str
) -> None:
    write_status(tmp_path, worker, "running")
    log = tmp_path / "run.log"
    log.write_bytes(b"skipped\nfirst\n")
    with follower(python, tmp_path, offset=len(b"skipped\n")) as proc:
        assert proc.stdout is not None
        assert proc.stdout.read(len(b"first\n")) == b"first\n"  # sent while the run goes on
        with log.open("ab") as f:
            f.write(b"second\n")
        assert proc.stdout.read(len(b"second\n")) == b"second\n"
        with log.open("ab") as f:
            f.write(b"last\n")
        write_status(tmp_path, worker, "succeeded")
        assert proc.stdout.read() == b"last\n"  # to its end: stdin stays open, as over ssh
        assert proc.wait(timeout=WAIT) == 0


@pytest.mark.parametrize("python", PYTHONS)
def test_the_follower_exits_when_its_stdin_closes_or_the_worker_is_gone(
    tmp_path: Path, worker: subprocess.Popen[bytes], python: str
) -> None:
    write_status(tmp_path, worker, "running")
    with follower(python, tmp_path) as proc:
        assert proc.stdin is not None
        proc.stdin.close()  # the client went: its channel closed
        assert proc.wait(timeout=WAIT) == 0
    with follower(python, tmp_path) as lost:
        worker.kill()
        worker.wait()
        assert lost.stdout is not None
        assert lost.stdout.read() == b""  # no end recorded, no worker: lost; stdin still open
        assert lost.wait(timeout=WAIT) == 0


@pytest.mark.parametrize("python", PYTHONS)
def test_the_follower_refuses_a_log_that_is_not_a_regular_file_and_caps_what_it_sends(
    tmp_path: Path, worker: subprocess.Popen[bytes], python: str
) -> None:
    write_status(tmp_path, worker, "succeeded")
    (tmp_path / "run.log").symlink_to("/dev/zero")
    with follower(python, tmp_path) as refused:
        out, err = refused.communicate(timeout=WAIT)
    assert refused.returncode == 3 and out == b"" and b"not a regular file" in err
    (tmp_path / "run.log").unlink()
    (tmp_path / "run.log").write_bytes(b"x" * 1000)
    with follower(python, tmp_path, offset=100, limit=400) as capped:
        out, _ = capped.communicate(timeout=WAIT)
    assert capped.returncode == 0 and out == b"x" * 300
