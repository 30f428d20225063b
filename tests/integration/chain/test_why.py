"""`substrax-compute why STEP` as a user runs it: loading the dodo, reading
doit's DB and the pinned handle, and agreeing with what `doit` then does.
Each reason itself, and that the check and `why` agree on it, is a unit
test over a step and its store (tests/unit/test_uptodate.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from dodo_helpers import (
    COMPUTE,
    compute,
    doit_ok,
    make_project,
    run_count,
    run_dirs,
    show,
    step_skipped,
    write_dodo,
)

BODY = """
COMMAND = {command!r}

def task_step():
    yield from remote_step(
        "step",
        command=["/bin/sh", "-c", COMMAND],
        inputs=["data/in.txt", "data/dir/"],
        outputs=["out/", "res.txt"],
        env={env!r},
    )

def task_other():
    yield from remote_step("sub/ject 01", shell="echo o > other.txt", outputs=["other.txt"])
"""
COMMAND = "mkdir -p out && cp data/in.txt out/a.txt && ls data/dir > res.txt"


def declare(root: Path, command: str = COMMAND, env: dict[str, str] | None = None) -> None:
    write_dodo(root, BODY.format(command=command, env=env or {"MODE": "fast"}), ["step"])


@pytest.fixture
def root(tmp_path: Path) -> Path:
    project = make_project(tmp_path, "", ["step"], files={"data/in.txt": "in\n", "data/dir/one.txt": "1\n"})
    declare(project)
    doit_ok(project)
    return project


def why(root: Path, step: str = "step") -> str:
    done = compute(root, "why", step)
    assert done.returncode == 0, show(done)
    return done.stdout


def reasons(root: Path, step: str = "step") -> list[str]:
    lines = why(root, step).splitlines()
    assert lines[0] == f"{step}: not up to date", lines
    return [line.strip().removeprefix("- ") for line in lines[1:]]


def assert_up_to_date(root: Path, step: str = "step") -> None:
    assert why(root, step).strip() == f"{step}: up to date"


def test_up_to_date_after_a_run_and_why_runs_nothing(root: Path) -> None:
    assert_up_to_date(root)
    assert run_count(root) == 1
    assert step_skipped(doit_ok(root), "step")  # why disturbed nothing


def test_never_run(tmp_path: Path) -> None:
    project = make_project(tmp_path, "", ["step"], files={"data/in.txt": "in\n", "data/dir/one.txt": "1\n"})
    declare(project)
    assert reasons(project)[0].startswith("no verified run yet")
    assert run_count(project) == 0


def test_backend_settings_changed(root: Path) -> None:
    pyproject = root / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace("grace_seconds = 0.5", "grace_seconds = 2.5"))
    (line,) = reasons(root)
    assert line.startswith("settings changed in [tool.substrax.compute.backends.local]")
    assert "grace_seconds was 0.5, now 2.5" in line


def test_why_and_doit_agree_once_the_verified_run_s_folder_is_removed(root: Path) -> None:
    """The outputs still hold the verified digest: up to date for both
    (`why` used to say the manifest was gone while doit skipped the step).
    Once an output is edited, both say it is not, and the run restores it."""
    (run_dir,) = run_dirs(root)
    shutil.rmtree(run_dir)
    assert_up_to_date(root)
    assert step_skipped(doit_ok(root), "step")
    (root / "res.txt").write_text("edited\n")
    (line,) = reasons(root)
    assert line.startswith("outputs: they are not the verified run's"), line
    assert not step_skipped(doit_ok(root), "step")
    assert_up_to_date(root)


def test_a_lock_file_that_appears_is_named_in_words(root: Path) -> None:
    """Before, `why` printed the key's two dicts of sha256 digests."""
    (root / "requirements.lock").write_text("numpy==2.0.0\n")
    said = "environment changed: requirements.lock appeared, the environment is built from it now"
    assert reasons(root) == [said]


def test_after_doit_forget(root: Path) -> None:
    doit_ok(root, "forget", "step")
    found = reasons(root)
    assert any("doit forget" in line for line in found), found


