"""A run whose result on the host can never verify does not wedge its step
(issue 28, item 9): its manifest altered on the host after the command
ended, the first fetch is refused and the run kept for a fetch again; the
fetch again is refused too, and then the run is recorded damaged, its
folder on the host removed, and the next `doit` starts a new run.

A real sshd in a network namespace as a test user, real rsync, real doit
(killed -9 mid-run so that the run ends with no client, and the host's
manifest is altered before any fetch).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dodo_helpers import doit, doit_ok, handles, show, wait_for
from ssh_helpers import (
    GATED_STEP,
    doit_killed_mid_run,
    make_ssh_project,
    needs_root,
    needs_sshd,
    only_handle,
    remote_run_dir,
    remote_status,
)
from testbeds.sshd_host import SshHost

from substrax_tasks._remote import manifest as remote_manifest

pytestmark = [needs_sshd, needs_root]


def alter(manifest: Path, how: str) -> None:
    """Change what the manifest says of out.txt: its digest left as it was
    (damaged), or made again to fit (the manifest reads whole, the outputs
    do not match it)."""
    data = json.loads(manifest.read_text())
    (entry,) = [e for e in data["entries"] if e["path"] == "out.txt"]
    entry["sha256"] = "0" * 64
    if how == "rewritten":
        data["digest"] = remote_manifest.entries_digest(data["entries"])
    manifest.write_text(json.dumps(data))


@pytest.mark.parametrize("how", ["damaged", "rewritten"])
def test_a_host_manifest_altered_after_the_run_leads_to_a_new_run_not_a_wedge(
    tmp_path: Path, host: SshHost, marker: str, how: str
) -> None:
    # On the host, where the run goes on while no doit is there; unsandboxed,
    # as the sandbox's private /tmp would hide the gate from the command.
    gate = host.scratch / f"gate-{marker}"
    body = GATED_STEP.format(gate=gate, marker=marker, resources="{}")
    root = make_ssh_project(tmp_path, host, body, sandbox="none")
    doit_killed_mid_run(root, marker)
    first = only_handle(root)
    gate.touch()
    wait_for(lambda: (remote_status(first) or {}).get("state") == "succeeded", "the run to end on the host")
    alter(remote_run_dir(first) / "manifest.json", how)

    refused = doit(root)
    said = refused.stdout + refused.stderr
    assert refused.returncode == 1, show(refused)
    assert "The run is kept: `doit step` fetches it again" in said, show(refused)
    assert "Traceback" not in said, show(refused)
    assert remote_run_dir(first).is_dir() and not (root / "out.txt").exists()

    again = doit(root)  # before the fix: refused like this on every doit, until a manual teardown
    said = again.stdout + again.stderr
    assert again.returncode == 1, show(again)
    assert f"Refused again: run {first['run_id']} is recorded damaged and torn down" in said, show(again)
    assert "`doit step` starts a new run" in said and "Traceback" not in said, show(again)
    assert not (root / "out.txt").exists(), "nothing that did not verify is promoted"
    assert not remote_run_dir(first).exists(), "the damaged run's folder on the host is removed"
    verdict = only_handle(root)["state"]["verdict"]
    assert verdict["state"] == "failed" and verdict["message"].startswith("damaged: "), verdict

    fresh = doit_ok(root)
    assert "new run" in fresh.stdout, show(fresh)
    assert (root / "out.txt").read_text() == "made\n"
    assert len(handles(root)) == 2
