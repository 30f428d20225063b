"""Declarations checked at load: paths made clean, overlaps found (in-process;
the same refusals through `doit` are in test_chain_errors.py)."""

from __future__ import annotations

from pathlib import Path

from dodo_helpers import doit, make_project, run_count, show, write_dodo

from substrax_tasks.step.spec import MAX_STEP_NAME

# ------------------------------------------- arguments of the wrong type


LONG_STEP = """
def task_long():
    yield from remote_step({name!r}, command=["sh", "-c", "echo ok > out.txt"], outputs=["out.txt"])
"""


def test_the_longest_step_name_runs_and_one_more_is_refused_at_load(tmp_path: Path) -> None:
    """The limit is exact: a step of the longest name goes through the whole
    chain (its longest file name is made), one character more is refused
    before anything is made."""
    longest = "a" * MAX_STEP_NAME
    root = make_project(tmp_path, LONG_STEP.format(name=longest), default_tasks=[longest])
    done = doit(root)
    assert done.returncode == 0, show(done)
    assert (root / "out.txt").read_text() == "ok\n"
    write_dodo(root, LONG_STEP.format(name="b" * (MAX_STEP_NAME + 1)))
    refused = doit(root)
    assert refused.returncode == 1, show(refused)
    assert "the name is 229 characters; at most 228" in refused.stderr
    assert "Traceback" not in refused.stderr and run_count(root) == 1
