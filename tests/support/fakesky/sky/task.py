"""sky.Task and sky.Resources: a task config read and checked as SkyPilot
0.14.1 reads it (unknown fields "did you mean ...", storage modes, infra
names, task names, file mount sources), enough to launch it locally."""

from __future__ import annotations

import copy
import difflib
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sky import clouds, exceptions

TASK_FIELDS = frozenset({
    "_metadata", "api_server_access", "config", "envs", "event_callback", "file_mounts",
    "file_mounts_mapping", "inputs", "managed_secrets", "name", "num_nodes", "outputs", "pool",
    "resources", "run", "secrets", "service", "setup", "volume_mounts", "volumes", "workdir",
})  # fmt: skip
RESOURCE_FIELDS = frozenset({
    "accelerator_args", "accelerators", "any_of", "autostop", "cloud", "cpus", "disk_size", "disk_tier",
    "ephemeral_storage", "image_id", "infra", "instance_type", "job_recovery", "labels", "local_disk",
    "max_hourly_cost", "memory", "network_tier", "ordered", "ports", "priority", "priority_class",
    "region", "use_spot", "volumes", "zone",
})  # fmt: skip
STORAGE_FIELDS = frozenset({"name", "source", "store", "persistent", "mode", "config"})
STORAGE_MODES = ("MOUNT", "COPY", "MOUNT_CACHED")
_VALID_NAME = re.compile(r"[a-zA-Z0-9]+(?:[._-]{1,2}[a-zA-Z0-9]+)*")
_ENV_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_CLOUD_URL = re.compile(r"^[a-z0-9]+://")


def _check_fields(config: dict[str, Any], known: frozenset[str], what: str) -> None:
    """SkyPilot's message for unknown fields: "Instead of 'rnu', did you mean 'run'?"."""
    problems = []
    for key in config:
        if key in known or key.startswith("_"):
            continue
        close = difflib.get_close_matches(key, sorted(known), 1)
        problems.append(f"Instead of {key!r}, did you mean {close[0]!r}?" if close
                        else f"The following fields are invalid: {key!r}")  # fmt: skip
    if problems:
        raise exceptions.InvalidSkyPilotConfigError(f"Invalid {what} YAML: " + " ".join(problems))


def is_cloud_url(source: str) -> bool:
    return bool(_CLOUD_URL.match(source))


class Resources:
    """One resources choice; `.cloud` is a sky.clouds object or None."""

    def __init__(  # noqa: PLR0917 - SkyPilot's signature
        self,
        cloud: clouds.Cloud | None = None,
        instance_type: str | None = None,
        cpus: int | float | str | None = None,
        memory: int | float | str | None = None,
        accelerators: str | dict[str, int | float] | None = None,
        accelerator_args: dict[str, str] | None = None,
        infra: str | None = None,
        use_spot: bool | None = None,
        job_recovery: dict[str, Any] | str | None = None,
        region: str | None = None,
        zone: str | None = None,
        image_id: dict[str | None, str] | str | None = None,
        disk_size: str | int | None = None,
        disk_tier: str | None = None,
        network_tier: str | None = None,
        local_disk: str | None = None,
        max_hourly_cost: float | None = None,
        ports: int | str | list[str] | tuple[str] | None = None,
        labels: dict[str, str] | None = None,
        autostop: bool | int | str | dict[str, Any] | None = None,
        hooks: list[dict[str, Any]] | None = None,
        priority: int | None = None,
        priority_class: str | None = None,
        volumes: list[dict[str, Any]] | None = None,
    ) -> None:
        if isinstance(cloud, str):
            cloud = _cloud_named(cloud)
        if infra is not None:
            cloud, region, zone = _parse_infra(infra)
        self.cloud = cloud
        self.infra = infra
        self.region, self.zone = region, zone
        self.instance_type, self.cpus, self.memory = instance_type, cpus, memory
        self.accelerators, self.accelerator_args = accelerators, accelerator_args
        self.use_spot, self.job_recovery = bool(use_spot), job_recovery
        self.image_id, self.disk_size, self.disk_tier = image_id, disk_size, disk_tier
        self.network_tier, self.local_disk, self.max_hourly_cost = network_tier, local_disk, max_hourly_cost
        self.ports, self.labels, self.hooks, self.volumes = ports, labels, hooks, volumes
        self.priority, self.priority_class = priority, priority_class
        self.autostop_config = _autostop_config(autostop)

    def validate(self) -> None:
        """Offline there is nothing more to check (no catalogs)."""

    def is_launchable(self) -> bool:
        return self.cloud is not None and self.instance_type is not None

    def get_cost(self, seconds: float) -> float:
        """USD for `seconds` of this instance, from the catalog (clouds.CATALOG)."""
        assert self.cloud is not None, "Cloud must be specified"
        assert self.instance_type is not None, "Instance type must be specified"
        hourly = self.cloud.instance_type_to_hourly_cost(self.instance_type, self.use_spot, self.region,
                                                         self.zone)  # fmt: skip
        return float(hourly * seconds / 3600)

    @classmethod
    def from_yaml_config(cls, config: dict[str, Any] | None) -> set[Resources] | list[Resources]:
        """As SkyPilot's: a set of the choices, a list when they are `ordered`."""
        choices = _resources_from_config(config)
        return choices if config and "ordered" in config else set(choices)

    def to_yaml_config(self, redact_secrets: bool = False) -> dict[str, Any]:
        config = {k: v for k, v in vars(self).items() if v is not None and k != "autostop_config"}
        config.pop("cloud", None)
        if self.infra is None and self.cloud is not None:
            config["infra"] = repr(self.cloud).lower()
        if not self.use_spot:
            config.pop("use_spot", None)
        if self.autostop_config is not None:
            config["autostop"] = self.autostop_config
        return config

    def __repr__(self) -> str:
        return f"Resources(cloud={self.cloud!r}, infra={self.infra!r})"


