"""A declared input edited between the run's key's hashing and its upload
(issue 28, item 1), on the ssh backend: rsync copies the file as it is
then, so the run makes its outputs from content its key does not name.
They are promoted, but the run is not kept in the run cache (a clone
holding the key's content would get an output of the other), not recorded
up to date, and doit says so once.

The window is held open as a user meets it: the host's max_parallel = 1
slot is held by another step's run, so `work` has hashed its key and waits
for the slot while the test edits its input. Real `doit`, a real sshd in a
network namespace, real rsync; the local case is in
tests/integration/chain/test_edited_mid_run.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from cache_parts import restored
from dodo_helpers import (
    DOIT,
    clean_env,
    compute,
    doit_ok,
    popen_doit,
    popen_output,
    run_count,
    runs_of,
    show,
    step_ran,
    step_skipped,
    stop,
    wait_for,
)
from progress import wait_exit
from ssh_helpers import launched_status, make_ssh_project, needs_root, needs_sshd
from testbeds.sshd_host import SshHost

pytestmark = [needs_sshd, needs_root]

# `hold` keeps the host's one slot until the test drops out/go in its outputs.
STEPS = """
def task_hold():
    yield from remote_step("hold", outputs=["out/held.txt"], command=["python3", "-c",
        "import os, time\\n"
        "os.makedirs('out', exist_ok=True); open('out/waiting', 'w').close()\\n"
        "while not os.path.exists('out/go'): time.sleep(0.02)\\n"
        "os.remove('out/go'); os.remove('out/waiting'); open('out/held.txt', 'w').write('held')\\n"])

def task_work():
    yield from remote_step("work", shell="mkdir -p out && cat in.txt > out/result.txt",
                           inputs=["in.txt"], outputs=["out/result.txt"])
"""
SAID = "work: in.txt changed while the run went: not kept in the run cache; the next doit runs it again"


def a_clone(tmp_path: Path, name: str, host: SshHost) -> Path:
    """The project on the ssh host, one slot, the run cache on (as shipped)
    in the test's one $XDG_CACHE_HOME."""
    return make_ssh_project(tmp_path / name, host, STEPS, ("work",), files={"in.txt": "A\n"}, max_parallel=1)


def made(root: Path, step: str) -> bool:
    """Whether the step's run is recorded (its handle written: a run folder
    is made before it, so one may have none yet)."""
    try:
        return bool(runs_of(root, step))
    except FileNotFoundError:
        return False


def holding(root: Path) -> bool:
    status = launched_status(root, "hold") if made(root, "hold") else None
    return bool(
        status and status.get("outputs_root") and Path(status["outputs_root"], "out", "waiting").exists()
    )


def test_an_input_edited_before_its_upload_is_not_cached_and_runs_again(
    tmp_path: Path, host: SshHost
) -> None:
    first = a_clone(tmp_path, "a", host)
    hold = popen_doit(first, "hold")
    try:
        wait_for(lambda: holding(first) or hold.poll() is not None, "the hold step to take the slot")
        assert hold.poll() is None, popen_output(first)
        with (tmp_path / "work.out").open("w") as out:  # popen_doit's files are hold's
            work = subprocess.Popen([str(DOIT), "work"], cwd=first, env=clean_env(), stdout=out,
                                    stderr=subprocess.STDOUT, text=True)  # fmt: skip
        try:
            # work's key is hashed (its run is recorded with it); it waits for the slot, not uploaded yet
            wait_for(lambda: made(first, "work") or work.poll() is not None, "work's run to be made")
            (first / "in.txt").write_text("B\n")
            status = launched_status(first, "hold")
            assert status is not None
            Path(status["outputs_root"], "out", "go").touch()
            assert wait_exit(work, "doit work to end", 120) == 0, (tmp_path / "work.out").read_text()
            assert wait_exit(hold, "doit hold to end", 120) == 0, popen_output(first)
        finally:
            stop(work)
    finally:
        stop(hold)
    output = (tmp_path / "work.out").read_text()
    assert (first / "out" / "result.txt").read_text() == "B\n", output  # the uploaded content
    assert output.count(SAID) == 1, output

    # The edit undone: a second clone holding the key's content gets no output of the other.
    (first / "in.txt").write_text("A\n")
    second = a_clone(tmp_path, "b", host)
    done = doit_ok(second, "work")
    assert not restored(done) and run_count(second) == 1, show(done)
    assert (second / "out" / "result.txt").read_text() == "A\n"

    why = compute(first, "why", "work")
    assert "input changed: in.txt" in why.stdout, show(why)
    done = doit_ok(first, "work")
    assert step_ran(done, "work") and SAID not in done.stdout + done.stderr, show(done)
    assert (first / "out" / "result.txt").read_text() == "A\n"
    done = doit_ok(first, "work")
    assert step_skipped(done, "work"), show(done)
