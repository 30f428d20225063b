"""sky.clouds: the cloud classes, offline. Each knows the features SkyPilot
0.14.1 says it lacks (its static `_CLOUD_UNSUPPORTED_FEATURES`) among
STORAGE_MOUNTING, AUTODOWN, AUTOSTOP and STOP, and refuses them in
`check_features_are_supported` with NotSupportedError, as SkyPilot does."""

from __future__ import annotations

import enum
from typing import Any, ClassVar

from sky import exceptions

__all__ = [
    "AWS", "DO", "GCP", "IBM", "OCI", "SCP", "SSH", "Azure", "Cloud", "CloudImplementationFeatures",
    "Cudo", "Fluidstack", "Hyperbolic", "Kubernetes", "Lambda", "Mithril", "Nebius", "Paperspace",
    "PrimeIntellect", "RunPod", "Seeweb", "Shadeform", "Slurm", "Vast", "Verda", "Vsphere", "Yotta",
]  # fmt: skip


class CloudImplementationFeatures(enum.Enum):
    STOP = "stop"
    MULTI_NODE = "multi-node"
    CLONE_DISK_FROM_CLUSTER = "clone_disk_from_cluster"
    IMAGE_ID = "image_id"
    DOCKER_IMAGE = "docker_image"
    SPOT_INSTANCE = "spot_instance"
    CUSTOM_DISK_TIER = "custom_disk_tier"
    CUSTOM_NETWORK_TIER = "custom_network_tier"
    OPEN_PORTS = "open_ports"
    STORAGE_MOUNTING = "storage_mounting"
    HOST_CONTROLLERS = "host_controllers"
    HIGH_AVAILABILITY_CONTROLLERS = "high_availability_controllers"
    AUTO_TERMINATE = "auto_terminate"
    AUTOSTOP = "autostop"
    AUTODOWN = "autodown"
    CUSTOM_MULTI_NETWORK = "custom_multi_network"
    LOCAL_DISK = "local_disk"


_F = CloudImplementationFeatures

# A few rows of SkyPilot's catalogs (USD an hour: on demand, spot), enough
# for the tests to price what they launch; SkyPilot prices the machines of
# Kubernetes, Slurm and SSH node pools at 0 (it knows no price for them).
CATALOG: dict[tuple[str, str], tuple[float, float]] = {
    ("aws", "m6i.large"): (0.096, 0.0372),
    ("aws", "p3.2xlarge"): (3.06, 0.9180),
    ("gcp", "n2-standard-2"): (0.0971, 0.0235),
}
UNPRICED = frozenset({"kubernetes", "slurm", "ssh"})


class Cloud:
    """A cloud; instances are what `resources.cloud` holds."""

    _REPR = "Cloud"
    _CLOUD_UNSUPPORTED_FEATURES: ClassVar[dict[CloudImplementationFeatures, str]] = {}

    @classmethod
    def _unsupported_features_for_resources(
        cls, resources: Any, region: str | None = None
    ) -> dict[CloudImplementationFeatures, str]:
        return dict(cls._CLOUD_UNSUPPORTED_FEATURES)

    @classmethod
    def check_features_are_supported(
        cls, resources: Any, requested_features: set[CloudImplementationFeatures], region: str | None = None
    ) -> None:
        unsupported = cls._unsupported_features_for_resources(resources, region)
        refused = [f for f in CloudImplementationFeatures if f in requested_features and f in unsupported]
        if refused:
            rows = "\n\t".join(f"{f.value}: {unsupported[f]}" for f in refused)
            raise exceptions.NotSupportedError(
                f"The following features are not supported by {cls._REPR}:\n\t{rows}"
            )

    def instance_type_to_hourly_cost(self, instance_type: str, use_spot: bool, region: str | None,
                                     zone: str | None) -> float:  # fmt: skip
        """The catalog's price of `instance_type`, USD an hour (CATALOG); 0
        where SkyPilot lists none (Kubernetes, Slurm, SSH); a ValueError
        for an instance type the catalog does not have, as SkyPilot's."""
        name = self._REPR.lower()
        if name in UNPRICED:
            return 0.0
        prices = CATALOG.get((name, instance_type))
        if prices is None:
            raise ValueError(f"Instance type {instance_type!r} not found in the {self._REPR} catalog.")
        return prices[1] if use_spot else prices[0]

    def __repr__(self) -> str:
        return self._REPR

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(type(self).__name__)


