"""What a run sees on a warm SkyPilot cluster that steps take turns on
(`reuse = true`): the runs of other steps and other clients sit beside it
under `<remote_root>/runs/<id>/`, the cluster's lease under
`<remote_root>/leases/`. Steps run there through the same worker as on an
ssh host, so under the sandbox a command sees its own view only: no other
run's folder is readable from it, and nothing of the remote root is
writable from it. Through the real `doit` against the fake SkyPilot, whose
clusters' ssh is a real sshd in a network namespace: the worker and
bubblewrap there are the real ones."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from dodo_helpers import doit, show
from sky_beds import Sky
from ssh_helpers import (
    needs_bwrap,
    needs_root,
    needs_sshd,
    other_runs_probe,
    probe_reads,
    shared_remote_root,
    write_ssh_dodo,
)

pytestmark = [needs_sshd, needs_root, needs_bwrap]

SECRET = "another-clients-secret"

SWEEP = """
def task_fit():
    for m in range(2):
        yield from remote_step(
            f"fit:m{m}", inputs=["data/in.txt"], outputs=[f"probe-{m}.txt"], timeout=60,
            resources={"cpus": 1}, shell=PROBE.replace("OUTPUT", f"probe-{m}.txt"),
        )
"""


@pytest.fixture
def shared_root() -> Iterator[Path]:
    """Requested before `sky`: removed once the fake's processes (the lease) are stopped."""
    with shared_remote_root() as folder:
        yield folder


def test_a_step_on_a_warm_cluster_cannot_read_another_runs_folder_or_write_the_lease(
    shared_root: Path, sky: Sky
) -> None:
    """Another client's run on the cluster's remote root (its project copy
    and outputs), and the cluster's lease beside: neither step of a sweep
    that takes turns on the cluster reads the run's files or writes there."""
    other = shared_root / "runs" / "fit-20260101T000000-0a1b2c"
    for rel in ("project/data/in.txt", "work/outputs/fit.txt", "work/checkpoints/step.ckpt"):
        (other / rel).parent.mkdir(parents=True, exist_ok=True)
        (other / rel).write_text(SECRET + "\n")
    sky.configure(reuse=True, max_parallel=1, remote_root=str(shared_root))
    probe = other_runs_probe(shared_root, SECRET, "OUTPUT")
    write_ssh_dodo(sky.root, f"PROBE = {probe!r}\n" + SWEEP, ["fit"])
    (sky.root / "data").mkdir()
    (sky.root / "data" / "in.txt").write_text("hello\n")
    done = doit(sky.root, env=sky.env, timeout=300)
    assert done.returncode == 0, show(done)
    assert "on warm cluster" in done.stdout, show(done)
    (cluster,) = sky.clusters()
    assert (shared_root / "leases" / cluster / "lease.json").is_file()  # the lease beside the runs
    for m in range(2):
        assert probe_reads((sky.root / f"probe-{m}.txt").read_text()) == []
