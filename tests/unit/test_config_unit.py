"""The unit half of tests/integration/config/test_config.py: the same subject, the
tests that start no process and open no connection (see its docstring)."""

from __future__ import annotations

from pathlib import Path

import pytest

from substrax_tasks.backends.registry import BACKEND_NAMES, backend_class, settings_model
from substrax_tasks.backends.settings import BackendSettings
from substrax_tasks.config.settings import ComputeConfig
from substrax_tasks.store.project import Project


@pytest.mark.unit
def test_defaults_need_no_configuration(project_dir: Path) -> None:
    project = Project.open(project_dir)
    assert project.config.default_backend == "local"
    assert project.store.root == project_dir / ".substrax"
    name, settings = project.settings_for()
    assert name == "local"
    assert settings == {"sandbox": "auto", "network_isolation": False, "grace_seconds": 5.0, "cache_dirs": [],
                        "max_parallel": None, "hide_gpus_when_unasked": False, "pip_args": [],
                        "keep_checkpoints": False, "hourly_cost": None, "max_cost": None}  # fmt: skip


@pytest.mark.unit
def test_a_cold_open_validates_each_backend_once(project_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Validating the table checks every backend; pinning them for the
    cached resolution then validates none of them again."""
    (project_dir / "pyproject.toml").write_text(
        '[tool.substrax.compute.backends.local]\nsandbox = "none"\n'
        '[tool.substrax.compute.backends.ssh]\nhost = "gpu-box"\n'
    )
    validated: list[str] = []
    real = ComputeConfig.backend_settings

    def counted(self: ComputeConfig, name: str, project: Path) -> BackendSettings:
        validated.append(name)
        return real(self, name, project)

    monkeypatch.setattr(ComputeConfig, "backend_settings", counted)
    project = Project.open(project_dir)
    assert sorted(validated) == ["local", "ssh"]
    assert project.settings["ssh"]["host"] == "gpu-box"
    assert project.settings_for() == ("local", project.settings["local"])


@pytest.mark.unit
def test_every_backend_has_its_settings_model_registered() -> None:
    for name in BACKEND_NAMES:
        assert backend_class(name).Settings is settings_model(name)


