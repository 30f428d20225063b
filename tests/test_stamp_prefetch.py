"""Output stamps walked ahead by a forked child (stamp_prefetch.py): the
same stamps as a walk in line, never used once a task the check depends on
has run, no child with other threads about, and no child left behind.

The scenarios in prefetch_scenarios.py drive the module as a check does,
with doit's own Task objects, each in a fresh interpreter; the chain tests
run the real `doit` on a project of several steps.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import prefetch_scenarios
import pytest
from dodo_helpers import clean_env, doit_ok, make_project, run_count, show, step_ran, step_skipped

TESTS = Path(__file__).resolve().parent
STEPS = 5

# every public function of prefetch_scenarios, in its order
SCENARIOS = [
    name
    for name, value in vars(prefetch_scenarios).items()
    if inspect.isfunction(value) and value.__module__ == prefetch_scenarios.__name__
    and not name.startswith("_")
]
RUN_SCENARIO = """
import sys
from pathlib import Path

import prefetch_scenarios
from substrax_tasks import stamp_prefetch

getattr(prefetch_scenarios, sys.argv[1])(Path(sys.argv[2]))
current = stamp_prefetch._CURRENT
if current is not None:
    current.close()
"""


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenario_in_a_fresh_interpreter(tmp_path: Path, scenario: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", RUN_SCENARIO, scenario, str(tmp_path)],
        # run where the scratch folder is, so a child left behind would be found there
        cwd=tmp_path, env=clean_env({"PYTHONPATH": str(TESTS)}), capture_output=True, text=True,
        timeout=120, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert _processes_in(tmp_path) == []


# ------------------------------------------------------------ with doit

BODY = f"""
def task_steps():
    for i in range({STEPS}):
        yield from remote_step(
            f"s{{i}}",
            shell=f"mkdir -p out/s{{i}} && cp data/in.txt out/s{{i}}/a.txt && echo {{i}} > out/s{{i}}/b.txt",
            inputs=["data/in.txt"],
            outputs=[f"out/s{{i}}/"],
        )
"""
NAMES = [f"s{i}" for i in range(STEPS)]

# A no-op doit in-process, then what the child did for it.
NOOP_WITH_CHILD = """
import sys
from doit.cmd_base import DodoTaskLoader
from doit.doit_cmd import DoitMain
from substrax_tasks import stamp_prefetch

code = DoitMain(DodoTaskLoader()).run([])
prefetch = stamp_prefetch._CURRENT
print(prefetch is not None, prefetch is not None and prefetch.closed)
sys.exit(code)
"""


def _processes_in(root: Path) -> list[int]:
    """Live processes whose working folder is `root` (a forked child of
    doit's has doit's)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if Path(os.readlink(entry / "cwd")) == root:
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.fixture
def built(tmp_path: Path) -> Path:
    project = make_project(tmp_path, BODY, NAMES, files={"data/in.txt": "in\n"})
    first = doit_ok(project)
    assert all(step_ran(first, name) for name in NAMES), show(first)
    return project


def test_a_noop_doit_forks_one_child_and_leaves_none(built: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", NOOP_WITH_CHILD], cwd=built, env=clean_env(), capture_output=True,
        text=True, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert all(f"-- {name}" in done.stdout for name in NAMES), done.stdout
    forked, closed = done.stdout.strip().splitlines()[-1].split()
    assert (forked, closed) == ("True", "True")  # every step taken: closed before exit
    assert _processes_in(built) == []


@pytest.mark.parametrize("pool", [[], ["-n", "2", "-P", "thread"]], ids=["serial", "threads"])
@pytest.mark.parametrize("where", ["first", "last"])
def test_an_edit_is_seen_whichever_side_walks_it(built: Path, where: str, pool: list[str]) -> None:
    """The child walks from the last step, the checks start at the first;
    under `-P thread` doit starts its threads after the first check (and the
    fork), and the step that reruns does so beside the later checks."""
    assert all(step_skipped(doit_ok(built, *pool), name) for name in NAMES)
    name = NAMES[0] if where == "first" else NAMES[-1]
    (built / "out" / name / "b.txt").write_text("tampered\n")
    again = doit_ok(built, *pool)
    assert step_ran(again, name), show(again)
    assert [n for n in NAMES if n != name and not step_skipped(again, n)] == [], show(again)
    assert (built / "out" / name / "b.txt").read_text() == f"{name[1:]}\n"
    assert run_count(built) == STEPS + 1  # that step only
    assert _processes_in(built) == []
