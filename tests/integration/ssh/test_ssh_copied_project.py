"""A copy of a project is another client (issue 39, item 5): `cp -a` of a
project, or a CI cache that restores `.substrax/`, carries the state
folder's `client-id`, but not where it was made (store/client.py). The copy
takes an id of its own: `gc --machines` there leaves the original's live
run on a shared host, and the runs it holds stay the original's (shown by
`status`, refused by `cancel`). The original, reached through a bind mount
(the same folder), keeps its id: its run finishes and is fetched.

A real sshd in a network namespace as a test user, real doit and rsync;
the same project path for two folders through a mount namespace (root).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from dodo_helpers import DOIT, clean_env, compute, pids_with, show, wait_for
from local_runs import kill_pid
from ssh_helpers import (
    GATED_STEP,
    compute_in_view,
    in_view,
    make_ssh_project,
    needs_root,
    needs_sshd,
    only_handle,
    remote_run_dir,
)
from testbeds.sshd_host import SshHost

COPY_SAID = "is a copy of another project's state folder"
SHOWN_AS_THE_ORIGINALS = (
    "was launched from the project this one is a copy of: shown here, it stays that project's"
)


def copy_tree(source: Path, dest: Path) -> None:
    """`cp -a`, as a user copies a project (times, modes and all)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-a", str(source), str(dest)], check=True)


@needs_sshd
@needs_root
@pytest.mark.timeout(900)  # a run, four copies and their commands, on a loaded machine
def test_a_copied_project_takes_an_id_of_its_own_and_its_gc_machines_leaves_the_originals_live_run(
    tmp_path: Path, host: SshHost, marker: str
) -> None:
    gate = host.scratch / f"gate-{tmp_path.name}"
    at = tmp_path / "workspace"  # the one path both a project and its restored cache are used at
    at.mkdir()
    body = GATED_STEP.format(gate=gate, marker=marker, resources="{}")
    # No sandbox: its private /tmp would hide the gate from the command.
    original = make_ssh_project(tmp_path / "one", host, body, sandbox="none")
    made = compute(original, "gc", "--machines")  # the original's id is made; its state folder is cached
    assert made.returncode == 0, show(made)
    first_id = (original / ".substrax" / "client-id").read_text()
    cached = tmp_path / "ci-cache" / ".substrax"
    copy_tree(original / ".substrax", cached)

    # Through a bind mount: the same folder, the same client.
    with (tmp_path / "doit.out").open("w") as said:
        doit_one = subprocess.Popen(in_view(original, at, [str(DOIT)]), env=clean_env(None), stdout=said,
                                    stderr=subprocess.STDOUT)  # fmt: skip
    try:
        wait_for(lambda: pids_with(marker), "the original's run to be going", timeout=120)
        running = remote_run_dir(only_handle(original))
        run_id = only_handle(original)["run_id"]

        # A CI job at the same path: the project checked out, `.substrax/` restored from the cache.
        restored = tmp_path / "two" / "proj"
        copy_tree(original, restored)
        shutil.rmtree(restored / ".substrax")
        copy_tree(cached, restored / ".substrax")
        removed = compute_in_view(restored, at, "gc", "--machines")
        assert removed.returncode == 0, show(removed)
        assert running.is_dir() and pids_with(marker), show(removed)
        assert str(running) not in removed.stdout, show(removed)
        assert COPY_SAID in removed.stderr, show(removed)
        assert (restored / ".substrax" / "client-id").read_text() != first_id

        # `cp -a` of the project while its run goes, to another path: the run's handle comes along.
        elsewhere = tmp_path / "elsewhere" / "proj"
        copy_tree(original, elsewhere)
        removed = compute(elsewhere, "gc", "--machines")
        assert removed.returncode == 0 and COPY_SAID in removed.stderr, show(removed)
        assert running.is_dir() and pids_with(marker), show(removed)
        told = compute(elsewhere, "status")
        assert f"run {run_id} {SHOWN_AS_THE_ORIGINALS}" in told.stderr, show(told)
        refused = compute(elsewhere, "cancel", run_id)
        assert refused.returncode == 1, show(refused)
        assert f"run {run_id} was launched from the project this one is a copy of" in refused.stderr
        assert running.is_dir() and pids_with(marker), show(refused)

        gate.touch()  # the original's run finishes; its doit fetches it
        assert doit_one.wait(timeout=600) == 0, (tmp_path / "doit.out").read_text()
    finally:
        if doit_one.poll() is None:
            kill_pid(doit_one.pid)
            doit_one.wait(timeout=30)
    assert (original / "out.txt").read_text() == "made\n"
    assert (original / ".substrax" / "client-id").read_text() == first_id
    assert only_handle(original)["state"]["phase"] == "promoted"

    moved = tmp_path / "moved"
    (tmp_path / "one" / "proj").rename(moved)  # a `mv` of the project: the same folder, the same client
    listed = compute(moved, "status")
    assert listed.returncode == 0 and COPY_SAID not in listed.stderr, show(listed)
    assert SHOWN_AS_THE_ORIGINALS not in listed.stderr, show(listed)
    assert (moved / ".substrax" / "client-id").read_text() == first_id
