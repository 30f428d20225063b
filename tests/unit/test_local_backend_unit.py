"""The unit half of tests/integration/local/test_local_backend.py: the same subject, the
tests that start no process and open no connection (see its docstring)."""

from __future__ import annotations

import pytest
from local_backend_parts import path_without_bwrap  # noqa: F401 - fixtures
from local_runs import (
    submit,
)

from substrax_tasks.errors import BackendError
from substrax_tasks.step.spec import make_spec
from substrax_tasks.store.project import Project

# ------------------------------------------------------------------ running


# ------------------------------------------------------------------ stopping


@pytest.mark.unit
def test_cancel_of_a_run_that_never_started(project: Project) -> None:
    spec = make_spec("never", ["true"], project.root)
    handle = project.new_run(spec, settings={"sandbox": "none"})
    backend = project.backend_for(handle)
    assert backend.poll(handle).state == "pending"
    assert backend.cancel(handle)
    assert backend.poll(handle).state == "cancelled"
    assert not backend.cancel(handle)  # finished now: left alone


# ------------------------------------------------- without bubblewrap at hand


@pytest.mark.usefixtures("path_without_bwrap")
@pytest.mark.unit
def test_sandbox_bwrap_without_bubblewrap_is_a_clear_error(project: Project) -> None:
    with pytest.raises(BackendError, match=r"bubblewrap is not installed.*apt-get install bubblewrap"):
        submit(project, ["/bin/sh", "-c", "true"], sandbox="bwrap")


# ------------------------------------------------- outputs carry no privileges


# ------------------------------------- a worker killed without ending its run


