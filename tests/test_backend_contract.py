"""One contract, every backend: the behaviours of substrax_tasks.backends.base
that the chain and the CLI rely on, run against each implementation with
real processes (LocalBackend on this machine, SshBackend against a real sshd
in a network namespace of its own).

Add a backend by adding a parameter to the `bound` fixture.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import describe, marked_pids, stubborn_tree, wait_for
from dodo_helpers import BWRAP
from fakesky_cleanup import cleanup, fakesky_env
from ssh_helpers import fresh_user, needs_root, needs_sshd, ssh_host, ssh_settings, write_ssh_pyproject
from testbeds.sshd_host import SshHost

from substrax_tasks.backends.base import Backend
from substrax_tasks.handle import RunHandle
from substrax_tasks.runs import Project
from substrax_tasks.spec import make_spec

SANDBOX = "bwrap" if BWRAP else "none"
WAIT = 60.0


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshHost]:
    with ssh_host(tmp_path_factory.mktemp("sshd-user"), fresh_user()) as started:
        yield started


@pytest.fixture(scope="module")
def root_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshHost]:
    """The SkyPilot clusters' ssh: the fake runs jobs as this process's user (root)."""
    with ssh_host(tmp_path_factory.mktemp("sshd-root"), None) as started:
        yield started


@dataclass
class Bound:
    """A project whose default backend is the one under test."""

    name: str
    project: Project

    def submit(self, command: list[str], outputs: list[str]) -> tuple[Backend, RunHandle]:
        spec = make_spec("step", command, self.project.root, outputs=outputs)
        handle = self.project.submit(spec)
        return self.project.backend_for(handle), handle


@pytest.fixture(
    params=[
        pytest.param("local", id="local"),
        pytest.param("ssh", id="ssh", marks=[needs_sshd, needs_root]),
        # SkyPilot's SDK through sky_helper/sky_sdk.py, against the fake SkyPilot
        # (jobs as local processes), the cluster's ssh a real sshd
        pytest.param("skypilot", id="skypilot", marks=[needs_sshd, needs_root]),
    ]
)
def bound(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Bound]:
    root = tmp_path / "project"
    root.mkdir()
    if request.param == "local":
        (root / "pyproject.toml").write_text(
            f'[tool.substrax.compute.backends.local]\nsandbox = "{SANDBOX}"\ngrace_seconds = 0.5\n'
        )
    elif request.param == "ssh":
        host: SshHost = request.getfixturevalue("host")
        write_ssh_pyproject(
            root, ssh_settings(host, remote_root=str(host.scratch / f"contract-{tmp_path.name}"))
        )
    else:
        sky_home = tmp_path / "skyhome"
        root_host: SshHost = request.getfixturevalue("root_host")
        env = fakesky_env(
            sky_home, FAKESKY_SSH_HOST=root_host.address, FAKESKY_SSH_PORT=str(root_host.port),
            FAKESKY_SSH_USER="root", FAKESKY_SSH_IDENTITY=str(root_host.client_key),
            FAKESKY_MINUTE_SECONDS="30", FAKESKY_CANCEL_GRACE="1",
        )  # fmt: skip
        for name, value in env.items():  # the helper and ssh run with these
            if name in ("HOME", "TMPDIR", "PYTHONPATH") or name.startswith("FAKESKY_"):
                monkeypatch.setenv(name, value)
        request.addfinalizer(lambda: cleanup(sky_home))
        (root / "pyproject.toml").write_text(
            '[tool.substrax.compute]\ndefault_backend = "skypilot"\n'
            "[tool.substrax.compute.backends.skypilot]\n"
            f'sky_python = "{sys.executable}"\nremote_root = "{tmp_path / "remote"}"\n'
            f'sandbox = "{SANDBOX}"\ngrace_seconds = 0.5\npoll_seconds = 0.3\n'
            "[tool.substrax.compute.backends.skypilot.copy]\n"
        )
    project = Project.open(root)
    assert project.config.default_backend == request.param
    yield Bound(request.param, project)


def live_children() -> set[int]:
    """This process's children that have not ended (zombies excluded)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            found.add(int(entry))
    return found


def wait_final(backend: Backend, handle: RunHandle) -> str:
    seen: list[str] = []

    def final() -> bool:
        status = backend.poll(handle)
        seen.append(status.state)
        return status.final

    wait_for(final, f"run {handle.run_id} to finish", WAIT)
    assert set(seen) <= {"pending", "running", "succeeded", "failed", "cancelled", "timed_out"}, seen
    return seen[-1]


def test_a_trivial_run_succeeds_logs_fetches_and_tears_down_twice(bound: Bound) -> None:
    backend, handle = bound.submit(
        ["/bin/sh", "-c", "mkdir -p out && echo contract-log-line && echo v > out/v.txt"], ["out/"]
    )
    assert backend.name == bound.name
    before = live_children()
    # what the chain holds while it waits for a run ends with the block
    with backend.ready_for_fetch(handle):
        assert wait_final(backend, handle) == "succeeded"
    wait_for(lambda: live_children() <= before, "what ready_for_fetch started to end", WAIT)
    assert backend.poll(handle).exit_code == 0

    log = backend.read_log(handle, 0)
    assert b"contract-log-line\n" in log
    assert backend.read_log(handle, len(log)) == b""
    offset = log.index(b"contract-log-line")
    assert backend.read_log(handle, offset).startswith(b"contract-log-line")

    fetched = backend.fetch(handle)
    assert [e["path"] for e in fetched.manifest["entries"]] == ["out", "out/v.txt"]
    assert fetched.manifest["missing"] == []
    assert (fetched.root / "out" / "v.txt").read_text() == "v\n"

    # a finished run is left alone by cancel
    assert backend.cancel(handle) is False
    assert backend.poll(handle).state == "succeeded"

    # teardown is idempotent and keeps what tells the run's story
    handle = bound.project.store.read(handle.run_id)
    backend.teardown(handle)
    handle = bound.project.store.read(handle.run_id)
    backend.teardown(handle)
    handle = bound.project.store.read(handle.run_id)
    assert backend.status(handle).state == "succeeded"
    assert b"contract-log-line\n" in backend.read_log(handle, 0)
    assert backend.cancel(handle) is False
    assert backend.outputs_available(handle) is False


def test_cancel_stops_a_running_tree_and_then_leaves_it_alone(bound: Bound, marker: str) -> None:
    backend, handle = bound.submit(stubborn_tree(marker, "grandchild"), ["out/"])
    wait_for(lambda: len(marked_pids(marker)) >= 2, "the task and its setsid grandchild", WAIT)
    time.sleep(0.2)  # both have set their SIGTERM traps
    assert backend.poll(handle).state == "running"
    assert backend.cancel(handle) is True
    assert not marked_pids(marker), describe(marked_pids(marker))
    assert backend.poll(handle).state == "cancelled"
    assert backend.cancel(handle) is False
    handle = bound.project.store.read(handle.run_id)
    backend.teardown(handle)
    backend.teardown(bound.project.store.read(handle.run_id))
    assert backend.status(bound.project.store.read(handle.run_id)).state == "cancelled"


def test_teardown_of_a_running_run_cancels_it_first(bound: Bound, marker: str) -> None:
    backend, handle = bound.submit(["/bin/sh", "-c", "while :; do sleep 0.1; done", marker], ["out/"])
    wait_for(lambda: backend.poll(handle).state == "running", "the run to start", WAIT)
    backend.teardown(handle)
    assert not marked_pids(marker), describe(marked_pids(marker))
    assert backend.status(bound.project.store.read(handle.run_id)).state == "cancelled"
