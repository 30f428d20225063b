"""A declared input edited while its run goes (issue 28, item 1): the run's
key was taken at launch from the old content, but on `local` the sandbox
binds the live file, so the command read the new one. Its outputs are
promoted (the run happened), but the run is not kept in the run cache (a
clone holding the old content would get an output of the new), not
recorded up to date (undoing the edit reruns it), `why` names the file, and
doit says so once.

Real `doit`, real bubblewrap; the command waits, in the run, for the edit
the test makes (no sleep decides anything). The ssh case is in
tests/integration/ssh/test_ssh_edited_mid_run.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from cache_parts import restored
from dodo_helpers import (
    compute,
    doit_ok,
    make_project,
    needs_bwrap,
    popen_doit,
    popen_output,
    run_count,
    show,
    step_ran,
    step_skipped,
    stop,
    wait_for,
    write_pyproject,
)
from progress import wait_exit

# The value of a secret (forwarded, never in the key): 1 in the doit whose
# run waits for the test's edit, 0 in the doits after it.
WORK = """\
import os, time
if os.environ["WAIT_FOR_EDIT"] == "1":
    print("waiting for an edit of in.txt", flush=True)
    while open("in.txt").read() == "A\\n":
        time.sleep(0.02)
os.makedirs("out", exist_ok=True)
open("out/result.txt", "w").write(open("in.txt").read())
"""
STEP = """
def task_work():
    yield from remote_step("work", command=["python3", "work.py"], inputs=["work.py", "in.txt"],
                           outputs=["out/result.txt"], secrets=["WAIT_FOR_EDIT"])
"""
SAID = "work: in.txt changed while the run went: not kept in the run cache; the next doit runs it again"


def a_clone(tmp_path: Path, name: str) -> Path:
    """The project, the run cache on in the test's one $XDG_CACHE_HOME."""
    (tmp_path / name).mkdir()
    root = make_project(tmp_path / name, STEP, ["work"], files={"work.py": WORK, "in.txt": "A\n"})
    write_pyproject(root, cache="")  # the cache as shipped: on
    return root


def run_log_says(root: Path, text: str) -> bool:
    return any(text in log.read_text(errors="replace") for log in root.glob(".substrax/runs/*/run.log"))


def said(done: subprocess.CompletedProcess[str]) -> str:
    return done.stdout + done.stderr


@needs_bwrap
def test_an_input_edited_while_the_run_goes_is_promoted_not_cached_and_runs_again(tmp_path: Path) -> None:
    first = a_clone(tmp_path, "a")
    going = popen_doit(first, env={"WAIT_FOR_EDIT": "1"})
    try:
        wait_for(lambda: run_log_says(first, "waiting for an edit") or going.poll() is not None,
                 "the run to wait for the edit")  # fmt: skip
        assert going.poll() is None, popen_output(first)
        (first / "in.txt").write_text("B\n")  # saved while the run goes
        assert wait_exit(going, "the doit to end", 90) == 0, popen_output(first)
    finally:
        stop(going)
    output = popen_output(first)
    assert (first / "out" / "result.txt").read_text() == "B\n", output  # promoted: the run happened
    assert output.count(SAID) == 1, output

    why = compute(first, "why", "work")
    assert "input changed: in.txt" in why.stdout, show(why)

    # The edit undone: a second clone holding the old content gets no output of the new one.
    (first / "in.txt").write_text("A\n")
    second = a_clone(tmp_path, "b")
    done = doit_ok(second, env={"WAIT_FOR_EDIT": "0"})
    assert not restored(done) and run_count(second) == 1, show(done)
    assert (second / "out" / "result.txt").read_text() == "A\n"

    # ... and the first clone runs the step again, on the file as it is now.
    why = compute(first, "why", "work")
    assert "input changed: in.txt" in why.stdout, show(why)
    done = doit_ok(first, env={"WAIT_FOR_EDIT": "0"})
    assert step_ran(done, "work") and SAID not in said(done), show(done)
    assert (first / "out" / "result.txt").read_text() == "A\n"
    done = doit_ok(first, env={"WAIT_FOR_EDIT": "0"})
    assert step_skipped(done, "work"), show(done)
    assert compute(first, "why", "work").stdout.strip() == "work: up to date"


