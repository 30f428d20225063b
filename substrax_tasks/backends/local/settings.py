"""`[tool.substrax.compute.backends.local]`: the local backend's settings."""

from __future__ import annotations

from substrax_tasks.backends.settings import BackendSettings, HideGpus, NetworkIsolation


class LocalSettings(BackendSettings):
    """`[tool.substrax.compute.backends.local]`"""

    network_isolation: NetworkIsolation = False
    hide_gpus_when_unasked: HideGpus = False

    @property
    def network_isolated(self) -> bool:
        return self.network_isolation
