"""A damaged snapshot of a step's checkpoints in the store (issue 28, item
9, over the records added since): a `latest` snapshot whose manifest is
JSON of the wrong shape made the next pull, as `doit` reattached to the
run, end in a traceback. It reads as no whole snapshot, as an unreadable
one already did, and the next pull replaces it. A real sshd in a network
namespace, real rsync; the client killed (-9) mid-run, the manifest
damaged by hand."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from checkpoint_parts import COUNT_PY, count_step, kept_state, result_of
from dodo_helpers import doit, popen_doit, show, stop, wait_for
from ssh_helpers import live_handles, make_ssh_project, needs_root, needs_sshd
from testbeds.sshd_host import SshHost

pytestmark = [needs_sshd, needs_root]


@pytest.mark.parametrize("damaged", ["{}", '{"entries": 5}', '{"entries": [{"size": 1}]}'])
def test_a_snapshot_whose_manifest_is_damaged_is_replaced_by_the_next_pull(
    tmp_path: Path, host: SshHost, damaged: str
) -> None:
    root = make_ssh_project(tmp_path, host, "def task_all():\n" + count_step("count", 16, 0.3), ["all"],
                            files={"count.py": COUNT_PY, "data.txt": "one\n"},
                            checkpoint_seconds=0.5)  # fmt: skip
    proc = popen_doit(root, "count")
    try:
        wait_for(lambda: (kept_state(root, "count") or {}).get("i", 0) >= 3, "a snapshot of 3 counts",
                 timeout=120)  # fmt: skip
        proc.send_signal(signal.SIGKILL)  # the run goes on there
        proc.wait(timeout=30)
    finally:
        stop(proc)
    (latest,) = (root / ".substrax" / "checkpoints" / "count").glob("*/latest")
    (latest / "manifest.json").write_text(damaged)

    done = doit(root, "count")  # reattaches, pulls while it follows, fetches
    said = done.stdout + done.stderr
    assert done.returncode == 0 and "Traceback" not in said, show(done)
    assert len(live_handles(root, "count")) == 1, show(done)  # reattached, not launched again
    assert result_of(root, "count") == (16, list(range(1, 17)))
