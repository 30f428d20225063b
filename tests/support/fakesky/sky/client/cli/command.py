"""The one helper of SkyPilot 0.14.1's CLI that skypilot/helper/sky_sdk.py calls:
what `sky status CLUSTER` does to the client's ssh config. The real one
(re)writes `~/.sky/generated/ssh/<cluster>` for each cluster that is UP,
through the API server's proxy where the cloud needs it (Slurm,
Kubernetes), and removes the config of a named cluster that is gone; the
fake writes its own config (FAKESKY_SSH_*) the same way."""

from __future__ import annotations

from typing import Any

from sky._client import get, status
from sky._cluster import _write_ssh_config, ssh_config_path
from sky._types import ClusterStatus, StatusRefreshMode


def _get_cluster_records_and_set_ssh_config(
    clusters: list[str] | None,
    refresh: StatusRefreshMode = StatusRefreshMode.NONE,
    all_users: bool = False,
    verbose: bool = False,
) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = get(status(clusters, refresh=refresh, all_users=all_users))
    for record in records:
        if record["status"] in (ClusterStatus.UP, "UP"):
            _write_ssh_config(record["name"])
        else:
            ssh_config_path(record["name"]).unlink(missing_ok=True)
    for name in set(clusters or []) - {record["name"] for record in records}:
        ssh_config_path(name).unlink(missing_ok=True)
    return records
