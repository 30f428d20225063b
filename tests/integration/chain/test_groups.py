"""Sweeps as doit groups: a step named "group:member" is doit's sub-task
`member` of `group`, so `doit group` runs the sweep, `doit list` shows one
row for it, `doit group:member` runs one member and `task_dep: ["group"]`
waits for all. Run with the real doit, serially and with threads."""

from __future__ import annotations

from pathlib import Path

import pytest
from dodo_helpers import (
    compute,
    compute_status,
    doit,
    doit_ok,
    make_project,
    run_count,
    runs_of,
    show,
    step_ran,
    step_skipped,
)

MEMBERS = ["a", "b", "c", "d", "e", "f", "g", "h"]
SWEEP = """
MEMBERS = {members!r}

def task_fit():
    for m in MEMBERS:
        yield from remote_step(f"fit:{{m}}", shell=f"echo {{m}} > fit-{{m}}.txt", outputs=[f"fit-{{m}}.txt"])

def task_report():
    return {{
        "actions": ["cat " + " ".join(f"fit-{{m}}.txt" for m in MEMBERS) + " > report.txt"],
        "task_dep": ["fit"],
        "targets": ["report.txt"],
    }}
"""


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return make_project(tmp_path, SWEEP.format(members=MEMBERS))


def listed(root: Path, *args: str) -> list[str]:
    return [line.split()[0] for line in doit_ok(root, "list", *args).stdout.splitlines() if line.strip()]


def test_doit_list_shows_the_group_once_and_its_members_with_all(root: Path) -> None:
    assert listed(root) == ["fit", "report"]
    assert listed(root, "--all") == ["fit", *(f"fit:{m}" for m in MEMBERS), "report"]
    assert not any(name.startswith("_") for name in listed(root, "--all"))  # the phase tasks stay hidden


def test_the_group_runs_the_whole_sweep_and_a_member_runs_alone(root: Path) -> None:
    done = doit_ok(root, "fit")
    assert all(step_ran(done, f"fit:{m}") for m in MEMBERS), show(done)
    for m in MEMBERS:
        assert (root / f"fit-{m}.txt").read_text() == f"{m}\n"
    assert not (root / "report.txt").exists()
    (root / "fit-c.txt").write_text("edited\n")
    again = doit_ok(root, "fit:c")
    assert step_ran(again, "fit:c") and not step_ran(again, "fit:a"), show(again)
    assert (root / "fit-c.txt").read_text() == "c\n"
    assert [len(runs_of(root, f"fit:{m}")) for m in MEMBERS] == [1, 1, 2, 1, 1, 1, 1, 1]
    noop = doit_ok(root, "fit")
    assert all(step_skipped(noop, f"fit:{m}") for m in MEMBERS), show(noop)


@pytest.mark.parametrize("threads", [None, "4"], ids=["serial", "threads"])
def test_a_task_dep_on_the_group_waits_for_every_member(root: Path, threads: str | None) -> None:
    args = ["-n", threads, "-P", "thread"] if threads else []
    done = doit_ok(root, *args, "report")
    assert (root / "report.txt").read_text() == "".join(f"{m}\n" for m in MEMBERS), show(done)
    assert run_count(root) == len(MEMBERS)
    assert all(step_skipped(doit_ok(root, *args, "report"), f"fit:{m}") for m in MEMBERS)


@pytest.mark.parametrize("name", ["fit:", ":a"])
def test_a_group_or_member_left_empty_is_refused_before_anything_runs(tmp_path: Path, name: str) -> None:
    body = f'def task_bad():\n    yield from remote_step({name!r}, shell="true", outputs=["x.txt"])\n'
    root = make_project(tmp_path, body, ["bad"])
    done = doit(root)
    assert done.returncode == 1, show(done)
    assert "a name with ':' is GROUP:MEMBER" in done.stderr, show(done)
    assert run_count(root) == 0


def test_why_and_status_name_a_member_by_its_full_name(root: Path) -> None:
    doit_ok(root, "fit")
    done = compute(root, "why", "fit:b")
    assert done.returncode == 0 and done.stdout.strip() == "fit:b: up to date", show(done)
    (root / "fit-b.txt").write_text("edited\n")
    assert "outputs: changed content: fit-b.txt" in compute(root, "why", "fit:b").stdout
    assert sorted({run["step"] for run in compute_status(root)}) == [f"fit:{m}" for m in MEMBERS]


