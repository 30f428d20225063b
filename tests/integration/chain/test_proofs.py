"""The up-to-date proofs (proofs.py): one file per project that lets a
no-op `doit` skip the full check of a step, and never a change.

A proof is kept only for a step whose inputs, outputs and record are older
than the racy window, so the chain tests here wait it out once before the
no-op that records the proof (the tests' doit runs with a short window,
dodo_helpers.RACY_SECONDS).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from dodo_helpers import (
    DEFAULT_SANDBOX,
    clean_env,
    doit_ok,
    run_count,
    show,
    step_ran,
    step_skipped,
    write_pyproject,
)
from proofs_parts import (
    FILE_NAME,
    proven,
    root,  # noqa: F401 - fixtures
)

from substrax_tasks.step.dodo import find_step
from substrax_tasks.uptodate import check as uptodate
from substrax_tasks.uptodate.check import DOIT_VALUE, Step

# ------------------------------------------------------------ the file


# ----------------------------------------------------------- the chain


def test_a_kept_proof_answers_without_the_full_check(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    step = find_step(root, "step")[0].step

    def full_check(step: Step, values: object) -> Iterator[str]:
        raise AssertionError("the full check was made")

    monkeypatch.setattr(uptodate, "reasons_to_run", full_check)
    assert uptodate.status(step, {DOIT_VALUE: "run"}).up_to_date
    assert uptodate.status(step, None, every_reason=True).up_to_date  # `why` takes the proof too
    # doit has no value for the task (`doit forget`): the full check decides
    with pytest.raises(AssertionError, match="full check"):
        uptodate.status(step, {})
    assert step_skipped(doit_ok(root), "step")
    assert run_count(root) == 1


def _edit_output(root: Path) -> None:
    (root / "out" / "a.txt").write_text("tampered\n")


def _edit_input(root: Path) -> None:
    (root / "data" / "in.txt").write_text("changed\n")


def _add_to_input_folder(root: Path) -> None:
    (root / "data" / "dir" / "y").write_text("y\n")


def _remove_record(root: Path) -> None:
    (root / ".substrax" / "steps" / "step.json").unlink()


def _change_settings(root: Path) -> None:
    write_pyproject(root, DEFAULT_SANDBOX)
    text = (root / "pyproject.toml").read_text()
    assert "grace_seconds = 0.5" in text
    (root / "pyproject.toml").write_text(text.replace("grace_seconds = 0.5", "grace_seconds = 0.7"))


def _add_environment_lock(root: Path) -> None:
    (root / "requirements.txt").write_text("# numpy==2.0.0\n")  # offline: an env with nothing in it


def _forget(root: Path) -> None:
    doit_ok(root, "forget", "step")


CHANGES: dict[str, Callable[[Path], None]] = {
    "edit-output": _edit_output,
    "edit-input": _edit_input,
    "add-to-input-folder": _add_to_input_folder,
    "remove-record": _remove_record,
    "change-settings": _change_settings,
    "add-environment-lock": _add_environment_lock,
    "doit-forget": _forget,
}


@pytest.mark.parametrize("change", CHANGES)
def test_every_change_reruns_despite_a_kept_proof(root: Path, change: str) -> None:
    CHANGES[change](root)
    again = doit_ok(root)
    assert step_ran(again, "step"), show(again)
    assert run_count(root) == 2
    assert step_skipped(doit_ok(root), "step")
    assert run_count(root) == 2


def test_a_damaged_proof_file_costs_the_full_check_only(root: Path) -> None:
    path = root / ".substrax" / "cache" / FILE_NAME
    path.write_text("{damaged")
    assert step_skipped(doit_ok(root), "step")
    assert set(proven(root)) == {"step"}  # written again
    path.unlink()
    assert step_skipped(doit_ok(root), "step")
    assert run_count(root) == 1


# What a no-op doit imports: each of these cost milliseconds on every run.
NOOP_DOIT = """
import sys
from doit.cmd_base import DodoTaskLoader
from doit.doit_cmd import DoitMain

code = DoitMain(DodoTaskLoader()).run([])
print(sorted(sys.modules))
sys.exit(code)
"""
NOT_ON_A_NOOP = ("pydantic", "filelock", "uuid", "substrax_tasks.run.promote",
                 "substrax_tasks.run.steplock", "substrax_tasks.backends.job", "substrax_tasks.backends")


# After the run, is anything still holding doit's tasks? (The runners stay in
# a module's table for `why`; held from there, doit's whole task graph was
# left for the interpreter's teardown to free: +0.1 s at exit, 1,000 steps.)
HELD_AFTER_RUN = """
import gc, sys
from doit.cmd_base import DodoTaskLoader
from doit.doit_cmd import DoitMain
from doit.task import Task

