"""Enums and records shaped as SkyPilot 0.14.1's (same member names, order
and values)."""

from __future__ import annotations

import enum
from typing import Any


class JobStatus(enum.Enum):
    """sky.JobStatus (sky.skylet.job_lib)."""

    INIT = "INIT"
    PENDING = "PENDING"
    SETTING_UP = "SETTING_UP"
    RUNNING = "RUNNING"
    FAILED_DRIVER = "FAILED_DRIVER"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    FAILED_SETUP = "FAILED_SETUP"
    CANCELLED = "CANCELLED"

    @classmethod
    def nonterminal_statuses(cls) -> list[JobStatus]:
        return [cls.INIT, cls.SETTING_UP, cls.PENDING, cls.RUNNING]

    def is_terminal(self) -> bool:
        return self not in self.nonterminal_statuses()


class ClusterStatus(enum.Enum):
    """sky.ClusterStatus."""

    INIT = "INIT"
    UP = "UP"
    STOPPED = "STOPPED"
    AUTOSTOPPING = "AUTOSTOPPING"
    PENDING = "PENDING"


class OptimizeTarget(enum.Enum):
    """sky.OptimizeTarget (launch's optimize_target default is COST)."""

    COST = 0
    TIME = 1


class StatusRefreshMode(enum.Enum):
    """sky.StatusRefreshMode (status's refresh default is NONE)."""

    NONE = "NONE"
    AUTO = "AUTO"
    FORCE = "FORCE"


class Record:
    """A record as SkyPilot's response models behave: fields as attributes,
    also readable like a dict (`r["name"]`, `r.get("name")`), `model_dump()`."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    def __getitem__(self, key: str) -> Any:
        try:
            return getattr(self, key)
        except AttributeError as exc:
            raise KeyError(key) from exc

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self.__dict__

    def model_dump(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items())
        return f"{type(self).__name__}({inner})"
