"""The unit half of tests/integration/skypilot/test_skypilot_config.py: the same subject, the
tests that start no process and open no connection (see its docstring)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from skypilot_config_parts import COPY, TABLE, write

from substrax_tasks.backends.skypilot import task as sky_task
from substrax_tasks.backends.skypilot.client import JOB_STATES, job_state, resolve_sky_python
from substrax_tasks.backends.skypilot.settings import NO_BUCKET_MOUNTS, SkypilotSettings
from substrax_tasks.config.pyproject import load_config
from substrax_tasks.errors import BackendError, ConfigError
from substrax_tasks.step.spec import make_spec, settings_in_key
from substrax_tasks.store.project import Project


@pytest.mark.unit
def test_a_copy_table_alone_is_a_valid_configuration(tmp_path: Path) -> None:
    root = write(tmp_path / "p", f'{TABLE}\ninfra = "runpod"\naccelerators = "H100:1"\n{COPY}\n')
    settings = load_config(root).backend_settings("skypilot", root)
    assert isinstance(settings, SkypilotSettings)
    assert settings.transport is settings.copy_
    assert settings.transport.lifetime_minutes == 120.0


@pytest.mark.unit
def test_a_steps_resources_override_the_backends(tmp_path: Path) -> None:
    settings = SkypilotSettings.model_validate(
        {"infra": "aws", "cpus": 8, "accelerators": "A100:1", "copy": {"disk_size": 40}}
    )
    merged = settings.resources({"accelerators": "H100:2", "memory": 64})
    assert merged == {"infra": "aws", "cpus": 8, "accelerators": "H100:2", "memory": 64, "disk_size": 40}


@pytest.mark.unit
def test_every_known_job_status_maps_and_an_unknown_one_raises() -> None:
    assert {job_state(s) for s in ("FAILED", "FAILED_SETUP", "FAILED_DRIVER")} == {"failed"}
    assert job_state("SUCCEEDED") == "succeeded"
    assert job_state("CANCELLED") == "cancelled"
    assert {job_state(s) for s in ("INIT", "PENDING", "SETTING_UP", "RUNNING")} == {"running"}
    assert set(JOB_STATES) == {
        "INIT", "PENDING", "SETTING_UP", "RUNNING", "SUCCEEDED", "FAILED", "FAILED_SETUP",
        "FAILED_DRIVER", "CANCELLED",
    }  # fmt: skip
    for unknown in ("RECOVERING", None, 3):
        with pytest.raises(BackendError, match="does not know"):
            job_state(unknown)


@pytest.mark.unit
def test_the_generated_task_mounts_read_only_copies_and_arms_the_timer_first(tmp_path: Path) -> None:
    root = write(
        tmp_path / "p",
        f'{TABLE}\ninfra = "aws"\nsetup_commands = ["echo one", "echo two"]\n'
        f'{COPY}\nsources = ["data"]\nlifetime_minutes = 30\nnetwork_isolation = true\n',
    )
    (root / "data").mkdir()
    (root / "requirements.txt").write_text("")
    project = Project.open(root)
    spec = make_spec("fit: a/b", ["python3", "fit.py"], root, outputs=["out/"], resources={"cpus": 2})
    handle = project.new_run(spec)
    backend = project.backend_for(handle)
    layout = backend.layout(handle)  # type: ignore[attr-defined]
    config = sky_task.task_config(
        backend.settings, handle, layout, upload_dir=tmp_path / "up", remote_dir=tmp_path / "bin",  # type: ignore[arg-type]
        cluster="c1", project=root, lock="requirements.txt", env_dir=layout.env_dir("d"),
    )  # fmt: skip
    # every mount is a plain local source: SkyPilot COPY, never a writable MOUNT
    assert all(isinstance(v, str) for v in config["file_mounts"].values())
    assert f"~/{layout.project}/data" in config["file_mounts"]
    setup = config["setup"].splitlines()
    watchdog = next(i for i, line in enumerate(setup) if "control.py watchdog" in line)
    assert watchdog < setup.index("echo one") < setup.index("echo two")
    assert any(" env.py " in line for line in setup[setup.index("echo two") :])
    # the cluster's timer, on the lease's folder: (30 - SkyPilot's 1-minute autodown) * 60 seconds
    assert setup[watchdog].endswith(f"control.py watchdog {layout.lease('c1')} 1740")
    assert "lease.py hold" in config["run"]  # the cluster's one SkyPilot job: its lease
    assert config["resources"] == {"infra": "aws", "cpus": 2}
    name = sky_task.cluster_name(backend.settings, handle, "0123456789abcdef" * 2)  # type: ignore[arg-type]
    assert name.startswith("substrax-fit-a-b-01234567-") and len(name) <= 35
    job = json.loads(json.dumps(sky_task.worker_job(backend.settings, handle, layout, None)))  # type: ignore[arg-type]
    assert job["network_isolation"] is True
    assert not job["project"].startswith("/")  # resolved by the worker on the cluster
    # the copy transport reads the manifest from the run's folder: no copy in a bucket
    assert "manifest_copy" not in job


@pytest.mark.unit
def test_bucket_shapes_are_refused_only_where_buckets_cannot_be_mounted() -> None:
    for cloud in sorted(NO_BUCKET_MOUNTS):
        with pytest.raises(ValueError, match="cannot mount buckets"):
            SkypilotSettings.model_validate({"infra": cloud, "bucket": {"outputs_bucket": "s3://b"}})
    ok = SkypilotSettings.model_validate({"infra": "aws", "bucket": {"outputs_bucket": "s3://b/"}})
    assert ok.bucket is not None and ok.bucket.outputs_bucket == "s3://b"


@pytest.mark.unit
def test_a_missing_skypilot_interpreter_is_an_error_naming_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError, match=r"sky_python = '/nowhere/python': no such program"):
        resolve_sky_python("/nowhere/python")
    monkeypatch.setenv("PATH", str(tmp_path))  # no `sky` anywhere
    with pytest.raises(ConfigError) as caught:
        resolve_sky_python(None)
    assert "no `sky` command on PATH" in str(caught.value)
    assert "[tool.substrax.compute.backends.skypilot] sky_python" in str(caught.value)
    # `sky` found: the python beside it
    (tmp_path / "sky").write_text("#!/bin/sh\n")
    (tmp_path / "sky").chmod(0o755)
    (tmp_path / "python").symlink_to(sys.executable)
    assert resolve_sky_python(None) == str(tmp_path / "python")


@pytest.mark.unit
def test_a_relaunched_attempt_gets_a_cluster_and_a_folder_of_its_own_and_on_demand_when_asked(
    tmp_path: Path,
) -> None:
    spot = 'infra = "aws"\nuse_spot = true\non_demand_last_attempt = true\n'
    root = write(tmp_path / "p", f"{TABLE}\n{spot}{COPY}\n")
    project = Project.open(root)
    handle = project.new_run(make_spec("fit", ["python3", "fit.py"], root, outputs=["out/"]))
    backend = project.backend_for(handle)
    client = "0123456789abcdef" * 2
    first = sky_task.cluster_name(backend.settings, handle, client)  # type: ignore[arg-type]
    assert backend.layout(handle).run.endswith(f"/runs/{handle.run_id}")  # type: ignore[attr-defined]
    assert sky_task.launched_resources(backend.settings, handle)["use_spot"] is True  # type: ignore[arg-type]
    attempts = [{"number": n, "machine": first, "launched_at": "2026-12-07T00:00:00+00:00"} for n in (1, 2)]
    project.store.update_state(handle, attempts=attempts)
    again = backend.save_state(project.store.read(handle.run_id), on_demand=True)
    second = sky_task.cluster_name(backend.settings, again, client)  # type: ignore[arg-type]
    assert second != first and second.rsplit("-", 1)[0] == first.rsplit("-", 1)[0]
    assert backend.layout(again).run.endswith(f"/runs/{handle.run_id}-attempt2")  # type: ignore[attr-defined]
    assert sky_task.launched_resources(backend.settings, again)["use_spot"] is False  # type: ignore[arg-type]
    # not in the step's key: the setting changes no output
    assert "on_demand_last_attempt" not in settings_in_key(handle.settings)


@pytest.mark.unit
def test_on_demand_last_attempt_without_use_spot_is_refused_naming_the_fix() -> None:
    with pytest.raises(ValueError, match="set use_spot = true, or remove on_demand_last_attempt"):
        SkypilotSettings.model_validate({"on_demand_last_attempt": True, "copy": {}})