def _cloud_named(name: str) -> clouds.Cloud | None:
    if name.strip() == "*":
        return None
    cloud = clouds.from_name(name)
    if cloud is None:
        raise exceptions.InvalidSkyPilotConfigError(
            f"Invalid resources YAML: {name!r} is not a known cloud (infra)."
        )
    return cloud


def _parse_infra(infra: str) -> tuple[clouds.Cloud | None, str | None, str | None]:
    """`aws`, `aws/us-east-1[/zone]`, `k8s/<context>`, `*/region` -> (cloud, region, zone)."""
    name, _, rest = infra.partition("/")
    cloud = _cloud_named(name)
    if isinstance(cloud, clouds.Kubernetes):
        return cloud, rest or None, None
    region, _, zone = rest.partition("/")
    return cloud, region or None, zone or None


def _autostop_config(value: Any) -> dict[str, Any] | None:
    """resources.autostop: true / false / minutes / "10m" / {idle_minutes, down}."""
    if value is None or value is False:
        return None
    if value is True:
        return {"idle_minutes": 0, "down": False}
    if isinstance(value, int):
        return {"idle_minutes": value, "down": False}
    if isinstance(value, str):
        return {"idle_minutes": int(value.rstrip("m") or 0), "down": False}
    return {"idle_minutes": int(value.get("idle_minutes", 0)), "down": bool(value.get("down", False))}


def _resources_from_config(config: dict[str, Any] | None) -> list[Resources]:
    config = dict(config or {})
    _check_fields(config, RESOURCE_FIELDS, "resources")
    choices = config.pop("any_of", None) or config.pop("ordered", None)
    if not choices:
        return [Resources(**{k: v for k, v in config.items() if not k.startswith("_")})]
    found = []
    for choice in choices:
        _check_fields(choice, RESOURCE_FIELDS, "resources")
        merged = {**config, **choice}
        found.append(Resources(**{k: v for k, v in merged.items() if not k.startswith("_")}))
    return found


def _check_storage(target: str, spec: dict[str, Any]) -> None:
    _check_fields(spec, STORAGE_FIELDS, "storage")
    mode = str(spec.get("mode", "MOUNT")).upper()
    if mode not in STORAGE_MODES:
        raise exceptions.InvalidSkyPilotConfigError(
            f"Invalid storage YAML: {spec.get('mode')!r} is not one of {list(STORAGE_MODES)}. "
            "Check problematic field(s): $.mode"
        )
    if not spec.get("source") and not spec.get("name"):
        raise exceptions.InvalidSkyPilotConfigError(
            f"Invalid storage YAML for {target!r}: a storage needs a source or a name"
        )


