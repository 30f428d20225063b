"""What may still hold a machine (issue 18, item 7): `status` shows the
lifetime left of a run that holds one, and with `--machines` the run
folders no handle accounts for (leaked); `gc --machines` removes those,
stopping what runs there, and leaves alone what is not provably this
project's.

A real sshd in a network namespace as a test user; real doit, killed (-9)
mid-run; the store deleted by hand, as a leak happens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from dodo_helpers import compute, pids_with, show, wait_for
from local_runs import kill_pid
from ssh_helpers import (
    GATED_STEP,
    compute_in_view,
    doit_killed_mid_run,
    doit_killed_mid_run_in_view,
    make_ssh_project,
    needs_root,
    needs_sshd,
    only_handle,
    popen_doit_in_view,
    remote_run_dir,
)
from testbeds.sshd_host import SshHost


@needs_sshd
@needs_root
def test_status_shows_the_lifetime_left_and_the_leaked_folders_that_gc_machines_removes(
    tmp_path: Path, host: SshHost, marker: str
) -> None:
    gate = host.scratch / f"gate-{tmp_path.name}"  # never made: the run goes on until stopped
    body = GATED_STEP.format(gate=gate, marker=marker, resources="{}")
    root = make_ssh_project(tmp_path, host, body, lifetime_minutes=10.0)
    doit_killed_mid_run(root, marker)
    run_dir = remote_run_dir(only_handle(root))

    listed = compute(root, "status", "--json")
    assert listed.returncode == 0, show(listed)
    (run,) = json.loads(listed.stdout)["runs"]
    assert 0 < run["lifetime_left_seconds"] <= 600, run
    told = compute(root, "status")
    holding = f"run {run['run_id']} may still hold a machine: its lifetime timer ends it in "
    assert holding in told.stderr, show(told)

    other = run_dir.parent / "another-projects-run"  # not marked as this client's
    other.mkdir()
    shutil.rmtree(root / ".substrax" / "runs")  # the handle is gone; the run goes on there: leaked
    plain = compute(root, "status", "--json")  # reads the store only: leaks are not looked for
    assert json.loads(plain.stdout)["leaked"] is None, show(plain)
    leaked = compute(root, "status", "--machines")
    said = f"leaked run folder {run_dir} on {host.address}: no live handle accounts for it"
    assert said in leaked.stderr and "another-projects-run" not in leaked.stderr, show(leaked)
    assert json.loads(compute(root, "status", "--machines", "--json").stdout)["leaked"] == [
        {"backend": "ssh", "where": host.address, "name": str(run_dir), "ours": True}
    ]

    listed = compute(root, "gc", "--machines", "--dry-run")
    assert f"would remove {run_dir} on {host.address}" in listed.stdout, show(listed)
    assert run_dir.is_dir() and "another-projects-run" not in listed.stdout
    removed = compute(root, "gc", "--machines")
    assert removed.returncode == 0, show(removed)
    assert f"removed {run_dir} on {host.address}" in removed.stdout
    assert not run_dir.exists() and other.is_dir()
    wait_for(lambda: not pids_with(marker), "the leaked run's command to be stopped")
    assert "leaked" not in compute(root, "status", "--machines").stderr


@needs_sshd
@needs_root
def test_gc_machines_of_a_client_at_the_same_project_path_leaves_anothers_live_run_and_removes_its_own(
    tmp_path: Path, host: SshHost, marker: str
) -> None:
    gate = host.scratch / f"gate-{tmp_path.name}"  # never made: the runs go on until stopped
    at = tmp_path / "workspace"
    at.mkdir()
    remote_root = str(host.scratch / f"shared-{tmp_path.name}")  # one remote_root for both
    first, second = (
        make_ssh_project(tmp_path / name, host, GATED_STEP.format(gate=gate, marker=f"{marker}-{name}",
                                                                  resources="{}"), remote_root=remote_root)
        for name in ("one", "two")
    )  # fmt: skip
    doit_one = popen_doit_in_view(first, at)
    try:
        wait_for(lambda: pids_with(f"{marker}-one"), "the first client's run to be going", timeout=120)
        running = remote_run_dir(only_handle(first))
        # The second client: its doit killed mid-run, its handles then lost: a leftover of its own.
        doit_killed_mid_run_in_view(second, at, f"{marker}-two")
        lost = only_handle(second)
        assert lost["state"]["project"] == only_handle(first)["state"]["project"] == str(at)  # one path
        leftover = remote_run_dir(lost)
        shutil.rmtree(second / ".substrax" / "runs")

        removed = compute_in_view(second, at, "gc", "--machines")
        assert removed.returncode == 0, show(removed)
        assert f"removed {leftover} on {host.address}" in removed.stdout, show(removed)
        assert not leftover.exists()
        wait_for(lambda: not pids_with(f"{marker}-two"), "the second client's leftover run to be stopped")
        assert running.is_dir() and pids_with(f"{marker}-one"), show(removed)  # the first's run goes on
        assert f"removed {running}" not in removed.stdout
    finally:
        kill_pid(doit_one.pid)
        doit_one.wait(timeout=30)
    torn = compute_in_view(first, at, "teardown", only_handle(first)["run_id"])
    assert torn.returncode == 0, show(torn)
    wait_for(lambda: not pids_with(marker), "the first client's run to be stopped")


def test_the_client_id_is_made_once_private_and_a_damaged_one_is_named_with_the_fix(tmp_path: Path) -> None:
    from substrax_tasks.errors import HandleError
    from substrax_tasks.store.run_store import RunStore

    store = RunStore(tmp_path / ".substrax")
    made = store.client_id()
    assert RunStore(tmp_path / ".substrax").client_id() == made and len(made) == 32
    assert store.client_id_file.stat().st_mode & 0o777 == 0o600
    # no temp file left
    assert sorted(p.name for p in store.root.iterdir()) == ["client-id", "client-id.stamp", "locks"]
    store.client_id_file.write_text("/workspace/proj\n")
    with pytest.raises(HandleError, match=r"holds no id this client made .*; remove it and a new one"):
        store.client_id()


def test_a_copy_of_the_state_folder_takes_an_id_of_its_own_and_a_move_keeps_it(tmp_path: Path) -> None:
    """`cp -a`, a cache restored at the same path after `rm -rf` (tar, as
    CI caches are), a `mv`: the id follows the folder, not its bytes."""
    import subprocess

    from substrax_tasks.store.run_store import RunStore

    project = tmp_path / "proj"
    made = RunStore(project / ".substrax").client_id()

    copied = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(project), str(copied)], check=True)
    assert (copied / ".substrax" / "client-id").read_text().strip() == made  # the bytes came along
    taken = RunStore(copied / ".substrax").client_id()
    assert taken != made and RunStore(copied / ".substrax").client_id() == taken  # made once

    moved = tmp_path / "moved"
    project.rename(moved)
    assert RunStore(moved / ".substrax").client_id() == made  # the same folder

    cache = tmp_path / "cache.tar"
    subprocess.run(["tar", "-C", str(moved), "-cf", str(cache), ".substrax"], check=True)
    shutil.rmtree(moved / ".substrax")
    subprocess.run(["tar", "-C", str(moved), "-xf", str(cache)], check=True)
    restored = RunStore(moved / ".substrax").client_id()
    assert restored not in (made, taken)


def test_the_runs_a_state_folder_owns_by_the_id_they_were_launched_with(tmp_path: Path) -> None:
    """A run recorded with no id (an earlier release) is the folder's own
    unless the folder is a copy; an id removed as damaged stays its own."""
    import subprocess

    from substrax_tasks.store import client
    from substrax_tasks.store.run_store import RunStore

    store = RunStore(tmp_path / "proj" / ".substrax")
    store.root.mkdir(parents=True)
    store.client_id_file.write_text("0" * 31 + "1\n")  # made by a release before the stamp
    assert store.client_id() == "0" * 31 + "1"
    mine = client.identity(store.root)
    assert mine.owns(None) and mine.owns("0" * 31 + "1") and not mine.owns("f" * 32)

    store.client_id_file.unlink()  # as the damaged id's message says to
    again = client.identity(store.root)
    assert again.id != "0" * 31 + "1" and again.owns("0" * 31 + "1") and again.owns(None)

    copied = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(tmp_path / "proj"), str(copied)], check=True)
    theirs = client.identity(copied / ".substrax")
    assert not theirs.owns(None) and not theirs.owns(again.id) and not theirs.owns("0" * 31 + "1")
    assert theirs.owns(theirs.id)
