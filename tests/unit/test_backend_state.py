"""What the core needs of a backend's own state in a handle, asked of the
backend (base.py's contract), never read from its keys: where a run ran,
whether it was torn down, its lifetime left."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from substrax_tasks.backends.registry import backend_class
from substrax_tasks.cli.status_view import lifetime_left
from substrax_tasks.step.spec import make_spec
from substrax_tasks.store.handle import RunHandle
from substrax_tasks.store.run_store import RunStore

pytestmark = pytest.mark.unit

ARMED = {"pid": 1, "start_ticks": 1, "seconds": 600, "armed_at": 1000.0}


def handle_of(tmp_path: Path, backend: str, **state: Any) -> RunHandle:
    made = RunStore(tmp_path / ".substrax").new_run(make_spec("s", ["true"], tmp_path), backend, {})
    return made.model_copy(update={"backend_state": state})


@pytest.mark.parametrize("backend", ["ssh", "skypilot"])
def test_a_remote_run_holds_its_machine_until_torn_down_with_the_time_its_timer_leaves(
    tmp_path: Path, backend: str
) -> None:
    cls = backend_class(backend)
    armed = handle_of(tmp_path, backend, watchdog=ARMED)
    assert cls.lifetime_left(armed, now=1100.0) == 500.0 and not cls.released(armed)
    torn = handle_of(tmp_path, backend, watchdog=ARMED, torn_down=True)
    assert cls.lifetime_left(torn, now=1100.0) is None and cls.released(torn)
    assert cls.lifetime_left(handle_of(tmp_path, backend), now=1100.0) is None  # never armed


def test_a_local_run_holds_no_machine_and_ran_here(tmp_path: Path) -> None:
    cls = backend_class("local")
    handle = handle_of(tmp_path, "local")
    assert cls.lifetime_left(handle) is None and not cls.released(handle)
    backend = cls(cls.Settings.model_validate({}), RunStore(tmp_path / ".substrax"))
    assert backend.ran_on(handle) == socket.gethostname()


def test_where_a_run_ran_is_its_host_or_its_cluster(tmp_path: Path) -> None:
    store = RunStore(tmp_path / ".substrax")
    ssh = backend_class("ssh")
    on_host = ssh(ssh.Settings.model_validate({"host": "me@gpu-box:2222"}), store)
    assert on_host.ran_on(handle_of(tmp_path, "ssh")) == "gpu-box"
    sky = backend_class("skypilot")
    on_cluster = sky(sky.Settings.model_validate({"copy": {}}), store)
    assert on_cluster.ran_on(handle_of(tmp_path, "skypilot", cluster="sx-train-1")) == "sx-train-1"


def test_the_status_listing_asks_the_runs_backend_and_knows_none_of_an_unknown_one(tmp_path: Path) -> None:
    assert lifetime_left(handle_of(tmp_path, "ssh", watchdog={**ARMED, "armed_at": 4e9})) is not None
    assert lifetime_left(handle_of(tmp_path, "gone", watchdog=ARMED)) is None
