"""Run handles: pinned settings, versions, damaged records, private files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from local_runs import (
    cli,
    describe,
    marked_pids,
    outputs_root,
    ready_files,
    run_dir,
    stubborn_tree,
    submit,
    wait_final,
    wait_for,
)

from substrax_tasks.errors import HandleError
from substrax_tasks.step.spec import make_spec
from substrax_tasks.store.handle import read_handle
from substrax_tasks.store.project import Project
from substrax_tasks.store.run_store import HANDLE_FILE


def write_pyproject(root: Path, local_table: str | None) -> None:
    text = '[project]\nname = "demo"\nversion = "0"\n'
    if local_table is not None:
        text += f"\n[tool.substrax.compute.backends.local]\n{local_table}\n"
    (root / "pyproject.toml").write_text(text)


def status_json(root: Path) -> tuple[int, dict[str, Any], str]:
    done = cli(root, "status", "--json")
    return done.returncode, json.loads(done.stdout), done.stderr


def test_settings_stay_pinned_when_the_pyproject_changes(project_dir: Path, marker: str) -> None:
    write_pyproject(project_dir, 'sandbox = "none"\ngrace_seconds = 0.5')
    project = Project.open(project_dir)
    spec = make_spec("pinned", stubborn_tree(marker, "child"), project_dir, outputs=["out/"])
    handle = project.submit(spec)  # no override: the settings come from pyproject.toml
    pinned = {"sandbox": "none", "network_isolation": False, "grace_seconds": 0.5, "cache_dirs": [],
              "max_parallel": None, "hide_gpus_when_unasked": False, "pip_args": [],
              "keep_checkpoints": False, "hourly_cost": None, "max_cost": None}  # fmt: skip
    assert handle.settings == pinned
    task_ready, child_ready = ready_files(outputs_root(project, handle), "child")
    wait_for(lambda: task_ready.exists() and child_ready.exists(), "the task tree to start")

    # 1. The table is edited: the run keeps the settings it was submitted with.
    write_pyproject(project_dir, 'sandbox = "bwrap"\nnetwork_isolation = true\ngrace_seconds = 30')
    code, data, _ = status_json(project_dir)
    assert code == 0
    assert [(r["run_id"], r["state"]) for r in data["runs"]] == [(handle.run_id, "running")]
    reopened = Project.open(project_dir)
    again = reopened.store.read(handle.run_id)
    assert again.settings == pinned
    assert reopened.backend_for(again).settings.model_dump() == pinned

    # 2. The table is deleted: still the same.
    write_pyproject(project_dir, None)
    logs = cli(project_dir, "logs", handle.run_id)
    assert logs.returncode == 0, logs.stderr
    assert "task started" in logs.stdout
    assert Project.open(project_dir).store.read(handle.run_id).settings == pinned

    # 3. The table is invalid: the CLI says so, and still acts on the run.
    write_pyproject(project_dir, 'sandbox = "bogus"')
    code, data, err = status_json(project_dir)
    assert code == 1  # status reports the broken configuration ...
    assert "sandbox" in err and "bogus" in err
    # ... and still lists the run
    assert [(r["run_id"], r["state"]) for r in data["runs"]] == [(handle.run_id, "running")]
    logs = cli(project_dir, "logs", handle.run_id)
    assert logs.returncode == 0, logs.stderr
    assert "task started" in logs.stdout
    cancel = cli(project_dir, "cancel", handle.run_id)
    assert cancel.returncode == 0, cancel.stderr
    assert "cancelled" in cancel.stdout
    assert not marked_pids(marker), describe(marked_pids(marker))
    code, data, _ = status_json(project_dir)
    assert [(r["run_id"], r["state"]) for r in data["runs"]] == [(handle.run_id, "cancelled")]


def test_handle_files_are_private_and_written_whole(project: Project) -> None:
    handle = submit(project, ["sh", "-c", "echo hi"])
    assert wait_final(project, handle) == "succeeded"
    folder = run_dir(project, handle)
    assert folder.stat().st_mode & 0o777 == 0o700
    for name in (HANDLE_FILE, "status.json", "job.json", "run.log"):
        assert (folder / name).stat().st_mode & 0o777 == 0o600, name
    assert not [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("version", [1, 4])
def test_handle_of_another_version_is_refused(project: Project, version: int) -> None:
    handle = submit(project, ["true"])
    wait_final(project, handle)
    path = run_dir(project, handle) / HANDLE_FILE
    data = json.loads(path.read_text())
    data["version"] = version
    path.write_text(json.dumps(data))
    with pytest.raises(HandleError, match=f"handle version {version} cannot be used by this release"):
        read_handle(path)
    for command in ("status", "logs", "cancel", "teardown"):
        done = cli(project.root, command, handle.run_id)
        assert done.returncode == 1, (command, done.stdout, done.stderr)
        assert f"handle version {version} cannot be used" in done.stderr
        assert "remove" in done.stderr  # ... and what to do about it


def test_status_lists_good_runs_and_names_unreadable_ones(project: Project) -> None:
    good = [submit(project, ["true"], step=name) for name in ("first", "second")]
    for handle in good:
        assert wait_final(project, handle) == "succeeded"
    text = (run_dir(project, good[0]) / HANDLE_FILE).read_text()
    truncated = project.store.runs_dir / "truncated-run"
    truncated.mkdir()
    (truncated / HANDLE_FILE).write_text(text[: len(text) // 2])
    old = project.store.runs_dir / "old-run"
    old.mkdir()
    (old / HANDLE_FILE).write_text(json.dumps({"version": 1, "id": "old-run", "cmd": "true"}))

    handles, unreadable = project.store.read_all()
    assert [h.run_id for h in handles] == [h.run_id for h in good]
    assert {u.path for u in unreadable} == {truncated / HANDLE_FILE, old / HANDLE_FILE}

    table = cli(project.root, "status")
    assert table.returncode == 1
    for handle in good:
        assert handle.run_id in table.stdout
    assert "succeeded" in table.stdout
    assert f"{truncated / HANDLE_FILE}: " in table.stderr
    assert "unreadable handle" in table.stderr
    assert f"{old / HANDLE_FILE}: " in table.stderr
    assert "handle version 1 cannot be used" in table.stderr

    code, data, _ = status_json(project.root)
    assert code == 1
    assert set(data) == {"runs", "groups", "unreadable", "leaked"}
    assert [r["run_id"] for r in data["runs"]] == [h.run_id for h in good]
    for record in data["runs"]:
        assert {"run_id", "step", "backend", "state", "created_at"} <= set(record)
        assert record["backend"] == "local"
        assert record["state"] == "succeeded"
    assert [r["step"] for r in data["runs"]] == ["first", "second"]
    by_path = {u["path"]: u for u in data["unreadable"]}
    assert set(by_path) == {str(old / HANDLE_FILE), str(truncated / HANDLE_FILE)}
    for record in data["unreadable"]:
        assert set(record) == {"path", "reason"}
    assert "version 1" in by_path[str(old / HANDLE_FILE)]["reason"]
    assert "unreadable handle" in by_path[str(truncated / HANDLE_FILE)]["reason"]


def test_a_run_folder_without_its_handle_is_named(project: Project) -> None:
    handle = submit(project, ["true"])
    wait_final(project, handle)
    # status.reserve: the worker removes it as it exits, maybe during the copy
    shutil.copytree(run_dir(project, handle), project.store.runs_dir / "no-handle",
                    ignore=shutil.ignore_patterns("status.reserve"))  # fmt: skip
    (project.store.runs_dir / "no-handle" / HANDLE_FILE).unlink()
    done = cli(project.root, "status")
    assert done.returncode == 1
    assert handle.run_id in done.stdout
    assert "no-handle" in done.stderr


def test_pinned_settings_this_release_refuses_are_named_not_a_traceback(project: Project) -> None:
    handle = submit(project, ["true"])
    wait_final(project, handle)
    path = run_dir(project, handle) / HANDLE_FILE
    data = json.loads(path.read_text())
    data["settings"]["sandbox"] = "firejail"  # e.g. a choice a later release dropped
    path.write_text(json.dumps(data))
    done = cli(project.root, "status")
    assert "Traceback" not in done.stderr
    assert done.returncode == 1
    assert handle.run_id in done.stderr


UPDATES = """
import sys
from pydantic import BaseModel, ConfigDict
from substrax_tasks.store.project import Project
class AnyKeys(BaseModel):  # a backend's state model that takes whatever it is given
    model_config = ConfigDict(extra="allow")
