"""Checkpoints on the SkyPilot backend, through the real `doit` and helper
against the fake SkyPilot (its clusters reached over a real sshd in a
network namespace, real rsync and bubblewrap there), as on an ssh host
(tests/integration/ssh/test_ssh_checkpoints.py): the checkpoints are
brought home as verified snapshots every `checkpoint_seconds`; a client
killed mid-run reattaches on the next `doit`; a failed run is resumed from
its snapshot on a new cluster (reuse = false) or a warm one (reuse = true).
With the bucket transport the snapshots go from the cluster to the bucket
(the real S3 server's) and the next run's cluster restores them from there."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from checkpoint_parts import (
    COUNT_PY,
    NAMING_STEP,
    count_step,
    kept_state,
    rerun_and_reattach_naming_the_checkpoints,
    result_of,
    run_logs,
    starts,
)
from dodo_helpers import COMPUTE, clean_env, doit, doit_ok, popen_doit, show, stop, unsafe_modes, wait_for
from s3_server import running_s3_server
from sky_beds import Sky
from ssh_helpers import live_handles, needs_root, needs_sshd, write_ssh_dodo

from substrax_tasks.run.promote import UNSAFE_BITS

pytestmark = [needs_sshd, needs_root]

PAUSE = 0.3
EVERY = 0.5  # checkpoint_seconds


def counting_project(sky: Sky, body: str, bucket: dict[str, Any] | None = None, **settings: Any) -> Path:
    sky.configure(checkpoint_seconds=EVERY, bucket=bucket, **settings)
    write_ssh_dodo(sky.root, "def task_all():\n" + body, ["all"])
    (sky.root / "count.py").write_text(COUNT_PY)
    (sky.root / "data.txt").write_text("one\n")
    return sky.root


def client_id(root: Path) -> str:
    """The project's own id (store.client_id): its snapshots in a bucket are under it."""
    return (root / ".substrax" / "client-id").read_text().strip()


def snapshot_keys(checkpoints: Path, step: str = "count") -> set[str]:
    """The keys of the step's snapshots in the bucket's checkpoints folder, whoever made them."""
    return {p.name for p in checkpoints.rglob("*") if p.parent.name == step and p.is_dir()}


def clusters_of(root: Path, step: str) -> list[str]:
    return [str(h["backend_state"].get("cluster")) for h in live_handles(root, step)]


def test_a_killed_client_reattaches_and_the_snapshots_go_once_promoted(sky: Sky) -> None:
    root = counting_project(sky, count_step("count", 16, PAUSE))
    proc = popen_doit(root, "count", env=sky.env)
    try:
        wait_for(lambda: (kept_state(root, "count") or {}).get("i", 0) >= 3, "a snapshot of 3 counts",
                 timeout=180)  # fmt: skip
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        stop(proc)
    folder = next((root / ".substrax" / "checkpoints" / "count").glob("*/latest"))
    manifest = json.loads((folder / "manifest.json").read_text())
    assert [e["path"] for e in manifest["entries"]] == ["state.json"]

    done = doit_ok(root, "count", env=sky.env)
    assert len(live_handles(root, "count")) == 1, show(done)  # reattached, not launched again
    assert result_of(root, "count") == (16, list(range(1, 17)))
    assert not (root / ".substrax" / "checkpoints" / "count").exists()


def test_a_command_naming_its_checkpoints_folder_runs_again_after_an_edit_and_reattaches(sky: Sky) -> None:
    """Issue 39, item 1, on a cluster: a project holding ckpt/long (as a
    local run of the step leaves it) had every launch refused."""
    root = counting_project(sky, NAMING_STEP)
    (root / "ckpt" / "long").mkdir(parents=True)

    def written_in() -> Path | None:  # on the cluster, bound at ckpt/long in its sandbox
        launched = live_handles(root, "train")
        return sky.remote / "runs" / launched[-1]["run_id"] / "work" / "checkpoints" if launched else None

    rerun_and_reattach_naming_the_checkpoints(root, written_in, env=sky.env, wait=180)


