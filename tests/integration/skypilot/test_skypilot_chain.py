"""remote_step() on the skypilot backend, through the real `doit` and the real
`substrax-compute`, against the fake SkyPilot (tests/support/fakesky: the SDK's
documented behaviour, jobs as real local processes, requests that outlive
their client) driven by the real skypilot/helper/sky_sdk.py helper, with the cluster's
ssh served by a real sshd in a network namespace (rsync and the manifests
go through it) and real bubblewrap.

No cloud is reachable here: this is the one place a fake stands in, and
tests/contract/test_fakesky_contract.py holds its signatures to the installed SDK's.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from dodo_helpers import (
    clean_env,
    doit,
    doit_ok,
    popen_doit,
    popen_output,
    run_count,
    show,
    step_ran,
    step_skipped,
    stop,
    wait_for,
)
from local_runs import marked_pids
from progress import wait_exit
from s3_server import S3Server, running_s3_server
from sky_beds import COMMAND, Sky
from special_files import plant_specials, specials_under
from ssh_helpers import (
    GATED_STEP,
    GATED_SWEEP,
    SANDBOX,
    compute_in_view,
    doit_killed_mid_run,
    doit_killed_mid_run_in_view,
    needs_root,
    needs_sshd,
    only_handle,
    write_ssh_dodo,
)

pytestmark = [needs_sshd, needs_root]









def test_full_chain_then_a_noop_rerun_that_asks_skypilot_nothing(sky: Sky) -> None:
    root = sky.project()
    # SkyPilot would leave out what .gitignore names: a declared input all the same
    (root / ".gitignore").write_text("data/\n")
    done = doit_ok(root, env=sky.env)
    assert step_ran(done, "step") and "launching cluster substrax-step-" in done.stdout, show(done)
    assert (root / "out" / "copy.txt").read_text() == "hello\n"
    sandboxed = "read-only\n" if SANDBOX == "bwrap" else "writable\n"
    assert (root / "out" / "project.txt").read_text() == sandboxed
    assert (root / "res.txt").read_text() == "done\n"
    assert "hello from the cluster" in done.stdout  # the task's log, streamed over ssh
    handle = only_handle(root)
    assert handle["backend_state"]["torn_down"] is True and handle["state"]["phase"] == "promoted"
    # the intent and the request id stayed beside the handle
    task = json.loads(sky.run_file(handle, "task.json").read_text())
    assert task["resources"] == {"cpus": 1}
    assert "echo setting up the node" in task["setup"]
    request = json.loads(sky.run_file(handle, "launch-request.json").read_text())
    assert request["name"] == "launch" and request["request_id"]
    assert sky.clusters() == []  # taken down after the outputs came home
    assert not (sky.home / ".sky" / "generated" / "ssh" / handle["backend_state"]["cluster"]).exists()
    status = sky.compute("status", handle["run_id"], "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["runs"][0]["state"] == "succeeded"  # from the local copy
    assert "hello from the cluster" in sky.compute("logs", handle["run_id"]).stdout

    asked = sky.requests()
    again = doit_ok(root, env=sky.env)
    assert step_skipped(again, "step"), show(again)
    assert run_count(root) == 1 and sky.requests() == asked


def test_a_steps_state_is_read_from_its_worker_never_from_skypilots_queue(sky: Sky) -> None:
    """The wait reads the worker's record over the cluster's ssh; SkyPilot's
    queue (a process importing sky per read) is read only for the lease's
    job while the cluster's setup runs, never once the step's worker started."""
    root = sky.project(command=COMMAND + "sleep 4\n")  # polls every 0.3 s: SkyPilot's were ~10 reads
    done = doit_ok(root, env=sky.env)
    assert (root / "res.txt").read_text() == "done\n", show(done)
    run = json.loads(sky.compute("status", only_handle(root)["run_id"], "--json").stdout)["runs"][0]
    started = datetime.fromisoformat(run["started_at"]).timestamp()
    asked = [
        json.loads(path.read_text())
        for path in (sky.home / ".fakesky" / "requests").glob("*/request.json")
    ]
    skypilots_queue = [r for r in asked if r["name"] in ("job_status", "exec", "queue")]
    assert not [r for r in skypilots_queue if r["created_at"] > started], (started, skypilots_queue)


def counting_python(folder: Path) -> tuple[str, Path]:
    """The cluster's python3, noting each start's arguments, one line each."""
    calls = folder / "python-calls.txt"
    script = folder / "python3-counted"
    script.write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexec python3 "$@"\n')
    script.chmod(0o755)
    return str(script), calls


def test_a_run_going_is_followed_by_one_process_not_a_read_started_every_tick(sky: Sky) -> None:
    """Once the worker's record says the run goes, one `control.py follow`
    on the cluster streams its log until it ends; the status is read once
    after, not started over ssh every 0.2 s of the run (~30 reads here)."""
    python, calls = counting_python(sky.base)
    root = sky.project(command=COMMAND + "sleep 6\n")
    sky.configure(python=python)
    done = doit_ok(root, env=sky.env)
    assert (root / "res.txt").read_text() == "done\n", show(done)
    assert "hello from the cluster" in done.stdout  # the task's log, through the follower
    started = calls.read_text().splitlines()
    follows = [i for i, line in enumerate(started) if "control.py follow " in line]
    assert len(follows) == 1, started
    after = [line for line in started[follows[0]:] if "control.py status " in line]
    # the end read once, the worker's record for its verdict, the fetch: a handful
    assert 1 <= len(after) <= 5, started


def test_a_skypilot_queue_lagging_behind_the_workers_end_does_not_hold_the_step_up(sky: Sky) -> None:
    """SkyPilot's job reads RUNNING until its driver has seen the job script
    exit; here for ten minutes. The step ends on the worker's record."""
    sky.env["FAKESKY_JOB_END_DELAY"] = "600"
    root = sky.project()
    done = doit_ok(root, env=sky.env)  # within doit()'s 90 s: the lag did not hold it up
    assert (root / "res.txt").read_text() == "done\n", show(done)
    assert only_handle(root)["backend_state"]["final_status"]["state"] == "succeeded"
    assert sky.clusters() == []  # and the cluster of the job SkyPilot still ran went


