"""A trivial task's whole life on a real Slurm cluster, through substrax's
SkyPilot helper (skypilot/helper/sky_sdk.py via SkyClient): launch (the cluster's
first runtime install included), its log, its status, down, and nothing
left on Slurm afterwards."""

from __future__ import annotations

import contextlib
import json
import secrets
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from e2e.conftest import SlurmBedInfo
from substrax_tasks.backends.skypilot.client import SkyCallError, SkyClient

# The session fixture's set-up (bed up, ~1 min) counts here too; a first
# launch on a fresh cluster user installs SkyPilot's runtime from PyPI.
pytestmark = pytest.mark.timeout(1500)
CALL_TIMEOUT = 600.0
CLEANUP_TIMEOUT = 180.0  # a best-effort `down` after a failure; the bed's teardown kills the rest


def _pypi_problem() -> str | None:
    try:
        with urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=15) as answer:
            answer.read(1)
    except (urllib.error.URLError, OSError) as exc:
        return str(getattr(exc, "reason", exc))
    return None


def _squeue(bed: SlurmBedInfo) -> str:
    done = subprocess.run(
        ["squeue", "-h", f"--user={bed.user.name}", "-o", "%i %j %T"],
        env={"PATH": "/usr/bin:/bin", "SLURM_CONF": str(bed.slurm_conf)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.strip()


def _report(request: pytest.FixtureRequest, line: str) -> None:
    reporter: Any = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"\n[e2e] {line}")


def test_launch_logs_status_down_through_sky_helper(
    slurm_bed: SlurmBedInfo, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    client = SkyClient(sky_python=str(slurm_bed.sky_python), env=slurm_bed.env)
    cluster = f"sxt-e2e-{secrets.token_hex(2)}"
    task = {
        "name": "substrax-e2e-hello",
        "resources": {"infra": slurm_bed.infra, "cpus": 1},  # 1 of the node's CPUs: room for a second
        "run": "echo hello-from-slurm $(whoami) on $(hostname)\n",
    }
    timings: dict[str, float] = {"bed_up": round(slurm_bed.up_seconds, 1)}
    request_file = tmp_path / "launch-request.json"
    launch_log = tmp_path / "launch.log"
    started = time.monotonic()
    try:
        answer = client.call(
            "launch",
            {
                "task": task,
                "cluster_name": cluster,
                "idle_minutes_to_autostop": 30,
                "down": True,
                "request_file": str(request_file),
                "log_file": str(launch_log),
            },
            timeout=None,
        )
        timings["launch"] = round(time.monotonic() - started, 1)
        job_id = answer["job_id"]
        assert isinstance(job_id, int), answer
        assert json.loads(request_file.read_text())["name"] == "launch"

        started = time.monotonic()
        output = tmp_path / "job.log"
        tail = client.call(
            "tail_logs",
            {"cluster_name": cluster, "job_id": job_id, "follow": True, "output_file": str(output)},
            timeout=CALL_TIMEOUT,
        )
        timings["tail_logs"] = round(time.monotonic() - started, 1)
        assert tail == {"exit_code": 0}, output.read_text()
        assert f"hello-from-slurm {slurm_bed.user.name} on " in output.read_text()

        statuses = client.call("job_status", {"cluster_name": cluster, "job_ids": [job_id]})
        assert statuses == {str(job_id): "SUCCEEDED"}
        records = client.call("cluster_status", {"cluster_names": [cluster]})
        assert [(r["name"], r["status"]) for r in records] == [(cluster, "UP")]
        assert cluster in _squeue(slurm_bed)  # SkyPilot's cluster is a Slurm job of the cluster user
    except SkyCallError as exc:
        with contextlib.suppress(Exception):
            client.call("down", {"cluster_name": cluster}, timeout=CLEANUP_TIMEOUT)
        why = _pypi_problem()
        if why is not None:
            pytest.fail(
                f"PyPI is unreachable ({why}): the cluster's SkyPilot runtime install downloads from it. "
                f"SkyPilot said: {exc}\nlaunch log: {launch_log}",
                pytrace=False,
            )
        raise
    except BaseException:
        with contextlib.suppress(Exception):
            client.call("down", {"cluster_name": cluster}, timeout=CLEANUP_TIMEOUT)
        raise

    started = time.monotonic()
    client.call("down", {"cluster_name": cluster, "request_file": str(tmp_path / "down-request.json")})
    timings["down"] = round(time.monotonic() - started, 1)
    assert client.call("cluster_status", {"cluster_names": [cluster]}) == []
    deadline = time.monotonic() + 60
    while cluster in (left := _squeue(slurm_bed)) and time.monotonic() < deadline:
        time.sleep(1)
    assert cluster not in left
    _report(request, f"timings (s): {json.dumps(timings)}")
