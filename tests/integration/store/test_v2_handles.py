"""Runs recorded by the release before handle version 3 stay reachable.

Each test makes a real run on its backend (local under bubblewrap; ssh on a
real sshd; skypilot on the fake SkyPilot with a real sshd for its cluster),
asks `substrax-compute` `status`, `logs`, `fetch` and `why` about it, then
rewrites its handle as that release wrote it (version 2:
tests/support/handle_versions.py, checked against the handles that release
wrote in tests/support/v2_handles/) and asks again: the answers are the same.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

from dodo_helpers import compute, doit_ok, make_project, show
from handle_versions import write_as_version_2
from sky_beds import Sky
from ssh_helpers import make_ssh_project, needs_root, needs_sshd, only_handle
from testbeds.sshd_host import SshHost

Ask = Callable[..., subprocess.CompletedProcess[str]]

STEP = """
def task_step():
    yield from remote_step(
        "step", shell="mkdir -p out; cat data/in.txt > out/a.txt; echo said-by-the-step",
        inputs=["data/in.txt"], outputs=["out/"],
    )
"""


COPY_TIME = re.compile(r"in [0-9.]+ s \([0-9.]+ MB/s\)")


def answers(ask: Ask, run_id: str) -> list[tuple[int, str]]:
    """What the CLI says of the run: its status, its log, a fetch, why;
    less the time a copy took (`in 0.3 s (0.0 MB/s)`), which varies."""
    said = []
    for args in (("status", run_id, "--json"), ("logs", run_id), ("fetch", run_id), ("why", "step")):
        done = ask(*args)
        said.append((done.returncode, COPY_TIME.sub("in <time>", done.stdout + done.stderr)))
    return said


# What `status --json` tells of a run that the release before did not
# record: a version-2 handle answers them empty.
SINCE_VERSION_2 = ("attempts",)


def without_the_clock(status: str) -> tuple[dict[str, object], bool]:
    """`status --json` less the time its lifetime leaves (it runs down
    between two asks), and whether it gave one (read from the backend's
    state: a kept remote run has one); less what a version-2 handle never
    recorded, and its machine time and cost (which a version-2 handle never
    recorded either, and which run on while a kept run holds its machine)."""
    data = json.loads(status)
    left = data["runs"][0].pop("lifetime_left_seconds")
    for key in (*SINCE_VERSION_2, "machine_seconds", "hourly_cost", "cost_usd", "max_cost"):
        data["runs"][0].pop(key)
    return data, isinstance(left, float)


def same_answers_from_a_version_2_handle(root: Path, ask: Ask) -> list[tuple[int, str]]:
    run_id = only_handle(root)["run_id"]
    handle_file = root / ".substrax" / "runs" / run_id / "handle.json"
    now = answers(ask, run_id)
    write_as_version_2(handle_file)
    then = answers(ask, run_id)
    assert then[1:] == now[1:]
    assert then[0][0] == now[0][0] and without_the_clock(then[0][1]) == without_the_clock(now[0][1])
    assert all(not json.loads(then[0][1])["runs"][0][key] for key in SINCE_VERSION_2)
    status, logs, _, why = now
    assert status[0] == 0 and json.loads(status[1])["runs"][0]["state"] == "succeeded", status
    assert logs[0] == 0 and "said-by-the-step" in logs[1], logs
    assert why == (0, "step: up to date\n"), why
    return now


def test_a_local_run_of_a_version_2_handle_answers_as_before(tmp_path: Path) -> None:
    root = make_project(tmp_path, STEP, ["step"], files={"data/in.txt": "hello\n"})
    doit_ok(root)
    _, _, fetch, _ = same_answers_from_a_version_2_handle(root, lambda *args: compute(root, *args))
    # its staged outputs were moved home by the promotion: nothing to fetch, said so
    assert fetch[0] == 1 and "its outputs are no longer where it ran" in fetch[1], fetch
    assert (root / "out" / "a.txt").read_text() == "hello\n"


@needs_sshd
@needs_root
def test_an_ssh_run_of_a_version_2_handle_answers_as_before_and_is_written_as_3(
    tmp_path: Path, host: SshHost
) -> None:
    root = make_ssh_project(tmp_path, host, STEP, files={"data/in.txt": "hello\n"}, keep_remote=True)
    doit_ok(root)
    (root / "out" / "a.txt").unlink()  # the fetch brings it back from the host
    status, _, fetch, _ = same_answers_from_a_version_2_handle(root, lambda *args: compute(root, *args))
    assert without_the_clock(status[1])[1]  # its lifetime timer, read from the backend's part
    assert fetch[0] == 0, fetch
    assert (root / "out" / "a.txt").read_text() == "hello\n"
    run_id = only_handle(root)["run_id"]
    torn = compute(root, "teardown", run_id)  # records torn_down: the handle is written again
    assert torn.returncode == 0, show(torn)
    written = only_handle(root)
    assert written["version"] == 3 and written["backend_state"]["torn_down"] is True
    assert written["backend_state"]["remote_run_dir"] and "remote_run_dir" not in written["state"]


@needs_sshd
@needs_root
def test_a_skypilot_run_of_a_version_2_handle_answers_as_before(sky: Sky) -> None:
    root = sky.project(STEP, command="")
    doit_ok(root, env=sky.env)
    _, _, fetch, _ = same_answers_from_a_version_2_handle(root, sky.compute)
    # its cluster went down once the outputs came home: nothing to fetch, said so
    assert fetch[0] == 1 and "its outputs are no longer where it ran" in fetch[1], fetch