store = Project.open(sys.argv[1]).store
handle = store.read(sys.argv[2])
print("ready", flush=True)
sys.stdin.readline()
for i in range(200):  # from the handle as first read: only the file carries the other's keys
    store.update_backend_state(handle, AnyKeys, **{f"{sys.argv[3]}{i}": i})
"""


def test_two_processes_writing_one_handle_lose_no_update(project: Project) -> None:
    """`doit` and `substrax-compute cancel` may both record state in one
    handle: each read-merge-write holds the handle's lock."""
    handle = project.new_run(make_spec("shared", ["true"], project.root))
    argv = [sys.executable, "-c", UPDATES, str(project.root), handle.run_id]
    writers = [
        subprocess.Popen([*argv, tag], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for tag in ("a", "b")
    ]
    for writer in writers:  # both loaded, then both released at once
        assert writer.stdout is not None and writer.stdout.readline() == "ready\n"
    for writer in writers:
        assert writer.stdin is not None
        writer.stdin.write("go\n")
        writer.stdin.flush()
    for writer in writers:
        writer.communicate(timeout=100)
    assert [writer.returncode for writer in writers] == [0, 0]
    written = project.store.read(handle.run_id)
    assert {f"{tag}{i}" for tag in "ab" for i in range(200)} <= set(written.backend_state)
    assert written.state.project == str(project.root)  # written before them, kept too
