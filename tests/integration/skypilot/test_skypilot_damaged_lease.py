"""A warm SkyPilot cluster whose lease script (remote/lease.py, in its bin
folder) was rewritten after the install: every call of it goes through the
digest check (CHECKED_RUN) with a bounded answer, so the script that would
stream without end is never run. The step is refused naming the cluster
and the damaged script, doit ends, and the client's memory stays small.
Through the real `doit` against the fake SkyPilot, whose clusters' ssh is a
real sshd in a network namespace."""

from __future__ import annotations

import resource

from dodo_helpers import doit, doit_ok, show
from sky_beds import Sky
from ssh_helpers import needs_root, needs_sshd, write_ssh_dodo

pytestmark = [needs_sshd, needs_root]

ONE = """
def task_fit():
    yield from remote_step(
        "fit", inputs=["data/in.txt"], outputs=["fit.txt"], timeout=60, resources={"cpus": 1},
        shell="cat data/in.txt > fit.txt",
    )
"""

# What the host put in place of lease.py: an answer without end.
STREAMER = "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n"
MAX_CLIENT_KIB = 400 << 10  # what doit may have grown to, at most (it holds a few tens of MiB)


def test_a_warm_cluster_whose_lease_script_was_rewritten_is_refused_by_name(sky: Sky) -> None:
    """The next step's claim finds lease.py changed: the step fails naming
    the cluster and the script, nothing launched in its place (a tampered
    cluster is the user's to look at); `status --machines` lists it with
    its lease unasked, `gc --machines` takes it down through SkyPilot, and
    the next doit launches a new one."""
    sky.configure(reuse=True, max_parallel=1, idle_minutes=60)
    write_ssh_dodo(sky.root, ONE, ["fit"])
    (sky.root / "data").mkdir()
    (sky.root / "data" / "in.txt").write_text("hello\n")
    doit_ok(sky.root, env=sky.env)
    (cluster,) = sky.clusters()
    (lease_py,) = sky.remote.glob("bin-*/lease.py")
    lease_py.write_text(STREAMER)
    (sky.root / "data" / "in.txt").write_text("edit\n")
    done = doit(sky.root, env=sky.env, timeout=120)
    assert done.returncode == 1, show(done)
    assert (f"warm cluster {cluster} is refused: the script(s) lease.py there are not the ones this client "
            "installed") in done.stdout, show(done)  # fmt: skip
    assert "`substrax-compute gc --machines` takes it down" in done.stdout, show(done)
    assert "Traceback" not in done.stdout + done.stderr and "launching cluster" not in done.stdout, show(done)
    assert sky.clusters() == [cluster] and (sky.root / "fit.txt").read_text() == "hello\n"
    assert resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss < MAX_CLIENT_KIB

    shown = sky.compute("status", "--machines")
    listed = shown.stdout + shown.stderr
    assert f"warm cluster {cluster} on SkyPilot: its lease could not be asked" in listed, listed
    assert "may still hold a machine" not in listed  # the refused run holds none
    gone = sky.compute("gc", "--machines")
    assert gone.returncode == 0 and sky.clusters() == [], gone.stdout + gone.stderr
    again = doit_ok(sky.root, env=sky.env)
    assert "launching cluster" in again.stdout and (sky.root / "fit.txt").read_text() == "edit\n", show(again)