def test_a_cluster_whose_ssh_starts_outside_the_jobs_home_is_reached_where_the_job_ran(sky: Sky) -> None:
    """The default, relative remote_root. The fake's job runs in its cluster's
    home, while a shell over ssh starts in the login user's own, as on a Slurm
    site whose sshd or ~/.bashrc keeps SkyPilot's ~/.sky_ssh_rc from moving
    it (the Slurm tier has such a site): the run is found where its job
    printed its home, and its outputs come home."""
    root = sky.project()
    sky.configure(remote_root=".substrax-remote")
    done = doit_ok(root, env=sky.env)
    assert (root / "res.txt").read_text() == "done\n", show(done)
    assert (root / "out" / "copy.txt").read_text() == "hello\n"
    handle = only_handle(root)
    cluster_home = sky.home / ".fakesky" / "clusters" / handle["backend_state"]["cluster"] / "home"
    assert handle["backend_state"]["job_home"] == str(cluster_home.resolve())
    assert handle["backend_state"]["torn_down"] is True and sky.clusters() == []
    assert "hello from the cluster" in sky.compute("logs", handle["run_id"]).stdout


def counting_sky_python(folder: Path) -> tuple[str, Path]:
    """SkyPilot's python for the helper, noting each operation it is asked (one line each)."""
    calls = folder / "sky-calls.txt"
    script = folder / "sky-python-counted"
    script.write_text(f'#!/bin/sh\necho "$2" >> {calls}\nexec {sys.executable} "$@"\n')
    script.chmod(0o755)
    return str(script), calls


