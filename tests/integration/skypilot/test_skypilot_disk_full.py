"""A full disk while a warm SkyPilot cluster's records are written at the
end of `doit` (issue 28, item 8, over the records added since): a run on a
warm cluster lets it go at doit's teardown, which keeps the run's cost in
its handle and its release in the cluster's life (`.substrax/machines/`).
One message naming the file system and the fix, exit status 1, no
traceback, every record readable as it was, and the next doit after space
is freed runs no command again (`substrax-compute teardown RUN`, as the
message says, lets the machine go: the step being done, doit leaves it be).

The project lives on a small tmpfs of its own (tests/support/disk_full_parts.py),
the fake SkyPilot's cluster a real sshd in a network namespace; root, as CI.
"""

from __future__ import annotations

import json

from disk_full_parts import FILL_ACTION, free_the_disk, inside, seen_from_here, small_disk
from dodo_helpers import COMPUTE, DOIT
from sky_beds import Sky
from ssh_helpers import needs_root, needs_sshd, write_ssh_dodo

pytestmark = [needs_sshd, needs_root]

WARM_THEN_FILL = FILL_ACTION + """
def task_fit():
    yield from remote_step(
        "fit", inputs=["data/in.txt"], outputs=["fit.txt"], timeout=60, resources={"cpus": 1},
        shell="cat data/in.txt > fit.txt",
    )

def task_fill():
    return {"actions": [fill_the_disk], "task_dep": ["fit"]}
"""


def test_a_full_disk_at_a_warm_clusters_release_is_one_message_and_the_next_doit_runs_nothing_again(
    sky: Sky,
) -> None:
    sky.project()
    sky.env["FAKESKY_MINUTE_SECONDS"] = "2"
    sky.configure(reuse=True, max_parallel=1, idle_minutes=60, infra="aws", instance_type="m6i.large")
    write_ssh_dodo(sky.root, WARM_THEN_FILL, ["fill"])
    source = sky.base / "source"
    source.mkdir()
    for item in sky.root.iterdir():
        item.rename(source / item.name)
    root = sky.root
    with small_disk(source, root) as pid:
        seen = seen_from_here(pid, root)
        (seen / "fill-now").touch()
        full = inside(pid, root, str(DOIT), env=sky.env, timeout=180)
        said = full.stdout + full.stderr
        assert full.returncode == 1, said
        assert "Traceback" not in said and "sqlite" not in said.lower(), said
        assert f"no space left on the file system mounted at {root}" in said, said
        assert "Free space there and run `doit` again" in said, said
        assert (seen / "fit.txt").read_text() == "hello\n"
        (handle_file,) = seen.glob(".substrax/runs/*/handle.json")
        assert json.loads(handle_file.read_text())["state"]["phase"] == "promoted"
        for life in seen.glob(".substrax/machines/*.json"):
            json.loads(life.read_text())  # whole: a write that failed left it as it was

        run_id = handle_file.parent.name
        assert f"as doit let run {run_id} go" in said, said
        print(f"\n[a full disk as doit ends] {said}")
        assert f"Free space there and run `substrax-compute teardown {run_id}`" in said, said

        free_the_disk(seen)
        torn = inside(pid, root, str(COMPUTE), "teardown", run_id, env=sky.env)
        assert torn.returncode == 0, torn.stdout + torn.stderr
        kept = json.loads(handle_file.read_text())["state"]
        assert kept["cost_usd"] is not None and kept["machine"]["released_at"] is not None, kept
        again = inside(pid, root, str(DOIT), env=sky.env, timeout=180)
        assert again.returncode == 0, again.stdout + again.stderr
        assert len(list(seen.glob(".substrax/runs/*/handle.json"))) == 1, "the command ran again"
        listed = inside(pid, root, str(COMPUTE), "status", "--all", "--json", env=sky.env)
        assert listed.returncode == 0, listed.stderr
        (run,) = json.loads(listed.stdout)["runs"]
        assert run["state"] == "succeeded" and run["cost_usd"] == kept["cost_usd"], run
    assert sky.clusters() == [], "the teardown left the cluster up"