SUBJECTS = """
DOIT_CONFIG = doit_config()  # no default_tasks: `doit` runs every task, the hidden groups first

def task_subject():
    for s in ["s1", "s2", "s3", "s4"]:
        command = "exit 3" if s == "s3" else f"echo {s} > out-{s}.txt"
        yield from remote_step(f"subject:{s}", shell=command, outputs=[f"out-{s}.txt"])
"""


@pytest.mark.parametrize("threads", [None, "4"], ids=["serial", "threads"])
def test_each_step_is_promoted_as_soon_as_it_is_fetched_whatever_fails_later(
    tmp_path: Path, threads: str | None
) -> None:
    root = make_project(tmp_path, SUBJECTS)  # sandboxed where bubblewrap works: outputs land in staging
    args = ["-n", threads, "-P", "thread"] if threads else []
    failed = doit(root, *args)
    assert failed.returncode == 1, show(failed)
    assert "until its outputs are home" not in failed.stdout + failed.stderr, show(failed)
    promoted = [s for s in ["s1", "s2", "s4"] if (root / f"out-{s}.txt").exists()]
    # serially doit stops at s3; with threads s4 may have been under way
    assert promoted[:2] == ["s1", "s2"], show(failed)
    for s in promoted:
        assert (root / f"out-{s}.txt").read_text() == f"{s}\n"
        assert compute(root, "why", f"subject:{s}").stdout.strip() == f"subject:{s}: up to date"
    runs = run_count(root)
    again = doit(root, *args, "subject:s1", "subject:s2")
    assert again.returncode == 0, show(again)
    assert run_count(root) == runs  # nothing ran again: their outputs were home


OWN_GROUP = """
def task_fits():
    for m in ["a", "b"]:
        yield from remote_step(f"fit:{m}", shell=f"echo {m} > fit-{m}.txt", outputs=[f"fit-{m}.txt"])

def task_fit():
    return {"actions": None, "task_dep": ["fit:a", "fit:b"]}
"""

HELPER = """
def sweep():
    for m in ["a", "b"]:
        yield from remote_step(f"fit:{m}", shell=f"echo {m} > fit-{m}.txt", outputs=[f"fit-{m}.txt"])

def task_fit():
    yield from sweep()
"""


def test_a_dodo_declaring_its_own_group_task_is_told_what_to_remove(tmp_path: Path) -> None:
    """The workaround older versions needed: before, doit stopped with
    `Task names must be unique. fit` and no hint."""
    root = make_project(tmp_path, OWN_GROUP)
    done = doit(root, "fit")
    said = done.stdout + done.stderr
    assert done.returncode == 1, show(done)
    assert "doit makes the group task 'fit' itself" in said, show(done)
    assert f"declares its own task_fit ({root / 'dodo.py'}:" in said and "remove task_fit" in said, show(done)
    assert "Traceback" not in said and run_count(root) == 0, show(done)


GROUP_DICT = '    yield {"basename": "fit", "actions": None, "task_dep": ["fit:a", "fit:b"]}\n'
MEMBER_STEPS = """    for m in ["a", "b"]:
        yield from remote_step(f"fit:{m}", shell=f"echo {m} > fit-{m}.txt", outputs=[f"fit-{m}.txt"])
"""
YIELDED_GROUP = {  # the group task yielded before its members, or after them
    "before": "\ndef task_fits():\n" + GROUP_DICT + MEMBER_STEPS,
    "after": "\ndef task_fits():\n" + MEMBER_STEPS + GROUP_DICT,
}


@pytest.mark.parametrize("order", list(YIELDED_GROUP))
def test_a_task_function_yielding_its_own_group_task_is_told_what_to_remove(
    tmp_path: Path, order: str
) -> None:
    """The workaround's other form: the group task yielded beside its
    members. Before, doit said only `Task generation 'fits' has duplicated
    definition of 'fit'`."""
    root = make_project(tmp_path, YIELDED_GROUP[order])
    done = doit(root, "fit")
    said = done.stdout + done.stderr
    assert done.returncode == 1, show(done)
    assert "step 'fit:a' is a member of the sweep 'fit', and doit makes the group task 'fit' itself" in said
    assert f"yields its own {{'basename': 'fit'}} from task_fits ({root / 'dodo.py'}:" in said, show(done)
    assert "remove that yield" in said and "duplicated definition" not in said, show(done)
    assert "Traceback" not in said and run_count(root) == 0, show(done)


def test_a_group_s_own_function_may_declare_its_members_through_a_helper(tmp_path: Path) -> None:
    root = make_project(tmp_path, HELPER)
    done = doit_ok(root, "fit")
    assert step_ran(done, "fit:a") and step_ran(done, "fit:b"), show(done)
