"""The exceptions of SkyPilot's `sky.exceptions` that the fake raises (same
names and bases as SkyPilot 0.14.1's)."""

from __future__ import annotations

import enum
from typing import Any


class InvalidSkyPilotConfigError(ValueError):
    """A task, resources or storage config does not match SkyPilot's schema."""


class ClusterNotUpError(Exception):
    """The cluster exists but is not UP."""

    def __init__(self, message: str, cluster_status: Any = None, handle: Any = None) -> None:
        super().__init__(message)
        self.cluster_status = cluster_status
        self.handle = handle


class ClusterDoesNotExist(ValueError):
    """No cluster of that name."""


class NotSupportedError(Exception):
    """The cloud (or the fake) does not support a requested feature."""


class InvalidClusterNameError(Exception):
    """The cluster name breaks SkyPilot's naming rule."""


class RequestCancelled(Exception):
    """The request was cancelled (`sky.api_cancel`)."""


class JobExitCode(enum.IntEnum):
    """`sky.tail_logs` return codes."""

    SUCCEEDED = 0
    FAILED = 100
    NOT_FINISHED = 101
    NOT_FOUND = 102
    CANCELLED = 103
