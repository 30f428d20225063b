"""SkyPilot's SDK helper (backends/skypilot/helper/sky_sdk.py) through
SkyClient, against the fake SkyPilot (tests/support/fakesky/sky), whose requests,
jobs and timers are real local processes and whose public API
tests/contract/test_fakesky_contract.py holds to the real SDK's.

SkyClient runs the helper with this interpreter as `sky_python` and the fake
on PYTHONPATH, HOME a fresh folder. Every test's fixture stops, by pid,
every process the fake started under that HOME, and fails if any survives.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fakesky_cleanup import cleanup, fakesky_env, kill, leftovers
from testbeds.sshd_host import SshHost

from substrax_tasks.backends.skypilot.client import SKY_SDK_SCRIPT, SkyCallError, SkyClient
from substrax_tasks.errors import ConfigError

WAIT = 30.0  # seconds for a condition; generous, the machine is noisy
TERMINAL = {"SUCCEEDED", "FAILED", "FAILED_SETUP", "FAILED_DRIVER", "CANCELLED"}


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "home"
    folder.mkdir()
    yield folder
    cleanup(folder)
    left = leftovers(folder)
    if left:
        kill(left)
        pytest.fail(f"processes of the fake SkyPilot survived its cleanup: {left}")


def client(home: Path, **env: str) -> SkyClient:
    return SkyClient(sys.executable, fakesky_env(home, **env))


def task(run: str | None, *, setup: str | None = None, infra: str = "aws", **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"name": "helper-test", "resources": {"infra": infra}, **extra}
    if run is not None:
        config["run"] = run
    if setup is not None:
        config["setup"] = setup
    return config


def launch(sky: SkyClient, cluster: str, config: dict[str, Any], **request: Any) -> int:
    request = {"task": config, "cluster_name": cluster, "down": False, **request}
    answer = sky.call("launch", request, timeout=60)
    job_id: int = answer["job_id"]
    return job_id


def wait_until(condition: Any, what: str, timeout: float = WAIT) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout:.0f} s for {what}")
        time.sleep(0.1)


def job_status(sky: SkyClient, cluster: str, job_id: int) -> str | None:
    status: str | None = sky.call("job_status", {"cluster_name": cluster, "job_ids": [job_id]})[str(job_id)]
    return status


def no_leftovers(home: Path) -> bool:
    """No process of the fake left (a request that has answered may take a
    moment to exit)."""
    wait_until(lambda: not leftovers(home), f"the fake's processes to end: {leftovers(home)}", timeout=10)
    return True


def wait_job(sky: SkyClient, cluster: str, job_id: int) -> str:
    status: str = wait_until(
        lambda: (s := job_status(sky, cluster, job_id)) in TERMINAL and s, f"job {job_id} on {cluster} to end"
    )
    return status


def tail_logs(sky: SkyClient, cluster: str, job_id: int, out: Path, follow: bool = True) -> int:
    answer = sky.call("tail_logs", {"cluster_name": cluster, "job_id": job_id, "follow": follow,
                                    "output_file": str(out)})  # fmt: skip
    code: int = answer["exit_code"]
    return code


def launch_and_kill_the_client(home: Path, request: dict[str, Any], env: dict[str, str]) -> str:
    """Start a launch in the helper (the SDK's client), SIGKILL it once the
    request id is on disk and the request's log shows provisioning; the
    request id it wrote."""
    request_file = Path(request["request_file"])
    stdin = request_file.with_name("helper-request.json")
    stdin.write_text(json.dumps(request))
    with stdin.open("rb") as source:
        helper = subprocess.Popen(
            [sys.executable, str(SKY_SDK_SCRIPT), "launch"], stdin=source,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=fakesky_env(home, **env),
        )  # fmt: skip
    try:
        wait_until(lambda: request_file.exists() or helper.poll() is not None, "the request file")
        assert helper.poll() is None, "the helper ended before it could be killed"
        rid: str = json.loads(request_file.read_text())["request_id"]
        log = home / ".fakesky" / "requests" / rid / "log"
        wait_until(lambda: log.exists() and "Launching" in log.read_text(), "provisioning to start")
    finally:
        helper.kill()
        helper.wait()
    return rid


# ------------------------------------------------------------------ launch


def test_launch_records_its_request_before_waiting_and_cancel_reaches_it(home: Path, tmp_path: Path) -> None:
    """The client (the helper) dies mid-launch, SIGKILLed while provisioning
    is under way: the request id is on disk, the request still RUNNING;
    api_cancel stops it and reattaching raises RequestCancelled."""
    request_file = tmp_path / "launch-request.json"
    request = {"task": task("echo never"), "cluster_name": "midlaunch", "request_file": str(request_file),
               "log_file": str(tmp_path / "launch.log")}  # fmt: skip
    rid = launch_and_kill_the_client(home, request, {"FAKESKY_LAUNCH_DELAY": "60"})
    assert json.loads(request_file.read_text())["name"] == "launch"

    sky = client(home)
    assert sky.call("request_status", {"request_ids": [rid]}) == [
        {"request_id": rid, "name": "launch", "status": "RUNNING"}
    ]
    status = sky.call("cluster_status", {"cluster_names": ["midlaunch"]})
    assert status == [{"name": "midlaunch", "status": "INIT"}]

    assert sky.call("api_cancel", {"request_ids": [rid]}) == [rid]
    with pytest.raises(SkyCallError) as caught:
        sky.call("wait_launch", {"request_id": rid})
    assert caught.value.kind == "RequestCancelled"
    assert sky.call("request_status", {"request_ids": [rid]})[0]["status"] == "CANCELLED"
    assert no_leftovers(home)  # the launch's process is gone; no job was submitted
    assert sky.call("api_cancel", {"request_ids": [rid]}) == []  # nothing left to cancel

    # As with the real SDK, the half-made cluster stays (INIT) until downed.
    sky.call("down", {"cluster_name": "midlaunch"})
    assert sky.call("cluster_status", {"cluster_names": ["midlaunch"]}) == []


def test_a_launch_outlives_its_killed_client_and_can_be_reattached(home: Path, tmp_path: Path) -> None:
    request_file = tmp_path / "launch-request.json"
    request = {"task": task("echo from-the-job"), "cluster_name": "orphan", "down": False,
               "request_file": str(request_file)}  # fmt: skip
    rid = launch_and_kill_the_client(home, request, {"FAKESKY_LAUNCH_DELAY": "1.5"})
    sky = client(home)
    assert sky.call("request_status", {"request_ids": [rid]})[0]["status"] == "RUNNING"

    log = tmp_path / "reattached.log"
    assert sky.call("wait_launch", {"request_id": rid, "log_file": str(log)}) == {"job_id": 1}
    assert "Job submitted, ID: 1" in log.read_text()
    assert sky.call("request_status", {"request_ids": [rid]})[0]["status"] == "SUCCEEDED"
    assert wait_job(sky, "orphan", 1) == "SUCCEEDED"


def test_job_statuses_map_through(home: Path, tmp_path: Path) -> None:
    """Relaunching on the UP cluster submits job 2, 3...: a succeeding run,
    a failing run, a failing setup (its run never starts)."""
    sky = client(home)
    assert launch(sky, "jobs", task("echo fine")) == 1
    assert launch(sky, "jobs", task("echo failing; exit 3")) == 2
    assert launch(sky, "jobs", task("echo never-runs", setup="echo setting-up; exit 4")) == 3
    assert [wait_job(sky, "jobs", i) for i in (1, 2, 3)] == ["SUCCEEDED", "FAILED", "FAILED_SETUP"]

    statuses = sky.call("job_status", {"cluster_name": "jobs", "job_ids": [1, 2, 3, 9]})
    assert statuses == {"1": "SUCCEEDED", "2": "FAILED", "3": "FAILED_SETUP", "9": None}

    out = tmp_path / "setup-failed.log"
    assert tail_logs(sky, "jobs", 3, out) == 100
    assert "setting-up" in out.read_text()
    assert "never-runs" not in out.read_text()
    assert launch(sky, "other", task("true")) == 1  # job ids count per cluster


def test_the_job_gets_envs_secrets_and_file_mounts(home: Path, tmp_path: Path) -> None:
    """Secrets come on the helper's stdin; local file mounts are copied as
    SkyPilot's rsync does (a folder's .gitignore'd files stay behind); `~/`
    is the cluster's home, absolute destinations are used as they are."""
    source = tmp_path / "source"
    source.mkdir()
    (source / "a.txt").write_text("from a\n")
    (source / "ignored.txt").write_text("should not travel\n")
    (source / ".gitignore").write_text("ignored.txt\n")
    single = tmp_path / "single.txt"
    single.write_text("single file\n")
    remote = tmp_path / "remote-root"
    run = "\n".join([
        'echo "greeting=$GREETING token=$TOKEN"',
        f"cat {remote}/project/a.txt {remote}/one.txt ~/inbox/a.txt",
        f"test -e {remote}/project/ignored.txt || echo ignored-stayed-behind",
        'echo "home=$HOME"',
    ])  # fmt: skip
    config = task(run, envs={"GREETING": "hello"}, file_mounts={
        f"{remote}/project": str(source), f"{remote}/one.txt": str(single), "~/inbox": str(source),
    })  # fmt: skip
    sky = client(home)
    job_id = launch(sky, "mounts", config, secrets={"TOKEN": "s3cret"})
    assert wait_job(sky, "mounts", job_id) == "SUCCEEDED"

    out = tmp_path / "job.log"
    assert tail_logs(sky, "mounts", job_id, out) == 0
    lines = out.read_text().splitlines()
    cluster_home = home / ".fakesky" / "clusters" / "mounts" / "home"
    assert lines == [
        "greeting=hello token=s3cret", "from a", "single file", "from a", "ignored-stayed-behind",
        f"home={cluster_home}",
    ]  # fmt: skip
    assert (remote / "project" / "a.txt").read_text() == "from a\n"
    assert not (remote / "project" / "ignored.txt").exists()


def test_a_missing_cluster_is_cluster_does_not_exist(home: Path, tmp_path: Path) -> None:
    sky = client(home)
    calls: dict[str, dict[str, Any]] = {
        "job_status": {"cluster_name": "nowhere", "job_ids": [1]},
        "down": {"cluster_name": "nowhere"},
        "tail_logs": {"cluster_name": "nowhere", "job_id": 1, "output_file": str(tmp_path / "out")},
    }
    for operation, request in calls.items():
        with pytest.raises(SkyCallError) as caught:
            sky.call(operation, request)
        assert caught.value.kind == "ClusterDoesNotExist", operation
        assert caught.value.operation == operation
    assert sky.call("cluster_status", {"cluster_names": ["nowhere"]}) == []


# -------------------------------------------------------------------- logs


def test_tail_logs_exit_codes(home: Path, tmp_path: Path) -> None:
    """0 succeeded, 100 failed, 101 still running (follow=False), 102 no
    such job, 103 cancelled; cancelling stops the job's processes."""
    sky = client(home)
    assert launch(sky, "logs", task("echo done-ok")) == 1
    assert launch(sky, "logs", task("echo going-wrong; exit 1")) == 2
    assert launch(sky, "logs", task("echo started; sleep 60; echo never")) == 3
    out = tmp_path / "logs"
    out.mkdir()

    assert tail_logs(sky, "logs", 1, out / "1") == 0
    assert (out / "1").read_text() == "done-ok\n"
    assert tail_logs(sky, "logs", 2, out / "2") == 100
    assert (out / "2").read_text() == "going-wrong\n"
    wait_until(lambda: job_status(sky, "logs", 3) == "RUNNING", "job 3 to run")
    wait_until(lambda: tail_logs(sky, "logs", 3, out / "3", follow=False) == 101
               and "started" in (out / "3").read_text(), "job 3's first line")  # fmt: skip
    assert tail_logs(sky, "logs", 9, out / "9") == 102

    sky.call("cancel", {"cluster_name": "logs", "job_ids": [3]})
    assert job_status(sky, "logs", 3) == "CANCELLED"
    assert tail_logs(sky, "logs", 3, out / "3-cancelled") == 103
    assert "never" not in (out / "3-cancelled").read_text()
    assert no_leftovers(home)  # the job's bash and its sleep are gone
    sky.call("cancel", {"cluster_name": "logs", "job_ids": [1]})  # a finished job is left alone
    assert job_status(sky, "logs", 1) == "SUCCEEDED"


# ---------------------------------------------------------- down, autostop


def test_down_stops_everything_and_status_is_empty(home: Path, tmp_path: Path) -> None:
    """down is the VM going away: the running job, and what it double-forked
    out of its session, are killed; the cluster is gone."""
    sky = client(home)
    run = "setsid sleep 300 < /dev/null > /dev/null 2>&1 & echo started; sleep 300"
    job_id = launch(sky, "gone", task(run))
    wait_until(lambda: job_status(sky, "gone", job_id) == "RUNNING", "the job to run")
    wait_until(lambda: len(leftovers(home)) >= 3, "the job's processes")  # runner, bash, sleeps

    request_file = tmp_path / "down-request.json"
    assert sky.call("down", {"cluster_name": "gone", "request_file": str(request_file)}) is None
    assert json.loads(request_file.read_text())["name"] == "down"
    assert sky.call("cluster_status", {"cluster_names": ["gone"]}) == []
    assert no_leftovers(home)
    with pytest.raises(SkyCallError) as caught:
        sky.call("down", {"cluster_name": "gone"})
    assert caught.value.kind == "ClusterDoesNotExist"


def test_autodown_once_idle(home: Path) -> None:
    """launch's down=True (the helper's default) arms autodown: 0 idle
    minutes become 1, as in SkyPilot; a fake minute here is 0.2 s. The
    cluster goes once its job has ended, with its ssh config."""
    sky = client(home, FAKESKY_MINUTE_SECONDS="0.2", FAKESKY_SSH_HOST="127.0.0.1")
    request = {"task": task("sleep 1"), "cluster_name": "idle", "idle_minutes_to_autostop": 0}
    answer = sky.call("launch", request)
    assert answer == {"job_id": 1, "hourly_cost": None}  # aws with no instance type: priced by none
    assert sky.call("ssh_config", {"cluster_name": "idle"})["path"] is not None
    wait_until(lambda: sky.call("cluster_status", {"cluster_names": ["idle"]}) == [], "autodown")
    assert sky.call("ssh_config", {"cluster_name": "idle"}) == {"path": None}
    assert no_leftovers(home)  # the timer ended with the cluster


def test_a_launch_answers_the_catalog_price_of_what_it_launched(home: Path) -> None:
    """The launched cluster's price, from its status record's handle (as
    `sky cost-report` prices it), comes back with the launch; and the price
    of resources asked for, before a launch, when the catalog has one."""
    sky = client(home)
    config = task("true", resources={"infra": "aws", "instance_type": "p3.2xlarge"})
    answer = sky.call("launch", {"task": config, "cluster_name": "priced", "down": False}, timeout=60)
    assert answer == {"job_id": 1, "hourly_cost": 3.06}
    spot = {"infra": "aws", "instance_type": "m6i.large", "use_spot": True}
    assert sky.call("hourly_price", {"resources": spot}) == {"hourly_cost": 0.0372}
    assert sky.call("hourly_price", {"resources": {"infra": "aws"}}) == {"hourly_cost": None}
    assert sky.call("hourly_price", {"resources": {"infra": "slurm", "instance_type": "4CPU--16GB"}}) == {
        "hourly_cost": None  # SkyPilot prices Slurm at 0: unknown
    }
    sky.call("down", {"cluster_name": "priced"}, timeout=60)


def test_autostop_call_downs_an_idle_cluster(home: Path) -> None:
    sky = client(home, FAKESKY_MINUTE_SECONDS="0.2")
    assert launch(sky, "later", task("true")) == 1
    assert wait_job(sky, "later", 1) == "SUCCEEDED"
    sky.call("autostop", {"cluster_name": "later", "idle_minutes": 1, "down": True})
    wait_until(lambda: sky.call("cluster_status", {"cluster_names": ["later"]}) == [], "autodown")


def test_autodown_is_refused_where_the_cloud_lacks_it(home: Path) -> None:
    sky = client(home)
    with pytest.raises(SkyCallError) as caught:
        sky.call("launch", {"task": task("true", infra="hyperbolic"), "cluster_name": "noauto", "down": True})
    assert caught.value.kind == "NotSupportedError"
    assert "autodown" in caught.value.detail
    assert sky.call("cluster_status", {"cluster_names": ["noauto"]}) == []


# ------------------------------------------------------------- validation


@pytest.mark.parametrize(("infra", "refused"), [("runpod", True), ("vast", True), ("aws", False)])
def test_validate_bucket_mounts_per_cloud(home: Path, infra: str, refused: bool) -> None:
    sky = client(home)
    config = task("true", infra=infra, file_mounts={"/data": {"source": "s3://bucket", "mode": "MOUNT"}})
    request = {"task": config, "needs_storage_mounting": True}
    if not refused:
        assert sky.call("validate", request) == {"valid": True}
        return
    with pytest.raises(SkyCallError) as caught:
        sky.call("validate", request)
    assert caught.value.kind == "NotSupportedError"
    assert "storage_mounting" in caught.value.detail
    with pytest.raises(SkyCallError) as caught:  # launch refuses it too, before any cluster
        sky.call("launch", {"task": config, "cluster_name": "mounting", "down": False})
    assert caught.value.kind == "NotSupportedError"
    assert sky.call("cluster_status", {"cluster_names": ["mounting"]}) == []


def test_bucket_mounts_need_a_bucket_folder(home: Path, tmp_path: Path) -> None:
    """The fake has no buckets: a MOUNT is refused, unless FAKESKY_BUCKET_DIR
    stands in for them (s3://bucket/path is <dir>/bucket/path)."""
    remote = tmp_path / "remote-root"
    config = task("echo written > mnt/out.txt", file_mounts={
        f"{remote}/mnt": {"source": "s3://outputs/run-1", "mode": "MOUNT"},
    })  # fmt: skip
    config["run"] = f"cd {remote} && {config['run']}"
    with pytest.raises(SkyCallError) as caught:
        launch(client(home), "nobucket", config)
    assert caught.value.kind == "NotSupportedError"

    buckets = tmp_path / "buckets"
    sky = client(home, FAKESKY_BUCKET_DIR=str(buckets))
    job_id = launch(sky, "bucket", config)
    assert wait_job(sky, "bucket", job_id) == "SUCCEEDED"
    assert (buckets / "outputs" / "run-1" / "out.txt").read_text() == "written\n"


def test_validate_reports_schema_errors_by_kind(home: Path) -> None:
    sky = client(home)
    with pytest.raises(SkyCallError) as caught:
        sky.call("validate", {"task": {"rnu": "echo"}})
    assert caught.value.kind == "InvalidSkyPilotConfigError"
    assert "did you mean 'run'" in caught.value.detail


def test_a_python_without_sky_is_a_config_error(home: Path) -> None:
    env = fakesky_env(home)
    del env["PYTHONPATH"]
    with pytest.raises(ConfigError, match="sky_python"):
        SkyClient(sys.executable, env).call("cluster_status", {"cluster_names": []})


# ---------------------------------------------------------------------- ssh


def test_ssh_config_reaches_the_cluster_host(home: Path, tmp_path: Path, root_host: SshHost) -> None:
    """FAKESKY_SSH_* point the cluster's ssh config at a real sshd: `ssh -F
    FILE CLUSTER` and rsync reach the files the launch put there."""
    source = tmp_path / "source"
    source.mkdir()
    (source / "a.txt").write_text("over ssh\n")
    host = root_host
    remote = host.scratch / f"cluster-root-{tmp_path.name}"
    sky = client(home, FAKESKY_SSH_HOST=host.address, FAKESKY_SSH_PORT=str(host.port),
                 FAKESKY_SSH_USER=host.user, FAKESKY_SSH_IDENTITY=str(host.client_key))  # fmt: skip
    launch(sky, "reachable", task("true", file_mounts={f"{remote}/in": str(source)}))
    path = sky.call("ssh_config", {"cluster_name": "reachable"})["path"]
    assert path == str(home / ".sky" / "generated" / "ssh" / "reachable")
    text = Path(path).read_text()
    assert "Host reachable\n" in text
    assert f"  HostName {host.address}\n" in text
    assert f"  Port {host.port}\n" in text

    ssh = ["ssh", "-F", path, "-o", "BatchMode=yes", "-o", "LogLevel=ERROR"]
    done = subprocess.run([*ssh, "reachable", "cat", shlex.quote(f"{remote}/in/a.txt")],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert (done.returncode, done.stdout) == (0, "over ssh\n"), done.stderr
    fetched = tmp_path / "fetched.txt"
    done = subprocess.run(["rsync", "-e", shlex.join(ssh), f"reachable:{remote}/in/a.txt", str(fetched)],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert fetched.read_text() == "over ssh\n"

    sky.call("down", {"cluster_name": "reachable"})
    assert sky.call("ssh_config", {"cluster_name": "reachable"}) == {"path": None}
