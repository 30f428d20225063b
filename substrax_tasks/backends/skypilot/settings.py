"""`[tool.substrax.compute.backends.skypilot]` and its transport tables.

Everything that can be judged without SkyPilot is judged here, when the
configuration is read: a wrong key, both or neither transport table, a
writable mount in the copy transport, a bucket on a provider that cannot
mount one. SkyPilot itself then validates the generated task before launch.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from substrax_tasks.backends.settings import LifetimeMinutes, NetworkIsolation, RemoteSettings, Strict
from substrax_tasks.constants import TABLE as COMPUTE_TABLE
from substrax_tasks.step.spec import RESOURCE_KEYS

TABLE = f"{COMPUTE_TABLE}.backends.skypilot"

# Clouds whose instances cannot mount buckets (each cloud's
# _CLOUD_UNSUPPORTED_FEATURES in SkyPilot 0.14: STORAGE_MOUNTING). Checked
# against the installed SkyPilot by tests/integration/skypilot/test_sky_validation.py.
NO_BUCKET_MOUNTS = frozenset({"runpod", "vast", "hyperbolic", "shadeform", "seeweb", "verda", "yotta"})
# Clouds where SkyPilot cannot autodown: the node's own timer powers it off.
NO_AUTODOWN = frozenset({"hyperbolic", "primeintellect", "verda", "yotta"})
# Machines SkyPilot's catalog prices at 0 (it knows no price): hourly_cost prices them.
UNPRICED_CLOUDS = frozenset({"kubernetes", "k8s", "slurm", "ssh"})
WRITABLE_MODES = ("MOUNT", "MOUNT_CACHED")
# SkyPilot's autodown idle: the cluster goes this long after its lease (its
# one job) ended. The lease, not SkyPilot, keeps a cluster warm (idle_minutes).
AUTODOWN_MINUTES = 1
_CLUSTER_PREFIX = re.compile(r"^[a-z][a-z0-9-]{0,19}$")


def cloud_of(infra: str | None) -> str | None:
    """`runpod`, `aws/us-east-1`, `k8s/ctx` -> the cloud's lower-case name."""
    if not infra:
        return None
    return infra.split("/", 1)[0].strip().lower() or None


class CopySource(Strict):
    """A `sources` entry written as a table: `{path = "data", mode = "COPY"}`."""

    path: str
    mode: str = "COPY"

    @field_validator("mode")
    @classmethod
    def _copy_only(cls, mode: str) -> str:
        if mode.upper() in WRITABLE_MODES:
            raise ValueError(
                f"mode {mode!r} is a writable mount; the copy transport copies each source read-only: "
                f'drop `mode` (or set mode = "COPY"), or use [{TABLE}.bucket] '
                "to mount a bucket"
            )
        if mode.upper() != "COPY":
            raise ValueError(f'unknown mode {mode!r}; the copy transport takes mode = "COPY" only')
        return "COPY"


class _TransportSettings(Strict):
    lifetime_minutes: LifetimeMinutes = 120.0
    network_isolation: NetworkIsolation = False


class SkyCopySettings(_TransportSettings):
    """`[...skypilot.copy]`: files travel by SkyPilot COPY file mounts and rsync."""

    sources: list[str | CopySource] = Field(
        default_factory=list,
        description="Project folders or files copied onto the cluster read-only, beside the step's inputs.",
    )
    disk_size: int | None = Field(
        None, gt=0, description="Disk (GB) for the copies, if [skypilot] sets none."
    )

    @field_validator("sources")
    @classmethod
    def _local_paths(cls, sources: list[str | CopySource]) -> list[str | CopySource]:
        for source in sources:
            path = source if isinstance(source, str) else source.path
            if "://" in path:
                raise ValueError(
                    f"source {path!r} is a bucket; the copy transport copies project paths. "
                    f"Mount buckets with [{TABLE}.bucket] buckets = {{...}}"
                )
            if path.startswith("/") or ".." in path.split("/"):
                raise ValueError(f"source {path!r} must be a path inside the project (relative, no '..')")
        return sources

    def source_paths(self) -> list[str]:
        return [(s if isinstance(s, str) else s.path).rstrip("/") for s in self.sources]