@pytest.mark.parametrize("reuse", [False, True], ids=["new-cluster", "warm-cluster"])
def test_a_failed_run_is_resumed_from_its_snapshot(sky: Sky, reuse: bool) -> None:
    # A timeout: a warm cluster is given only to a step whose time it can hold.
    body = count_step("count", 6, PAUSE, "fail-fresh").replace("checkpoints=", "timeout=120, checkpoints=")
    root = counting_project(sky, body, reuse=reuse, max_parallel=1)
    failed = doit(root, "count", env=sky.env, timeout=180)
    assert failed.returncode != 0, show(failed)
    # Pulled as the run was seen to end: the count it failed at.
    assert kept_state(root, "count") == {"n": 6, "i": 3, "seen": [1, 2, 3]}, show(failed)

    done = doit(root, "count", env=sky.env, timeout=180)
    assert done.returncode == 0, show(done)
    said = done.stdout + done.stderr
    assert "checkpoints put in place from the last snapshot (1 file(s))" in said, show(done)
    assert starts(run_logs(root, "count")[-1]) == [3], show(done)
    assert result_of(root, "count") == (6, list(range(1, 7)))
    first, second = clusters_of(root, "count")
    assert (first == second) is reuse, (first, second)


def test_a_run_that_failed_after_its_client_was_killed_resumes_from_what_it_left(sky: Sky) -> None:
    """The command writes one more checkpoint after the last one a client
    pulled, then fails; the next doit brings it home from the cluster,
    still up, before a new run starts from it."""
    root = counting_project(sky, count_step("count", 6, PAUSE, "fail-fresh", "hold-at-3"))
    proc = popen_doit(root, "count", env=sky.env)
    try:  # it holds at 2: the last snapshot a client pulled
        wait_for(lambda: (kept_state(root, "count") or {}).get("i") == 2, "a snapshot of 2 counts",
                 timeout=180)  # fmt: skip
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        stop(proc)
    run_dir = sky.remote / "runs" / live_handles(root, "count")[0]["run_id"]
    (run_dir / "work" / "checkpoints" / "go").write_text("")  # count 3, written by rename, then exit 3
    wait_for(lambda: (run_dir / "status.json").exists() and
             json.loads((run_dir / "status.json").read_text()).get("state") == "failed",
             "the run to fail on the cluster", timeout=60)  # fmt: skip

    done = doit(root, "count", env=sky.env, timeout=180)
    assert done.returncode == 0, show(done)
    assert starts(run_logs(root, "count")[-1]) == [3], show(done)
    assert result_of(root, "count") == (6, list(range(1, 7)))


def test_a_cancel_that_takes_the_cluster_down_keeps_the_last_checkpoint_first(sky: Sky) -> None:
    root = counting_project(sky, count_step("count", 40, PAUSE, "hold-at-3"))
    proc = popen_doit(root, "count", env=sky.env)
    try:  # it holds at 2 until told to go on: the last snapshot a client pulled
        wait_for(lambda: (kept_state(root, "count") or {}).get("i") == 2, "a snapshot of 2 counts",
                 timeout=180)  # fmt: skip
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        stop(proc)
    handle = live_handles(root, "count")[0]
    kept = sky.remote / "runs" / handle["run_id"] / "work" / "checkpoints"
    (kept / "go").write_text("")
    wait_for(lambda: json.loads((kept / "state.json").read_text())["i"] >= 5, "five counts on the cluster")
    reached = json.loads((kept / "state.json").read_text())["i"]
    cancelled = sky.compute("cancel", handle["run_id"])
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    assert sky.clusters() == []

    done = doit(root, "count", env=sky.env, timeout=180)
    assert done.returncode == 0, show(done)
    assert starts(run_logs(root, "count")[-1])[0] >= reached, show(done)
    assert result_of(root, "count") == (40, list(range(1, 41)))