LOCK_WORK = """\
import os, time
if os.environ["WAIT_FOR_EDIT"] == "1":
    print("waiting for an edit of requirements.txt", flush=True)
    while open("requirements.txt").read() == "":
        time.sleep(0.02)
os.makedirs("out", exist_ok=True)
open("out/result.txt", "w").write(open("requirements.txt").read())
"""


@needs_bwrap
def test_the_lock_file_edited_while_the_run_goes_is_named_and_the_step_runs_again(tmp_path: Path) -> None:
    """The lock file is in every run's view and key, as a declared input is."""
    (tmp_path / "a").mkdir()
    root = make_project(tmp_path / "a", STEP, ["work"],
                        files={"work.py": LOCK_WORK, "in.txt": "A\n", "requirements.txt": ""})  # fmt: skip
    write_pyproject(root, cache="")
    going = popen_doit(root, env={"WAIT_FOR_EDIT": "1"})
    try:
        wait_for(lambda: run_log_says(root, "waiting for an edit") or going.poll() is not None,
                 "the run to wait for the edit")  # fmt: skip
        assert going.poll() is None, popen_output(root)
        (root / "requirements.txt").write_text("# nothing to install\n")
        assert wait_exit(going, "the doit to end", 120) == 0, popen_output(root)
    finally:
        stop(going)
    said_lock = SAID.replace("in.txt", "requirements.txt")
    assert popen_output(root).count(said_lock) == 1, popen_output(root)
    why = compute(root, "why", "work")
    assert "environment changed: requirements.txt changed" in why.stdout, show(why)
    (root / "requirements.txt").write_text("")  # undone: the step runs again all the same
    done = doit_ok(root, env={"WAIT_FOR_EDIT": "0"})
    assert step_ran(done, "work") and said_lock not in said(done), show(done)
    assert (root / "out" / "result.txt").read_text() == ""


CKPT_WORK = """\
import os, time
os.makedirs("ckpt", exist_ok=True)
if os.environ["WAIT_FOR_EDIT"] == "1":
    print("waiting for an edit of in.txt", flush=True)
    while open("in.txt").read() == "A\\n":
        time.sleep(0.02)
open("ckpt/state.txt", "w").write(open("in.txt").read())  # a checkpoint made from the edited file
os.makedirs("out", exist_ok=True)
open("out/result.txt", "w").write(open("in.txt").read())
"""
CKPT_STEP = """
def task_work():
    yield from remote_step("work", command=["python3", "work.py"], inputs=["work.py", "in.txt"],
                           outputs=["out/result.txt"], secrets=["WAIT_FOR_EDIT"], checkpoints="ckpt/")
"""


@needs_bwrap
def test_checkpoints_kept_by_a_run_whose_input_was_edited_are_not_kept_under_its_key(tmp_path: Path) -> None:
    """keep_checkpoints = true keeps a step's checkpoints under its key after
    the promotion, for the next run of that key to start from. A run whose
    input was edited while it went made them from other files than its key
    names: kept, the edit undone, the next run of that key would start from
    a checkpoint of the edited file. They are removed, as without
    keep_checkpoints."""
    (tmp_path / "a").mkdir()
    root = make_project(tmp_path / "a", CKPT_STEP, ["work"], files={"work.py": CKPT_WORK, "in.txt": "A\n"})
    write_pyproject(root, extra="keep_checkpoints = true\n")
    going = popen_doit(root, env={"WAIT_FOR_EDIT": "1"})
    try:
        wait_for(lambda: run_log_says(root, "waiting for an edit") or going.poll() is not None,
                 "the run to wait for the edit")  # fmt: skip
        assert going.poll() is None, popen_output(root)
        (root / "in.txt").write_text("B\n")
        assert wait_exit(going, "the doit to end", 90) == 0, popen_output(root)
    finally:
        stop(going)
    output = popen_output(root)
    assert "in.txt changed while the run went" in output, output
    kept = [p for p in (root / ".substrax" / "checkpoints").rglob("state.txt")]
    assert kept == [], (kept, output)

    (root / "in.txt").write_text("A\n")  # undone: the next run starts from nothing of B
    done = doit_ok(root, env={"WAIT_FOR_EDIT": "0"})
    assert "checkpoints of an earlier run in place" not in said(done), show(done)
    assert (root / "out" / "result.txt").read_text() == "A\n"