class SkyBucketSettings(_TransportSettings):
    """`[...skypilot.bucket]`: outputs are written to a mounted bucket."""

    outputs_bucket: str = Field(
        description="Bucket URI the outputs are written to, e.g. s3://my-bucket/runs."
    )
    buckets: dict[str, str] = Field(
        default_factory=dict,
        description="Project path -> bucket URI, mounted read-only as the step's inputs.",
    )

    @field_validator("outputs_bucket")
    @classmethod
    def _uri(cls, uri: str) -> str:
        if "://" not in uri:
            raise ValueError(f"{uri!r} is not a bucket URI; write it as s3://bucket[/prefix]")
        return uri.rstrip("/")


class SkypilotSettings(RemoteSettings):
    """`[tool.substrax.compute.backends.skypilot]`"""

    # -- resources (a step's own `resources` override these)
    infra: str | None = Field(
        None, description='Where: "aws", "aws/us-east-1", "runpod", "k8s", "slurm", ...'
    )
    accelerators: str | dict[str, int] | None = Field(None, description='e.g. "H100:1"')
    cpus: str | int | float | None = Field(None, description='e.g. 4 or "4+"')
    memory: str | int | float | None = Field(None, description='GB, e.g. 16 or "16+"')
    instance_type: str | None = None
    use_spot: bool | None = None
    on_demand_last_attempt: bool = Field(
        False, description="With use_spot = true: the last relaunch a step's preemptions= allow (its "
        "machine lost that many times) runs on an on-demand machine, which is not preempted.",
    )
    disk_size: int | None = Field(None, gt=0, description="Disk in GB.")
    disk_tier: Literal["low", "medium", "high", "ultra", "best"] | None = None
    image_id: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    # -- the run (and the fields of RemoteSettings)
    sky_python: str | None = Field(
        None, description="SkyPilot's Python (default: the one beside `sky` on PATH)."
    )
    cluster_prefix: str = Field("substrax", description="Clusters are named <prefix>-<step>-<client>-<run>.")
    idle_minutes: float = Field(
        5, gt=0, description="A cluster stays warm this long after its last step ended (its lease "
        "holds it), then SkyPilot takes it down; with reuse = true a step of another doit may use it "
        "meanwhile.",
    )
    retry_until_up: bool = False
    poll_seconds: float = Field(
        5.0, gt=0,
        description="How often the job's status is read until its worker has started (then one follower "
        "streams its log and its end).",
    )  # fmt: skip
    max_parallel: int | None = Field(
        4, ge=1, description="At most this many clusters of one shape (settings and resources) at once, "
        "each running one step at a time; more steps wait, across every doit of the project."
    )
    reuse: bool = Field(
        False, description="Steps of one shape take turns on up to max_parallel clusters, kept warm "
        "across doits while their lease holds them, instead of a cluster each."
    )
    copy_: SkyCopySettings | None = Field(None, alias="copy")
    bucket: SkyBucketSettings | None = None

    @field_validator("cluster_prefix")
    @classmethod
    def _prefix(cls, prefix: str) -> str:
        if not _CLUSTER_PREFIX.match(prefix):
            raise ValueError("must start with a lower-case letter, then up to 19 of a-z, 0-9 and '-'")
        return prefix

    @model_validator(mode="after")
    def _one_transport(self) -> SkypilotSettings:
        copy_key, bucket_key = f"[{TABLE}.copy]", f"[{TABLE}.bucket]"
        if self.copy_ is None and self.bucket is None:
            raise ValueError(f"no transport: configure exactly one of {copy_key} or {bucket_key}")
        if self.copy_ is not None and self.bucket is not None:
            raise ValueError(f"both {copy_key} and {bucket_key} are set; keep exactly one")
        if self.bucket is not None and cloud_of(self.infra) in NO_BUCKET_MOUNTS:
            raise ValueError(
                f"infra = {self.infra!r} cannot mount buckets, which {bucket_key} needs; "
                f"use the copy transport ({copy_key}) with this provider"
            )
        if self.copy_ is not None and self.copy_.disk_size and self.disk_size:
            raise ValueError(f"disk_size is set in [{TABLE}] and in {copy_key}; give one")
        if self.reuse and (self.bucket is not None or cloud_of(self.infra) in NO_AUTODOWN):
            raise ValueError(
                f"reuse = true needs the copy transport ({copy_key}) and a provider SkyPilot can take "
                f"down when idle (not {', '.join(sorted(NO_AUTODOWN))}); set reuse = false"
            )
        if self.on_demand_last_attempt and self.use_spot is not True:
            raise ValueError(
                "on_demand_last_attempt = true makes the last attempt of a step on spot machines on "
                "demand, but use_spot is not true here: set use_spot = true, or remove "
                "on_demand_last_attempt"
            )
        if self.transport.lifetime_minutes <= AUTODOWN_MINUTES:
            raise ValueError(
                f"lifetime_minutes = {self.transport.lifetime_minutes:g} must be more than "
                f"{AUTODOWN_MINUTES} "
                "(the cluster's steps and lease are stopped that long before the lifetime ends, so that "
                "SkyPilot's autodown has the cluster gone by then)"
            )
        return self

    @property
    def network_isolated(self) -> bool:
        # read by the shared validator, which may run before _one_transport
        chosen = self.copy_ if self.copy_ is not None else self.bucket
        return chosen is not None and chosen.network_isolation

    @property
    def transport(self) -> SkyCopySettings | SkyBucketSettings:
        chosen = self.copy_ if self.copy_ is not None else self.bucket
        assert chosen is not None  # the validator above
        return chosen

    def seats(self, step_resources: dict[str, Any]) -> int:
        """How many steps of these resources run side by side on one reused
        cluster: its GPUs (`accelerators` here) shared out among steps that
        each ask for a whole part of them (the worker hands them out, as on
        an ssh host); 1 otherwise."""
        mine, asked = gpus_of(self.accelerators), gpus_of(step_resources.get("accelerators"))
        if not self.reuse or mine is None or asked is None:
            return 1
        if asked[0] is not None and mine[0] is not None and asked[0].lower() != mine[0].lower():
            return 1
        return max(mine[1] // asked[1], 1)

    def resources(self, step_resources: dict[str, Any]) -> dict[str, Any]:
        """SkyPilot's `resources:` for one step: these defaults, the step's
        own on top; but a step that shares out a reused cluster's GPUs
        (seats) gets the cluster these settings name."""
        disk = self.disk_size or (self.copy_.disk_size if self.copy_ is not None else None)
        values: dict[str, Any] = {
            "infra": self.infra, "accelerators": self.accelerators, "cpus": self.cpus,
            "memory": self.memory, "instance_type": self.instance_type, "use_spot": self.use_spot,
            "disk_size": disk, "disk_tier": self.disk_tier, "image_id": self.image_id,
            "labels": dict(self.labels) or None,
        }  # fmt: skip
        values.update({k: v for k, v in step_resources.items() if k in RESOURCE_KEYS})
        if self.seats(step_resources) > 1:
            values["accelerators"] = self.accelerators
        return {k: v for k, v in values.items() if v is not None}


def gpus_of(accelerators: object) -> tuple[str | None, int] | None:
    """("A100", 2) for "A100:2" or {"A100": 2}, (None, 2) for "2"; None for
    no GPUs, or for what names no single kind and whole count."""
    if isinstance(accelerators, dict):
        if len(accelerators) != 1:
            return None
        ((name, count),) = accelerators.items()
        return (str(name), count) if isinstance(count, int) and count >= 1 else None
    if not isinstance(accelerators, str) or "," in accelerators:
        return None
    name, colon, number = accelerators.strip().rpartition(":")
    if not colon:
        return (None, int(number)) if number.isdigit() else (number, 1) if number else None
    return (name, int(number)) if number.isdigit() and int(number) >= 1 and name else None