def test_with_the_bucket_transport_snapshots_go_to_the_bucket_from_the_cluster(
    sky: Sky, tmp_path: Path
) -> None:
    with running_s3_server(tmp_path / "s3") as s3_server:
        bucket = {"outputs_bucket": f"s3://{s3_server.bucket}/runs", "lifetime_minutes": 10.0}
        root = counting_project(sky, count_step("count", 6, PAUSE, "fail-fresh"), bucket=bucket)
        sky.env.update(s3_server.env)
        sky.env["FAKESKY_BUCKET_DIR"] = str(s3_server.data_dir)
        failed = doit(root, "count", env=sky.env, timeout=180)
        assert failed.returncode != 0, show(failed)
        assert "checkpoints snapshot put in the bucket" in failed.stdout + failed.stderr, show(failed)
        # In the bucket, not through the client: nothing kept here.
        assert kept_state(root, "count") is None
        mine = s3_server.data_dir / s3_server.bucket / "runs" / "checkpoints" / client_id(root)
        in_bucket = next((mine / "count").iterdir())
        latest = json.loads((in_bucket / "latest.json").read_text())["snapshot"]
        entries = json.loads((in_bucket / latest / "manifest.json").read_text())["entries"]
        assert [e["path"] for e in entries] == ["state.json"]
        assert json.loads((in_bucket / latest / "files" / "state.json").read_text())["i"] == 3

        done = doit(root, "count", env=sky.env, timeout=180)
        assert done.returncode == 0, show(done)
        said = done.stdout + done.stderr
        assert "checkpoints put in place from the bucket's last snapshot (1 file(s))" in said, show(done)
        assert starts(run_logs(root, "count")[-1]) == [3], show(done)
        assert result_of(root, "count") == (6, list(range(1, 7)))
        first, second = clusters_of(root, "count")
        assert first != second  # a new cluster restored it from the bucket
        # The outputs are home: the step's snapshots in the bucket have gone with those here.
        assert not in_bucket.parent.exists()


def test_gc_removes_the_snapshots_in_the_bucket_of_keys_no_step_has(sky: Sky, tmp_path: Path) -> None:
    with running_s3_server(tmp_path / "s3") as s3_server:
        bucket = {"outputs_bucket": f"s3://{s3_server.bucket}/runs", "lifetime_minutes": 10.0}
        root = counting_project(sky, count_step("count", 6, PAUSE, "fail-fresh"), bucket=bucket)
        sky.env.update(s3_server.env)
        sky.env["FAKESKY_BUCKET_DIR"] = str(s3_server.data_dir)
        failed = doit(root, "count", env=sky.env, timeout=180)
        assert failed.returncode != 0, show(failed)
        mine = f"checkpoints/{client_id(root)}"
        step_folder = s3_server.data_dir / s3_server.bucket / "runs" / mine / "count"
        (key,) = [p.name for p in step_folder.iterdir()]

        kept = sky.compute("gc")  # the dodo's key is the snapshot's: kept
        assert kept.returncode == 0, kept.stdout + kept.stderr
        assert "checkpoints" not in kept.stdout and (step_folder / key).is_dir()
        (root / "data.txt").write_text("two\n")  # now no step has that key
        done = sky.compute("gc")
        assert done.returncode == 0, done.stdout + done.stderr
        uri = f"s3://{s3_server.bucket}/runs/{mine}/count/{key}"
        assert f"removed checkpoints {uri} (step count: no step of the dodo file has that key any more)" in (
            done.stdout), done.stdout  # fmt: skip
        assert not (step_folder / key).exists()