def test_a_new_cluster_is_reached_with_no_helper_process_after_its_launch(sky: Sky) -> None:
    """After `sky.launch` answers, the step goes straight to the cluster over
    ssh: the launch's own helper process wrote the ssh config, and the first
    ssh call learns the home the lease's job runs in where the lease wrote
    it (the login's home, where ssh lands), not from the job's log through
    SkyPilot (a helper process importing sky each, seconds apiece on a
    loaded machine)."""
    sky_python, calls = counting_sky_python(sky.base)
    root = sky.project()
    sky.configure(sky_python=sky_python, remote_root=".substrax-remote")
    done = doit_ok(root, env=sky.env)
    assert (root / "res.txt").read_text() == "done\n", show(done)
    handle = only_handle(root)
    cluster = handle["backend_state"]["cluster"]
    home = sky.home / ".fakesky" / "clusters" / cluster / "home"
    assert handle["backend_state"]["job_home"] == str(home.resolve())
    asked = calls.read_text().split()
    after_launch = asked[asked.index("launch") + 1 :]
    assert "tail_logs" not in asked and "ssh_config" not in asked, asked
    assert set(after_launch) <= {"job_status", "down"}, asked  # the lease was held by the first claim
    assert sky.clusters() == []


def test_a_task_skypilot_refuses_is_refused_by_the_launchs_own_helper_and_nothing_is_launched(
    sky: Sky,
) -> None:
    """SkyPilot checks the task in the launch's helper process, before it
    launches anything: a refusal names the problem and the table to fix,
    and no helper process was spent on the check alone."""
    sky_python, calls = counting_sky_python(sky.base)
    root = sky.project()
    sky.configure(sky_python=sky_python, infra="nosuchcloud")
    done = doit(root, env=sky.env)
    assert done.returncode != 0, show(done)
    said = done.stdout + done.stderr
    assert "SkyPilot refused the task for this step (InvalidSkyPilotConfigError: " in said, said
    assert "'nosuchcloud' is not a known cloud" in said, said
    assert "[tool.substrax.compute.backends.skypilot]" in said, said
    assert "launch" in calls.read_text().split() and "validate" not in calls.read_text().split()
    assert sky.requests() == 0 and sky.clusters() == []
    assert only_handle(root)["backend_state"]["cluster"] is None


def test_a_failing_command_reads_as_failed_with_its_log_and_the_cluster_goes(sky: Sky) -> None:
    root = sky.project(command="echo about to fail; exit 7")
    done = doit(root, env=sky.env)
    assert done.returncode != 0, show(done)
    assert "failed" in done.stderr + done.stdout and "about to fail" in done.stderr + done.stdout
    handle = only_handle(root)
    status = sky.compute("status", handle["run_id"], "--json")
    record = json.loads(status.stdout)["runs"][0]
    assert record["state"] == "failed" and record["exit_code"] == 7
    assert sky.clusters() == []
    assert not (root / "res.txt").exists()


LISTS_THE_VIEW = """
set -e
mkdir -p out
find . -path ./out -prune -o -type f -print | sort | tr '\\n' ' ' > out/seen.txt
echo done > res.txt
"""


def test_the_cluster_sees_the_declared_inputs_only_as_a_local_run_does(sky: Sky) -> None:
    """The snapshot SkyPilot uploads is the step's view: a tracked file the
    step does not declare (README.md, a helper, the dodo.py) never reaches
    the cluster."""
    root = sky.project(command=LISTS_THE_VIEW)
    (root / "README.md").write_text("tracked, not declared\n")
    (root / "helper.py").write_text("X = 1\n")
    for args in (["init", "-q"], ["add", "-A"]):
        subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, timeout=60)
    done = doit_ok(root, env=sky.env)
    # .skyignore: the snapshot's own, so that SkyPilot uploads it as it is
    assert (root / "out" / "seen.txt").read_text().split() == ["./.skyignore", "./data/in.txt"], show(done)


def kill_client_mid_launch(sky: Sky, launch_seconds: float) -> None:
    """`doit` SIGKILLed once SkyPilot has handed out the launch request's id,
    while the (fake) provisioning takes `launch_seconds`."""
    sky.env["FAKESKY_LAUNCH_DELAY"] = str(launch_seconds)
    proc = popen_doit(sky.root, env=sky.env)
    try:
        wait_for(lambda: list((sky.root / ".substrax" / "runs").glob("*/launch-request.json")),
                 "the launch request id", timeout=60)  # fmt: skip
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        stop(proc)


