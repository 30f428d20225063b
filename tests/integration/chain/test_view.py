"""A run sees only what its step declares (issue 28, item 1): its inputs and
the environment's lock file. So every file the run could see is covered by
the up-to-date key and the run cache's key: a second clone whose undeclared
helper differs never gets the first clone's output, an edit of a declared
helper reruns the step and `why` names it, an edit of an undeclared file
reruns nothing, and a command naming an undeclared project file is refused
before anything is launched. A local run without the sandbox could read
anything, so it is never kept in the run cache.

Real `doit`, real git clones, real bubblewrap; the ssh and skypilot views
are held to the same rule in test_env_parity.py and test_skypilot_chain.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from cache_parts import restored
from dodo_helpers import (
    compute,
    doit,
    doit_ok,
    make_project,
    needs_bwrap,
    run_count,
    show,
    step_ran,
    step_skipped,
    write_dodo,
)
from local_runs import WORKER, log_text, outputs_root, run_dir, wait_final
from other_user import OtherUser
from view_parts import WORK, clone, git, work_step

from substrax_tasks.step.spec import make_spec
from substrax_tasks.store.project import Project


def said(done: subprocess.CompletedProcess[str]) -> str:
    return done.stdout + done.stderr


@needs_bwrap
def test_two_clones_with_different_helpers_never_share_an_output(tmp_path: Path) -> None:
    """The issue's reproduction: undeclared, the helper is not in the run's
    view (the run fails naming it); declared, it is in the key, and the
    second clone's other helper makes its own output."""
    first = clone(tmp_path, "a", "A", ["work.py"])
    failed = doit(first)
    assert failed.returncode == 1, show(failed)
    assert "No module named 'helper'" in said(failed), show(failed)
    assert (
        "the run sees the step's declared inputs only, and helper.py is not declared; "
        "declare it in inputs=[...] (in outputs=[...] if the command writes it)" in said(failed)
    ), show(failed)
    assert not (first / "out" / "result.txt").exists()

    write_dodo(first, work_step(["work.py", "helper.py"]), ["work"])
    doit_ok(first)
    assert (first / "out" / "result.txt").read_text() == "A"

    second = clone(tmp_path, "b", "B", ["work.py", "helper.py"])
    done = doit_ok(second)
    assert not restored(done) and step_ran(done, "work") and run_count(second) == 1, show(done)
    assert (second / "out" / "result.txt").read_text() == "B"

    third = clone(tmp_path, "c", "A", ["work.py", "helper.py"])  # the first clone's helper: a hit
    done = doit_ok(third)
    assert restored(done) and run_count(third) == 0, show(done)
    assert (third / "out" / "result.txt").read_text() == "A"


@needs_bwrap
def test_the_issues_reproduction_as_a_user_without_root_with_roots_folders_left_on_path(
    other_user: OtherUser,
) -> None:
    """The same reproduction as a new user on a shared machine runs it: no
    root, one $XDG_CACHE_HOME of their own, and (as `su` leaves it) a PATH
    that still names a folder of root's they cannot enter."""
    roots = other_user.base / "roots-bin"  # root's own, closed to the user
    roots.mkdir(mode=0o700)
    env = {"PATH": f"{roots}:{other_user.env()['PATH']}"}

    def clone_of(name: str, value: str, inputs: list[str]) -> Path:
        made = clone(other_user.base, name, value, inputs)  # git as root, then the user's
        other_user.own(other_user.base / name)
        return made

    first = clone_of("a", "A", ["work.py"])
    failed = other_user.doit(first, env=env)
    assert failed.returncode == 1, show(failed)
    assert "helper.py is not declared; declare it in inputs=[...]" in said(failed), show(failed)
    assert "PythonAction Error" not in said(failed), show(failed)  # a failure of its own, not ours

    inputs = ["work.py", "helper.py"]
    write_dodo(first, work_step(inputs), ["work"])
    done = other_user.doit(first, env=env)
    assert done.returncode == 0 and (first / "out" / "result.txt").read_text() == "A", show(done)
    second = clone_of("b", "B", inputs)
    done = other_user.doit(second, env=env)
    assert done.returncode == 0 and not restored(done), show(done)
    assert (second / "out" / "result.txt").read_text() == "B"
    third = clone_of("c", "A", inputs)  # the first clone's helper: a hit from the user's own cache
    done = other_user.doit(third, env=env)
    assert done.returncode == 0 and restored(done) and run_count(third) == 0, show(done)
    assert (third / "out" / "result.txt").read_text() == "A"

    (second / "helper.py").write_text('VALUE = "C"\n')
    why = other_user.compute(second, "why", "work", env=env)
    assert why.returncode == 0 and "input changed: helper.py" in why.stdout, show(why)
    done = other_user.doit(second, env=env)
    assert done.returncode == 0 and (second / "out" / "result.txt").read_text() == "C", show(done)


