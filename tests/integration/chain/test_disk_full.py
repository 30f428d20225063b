"""A command that fills the disk (issue 18, item 8): the run ends failed
with the reason, doit ends without a traceback (sqlite included), and the
next doit recovers with nothing deleted by hand.

The project (store and doit's DB with it) lives on a small tmpfs mounted
in a private mount namespace the test makes (as root); doit runs there
through nsenter. Real doit, real worker.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from disk_full_parts import FILL_ACTION, inside
from disk_full_parts import small_disk as a_small_disk
from dodo_helpers import (
    COMPUTE,
    DOIT,
    NO_RUN_CACHE,
    clean_env,
    make_project,
    run_count,
    step_skipped,
    write_dodo,
)
from ssh_helpers import needs_sshd, pyproject_text, ssh_settings
from testbeds.sshd_host import SshHost

BODY = """
def task_step():
    yield from remote_step(
        "step", inputs=["flags/"], outputs=["big"],  # a run sees its inputs only: the flag's folder
        command=["sh", "-c",
                 "if [ -e flags/fill ]; then dd if=/dev/zero of=big bs=1M; exit 1; fi; echo ok > big"],
    )
"""
DISK_MB = 24
WAIT_SECONDS = 60


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """(the project on a tmpfs of DISK_MB, the pid whose namespace holds it)."""
    (tmp_path / "src").mkdir()
    source = make_project(tmp_path / "src", BODY, default_tasks=["step"], files={"flags/fill": ""})
    root = tmp_path / "proj"
    with a_small_disk(source, root, DISK_MB) as pid:
        yield root, pid


def test_a_command_that_fills_the_disk_fails_with_the_reason_and_the_next_doit_recovers(
    small_disk: tuple[Path, int],
) -> None:
    root, pid = small_disk
    seen = Path(f"/proc/{pid}/root") / str(root).lstrip("/")
    full = inside(pid, root, str(DOIT))
    said = full.stdout + full.stderr
    assert full.returncode == 1, said
    assert "Traceback" not in said and "sqlite" not in said.lower(), said
    assert "failed (exit code 1): no space left on device where its outputs go" in said, said
    listed = inside(pid, root, str(COMPUTE), "status", "--all", "--json")
    assert listed.returncode == 0, listed.stderr
    (run,) = json.loads(listed.stdout)["runs"]
    assert run["state"] == "failed" and "no space left on device" in run["message"], run

    (seen / "flags" / "fill").unlink()
    again = inside(pid, root, str(DOIT))
    assert again.returncode == 0, again.stdout + again.stderr
    assert (seen / "big").read_text() == "ok\n"


# Issue 28, item 8: the disk fills just after the command ends. The test
# holds doit still (SIGSTOP) from the moment the command has written its
# output until the worker has recorded the run's end, fills the disk to the
# last byte, and lets doit go on: it fetches, promotes and saves its DB on a
# full disk. The command says it is ready, and waits to be let go, through
# files in its output folder (all the sandbox lets it write).
WAIT_FOR_GO = """
import os, time
version = open("version.txt").read()
os.makedirs("out", exist_ok=True)
with open("out/result.txt", "w") as f:
    f.write(version)
if version != "v1\\n":
    open("out/ready", "w").close()
    while not os.path.exists("out/go"):
        time.sleep(0.05)
    os.remove("out/ready")
    os.remove("out/go")
"""
STEP = """
def task_step():
    yield from remote_step("step", inputs=["version.txt", "work.py"], outputs=["out/"],
                           command=["python3", "work.py"])
