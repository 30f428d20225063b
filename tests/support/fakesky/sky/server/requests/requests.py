"""`sky.server.requests.requests.RequestStatus`, as in SkyPilot 0.14.1."""

from __future__ import annotations

import enum


class RequestStatus(enum.Enum):
    PENDING = "PENDING"
    WAITING = "WAITING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @classmethod
    def finished_status(cls) -> list[RequestStatus]:
        return [cls.SUCCEEDED, cls.FAILED, cls.CANCELLED]
