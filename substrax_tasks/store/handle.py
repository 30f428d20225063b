"""The handle: the durable record of one run.

Everything needed to reach the run again, from the handle alone: the spec,
the backend's validated settings (paths absolute), the backend's state.
Where it lives and how it is written: store.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from substrax_tasks.errors import HandleError
from substrax_tasks.step.spec import StepSpec

HANDLE_VERSION = 2


class RunHandle(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = HANDLE_VERSION
    run_id: str
    step: str
    backend: str
    settings: dict[str, Any]
    spec: StepSpec
    spec_digest: str
    created_at: str
    state: dict[str, Any] = {}


def read_handle(path: Path) -> RunHandle:
    """Read one handle; refuse any other version with what to do about it."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HandleError(f"{path}: no such run handle") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HandleError(
            f"{path}: unreadable handle ({exc}); the file is damaged: "
            f"remove {path.parent} to forget this run"
        ) from None
    version = data.get("version") if isinstance(data, dict) else None
    if version != HANDLE_VERSION:
        raise HandleError(
            f"{path}: handle version {version!r} cannot be used by this release "
            f"(it reads version {HANDLE_VERSION}); reach that run with the release "
            f"that made it, or remove {path.parent} to forget it"
        )
    try:
        return RunHandle.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise HandleError(
            f"{path}: damaged handle ({'.'.join(map(str, first['loc']))}: {first['msg']}); "
            f"remove {path.parent} to forget this run"
        ) from None

