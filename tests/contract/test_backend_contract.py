"""One contract, every backend: the behaviours of substrax_tasks.backends.base
that the chain and the CLI rely on, run against each implementation with
real processes (LocalBackend on this machine, SshBackend against a real sshd
in a network namespace of its own, SkypilotBackend through the SDK helper
against the fake SkyPilot). One test per behaviour, as fsspec's
tests/abstract binds one suite to every filesystem.

Add a backend by adding a parameter to the `bound` fixture. Per backend, one
finished run (`finished`) and one torn-down run (`torn_down`) are made once
and shared by the tests that only look at them.
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from dodo_helpers import BWRAP
from fakesky_cleanup import cleanup, fakesky_env
from local_runs import describe, marked_pids, stop_worker, stubborn_tree, wait_for
from ssh_helpers import needs_root, needs_sshd, ssh_settings, write_ssh_pyproject
from testbeds.sshd_host import SshHost

from substrax_tasks.backends.base import Backend
from substrax_tasks.backends.job import STATUS_FILE
from substrax_tasks.step.spec import make_spec
from substrax_tasks.store.handle import RunHandle
from substrax_tasks.store.project import Project

SANDBOX = "bwrap" if BWRAP else "none"
WAIT = 60.0
STATES = {"pending", "running", "succeeded", "failed", "cancelled", "timed_out"}
LOG_LINE = b"contract-log-line"
TRIVIAL = ["/bin/sh", "-c", "mkdir -p out && echo contract-log-line && echo v > out/v.txt"]


@dataclass
class Bound:
    """A project whose default backend is the one under test."""

    name: str
    project: Project

    def submit(self, command: list[str], outputs: list[str]) -> tuple[Backend, RunHandle]:
        spec = make_spec("step", command, self.project.root, outputs=outputs)
        handle = self.project.submit(spec)
        return self.project.backend_for(handle), handle

    def reread(self, handle: RunHandle) -> RunHandle:
        return self.project.store.read(handle.run_id)


def _write_pyproject(request: pytest.FixtureRequest, root: Path, tmp: Path, env: pytest.MonkeyPatch) -> None:
    if request.param == "local":
        (root / "pyproject.toml").write_text(
            f'[tool.substrax.compute.backends.local]\nsandbox = "{SANDBOX}"\ngrace_seconds = 0.5\n'
        )
    elif request.param == "ssh":
        host: SshHost = request.getfixturevalue("host")
        write_ssh_pyproject(root, ssh_settings(host, remote_root=str(host.scratch / f"contract-{tmp.name}")))
    else:
        sky_home = tmp / "skyhome"
        root_host: SshHost = request.getfixturevalue("root_host")
        fake = fakesky_env(
            sky_home, FAKESKY_SSH_HOST=root_host.address, FAKESKY_SSH_PORT=str(root_host.port),
            FAKESKY_SSH_USER="root", FAKESKY_SSH_IDENTITY=str(root_host.client_key),
            FAKESKY_MINUTE_SECONDS="30", FAKESKY_CANCEL_GRACE="1",
        )  # fmt: skip
        for name, value in fake.items():  # the helper and ssh run with these
            if name in ("HOME", "TMPDIR", "PYTHONPATH") or name.startswith("FAKESKY_"):
                env.setenv(name, value)
        request.addfinalizer(lambda: cleanup(sky_home))
        (root / "pyproject.toml").write_text(
            '[tool.substrax.compute]\ndefault_backend = "skypilot"\n'
            "[tool.substrax.compute.backends.skypilot]\n"
            f'sky_python = "{sys.executable}"\nremote_root = "{tmp / "remote"}"\n'
            f'sandbox = "{SANDBOX}"\ngrace_seconds = 0.5\npoll_seconds = 0.3\n'
            "[tool.substrax.compute.backends.skypilot.copy]\n"
        )


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("local", id="local"),
        pytest.param("ssh", id="ssh", marks=[needs_sshd, needs_root]),
        # SkyPilot's SDK through skypilot/helper/sky_sdk.py, against the fake SkyPilot
        # (jobs as local processes), the cluster's ssh a real sshd
        pytest.param("skypilot", id="skypilot", marks=[needs_sshd, needs_root]),
    ],
)
def bound(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bound]:
    tmp = tmp_path_factory.mktemp(f"contract-{request.param}")
    root = tmp / "project"
    root.mkdir()
    with pytest.MonkeyPatch.context() as env:
        _write_pyproject(request, root, tmp, env)
        project = Project.open(root)
        assert project.config.default_backend == request.param
        yield Bound(request.param, project)
        for status_file in tmp.rglob(STATUS_FILE):  # a failed test leaves no worker behind
            stop_worker(status_file)


def wait_final(backend: Backend, handle: RunHandle) -> list[str]:
    """Every state poll() reported until the run was final."""
    seen: list[str] = []

    def final() -> bool:
        status = backend.poll(handle)
        seen.append(status.state)
        return status.final

    wait_for(final, f"run {handle.run_id} to finish", WAIT)
    return seen


@dataclass
class Finished:
    """A trivial run that ended."""

    bound: Bound
    backend: Backend
    handle: RunHandle
    states: list[str]  # what poll() said while the chain would wait


@pytest.fixture(scope="module")
def finished(bound: Bound) -> Finished:
    backend, handle = bound.submit(TRIVIAL, ["out/"])
    return Finished(bound, backend, handle, wait_final(backend, handle))


@pytest.fixture(scope="module")
def torn_down(bound: Bound) -> Finished:
    """A finished trivial run, then torn down."""
    backend, handle = bound.submit(TRIVIAL, ["out/"])
    states = wait_final(backend, handle)
    backend.teardown(bound.reread(handle))
    return Finished(bound, backend, bound.reread(handle), states)


def test_the_project_builds_the_backend_it_configures(finished: Finished) -> None:
    assert finished.backend.name == finished.bound.name


def test_a_trivial_run_succeeds(finished: Finished) -> None:
    assert set(finished.states) <= STATES, finished.states
    assert finished.states[-1] == "succeeded", finished.states
    status = finished.backend.poll(finished.handle)
    assert (status.state, status.exit_code) == ("succeeded", 0)


def test_the_log_holds_what_the_command_printed(finished: Finished) -> None:
    assert LOG_LINE + b"\n" in finished.backend.read_log(finished.handle, 0)


def test_the_log_read_from_its_end_is_empty(finished: Finished) -> None:
    log = finished.backend.read_log(finished.handle, 0)
    assert finished.backend.read_log(finished.handle, len(log)) == b""


def test_the_log_read_from_an_offset_starts_there(finished: Finished) -> None:
    offset = finished.backend.read_log(finished.handle, 0).index(LOG_LINE)
    assert finished.backend.read_log(finished.handle, offset).startswith(LOG_LINE)


def test_fetch_lists_every_output_in_its_manifest(finished: Finished) -> None:
    fetched = finished.backend.fetch(finished.handle)
    assert [e["path"] for e in fetched.manifest["entries"]] == ["out", "out/v.txt"]
    assert fetched.manifest["missing"] == []


def test_fetch_brings_the_outputs_under_its_root(finished: Finished) -> None:
    fetched = finished.backend.fetch(finished.handle)
    assert (fetched.root / "out" / "v.txt").read_text() == "v\n"


def test_cancel_leaves_a_finished_run_alone(finished: Finished) -> None:
    assert finished.backend.cancel(finished.handle) is False
    assert finished.backend.poll(finished.handle).state == "succeeded"


def test_a_second_teardown_is_harmless(torn_down: Finished) -> None:
    torn_down.backend.teardown(torn_down.bound.reread(torn_down.handle))
    assert torn_down.backend.status(torn_down.bound.reread(torn_down.handle)).state == "succeeded"


def test_teardown_keeps_the_final_status(torn_down: Finished) -> None:
    assert torn_down.backend.status(torn_down.handle).state == "succeeded"


def test_teardown_keeps_the_log(torn_down: Finished) -> None:
    assert LOG_LINE + b"\n" in torn_down.backend.read_log(torn_down.handle, 0)


def test_cancel_leaves_a_torn_down_run_alone(torn_down: Finished) -> None:
    assert torn_down.backend.cancel(torn_down.handle) is False


def test_teardown_leaves_no_outputs_to_fetch(torn_down: Finished) -> None:
    assert torn_down.backend.outputs_available(torn_down.handle) is False


# What the core needs of a run it asks the backend, never the handle's
# backend_state (backends/base.py, Capabilities): whether the outputs stay
# where it ran until teardown, whether it wrote them in place, where it ran.


def wrote_in_place(finished: Finished) -> bool:
    """A local run without the sandbox writes its outputs in the project itself."""
    return finished.bound.name == "local" and SANDBOX == "none"


def test_outputs_stay_where_the_run_ran_until_teardown(finished: Finished) -> None:
    handle = finished.bound.reread(finished.handle)
    assert finished.backend.outputs_available(handle) is not wrote_in_place(finished)


def test_fetch_is_in_place_only_for_a_run_that_wrote_in_the_project(finished: Finished) -> None:
    fetched = finished.backend.fetch(finished.bound.reread(finished.handle))
    in_place = fetched.root.resolve() == finished.bound.project.root.resolve()
    assert in_place is wrote_in_place(finished)
    assert fetched.saw_whole_project is in_place


def test_where_the_run_ran_is_this_machine_its_host_or_its_cluster(finished: Finished) -> None:
    handle = finished.bound.reread(finished.handle)
    expected = {
        "local": socket.gethostname(),
        "ssh": str(getattr(finished.backend.settings, "host", None)),
        "skypilot": str(handle.backend_state.get("cluster")),
    }
    assert finished.backend.ran_on(handle) == expected[finished.bound.name]


def test_cancel_stops_a_running_tree_and_then_leaves_it_alone(bound: Bound, marker: str) -> None:
    backend, handle = bound.submit(stubborn_tree(marker, "grandchild"), ["out/"])
    wait_for(lambda: len(marked_pids(marker)) >= 2, "the task and its setsid grandchild", WAIT)
    time.sleep(0.2)  # both have set their SIGTERM traps
    assert backend.poll(handle).state == "running"
    assert backend.cancel(handle) is True
    assert not marked_pids(marker), describe(marked_pids(marker))
    assert backend.poll(handle).state == "cancelled"
    assert backend.cancel(handle) is False
    backend.teardown(bound.reread(handle))
    backend.teardown(bound.reread(handle))
    assert backend.status(bound.reread(handle)).state == "cancelled"


def test_teardown_of_a_running_run_cancels_it_first(bound: Bound, marker: str) -> None:
    backend, handle = bound.submit(["/bin/sh", "-c", "while :; do sleep 0.1; done", marker], ["out/"])
    wait_for(lambda: backend.poll(handle).state == "running", "the run to start", WAIT)
    backend.teardown(handle)
    assert not marked_pids(marker), describe(marked_pids(marker))
    assert backend.status(bound.reread(handle)).state == "cancelled"