def test_client_killed_mid_launch_then_cancel_finds_the_request_and_leaves_nothing(sky: Sky) -> None:
    root = sky.project()
    kill_client_mid_launch(sky, launch_seconds=60)
    handle = only_handle(root)
    assert sky.run_file(handle, "task.json").is_file()  # the intent, written before waiting
    own = handle["backend_state"]
    assert own.get("final_status") is None and own.get("job_id") is None
    status = sky.compute("status", handle["run_id"], "--json")
    assert json.loads(status.stdout)["runs"][0]["state"] == "pending", popen_output(root)
    done = sky.compute("cancel", handle["run_id"])
    assert done.returncode == 0, done.stderr
    assert "cancelled" in done.stdout
    request = json.loads(sky.run_file(handle, "launch-request.json").read_text())["request_id"]
    record = json.loads((sky.home / ".fakesky" / "requests" / request / "request.json").read_text())
    assert record["status"] == "CANCELLED"
    assert sky.clusters() == []
    again = sky.compute("cancel", handle["run_id"])
    assert again.returncode == 0 and "nothing to cancel" in again.stdout


def test_a_rerun_after_an_interrupted_launch_waits_on_the_same_request(sky: Sky) -> None:
    root = sky.project()
    kill_client_mid_launch(sky, launch_seconds=4)
    first = json.loads(next((root / ".substrax" / "runs").glob("*/launch-request.json")).read_text())
    done = doit_ok(root, env=sky.env)
    assert "reattaching" in done.stdout and "waiting for launch request" in done.stdout, show(done)
    handle = only_handle(root)
    assert json.loads(sky.run_file(handle, "launch-request.json").read_text()) == first
    assert (root / "res.txt").read_text() == "done\n"
    assert sky.clusters() == []


def test_cancel_of_a_finished_run_does_nothing(sky: Sky) -> None:
    root = sky.project()
    doit_ok(root, env=sky.env)
    handle = only_handle(root)
    asked = sky.requests()
    done = sky.compute("cancel", handle["run_id"])
    assert done.returncode == 0
    assert "had already finished (succeeded); nothing to cancel" in done.stdout
    assert sky.requests() == asked