def test_two_clients_of_one_bucket_keep_and_remove_only_their_own_snapshots(sky: Sky, tmp_path: Path) -> None:
    """Two clones (two state folders, so two clients) of a project with a
    step of one name, on another key each (another branch), share the
    outputs bucket: the second's `gc` and the first's promotion leave the
    other's snapshots, and each resumes from its own."""
    with running_s3_server(tmp_path / "s3") as s3_server:
        bucket = {"outputs_bucket": f"s3://{s3_server.bucket}/runs", "lifetime_minutes": 10.0}
        first = counting_project(sky, count_step("count", 6, PAUSE, "fail-fresh"), bucket=bucket)
        sky.env.update(s3_server.env)
        sky.env["FAKESKY_BUCKET_DIR"] = str(s3_server.data_dir)
        second = tmp_path / "clone"
        second.mkdir()
        for name in ("dodo.py", "pyproject.toml", "count.py"):
            shutil.copy2(first / name, second / name)
        (second / "data.txt").write_text("another branch\n")
        checkpoints = s3_server.data_dir / s3_server.bucket / "runs" / "checkpoints"
        keys: list[str] = []
        for root in (first, second):
            failed = doit(root, "count", env=sky.env, timeout=180)
            assert failed.returncode != 0 and "snapshot put in the bucket" in failed.stderr, show(failed)
            (key,) = snapshot_keys(checkpoints) - set(keys)
            keys.append(key)

        done = doit(first, "count", env=sky.env, timeout=180)
        assert done.returncode == 0, show(done)
        assert starts(run_logs(first, "count")[-1]) == [3], show(done)  # from its own snapshot
        # Its outputs are home: its own snapshots go, and only those.
        assert snapshot_keys(checkpoints) == {keys[1]}

        # The first moves on to another key (another branch) and fails there:
        # the second's dodo has not that key, and its gc leaves the snapshot.
        (first / "data.txt").write_text("a third branch\n")
        failed = doit(first, "count", env=sky.env, timeout=180)
        assert failed.returncode != 0 and "snapshot put in the bucket" in failed.stderr, show(failed)
        (moved,) = snapshot_keys(checkpoints) - {keys[1]}
        gc = subprocess.run([str(COMPUTE), "--project", str(second), "gc"], cwd=second,
                            env=clean_env(sky.env), capture_output=True, text=True, timeout=120,
                            check=False)  # fmt: skip
        assert gc.returncode == 0, gc.stdout + gc.stderr
        assert snapshot_keys(checkpoints) == {keys[1], moved}, gc.stdout
        # Each client's under its own id.
        for root, key in ((first, moved), (second, keys[1])):
            assert (checkpoints / client_id(root) / "count" / key / "latest.json").is_file()
        # (No fetch after a listing here: the fake's clusters write into the
        # S3 server's folder behind its back, and a listing caches what it saw.)


# The command makes a setuid and a world-writable setuid file in its
# checkpoints, then fails; run again (on a new cluster, restored from the
# bucket), it says the modes it finds.
PRIVILEGED = """\
def task_all():
    yield from remote_step("priv", command=["sh", "-c", MAKE], inputs=["data.txt"], outputs=["out.txt"],
                           checkpoints="ckpt/")
MAKE = (
    "if [ -e ckpt/s ]; then stat -c 'mode %a %n' ckpt/s ckpt/o; echo done > out.txt; exit 0; fi; "
    "mkdir -p ckpt && echo s > ckpt/s && echo o > ckpt/o && chmod 6755 ckpt/s && chmod 4777 ckpt/o && exit 3"
)
"""


def test_setuid_checkpoints_reach_neither_the_bucket_nor_the_next_run_with_those_bits(
    sky: Sky, tmp_path: Path
) -> None:
    """Issue 28, item 2, with the bucket transport: the snapshot pushed into
    the bucket and the files restored from it keep no setuid, setgid,
    sticky or other-write bit (the push and the restore make them safe).
    The command fails at once, often before its client follows it: what it
    left is pushed all the same as the run is seen to have failed."""
    with running_s3_server(tmp_path / "s3") as s3_server:
        sky.configure(checkpoint_seconds=EVERY, bucket={"outputs_bucket": f"s3://{s3_server.bucket}/runs",
                                                        "lifetime_minutes": 10.0})  # fmt: skip
        write_ssh_dodo(sky.root, PRIVILEGED, ["all"])
        (sky.root / "data.txt").write_text("one\n")
        sky.env.update(s3_server.env)
        sky.env["FAKESKY_BUCKET_DIR"] = str(s3_server.data_dir)
        failed = doit(sky.root, "priv", env=sky.env, timeout=180)
        assert failed.returncode != 0 and "snapshot put in the bucket" in failed.stderr, show(failed)
        checkpoints = s3_server.data_dir / s3_server.bucket / "runs" / "checkpoints"
        assert {p.name for p in checkpoints.rglob("*") if p.parent.name == "files"} == {"s", "o"}
        assert unsafe_modes(checkpoints, ["."]) == {}

        done = doit(sky.root, "priv", env=sky.env, timeout=180)
        assert done.returncode == 0, show(done)
        modes = dict(line.split()[::-1][:2] for line in run_logs(sky.root, "priv")[-1].splitlines()
                     if line.startswith("mode "))  # fmt: skip
        assert set(modes) == {"ckpt/s", "ckpt/o"}, show(done)
        assert not [name for name, mode in modes.items() if int(mode, 8) & UNSAFE_BITS], modes