def test_step_name_with_special_characters(root: Path) -> None:
    assert reasons(root, "sub/ject 01")[0].startswith("no verified run yet")
    doit_ok(root, "sub/ject 01")
    assert_up_to_date(root, "sub/ject 01")


def test_unknown_step_is_an_error_naming_the_known_ones(root: Path) -> None:
    done = compute(root, "why", "nope")
    assert done.returncode == 1, show(done)
    assert "no remote step 'nope'" in done.stderr
    assert "step" in done.stderr and "sub/ject 01" in done.stderr


def test_get_var_defaults_apply_when_why_loads_the_dodo(tmp_path: Path) -> None:
    body = """
X = get_var("x", "1")

def task_step():
    yield from remote_step("step", command=["/bin/sh", "-c", 'echo "$0" > o.txt', X], outputs=["o.txt"])
"""
    project = make_project(tmp_path, body, ["step"])
    doit_ok(project)
    assert_up_to_date(project)
    doit_ok(project, "step", "x=2")
    (line,) = reasons(project)
    assert line.startswith("command changed")


def test_no_dodo_file(tmp_path: Path) -> None:
    project = make_project(tmp_path, "", ["step"])
    (project / "dodo.py").unlink()
    done = compute(project, "why", "step")
    assert done.returncode == 1, show(done)
    assert "no dodo file" in done.stderr


def test_why_with_another_dodo_file(root: Path) -> None:
    (root / "dodo.py").rename(root / "pipeline.py")
    done = subprocess.run(
        [*compute_argv(root), "why", "step", "--dodo", str(root / "pipeline.py")],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 0, show(done)
    assert done.stdout.strip() == "step: up to date"


def compute_argv(root: Path) -> list[str]:
    return [str(COMPUTE), "--project", str(root)]


def test_why_loading_the_dodo_changes_no_signal_handler(root: Path) -> None:
    """`why` loads the dodo as doit does, but runs no task: SIGTERM and
    SIGHUP keep the handlers they had."""
    import signal

    from substrax_tasks.step.dodo import find_step

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    driver, values = find_step(root, "step")
    assert driver.step.name == "step"
    assert values is not None  # doit's DB was read: its saved values
    assert {sig: signal.getsignal(sig) for sig in before} == before


def rewrite_keeping_size_and_mtime(path: Path, content: str) -> None:
    """A content change `os.utime` hides from (size, mtime, inode): what a
    user (or a task) can restore. Only the ctime moves, and nobody can set
    that back."""
    before = path.stat()
    assert len(content.encode()) == before.st_size
    with path.open("r+") as f:
        f.write(content)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    kept = (after.st_size, after.st_mtime_ns, after.st_ino)
    assert kept == (before.st_size, before.st_mtime_ns, before.st_ino)


@pytest.mark.parametrize(
    ("path", "content", "reason"),
    [
        ("data/in.txt", "IN\n", "input changed: data/in.txt"),
        ("res.txt", "two.txt\n", "res.txt"),
    ],
    ids=["input", "file-output"],
)
def test_a_change_that_keeps_size_and_mtime_is_seen(root: Path, path: str, content: str, reason: str) -> None:
    """`why` names it, and doit runs the step: the two agree."""
    time.sleep(0.1)  # past the racy window: the hashes of the first run are cached
    assert_up_to_date(root)
    rewrite_keeping_size_and_mtime(root / path, content)
    found = reasons(root)
    assert any(reason in line for line in found), found
    assert not step_skipped(doit_ok(root), "step")
    assert_up_to_date(root)
    if path != "data/in.txt":  # the outputs are the command's again
        assert (root / path).read_text() != content


def test_each_project_s_dodo_is_loaded_afresh_in_one_process(tmp_path: Path) -> None:
    """doit imports a dodo by its bare name: `find_step` on a second project
    in one process (a notebook, a test run) must not get the first's module."""
    from substrax_tasks.step.dodo import find_step

    roots = []
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        body = f'def task_{name}():\n    yield from remote_step("{name}", command=["true"], outputs=["o"])\n'
        roots.append(make_project(tmp_path / name, body))
    for root, name in zip(roots, ("one", "two"), strict=True):
        assert find_step(root, name)[0].step.root == root.resolve()