def failing_python(folder: Path, operation: str) -> str:
    """A SkyPilot interpreter whose `operation` fails as SkyPilot would (an
    answer naming the exception), every other one passing through."""
    script = folder / "sky-python"
    answer = json.dumps({"ok": False, "error": {"type": "ApiServerConnectionError",
                                                "message": f"injected failure of {operation}"}})  # fmt: skip
    script.write_text(
        "#!/bin/sh\n"
        f'if [ "$2" = {operation} ]; then cat >/dev/null; echo {json.dumps(answer)}; exit 1; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def test_cancel_whose_cluster_down_fails_stops_the_run_all_the_same_and_exits_1(sky: Sky) -> None:
    root = sky.project(command="echo started; sleep 300")
    proc = popen_doit(root, env=sky.env)
    try:
        wait_for(lambda: "started" in popen_output(root), "the command to start", timeout=90)
        # the driver's last write before the wait: not to race the edit below
        wait_for(lambda: only_handle(root)["state"].get("phase") == "started", "the run's start recorded")
        handle = only_handle(root)
        # the handle's pinned settings are what cancel uses: the failure goes there
        path = root / ".substrax" / "runs" / handle["run_id"] / "handle.json"
        pinned = json.loads(path.read_text())
        sky_python = pinned["settings"]["sky_python"]
        pinned["settings"]["sky_python"] = failing_python(sky.base, "down")
        path.write_text(json.dumps(pinned))
        done = sky.compute("cancel", handle["run_id"])
        assert done.returncode == 1, done.stdout
        assert "1 cancel step(s) failed" in done.stderr
        assert "injected failure of down" in done.stderr
        wait_exit(proc, "the doit to end", 90)
    finally:
        stop(proc)
    assert proc.returncode != 0
    status = json.loads(sky.compute("status", handle["run_id"], "--json").stdout)
    assert status["runs"][0]["state"] == "cancelled", status  # the run's tree was stopped first
    pinned = json.loads(path.read_text())
    pinned["settings"]["sky_python"] = sky_python
    path.write_text(json.dumps(pinned))
    assert sky.compute("teardown", handle["run_id"]).returncode == 0
    assert sky.clusters() == []


def test_the_lifetime_takes_the_cluster_down_with_no_client_present(sky: Sky, marker: str) -> None:
    """The node's timers stop the run and end the cluster's lease (lifetime
    less SkyPilot's 1-minute autodown = 12 s here), the idle cluster's
    autodown (1 minute = 2 s here) takes it down: nobody calls."""
    sky.env["FAKESKY_MINUTE_SECONDS"] = "2"
    sky.project(command=f"echo started; exec sleep 300 # {marker}")
    sky.configure(copy={"lifetime_minutes": 1.2})
    proc = popen_doit(sky.root, env=sky.env)
    try:
        wait_for(lambda: marked_pids(marker), "the command to start", timeout=90)
        proc.send_signal(signal.SIGKILL)  # the client is gone for good
        proc.wait(timeout=30)
    finally:
        stop(proc)
    assert marked_pids(marker), "the command runs on after its client died"
    wait_for(lambda: sky.clusters() == [] and not marked_pids(marker),
             "the lifetime to end the run and the cluster", timeout=60)  # fmt: skip
    handle = only_handle(sky.root)
    status = sky.compute("status", handle["run_id"], "--json")
    assert json.loads(status.stdout)["runs"][0]["state"] == "lost"  # its cluster went by itself


def test_the_bucket_transport_fetches_from_a_real_s3_server_and_verifies(sky: Sky, tmp_path: Path) -> None:
    """Outputs written to the mounted bucket (the fake mounts a bucket as
    the folder the S3 server serves), fetched with s3fs through the real S3
    API, verified against the manifest the worker wrote beside them. A
    server of its own: rclone caches folder listings for minutes, so one
    that listed the bucket before would not see what the job wrote there."""
    with running_s3_server(tmp_path / "s3") as s3_server:
        bucket_chain(sky, s3_server)


def bucket_chain(sky: Sky, s3_server: S3Server) -> None:
    sky.project()
    sky.configure(bucket={"outputs_bucket": f"s3://{s3_server.bucket}/runs", "lifetime_minutes": 10.0})
    sky.env.update(s3_server.env)
    sky.env["FAKESKY_BUCKET_DIR"] = str(s3_server.data_dir)
    done = doit_ok(sky.root, env=sky.env)
    assert step_ran(done, "step"), show(done)
    assert (sky.root / "out" / "copy.txt").read_text() == "hello\n"
    assert (sky.root / "res.txt").read_text() == "done\n"
    handle = only_handle(sky.root)
    in_bucket = s3_server.data_dir / s3_server.bucket / "runs" / handle["run_id"]
    assert (in_bucket / "outputs" / "res.txt").read_text() == "done\n"
    manifest = json.loads((in_bucket / "manifest.json").read_text())
    assert {e["path"] for e in manifest["entries"]} >= {"out/copy.txt", "res.txt"}
    assert sky.clusters() == []
    again = doit_ok(sky.root, env=sky.env)
    assert step_skipped(again, "step"), show(again)


BIG = 8 * 1024 * 1024
BIG_STEP = """
def task_step():
    yield from remote_step("step", shell=COMMAND, outputs=["out/"], retries=0)
"""


def doit_with_a_hostile_host(sky: Sky, root: Path, tamper: Callable[[Path, threading.Event], None]) -> Any:
    """`doit`, while a thread waits for the run to succeed on the cluster
    (the worker writes its manifest, then its final status) and then calls
    `tamper(the run's outputs folder there, an event set once doit ended)`."""
    ended = threading.Event()

    def watch() -> None:
        while not ended.is_set():
            done = [p for p in (sky.remote / "runs").glob("*/status.json") if '"succeeded"' in p.read_text()]
            if done:
                tamper(done[0].parent / "work" / "outputs", ended)
                return
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        return doit(root, env=sky.env)
    finally:
        ended.set()
        watcher.join(timeout=30)


def test_outputs_changed_on_the_cluster_after_the_run_keep_it_until_put_back(sky: Sky) -> None:
    """As over SSH: the copy is verified against the worker's manifest of
    the command's end, so outputs grown since are refused, the cluster kept."""
    sky.env["FAKESKY_MINUTE_SECONDS"] = "60"  # the idle cluster waits a minute for the rerun
    command = f"mkdir -p out && head -c {BIG} /dev/zero > out/big.bin && echo s > out/s.txt"
    root = sky.project(BIG_STEP, command)
    writes = [0]
    grown: list[Path] = []

    def keep_appending(outputs: Path, ended: threading.Event) -> None:
        big = outputs / "out" / "big.bin"
        grown.append(big)
        while not ended.is_set():
            with big.open("ab") as f:
                f.write(b"x" * 4096)
            writes[0] += 1
            time.sleep(0.002)

    first = doit_with_a_hostile_host(sky, root, keep_appending)
    assert writes[0] > 0, "the output was never changed: the test proves nothing"
    assert first.returncode != 0, show(first)
    assert "changed content: out/big.bin" in first.stdout + first.stderr, show(first)
    assert "nothing was promoted" in first.stdout + first.stderr
    assert not (root / "out").exists()
    assert len(sky.clusters()) == 1, "the cluster must stay up for the next fetch"
    os.truncate(grown[0], BIG)  # as the command left it

    second = doit_ok(root, env=sky.env)
    assert "fetching its outputs again" in second.stdout, show(second)
    assert run_count(root) == 1  # the command did not run again
    assert (root / "out" / "big.bin").stat().st_size == BIG
    assert (root / "out" / "s.txt").read_text() == "s\n"
    assert sky.clusters() == []


def test_fifos_sockets_and_devices_put_in_on_the_cluster_are_refused_and_leave_nothing_here(sky: Sky) -> None:
    """The copy transport fetches as the ssh backend does: rsync makes no
    special file, the fetch that meets one is refused with nothing of it
    kept, and the cluster stays for a fetch once the host is mended."""
    sky.env["FAKESKY_MINUTE_SECONDS"] = "60"  # the idle cluster waits a minute for the rerun
    root = sky.project(BIG_STEP, "mkdir -p out && echo a > out/a.txt")
    planted: list[Path] = []

    def plant(outputs: Path, _: threading.Event) -> None:
        planted.append(outputs / "out")
        plant_specials(planted[0])

    first = doit_with_a_hostile_host(sky, root, plant)
    assert planted, "nothing was planted: the test proves nothing"
    assert first.returncode != 0, show(first)
    said = first.stdout + first.stderr
    assert "hold out/node, out/pipe, out/sock, which are not a file, folder or symlink" in said, show(first)
    assert specials_under(root) == []  # the project and its store
    run = sky.run_file(only_handle(root), "")
    assert not (run / "fetched").exists(), "the refused copy stayed in the store"
    assert len(sky.clusters()) == 1, "the cluster must stay up for the next fetch"
    for name in ("node", "pipe", "sock"):  # the host is mended
        (planted[0] / name).unlink()

    second = doit_ok(root, env=sky.env)
    assert "fetching its outputs again" in second.stdout, show(second)
    assert run_count(root) == 1  # the command did not run again
    assert (root / "out" / "a.txt").read_text() == "a\n"
    assert sky.clusters() == []
    assert not (run / "fetched").exists()  # torn down: no copy left in the store


SWEEP = """
def task_fit():
    for m in range(8):
        yield from remote_step(f"fit:m{m}", shell=f"echo m{m} > fit-{m}.txt", outputs=[f"fit-{m}.txt"])
"""


def test_a_sweep_of_eight_steps_under_four_threads_finishes_and_leaves_no_cluster(sky: Sky) -> None:
    sky.configure()
    write_ssh_dodo(sky.root, SWEEP, ["fit"])
    done = doit(sky.root, "-n", "4", "-P", "thread", env=sky.env, timeout=300)
    assert done.returncode == 0, show(done)
    for m in range(8):
        assert (sky.root / f"fit-{m}.txt").read_text() == f"m{m}\n"
    assert run_count(sky.root) == 8
    assert sky.clusters() == []
    asked = sky.requests()
    again = doit_ok(sky.root, "-n", "4", "-P", "thread", env=sky.env)
    assert all(step_skipped(again, f"fit:m{m}") for m in range(8)), show(again)
    assert sky.requests() == asked


def test_ctrl_c_under_four_threads_detaches_every_run_and_the_rerun_reattaches(sky: Sky, marker: str) -> None:
    # Unsandboxed: the sandbox's private /tmp would hide the gate from the jobs.
    gate = sky.base / f"gate-{marker}"
    sky.configure(sandbox="none")
    write_ssh_dodo(sky.root, GATED_SWEEP.format(gate=str(gate), marker=marker), ["fit"])
    proc = popen_doit(sky.root, "-n", "4", "-P", "thread", env=sky.env)
    try:
        wait_for(lambda: len(marked_pids(marker)) >= 4, "the four jobs to be running", timeout=120)
        # and each step's client in its run phase, following the log: one
        # follower per run on the cluster (its argv, NUL-separated)
        followers = f"control.py\0follow\0{sky.remote}"
        wait_for(lambda: len(marked_pids(followers)) == 4, "the four steps to follow their runs")
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=30)
    finally:
        stop(proc)
    said = popen_output(sky.root)
    assert code != 0, said
    assert "Traceback" not in said, said
    assert said.count("detached from run fit-m") == 4, said
    # the followers' stdin closed as doit went: each ended there
    wait_for(lambda: not marked_pids(followers), "the followers to end on the cluster")
    assert len(sky.clusters()) == 4, "the clusters must stay up for the runs that go on"
    gate.touch()
    done = doit(sky.root, "-n", "4", "-P", "thread", env=sky.env, timeout=300)
    assert done.returncode == 0, show(done)
    assert "new run" not in done.stdout, show(done)  # reattached to the same four runs
    for m in range(4):
        assert (sky.root / f"fit-{m}.txt").read_text() == f"{m}\n"
    assert run_count(sky.root) == 4
    assert sky.clusters() == []