code = DoitMain(DodoTaskLoader()).run([])
gc.unfreeze()  # the step's first check froze what loading made: collect it all here
gc.collect()
print(sum(isinstance(o, Task) for o in gc.get_objects()))
sys.exit(code)
"""


def noop_doit_says(root: Path, script: str) -> str:
    """Run `script` (a no-op doit in-process) in the project; its last line."""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, env=clean_env(), capture_output=True, text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "-- step" in done.stdout
    return done.stdout.strip().splitlines()[-1]


def test_nothing_holds_doits_tasks_once_a_noop_doit_has_run(root: Path) -> None:
    assert noop_doit_says(root, HELD_AFTER_RUN) == "0"


def test_a_noop_doit_imports_no_machinery_of_the_phases(root: Path) -> None:
    modules = noop_doit_says(root, NOOP_DOIT)
    imported = [name for name in NOT_ON_A_NOOP if repr(name) in modules]
    assert imported == []


# ------------------------------------------- what loading a dodo installs

LOAD_ONLY = """
import atexit, json, signal, sys
from doit.loader import get_module, load_tasks

# As inherited (a `nohup make test` starts with SIGHUP ignored): loading must leave them so.
before = {name: signal.getsignal(getattr(signal, name)) for name in ("SIGTERM", "SIGHUP")}
hooks = atexit._ncallbacks()
module = get_module("dodo.py", seek_parent=False)
tasks = {t.name: t for t in load_tasks(dict(vars(module)), allow_delayed=False)}
loaded = {
    "sigterm_kept": signal.getsignal(signal.SIGTERM) is before["SIGTERM"],
    "sighup_kept": signal.getsignal(signal.SIGHUP) is before["SIGHUP"],
    "new_exit_hooks": atexit._ncallbacks() - hooks,
    "tasks": sorted(tasks),
}
check = tasks["step"].uptodate[0][0]  # the step's own check, as doit would call it
check(tasks["step"], {})
loaded["sigterm_mapped_at_first_check"] = signal.getsignal(signal.SIGTERM) is not before["SIGTERM"]
print(json.dumps(loaded))
"""


def test_loading_a_dodo_only_declares_tasks(root: Path) -> None:
    """Importing a dodo and calling its task functions installs no signal
    handler and no exit hook; the SIGTERM mapping doit needs comes with the
    first check, when doit runs tasks."""
    done = subprocess.run(
        [sys.executable, "-c", LOAD_ONLY], cwd=root, env=clean_env(), capture_output=True, text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout) == {
        "sigterm_kept": True,
        "sighup_kept": True,
        "new_exit_hooks": 0,
        "tasks": ["_step", "step"],
        "sigterm_mapped_at_first_check": True,
    }


# ------------------------------------------- what the collector walks at load

SWEEP_DODO = """
from substrax_tasks import remote_step


def task_sweep():
    for i in range(1000):
        yield from remote_step(f"s{i}", command=["true"], outputs=[f"out/s{i}/"])
"""

TRACKED_AFTER_LOAD = """
import gc, json
from doit.loader import get_module, load_tasks
module = get_module("dodo.py", seek_parent=False)
tasks = load_tasks(dict(vars(module)), allow_delayed=False)
print(json.dumps({"tasks": len(tasks), "tracked": sum(len(gc.get_objects(g)) for g in range(3))}))
"""


def test_declaring_many_steps_leaves_the_collector_only_the_last_ones(tmp_path: Path) -> None:
    """Issue 29: each full collection while a dodo is loaded walks every
    object the collector tracks, and the steps declared before were walked
    again and again (1 s of a 5 s no-op at 10,000 steps). What was made is
    frozen as steps are declared, so after 1,000 steps (~65 objects each)
    the collector tracks no more than the last hundred steps made."""
    (tmp_path / "dodo.py").write_text(SWEEP_DODO)
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "sweep"\nversion = "0"\n')
    done = subprocess.run(
        [sys.executable, "-c", TRACKED_AFTER_LOAD], cwd=tmp_path, env=clean_env(), capture_output=True,
        text=True, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    loaded = json.loads(done.stdout)
    assert loaded["tasks"] == 2000
    assert loaded["tracked"] < 10_000, loaded