"""


def _wait_for(found: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not found():
        assert time.monotonic() < deadline, f"waited {WAIT_SECONDS} s for {what}"
        time.sleep(0.05)


def _fill(folder: Path) -> list[Path]:
    """Files that fill the file system of `folder` to its last byte."""
    made: list[Path] = []
    for size in (1 << 20, 4096, 1):
        path = folder / f"filler-{len(made)}"
        made.append(path)
        with contextlib.suppress(OSError), path.open("wb") as f:
            while True:
                f.write(b"\0" * size)
                f.flush()
    return made


def _run_ended(seen: Path, earlier: set[Path]) -> bool:
    for status in set((seen / ".substrax" / "runs").glob("*/**/status.json")) - earlier:
        with contextlib.suppress(ValueError, OSError):
            # the worker gives back the room it kept for the status as it exits
            if json.loads(status.read_text()).get("state") == "succeeded":
                return not (status.parent / "status.reserve").exists()
    return False


def test_a_disk_that_fills_right_after_the_command_ends_in_one_message_and_the_next_doit_finishes(
    small_disk: tuple[Path, int],
) -> None:
    root, pid = small_disk
    seen = Path(f"/proc/{pid}/root") / str(root).lstrip("/")
    write_dodo(seen, STEP, default_tasks=["step"])
    (seen / "work.py").write_text(WAIT_FOR_GO)
    (seen / "version.txt").write_text("v1\n")
    first = inside(pid, root, str(DOIT))
    assert first.returncode == 0, first.stdout + first.stderr
    assert (seen / "out" / "result.txt").read_text() == "v1\n"

    (seen / "version.txt").write_text("v2\n")
    earlier = set((seen / ".substrax" / "runs").glob("*/**/status.json"))
    doit = subprocess.Popen(
        ["nsenter", "-t", str(pid), "-m", f"--wd={root}", "--", str(DOIT)],
        env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        _wait_for(lambda: bool(list(seen.glob(".substrax/runs/*/**/out/ready"))), "the command's output")
        doit.send_signal(signal.SIGSTOP)
        (ready,) = seen.glob(".substrax/runs/*/**/out/ready")
        (ready.parent / "go").touch()
        _wait_for(lambda: _run_ended(seen, earlier), "the worker to record the run's end")
        fillers = _fill(seen)
        doit.send_signal(signal.SIGCONT)
        said, _ = doit.communicate(timeout=120)
    finally:
        if doit.poll() is None:
            doit.kill()
            doit.communicate()
    assert doit.returncode == 1, said
    assert "Traceback" not in said, said
    assert "no space left" in said.lower() and str(root) in said, said
    assert "Free space there and run `doit` again" in said, said
    assert (seen / "out" / "result.txt").read_text() == "v1\n", "the earlier output was lost"

    for filler in fillers:
        filler.unlink(missing_ok=True)
    again = inside(pid, root, str(DOIT))
    assert again.returncode == 0, again.stdout + again.stderr
    assert (seen / "out" / "result.txt").read_text() == "v2\n"
    assert run_count(seen) == 2, "the command ran again"
    done = inside(pid, root, str(DOIT))
    assert done.returncode == 0 and "nothing to do" in done.stdout, done.stdout + done.stderr


# v1 writes 1 MB, v2 13 MB: the small disk holds v1 and v2 side by side (the
# copy is made beside the old output, then renamed over it), not two of v2.
BIG = """
import os, sys
version = open("version.txt").read().strip().encode()
os.makedirs(os.path.dirname(sys.argv[1]) or ".", exist_ok=True)
with open(sys.argv[1], "wb") as f:
    f.write(version * (({b"v1": 1, b"v2": 13}[version] << 20) // len(version)))
"""


@pytest.mark.parametrize(("output", "written"), [("out.bin", "out.bin"), ("out/", "out/model/out.bin")],
                         ids=["a-file", "a-folder"])  # fmt: skip
def test_a_full_disk_during_a_promotion_across_file_systems_keeps_the_old_output_and_the_next_doit_finishes(
    small_disk: tuple[Path, int], tmp_path: Path, output: str, written: str
) -> None:
    """The state folder on the machine's disk, the project (doit's DB with
    it) on the small one: outputs are promoted by a copy, which fills it.
    A folder's copy told the full disk as a list of errors and, once space
    was freed, was copied a second time after `recover` had finished it,
    which the disk had no room for: the step never finished."""
    root, pid = small_disk
    seen = Path(f"/proc/{pid}/root") / str(root).lstrip("/")
    (seen / "pyproject.toml").write_text(
        f'[tool.substrax.compute]\nstate_dir = "{tmp_path / "state"}"\n'
        '[tool.substrax.compute.backends.local]\n[tool.substrax.compute.cache]\nenabled = false\n'
    )
    write_dodo(seen, f"""
def task_step():
    yield from remote_step("step", inputs=["version.txt", "big.py"], outputs=[{output!r}],
                           command=["python3", "big.py", {written!r}])
""", default_tasks=["step"])  # fmt: skip
    (seen / "big.py").write_text(BIG)
    (seen / "version.txt").write_text("v1\n")
    first = inside(pid, root, str(DOIT))
    assert first.returncode == 0, first.stdout + first.stderr
    old = (seen / written).read_bytes()
    (seen / "filler").write_bytes(b"\0" * (12 << 20))  # 1 + 13 + 12 MB > DISK_MB

    (seen / "version.txt").write_text("v2\n")
    full = inside(pid, root, str(DOIT))
    said = full.stdout + full.stderr
    assert full.returncode == 1, said
    assert "Traceback" not in said, said
    assert said.count("no space left") == 1 and str(root) in said, said
    assert "Free space there and run `doit` again" in said, said
    assert (seen / written).read_bytes() == old, "the earlier output was lost"

    (seen / "filler").unlink()  # room for v2 beside v1, not for two copies of v2
    again = inside(pid, root, str(DOIT))
    assert again.returncode == 0, again.stdout + again.stderr
    assert (seen / written).read_bytes()[:2] == b"v2"
    assert len(list((tmp_path / "state" / "runs").iterdir())) == 2, "the command ran again"
    done = inside(pid, root, str(DOIT))
    assert done.returncode == 0 and "nothing to do" in done.stdout, done.stdout + done.stderr


@needs_sshd
def test_a_full_disk_here_during_an_ssh_fetch_is_told_as_one_and_the_next_doit_fetches_without_running_again(
    small_disk: tuple[Path, int], host: SshHost
) -> None:
    """rsync's receiver (this machine) meets the full disk: it said so in
    rsync's words, and doit exited 2; it is the phase's one message, exit 1."""
    root, pid = small_disk
    seen = Path(f"/proc/{pid}/root") / str(root).lstrip("/")
    (seen / "pyproject.toml").write_text(pyproject_text(ssh_settings(host)) + NO_RUN_CACHE)
    write_dodo(seen, """
def task_step():
    yield from remote_step("step", outputs=["out/"], command=[
        "sh", "-c", "mkdir -p out/m && head -c 9000000 /dev/urandom > out/m/data.bin"])
""", default_tasks=["step"])  # fmt: skip
    (seen / "filler").write_bytes(b"\0" * (16 << 20))  # 9 + 16 MB > DISK_MB
    full = inside(pid, root, str(DOIT))
    said = full.stdout + full.stderr
    assert full.returncode == 1, said
    assert said.count("no space left on the file system mounted at") == 1 and str(root) in said, said
    assert "Free space there and run `doit` again" in said and "Traceback" not in said, said

    (seen / "filler").unlink()
    again = inside(pid, root, str(DOIT))
    assert again.returncode == 0, again.stdout + again.stderr
    assert (seen / "out" / "m" / "data.bin").stat().st_size == 9000000
    assert run_count(seen) == 1 and "new run" not in again.stdout, again.stdout + again.stderr


# Issue 28, item 8, doit's own save: every phase of the step succeeds; a
# plain doit task after it (task_dep) fills the disk to the last byte, so
# only doit's save of its DB at the very end meets the full disk.
SAVE_LAST = FILL_ACTION.replace("fill-now", "fill-after-step") + """
def task_hello():
    return {"actions": ["echo hello"], "file_dep": ["version.txt"]}

def task_step():
    yield from remote_step("step", inputs=["version.txt"], outputs=["out/result.txt"],
                           command=["sh", "-c", "mkdir -p out && cp version.txt out/result.txt"])

def task_fill():
    return {"actions": [fill_the_disk], "task_dep": ["step"]}
"""


# Run inside the namespace: sqlite resolves /proc/PID/root, a link, to this one's /.
READ_DB = (
    "import json, sqlite3; db = sqlite3.connect('file:.doit.db?mode=ro', uri=True); "
    "print(json.dumps(sorted(db.execute('SELECT task_id, task_data FROM doit').fetchall())))"
)


def _doit_db_rows(pid: int, root: Path) -> list[list[str]]:
    """What doit's DB holds, read without writing to it."""
    read = inside(pid, root, sys.executable, "-c", READ_DB)
    assert read.returncode == 0, read.stderr
    rows: list[list[str]] = json.loads(read.stdout)
    return rows


def test_doits_own_save_failing_after_every_phase_succeeded_is_one_message_and_nothing_runs_again(
    small_disk: tuple[Path, int],
) -> None:
    root, pid = small_disk
    seen = Path(f"/proc/{pid}/root") / str(root).lstrip("/")
    write_dodo(seen, SAVE_LAST, default_tasks=["fill"])
    (seen / "version.txt").write_text("v1\n")
    before = inside(pid, root, str(DOIT), "hello")  # a DB with something in it
    assert before.returncode == 0, before.stdout + before.stderr
    kept = _doit_db_rows(pid, root)
    assert [row[0] for row in kept] == ["hello"], kept

    (seen / "fill-after-step").touch()
    full = inside(pid, root, str(DOIT))
    said = full.stdout + full.stderr
    assert full.returncode == 1, said
    assert "Traceback" not in said and "sqlite" not in said.lower(), said
    assert said.count("no space left") == 1, said
    assert f"no space left on the file system mounted at {root}: doit could not save its record" in said, said
    assert "Free space there and run `doit` again" in said, said
    assert list(seen.glob("filler-*")), "the fill task filled nothing"
    assert _doit_db_rows(pid, root) == kept, "doit's DB is not as the previous doit left it"
    assert (seen / "out" / "result.txt").read_text() == "v1\n"
    listed = inside(pid, root, str(COMPUTE), "status", "--all", "--json")
    assert listed.returncode == 0, listed.stderr
    (run,) = json.loads(listed.stdout)["runs"]
    assert run["state"] == "succeeded", run
    record = json.loads((seen / ".substrax" / "steps" / "step.json").read_text())
    assert record["verified"]["run_id"] == run["run_id"], record  # home and verified
    assert record.get("acknowledged") != run["run_id"], "acknowledged although doit saved nothing"
    assert run_count(seen) == 1

    for filler in [*seen.glob("filler-*"), seen / "fill-after-step"]:
        filler.unlink()
    again = inside(pid, root, str(DOIT))
    assert again.returncode == 0, again.stdout + again.stderr
    assert run_count(seen) == 1, "the command ran again"
    assert "new run" not in again.stdout and "restored" not in again.stdout, again.stdout
    assert (seen / "out" / "result.txt").read_text() == "v1\n"
    done = inside(pid, root, str(DOIT))  # the DB saved at last: doit itself finds the step up to date
    assert done.returncode == 0 and step_skipped(done, "step"), done.stdout + done.stderr
    print(f"\n[the save after the last phase] {said}\n[after space was freed] {again.stdout}")
