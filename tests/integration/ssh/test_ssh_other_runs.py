"""What a run sees on a host other runs use: the runs of other steps and
other clients sit beside it under `<remote_root>/runs/<id>/` (their project
copies, outputs, checkpoints). Under the sandbox a command sees its own
view only, as it would here: another run's folder is not readable from it,
and nothing of the remote root (the scripts, the environments, the caches)
is writable from it. Through the real `doit` against a real sshd in a
network namespace, with real bubblewrap; the remote root is outside /tmp
(which the sandbox empties anyway), where a user's would be."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from dodo_helpers import doit, show
from ssh_helpers import (
    make_ssh_project,
    needs_bwrap,
    needs_root,
    needs_sshd,
    other_runs_probe,
    probe_reads,
    shared_remote_root,
)
from testbeds.sshd_host import SshHost

pytestmark = [needs_sshd, needs_root, needs_bwrap]

SECRET = "first-step-secret"

TWO_STEPS = """
def task_first():
    yield from remote_step(
        "first", inputs=["data/first.txt"], outputs=["first.txt"], shell="cat data/first.txt > first.txt",
    )

def task_second():
    yield from remote_step("second", inputs=["first.txt"], outputs=["probe.txt"], shell=PROBE)
"""


@pytest.fixture
def shared_root(host: SshHost) -> Iterator[Path]:
    with shared_remote_root(host.user) as folder:
        yield folder


def test_a_step_on_an_ssh_host_cannot_read_another_runs_folder_beside_its_own(
    tmp_path: Path, host: SshHost, shared_root: Path
) -> None:
    """The second step's command looks for the first's project copy and
    outputs (kept on the host) by absolute path: it reads its own copy of
    its input only, and writes nowhere in the remote root."""
    probe = other_runs_probe(shared_root, SECRET, "probe.txt")
    root = make_ssh_project(
        tmp_path, host, f"PROBE = {probe!r}\n" + TWO_STEPS, ["first", "second"],
        files={"data/first.txt": SECRET + "\n"},
        remote_root=str(shared_root), keep_remote=True,  # the first's folder stays beside the second's
    )  # fmt: skip
    done = doit(root, timeout=300)
    assert done.returncode == 0, show(done)
    (first,) = shared_root.glob("runs/first-*")
    for kept in (first / "project" / "data" / "first.txt", first / "work" / "outputs" / "first.txt"):
        assert kept.read_text() == SECRET + "\n"  # beside the second's run, as another client's would be
    (read,) = probe_reads((root / "probe.txt").read_text())
    assert re.fullmatch(rf"{shared_root}/runs/second-[^/]+/project/first.txt", read), read