class Task:
    """A task: setup, run, envs and secrets, workdir, file mounts, resources."""

    def __init__(
        self,
        name: str | None = None,
        *,
        setup: str | list[str] | None = None,
        run: str | list[str] | None = None,
        envs: dict[str, str] | None = None,
        secrets: dict[str, str] | None = None,
        workdir: str | dict[str, Any] | None = None,
        num_nodes: int | None = None,
        file_mounts: dict[str, str] | None = None,
        storage_mounts: dict[str, Any] | None = None,
        volumes: dict[str, str | dict[str, Any]] | None = None,
        resources: Resources | set[Resources] | list[Resources] | None = None,
        docker_image: str | None = None,
        event_callback: str | None = None,
        blocked_resources: Iterable[Resources] | None = None,
        api_server_access: bool = True,
    ) -> None:
        self.name = name
        self.setup = "\n".join(setup) if isinstance(setup, list) else setup
        self.run = "\n".join(run) if isinstance(run, list) else run
        self._envs = {str(k): "" if v is None else str(v) for k, v in (envs or {}).items()}
        self._secrets = {str(k): "" if v is None else str(v) for k, v in (secrets or {}).items()}
        self.workdir = workdir
        self.num_nodes = 1 if num_nodes is None else num_nodes
        self.file_mounts = dict(file_mounts) if file_mounts else None
        # destination -> storage spec dict (source, mode, ...)
        self.storage_mounts: dict[str, dict[str, Any]] = dict(storage_mounts or {})
        self.volumes = volumes
        self.docker_image, self.event_callback = docker_image, event_callback
        self.blocked_resources = blocked_resources
        self.api_server_access = api_server_access
        self.resources: set[Resources] = set()
        self.set_resources(Resources() if resources is None else resources)

    def set_resources(self, resources: Resources | set[Resources] | list[Resources]) -> Task:
        self.resources = {resources} if isinstance(resources, Resources) else set(resources)
        return self

    @property
    def envs(self) -> dict[str, str]:
        return dict(self._envs)

    @property
    def secrets(self) -> dict[str, str]:
        return dict(self._secrets)

    @property
    def envs_and_secrets(self) -> dict[str, str]:
        return {**self._envs, **self._secrets}

    @classmethod
    def from_yaml_config(
        cls,
        config: dict[str, Any],
        env_overrides: list[tuple[str, str]] | None = None,
        secrets_overrides: list[tuple[str, str]] | None = None,
    ) -> Task:
        config = copy.deepcopy({k: v for k, v in config.items() if v is not None})
        _check_fields(config, TASK_FIELDS, "task")
        envs = {str(k): None if v is None else str(v) for k, v in (config.get("envs") or {}).items()}
        bad = [k for k in envs if not _ENV_NAME.fullmatch(k)]
        if bad:
            raise exceptions.InvalidSkyPilotConfigError(
                f"Invalid task YAML: The `envs` field contains invalid keys: {bad}"
            )
        envs.update(env_overrides or [])
        secrets = config.get("secrets") or {}
        secrets = {str(k): None if v is None else str(v) for k, v in dict(secrets).items()}
        secrets.update(secrets_overrides or [])
        missing = [k for k, v in envs.items() if v is None]
        if missing:
            raise ValueError(f"Environment variable {missing[0]!r} is None. Please set a value for it.")
        file_mounts: dict[str, str] = {}
        storage: dict[str, dict[str, Any]] = {}
        for target, source in (config.get("file_mounts") or {}).items():
            if isinstance(source, dict):
                _check_storage(target, source)
                storage[str(target)] = dict(source)
            else:
                file_mounts[str(target)] = str(source)
        if not isinstance(config.get("setup", ""), str) or not isinstance(config.get("run", ""), str):
            raise exceptions.InvalidSkyPilotConfigError("Invalid task YAML: setup and run must be strings")
        return cls(
            config.get("name"),
            setup=config.get("setup"),
            run=config.get("run"),
            envs=envs,  # type: ignore[arg-type]
            secrets=secrets,
            workdir=config.get("workdir"),
            num_nodes=config.get("num_nodes"),
            file_mounts=file_mounts or None,
            storage_mounts=storage,
            volumes=config.get("volumes"),
            resources=_resources_from_config(config.get("resources")),
            event_callback=config.get("event_callback"),
        )

    def to_yaml_config(self, use_user_specified_yaml: bool = False) -> dict[str, Any]:
        """The config back (secrets included, as the request carries them)."""
        file_mounts: dict[str, Any] = {**(self.file_mounts or {}), **self.storage_mounts}
        resources = [r.to_yaml_config() for r in self.resources]
        config: dict[str, Any] = {
            "name": self.name, "setup": self.setup, "run": self.run, "envs": self._envs or None,
            "secrets": self._secrets or None, "workdir": self.workdir, "num_nodes": self.num_nodes,
            "file_mounts": file_mounts or None,
            "resources": resources[0] if len(resources) == 1 else {"any_of": resources},
        }  # fmt: skip
        return {k: v for k, v in config.items() if v is not None}

    def validate(self, skip_file_mounts: bool = False, skip_workdir: bool = False) -> None:
        if self.name is not None and not _VALID_NAME.fullmatch(self.name):
            raise ValueError(
                f"Invalid task name {self.name}. Valid name: ASCII characters and may contain lowercase "
                "and uppercase letters, digits, underscores, periods, and dashes. Must start and end "
                "with alphanumeric characters. No triple dashes or underscores."
            )
        if self.run is not None and not isinstance(self.run, str):
            raise ValueError(f"run must be a shell script (str). Got {type(self.run)}")
        if not skip_workdir and isinstance(self.workdir, str):
            workdir = Path(self.workdir).expanduser().absolute()
            if not workdir.is_dir():
                raise ValueError(
                    "Workdir must be a valid directory (or a symlink to a directory). "
                    f"{self.workdir} not found."
                )
            self.workdir = str(workdir)
        if not skip_file_mounts:
            self._validate_file_mounts()
        for resources in self.resources:
            resources.validate()

    def _validate_file_mounts(self) -> None:
        for target, source in (self.file_mounts or {}).items():
            location = f"file_mounts.{target}: {source}"
            if target.endswith("/") or source.endswith("/"):
                raise ValueError(f"Mount paths cannot end with a slash Found: {target} in {location}")
            if is_cloud_url(target):
                raise ValueError("File mount destination paths cannot be cloud storage")
            if is_cloud_url(source):
                continue
            resolved = Path(source).expanduser().absolute()
            if not resolved.exists():
                raise ValueError(
                    f"File mount source {source!r} does not exist locally. To fix: check if it exists, "
                    "and correct the path."
                )
            self.file_mounts[target] = str(resolved)  # type: ignore[index]