@needs_bwrap
def test_a_declared_helper_edited_reruns_and_why_names_it_an_undeclared_file_edited_reruns_nothing(
    tmp_path: Path,
) -> None:
    listing = "open('out/result.txt', 'a').write(' ' + ' '.join(sorted(os.listdir('.'))))\n"
    root = clone(tmp_path, "a", "A", ["work.py", "helper.py"])
    (root / "work.py").write_text(WORK + listing)
    git(root, "add", "-A")
    doit_ok(root)
    # nothing else of the project was in the run's view: not the tracked README, dodo.py, pyproject.toml
    assert (root / "out" / "result.txt").read_text().split() == ["A", "helper.py", "out", "work.py"]

    (root / "helper.py").write_text('VALUE = "A2"\n')
    why = compute(root, "why", "work")
    assert why.returncode == 0 and "input changed: helper.py" in why.stdout, show(why)
    done = doit_ok(root)
    assert step_ran(done, "work") and run_count(root) == 2, show(done)
    assert (root / "out" / "result.txt").read_text().split()[0] == "A2"

    (root / "README.md").write_text("a pipeline, edited\n")
    git(root, "commit", "-qam", "an edit")
    done = doit_ok(root)
    assert step_skipped(done, "work") and run_count(root) == 2, show(done)
    assert compute(root, "why", "work").stdout.strip() == "work: up to date"


def test_a_command_naming_an_undeclared_project_file_is_refused_before_anything_is_launched(
    tmp_path: Path,
) -> None:
    root = clone(tmp_path, "a", "A", ["helper.py"])
    done = doit(root)
    assert done.returncode == 1, show(done)
    assert (
        "step 'work': its command names work.py, a project file the run would not see (a run sees "
        "the step's declared inputs only); declare it in inputs=[...]" in said(done)
    ), show(done)
    assert not (root / ".substrax" / "runs").exists() or run_count(root) == 0, show(done)
    assert not (root / "out").exists()
    record = root / ".substrax" / "steps" / "work.json"
    assert not record.exists() or "run_id" not in json.loads(record.read_text())


def test_a_step_verified_when_runs_saw_every_tracked_file_runs_once_more_and_why_says_so(
    tmp_path: Path,
) -> None:
    body = (
        "def task_step():\n"
        '    yield from remote_step("step", shell="cat in.txt > o.txt",\n'
        '                           inputs=["in.txt"], outputs=["o.txt"])\n'
    )
    root = make_project(tmp_path, body, ["step"], files={"in.txt": "x\n"})
    doit_ok(root)
    # The record as a release before the rule wrote it: a key with no view part.
    path = root / ".substrax" / "steps" / "step.json"
    record = json.loads(path.read_text())
    parts = record["verified"]["key_parts"]
    del parts["view"]
    from substrax_tasks.uptodate.check import key

    record["verified"]["key"] = key(parts)
    path.write_text(json.dumps(record))
    (root / ".substrax" / "proofs.json").unlink(missing_ok=True)
    why = compute(root, "why", "step")
    assert why.stdout.splitlines() == [
        "step: not up to date",
        "  - the run's view changed: runs now see only the step's declared inputs (and the lock file), "
        "so the step runs once more under that rule",
    ], show(why)
    done = doit_ok(root)
    assert step_ran(done, "step") and run_count(root) == 2, show(done)
    assert compute(root, "why", "step").stdout.strip() == "step: up to date"


def test_a_local_run_without_the_sandbox_is_never_kept_in_the_run_cache(tmp_path: Path) -> None:
    root = clone(tmp_path, "a", "A", ["work.py", "helper.py"], sandbox="none")
    done = doit_ok(root)
    assert (root / "out" / "result.txt").read_text() == "A"
    assert done.stdout.count("is not kept in the run cache: it ran without the sandbox") == 1, show(done)
    cache = tmp_path / "xdg-cache" / "substrax-tasks" / "entries"
    assert not cache.exists() or list(cache.iterdir()) == []
    second = clone(tmp_path, "b", "A", ["work.py", "helper.py"], sandbox="none")
    again = doit_ok(second)
    assert not restored(again) and run_count(second) == 1, show(again)


@needs_bwrap
def test_an_entry_made_in_the_project_after_the_view_was_taken_is_not_seen(project: Project) -> None:
    """The view is taken at launch; a file or folder that appears before the
    command starts (another step's outputs promoted meanwhile, say) is in
    neither list, and stays hidden."""
    (project.root / "in.txt").write_text("x")
    listing = "import os; open('out/seen.txt', 'w').write(' '.join(sorted(os.listdir('.'))))"
    spec = make_spec("late", ["python3", "-c", listing], project.root, inputs=["in.txt"], outputs=["out/"])
    handle = project.new_run(spec, settings={"sandbox": "bwrap"})
    handle = project.backend_for(handle).launch(handle)
    (project.root / "late.txt").write_text("made after the launch\n")
    (project.root / "late").mkdir()
    subprocess.run([sys.executable, str(WORKER), str(run_dir(project, handle) / "job.json")],
                   check=True, capture_output=True, timeout=120)  # fmt: skip
    assert wait_final(project, handle) == "succeeded", log_text(project, handle)
    assert (outputs_root(project, handle) / "out" / "seen.txt").read_text().split() == ["in.txt", "out"]


# ------------------------------------------------------------ the pieces


