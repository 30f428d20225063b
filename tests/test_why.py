"""`substrax-compute why STEP`: up to date or not, and which of inputs,
command, settings, env or outputs changed, naming the paths."""

from __future__ import annotations

import os
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


def test_input_file_changed(root: Path) -> None:
    (root / "data" / "in.txt").write_text("changed\n")
    assert reasons(root) == ["input changed: data/in.txt"]
    (root / "data" / "in.txt").write_text("in\n")  # the same content again
    assert_up_to_date(root)


def test_input_folder_file_added_and_removed(root: Path) -> None:
    (root / "data" / "dir" / "two.txt").write_text("2\n")
    assert reasons(root) == ["input added: data/dir/two.txt"]
    (root / "data" / "dir" / "one.txt").unlink()
    assert sorted(reasons(root)) == ["input added: data/dir/two.txt", "input removed: data/dir/one.txt"]


def test_input_missing(root: Path) -> None:
    (root / "data" / "in.txt").unlink()
    found = reasons(root)
    assert "input removed: data/in.txt" in found
    assert "input missing: data/in.txt" in found


def test_command_changed(root: Path) -> None:
    declare(root, command=COMMAND + " && true")
    (line,) = reasons(root)
    assert line.startswith("command changed:")
    assert "&& true" in line


def test_env_changed(root: Path) -> None:
    declare(root, env={"MODE": "slow"})
    (line,) = reasons(root)
    assert line.startswith("env changed:")
    assert "'fast'" in line and "'slow'" in line


def test_backend_settings_changed(root: Path) -> None:
    pyproject = root / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace("grace_seconds = 0.5", "grace_seconds = 2.5"))
    (line,) = reasons(root)
    assert line.startswith("settings changed in [tool.substrax.compute.backends.local]")
    assert "grace_seconds was 0.5, now 2.5" in line


def test_backend_changed_is_said_first_in_one_line(root: Path) -> None:
    """Not a diff of the local backend's settings against the ssh one's."""
    pyproject = root / "pyproject.toml"
    pyproject.write_text(
        '[tool.substrax.compute]\ndefault_backend = "ssh"\n\n'
        + pyproject.read_text()
        + '\n[tool.substrax.compute.backends.ssh]\nhost = "gpu-box"\n'
    )
    assert reasons(root) == ["backend changed: local -> ssh"]
    declare(root, env={"MODE": "slow"})
    lines = reasons(root)
    assert lines[0] == "backend changed: local -> ssh" and lines[1].startswith("env changed:"), lines


@pytest.mark.parametrize(
    ("tamper", "path"),
    [
        (lambda r: (r / "out" / "a.txt").write_text("edited\n"), "out/a.txt"),
        (lambda r: (r / "out" / "a.txt").unlink(), "out/a.txt"),
        (lambda r: (r / "out" / "stray.txt").write_text("x"), "out/stray.txt"),
        (lambda r: (r / "res.txt").unlink(), "res.txt"),
    ],
    ids=["edited", "deleted", "added", "file-output-deleted"],
)
def test_outputs_changed_names_the_path(root: Path, tamper: object, path: str) -> None:
    assert callable(tamper)
    tamper(root)
    found = reasons(root)
    assert found, found
    assert all(line.startswith("outputs:") for line in found), found
    assert any(path in line for line in found), found


def test_several_causes_at_once(root: Path) -> None:
    declare(root, command=COMMAND + " && true", env={"MODE": "slow"})
    (root / "data" / "in.txt").write_text("changed\n")
    (root / "res.txt").write_text("edited\n")
    text = why(root)
    for needle in ("command changed", "env changed", "input changed: data/in.txt", "res.txt"):
        assert needle in text, text


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
        ("out/a.txt", "XX\n", "out/a.txt"),
        ("res.txt", "two.txt\n", "res.txt"),
    ],
    ids=["input", "folder-output-file", "file-output"],
)
def test_a_change_that_keeps_size_and_mtime_is_seen(root: Path, path: str, content: str, reason: str) -> None:
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