def _cloud(class_name: str, unsupported: tuple[CloudImplementationFeatures, ...] = ()) -> type[Cloud]:
    table = {f: f"{f.value} is not supported on {class_name}." for f in unsupported}
    return type(class_name, (Cloud,), {"_REPR": class_name, "_CLOUD_UNSUPPORTED_FEATURES": table})


class Kubernetes(Cloud):
    _REPR = "Kubernetes"
    _CLOUD_UNSUPPORTED_FEATURES: ClassVar[dict[CloudImplementationFeatures, str]] = {
        _F.STOP: "Stopping clusters is not supported on Kubernetes."
    }

    @classmethod
    def _unsupported_features_for_resources(
        cls, resources: Any, region: str | None = None
    ) -> dict[CloudImplementationFeatures, str]:
        # As SkyPilot decides per context: no stop, no autostop; autodown works.
        table = dict(cls._CLOUD_UNSUPPORTED_FEATURES)
        table[_F.AUTOSTOP] = "Auto-stop is not supported on Kubernetes."
        return table


_NO_STOP = (_F.STOP,)
_NO_AUTO = (_F.AUTODOWN, _F.AUTOSTOP, _F.STOP)
AWS = _cloud("AWS")
Azure = _cloud("Azure")
Cudo = _cloud("Cudo", _NO_STOP)
DO = _cloud("DO")
Fluidstack = _cloud("Fluidstack", _NO_STOP)
GCP = _cloud("GCP")
Hyperbolic = _cloud("Hyperbolic", (*_NO_AUTO, _F.STORAGE_MOUNTING))
IBM = _cloud("IBM")
Lambda = _cloud("Lambda", _NO_STOP)
Mithril = _cloud("Mithril")
Nebius = _cloud("Nebius")
OCI = _cloud("OCI")
Paperspace = _cloud("Paperspace")
PrimeIntellect = _cloud("PrimeIntellect", _NO_AUTO)
RunPod = _cloud("RunPod", (_F.STOP, _F.STORAGE_MOUNTING))
SCP = _cloud("SCP")
Seeweb = _cloud("Seeweb", (_F.STORAGE_MOUNTING,))
Shadeform = _cloud("Shadeform", (_F.STOP, _F.STORAGE_MOUNTING))
# Slurm: SkyPilot checks /dev/fuse on the cluster; offline it counts as missing.
Slurm = _cloud("Slurm", (_F.AUTOSTOP, _F.STOP, _F.STORAGE_MOUNTING))
SSH = _cloud("SSH", _NO_STOP)
Vast = _cloud("Vast", (_F.STORAGE_MOUNTING,))
Verda = _cloud("Verda", (*_NO_AUTO, _F.STORAGE_MOUNTING))
Vsphere = _cloud("Vsphere")
Yotta = _cloud("Yotta", (*_NO_AUTO, _F.STORAGE_MOUNTING))

# infra / cloud names, lower case, as sky.utils.registry.CLOUD_REGISTRY has them.
CLOUD_REGISTRY: dict[str, Cloud] = {
    cls.__name__.lower(): cls()
    for cls in (AWS, Azure, Cudo, DO, Fluidstack, GCP, Hyperbolic, IBM, Kubernetes, Lambda, Mithril,
                Nebius, OCI, Paperspace, PrimeIntellect, RunPod, SCP, Seeweb, Shadeform, Slurm, SSH,
                Vast, Verda, Vsphere, Yotta)
}  # fmt: skip
CLOUD_ALIASES = {"k8s": "kubernetes", "digitalocean": "do"}


def from_name(name: str) -> Cloud | None:
    key = name.strip().lower()
    return CLOUD_REGISTRY.get(CLOUD_ALIASES.get(key, key))