def test_a_cluster_gone_under_a_killed_client_loses_the_run_and_the_rerun_launches_anew(
    sky: Sky, marker: str
) -> None:
    # Unsandboxed: the sandbox's private /tmp would hide the gate from the job.
    gate = sky.base / f"gate-{marker}"
    sky.configure(sandbox="none")
    body = GATED_STEP.format(gate=str(gate), marker=marker, resources={"cpus": 1})
    write_ssh_dodo(sky.root, body, ["step"])
    doit_killed_mid_run(sky.root, marker, env=sky.env)
    (cluster,) = sky.clusters()
    # Deleted by hand (as a preemption would): SkyPilot's own down, from outside.
    down = f"import sky; sky.get(sky.down({cluster!r}))"
    gone = subprocess.run([sys.executable, "-c", down], env=clean_env(sky.env), capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    assert gone.returncode == 0 and sky.clusters() == [], gone.stderr
    first = only_handle(sky.root)
    gate.touch()
    done = doit(sky.root, env=sky.env, timeout=300)
    assert done.returncode == 0, show(done)
    said = f"run {first['run_id']} was lost (its cluster {cluster} is gone"
    assert said in done.stdout and "launching a new run" in done.stdout, show(done)
    assert (sky.root / "out.txt").read_text() == "made\n"
    assert run_count(sky.root) == 2
    lost = sky.compute("status", first["run_id"], "--json")
    assert json.loads(lost.stdout)["runs"][0]["state"] == "lost", lost.stdout
    assert sky.clusters() == []


def test_deleting_the_store_mid_run_takes_the_runs_cluster_down(sky: Sky, marker: str) -> None:
    """The client driving the run still holds its handle: no cluster is
    left to its lifetime timer when the state folder goes (issue 28)."""
    gate = sky.base / f"gate-{marker}"  # never made: the run goes on until stopped
    sky.configure(sandbox="none")
    body = GATED_STEP.format(gate=str(gate), marker=marker, resources={"cpus": 1})
    write_ssh_dodo(sky.root, body, ["step"])
    client = popen_doit(sky.root, env=sky.env)
    try:
        wait_for(lambda: "started" in popen_output(sky.root), "the run to be followed", timeout=120)
        (cluster,) = sky.clusters()
        shutil.rmtree(sky.root / ".substrax")
        code = wait_exit(client, "the doit to end", 120)
    finally:
        stop(client)
    said = popen_output(sky.root)
    assert code == 1, said
    assert f"drove the run: stopped it and took its cluster {cluster} down" in said, said
    assert "Traceback" not in said, said
    assert sky.clusters() == []  # before the fix: up until its lifetime timer
    wait_for(lambda: not marked_pids(marker), "the command to end with its cluster")


def test_status_shows_the_lifetime_left_and_a_cluster_no_handle_names_which_gc_leaves_alone(
    sky: Sky, marker: str
) -> None:
    gate = sky.base / f"gate-{marker}"
    sky.configure(sandbox="none")
    body = GATED_STEP.format(gate=str(gate), marker=marker, resources={"cpus": 1})
    write_ssh_dodo(sky.root, body, ["step"])
    doit_killed_mid_run(sky.root, marker, env=sky.env)
    (cluster,) = sky.clusters()
    listed = json.loads(sky.compute("status", "--machines", "--json").stdout)
    (run,) = listed["runs"]
    assert 0 < run["lifetime_left_seconds"] <= (10 - 1) * 60, run  # lifetime_minutes - idle_minutes
    assert listed["leaked"] == []
    shutil.rmtree(sky.root / ".substrax")  # no handle names the cluster: another project's, for all we know
    listed = json.loads(sky.compute("status", "--machines", "--json").stdout)
    assert listed["leaked"] == [{"backend": "skypilot", "where": "SkyPilot", "name": cluster, "ours": False}]
    done = sky.compute("gc", "--machines")
    assert done.returncode == 0 and done.stdout == "", show(done)
    assert sky.clusters() == [cluster]
    gate.touch()  # the run ends; the fixture takes what is left down


def test_gc_machines_of_a_client_at_the_same_project_path_leaves_anothers_cluster_and_downs_its_own(
    sky: Sky, marker: str
) -> None:
    """Two clients at one project path (each its folder bind-mounted there)
    on one SkyPilot: the second, its handles lost, takes down the cluster its
    id names and leaves the first's, which runs on."""
    gate = sky.base / f"gate-{marker}"
    sky.configure(sandbox="none", remote_root=str(sky.base / "remote"))
    at = sky.base / "workspace"
    at.mkdir()
    second = sky.base / "two" / "proj"
    second.mkdir(parents=True)
    shutil.copy(sky.root / "pyproject.toml", second)
    for name, root in (("one", sky.root), ("two", second)):
        write_ssh_dodo(root, GATED_STEP.format(gate=str(gate), marker=f"{marker}-{name}",
                                               resources={"cpus": 1}), ["step"])  # fmt: skip
        doit_killed_mid_run_in_view(root, at, f"{marker}-{name}", env=sky.env)
    running = only_handle(sky.root)["backend_state"]["cluster"]
    lost = only_handle(second)["backend_state"]["cluster"]
    assert sorted(sky.clusters()) == sorted([running, lost])
    shutil.rmtree(second / ".substrax" / "runs")  # its handle lost: the cluster is known by its id only

    done = compute_in_view(second, at, "gc", "--machines", env=sky.env)
    assert done.returncode == 0, show(done)
    assert f"removed {lost} on SkyPilot" in done.stdout, show(done)
    assert sky.clusters() == [running] and marked_pids(f"{marker}-one")  # the first's goes on
    gate.touch()  # the first's run ends; the fixture takes what is left down
