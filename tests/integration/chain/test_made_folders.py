"""A failed run (an exit code, a timeout, a missing output) removes the
empty folders it made for its outputs in the project, and only those no
other step of the dodo declares an output in: a shared `out/` stays, under
threads too, and a folder holding a file stays."""

from __future__ import annotations

from pathlib import Path

import pytest
from dodo_helpers import SANDBOXES, doit, make_project, popen_doit, popen_output, show, stop, wait_for
from progress import wait_exit

FAILING = """
def task_bx():
    yield from remote_step("bx", shell="exit 3", outputs=["bx/", "deep/er/f.txt", "kept/g.txt"])

def task_bt():
    yield from remote_step("bt", shell="sleep 30", outputs=["bt/"], timeout=0.5)

def task_bm():
    yield from remote_step("bm", shell="true", outputs=["bm/x.txt", "empty/"])
"""


def left_in(root: Path) -> list[str]:
    """What the project holds besides the store and doit's DB."""
    return sorted(p.name for p in root.iterdir() if p.name not in (".substrax", ".doit.db"))


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_a_failed_step_leaves_no_empty_output_folders_it_made(tmp_path: Path, sandbox: str) -> None:
    """An exit 3, a timeout and a missing output: the folders the runs made
    for their outputs go, each level of them (even the empty folder output
    of the run that missed another); a folder that was there stays."""
    root = make_project(tmp_path, FAILING, ["bx", "bt", "bm"], sandbox=sandbox)
    (root / "kept").mkdir()
    done = doit(root, "--continue")
    said = done.stdout + done.stderr
    assert done.returncode == 1, show(done)
    assert "exit code 3" in said and "timed_out" in said and "bm/x.txt" in said, show(done)
    assert left_in(root) == ["dodo.py", "kept", "pyproject.toml"], show(done)
    assert "bx: removed the empty output folder(s) it made: deep/er/, bx/, deep/\n" in said, show(done)
    assert "bt: removed the empty output folder(s) it made: bt/\n" in said, show(done)
    assert "bm: removed the empty output folder(s) it made: bm/, empty/\n" in said, show(done)


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_a_folder_holding_a_file_the_user_put_there_is_kept(tmp_path: Path, sandbox: str) -> None:
    """The run made `notes/sub/`; the user put a file in `notes/` while it
    ran: `notes/sub/` goes, `notes/` and the file stay."""
    # The gate is in an input folder: the sandbox shows the project's
    # inputs, not /tmp nor the rest of the project.
    body = """
def task_bu():
    yield from remote_step("bu", shell="while [ ! -e gate/go ]; do sleep 0.05; done; exit 3",
                           inputs=["gate/"], outputs=["notes/sub/r.txt"])
"""
    root = make_project(tmp_path, body, ["bu"], sandbox=sandbox)
    (root / "gate").mkdir()
    go = root / "gate" / "go"
    proc = popen_doit(root)
    try:
        wait_for((root / "notes" / "sub").is_dir, "the run to make notes/sub/")
        (root / "notes" / "mine.txt").write_text("the user's\n")
        go.touch()
        assert wait_exit(proc, "the doit to end", 90) == 1, popen_output(root)
    finally:
        stop(proc)
    said = popen_output(root)
    assert "exit code 3" in said, said
    assert (root / "notes" / "mine.txt").read_text() == "the user's\n", said
    assert sorted(p.name for p in (root / "notes").iterdir()) == ["mine.txt"], said
    assert "bu: removed the empty output folder(s) it made: notes/sub/\n" in said, said


SHARED_OUT = """
def task_w():
    for n in range(7):
        yield from remote_step(f"w:{n}", shell=f"sleep 1; echo {n} > out/s{n}.txt", outputs=[f"out/s{n}.txt"])

def task_bad():
    yield from remote_step("bad", shell="exit 3", outputs=["out/bad/"])
"""


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_threads_sharing_a_new_folder_never_lose_it_to_a_failed_step(tmp_path: Path, sandbox: str) -> None:
    """Eight steps under `doit -n 4 -P thread` with outputs in a new `out/`:
    `bad` fails at once while the others still write. It removes its own
    `out/bad/`, never `out/`, which is the others' too: they all succeed."""
    root = make_project(tmp_path, SHARED_OUT, ["bad", "w"], sandbox=sandbox)
    done = doit(root, "-n", "4", "-P", "thread", "--continue")
    said = done.stdout + done.stderr
    assert done.returncode == 1, show(done)
    assert "exit code 3" in said, show(done)
    assert "could not start" not in said and "No such file" not in said, show(done)
    assert sorted(p.name for p in (root / "out").iterdir()) == [f"s{n}.txt" for n in range(7)], show(done)
    assert "bad | removed the empty output folder(s) it made: out/bad/\n" in said, show(done)


SWEEP = """
def task_fit():
    for lr in (1, 2, 3):
        command = "exit 3" if lr == 3 else f"echo {lr} > runs/lr{lr}/m.txt"
        yield from remote_step(f"fit:lr{lr}", shell=command, outputs=[f"runs/lr{lr}/"])
"""


def test_a_failed_sweep_member_removes_its_own_folder_and_keeps_the_shared_parent(tmp_path: Path) -> None:
    """`fit:lr3` fails: `runs/lr3/` is its alone and goes; `runs/` holds
    the other members' outputs and stays."""
    root = make_project(tmp_path, SWEEP, ["fit"])
    done = doit(root, "--continue")
    said = done.stdout + done.stderr
    assert done.returncode == 1, show(done)
    assert sorted(p.name for p in (root / "runs").iterdir()) == ["lr1", "lr2"], show(done)
    assert (root / "runs" / "lr1" / "m.txt").read_text() == "1\n", show(done)
    assert "fit:lr3: removed the empty output folder(s) it made: runs/lr3/\n" in said, show(done)
