"""`.substrax` deleted while a run goes on (issue 18, item 8): doit does
not wait for ever; the run is found lost, said so, and the next doit
launches it anew. Over ssh the client that drove the run removes its
folder on the host (issue 28). Real doit, real worker, a real sshd in a
network namespace.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from dodo_helpers import (
    doit,
    handles,
    make_project,
    pids_with,
    popen_doit,
    popen_output,
    show,
    stop,
    wait_for,
)
from local_runs import describe, marked_pids
from progress import wait_exit
from ssh_helpers import GATED_STEP, make_ssh_project, needs_root, needs_sshd, only_handle, remote_run_dir
from testbeds.sshd_host import SshHost

BODY = """
def task_step():
    yield from remote_step(
        "step", inputs=["flags/"], outputs=["out.txt"],  # a run sees its inputs only: the flag's folder
        command=["sh", "-c", "if [ -e flags/slow ]; then sleep 60; fi; echo ok > out.txt", {marker!r}],
    )
"""


def started(root: Path) -> bool:
    return any(h["state"].get("phase") == "started" for h in handles(root))


def test_deleting_the_store_mid_run_ends_doit_with_the_run_lost(tmp_path: Path, marker: str) -> None:
    root = make_project(tmp_path, BODY.format(marker=marker), default_tasks=["step"],
                        files={"flags/slow": ""})  # fmt: skip
    client = popen_doit(root)
    try:
        wait_for(lambda: pids_with(marker) and started(root), "the run to be followed")
        store = root / ".substrax"
        # as `rm -rf` would, again while doit writes in it meanwhile
        def removed() -> bool:
            shutil.rmtree(store, ignore_errors=True)
            return not store.exists()

        wait_for(removed, "the store to go")
        code = wait_exit(client, "the doit to end", 60)  # before the fix: no end (the run read as pending)
    finally:
        stop(client)
    said = popen_output(root)
    assert code == 1, said
    assert "was deleted" in said and "Traceback" not in said, said
    wait_for(lambda: not pids_with(marker), "the lost run's command to be stopped")

    (root / "flags" / "slow").unlink()
    again = doit(root)
    assert again.returncode == 0, show(again)
    assert (root / "out.txt").read_text() == "ok\n"


@needs_sshd
@needs_root
def test_deleting_the_store_mid_run_over_ssh_leaves_no_run_folder_on_the_host(
    tmp_path: Path, host: SshHost, marker: str
) -> None:
    """The client driving the run still holds its handle: it stops the run
    and removes its folder on the host, which nothing could find again."""
    gate = host.scratch / f"gate-{marker}"  # never made: the run goes on until stopped
    body = GATED_STEP.format(gate=gate, marker=marker, resources="{}")
    root = make_ssh_project(tmp_path, host, body)
    client = popen_doit(root)
    try:
        wait_for(lambda: marked_pids(marker) and started(root), "the run to be followed")
        run_dir = remote_run_dir(only_handle(root))
        shutil.rmtree(root / ".substrax")
        code = wait_exit(client, "the doit to end", 60)
    finally:
        stop(client)
    said = popen_output(root)
    assert code == 1, said
    assert "was deleted while this doit drove the run: stopped it and removed its folder" in said, said
    assert "Traceback" not in said, said
    # before the fix: there until its lifetime timer (10 minutes here)
    assert not run_dir.exists(), "the run's folder on the host outlived the client that drove it"
    assert not marked_pids(marker), describe(marked_pids(marker))
