"""A backend's part of the run handle (`RunHandle.backend_state`).

The core carries it and reads nothing of it; each backend declares what it
keeps there as a model (`Backend.State`), reads it through `State.of(handle)`
and writes it through `Backend.save_state` (RunStore.update_backend_state),
so a key the model does not declare is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from typing_extensions import Self

    from substrax_tasks.store.handle import RunHandle


class BackendState(BaseModel):
    """What a backend records of a run; a backend that records nothing
    uses it as is."""

    model_config = ConfigDict(extra="forbid")

    @classmethod
    def of(cls, handle: RunHandle) -> Self:
        return cls.model_validate(handle.backend_state)


class RemoteState(BackendState):
    """What backends that run elsewhere share, and remote_run.py reads."""

    watchdog: dict[str, Any] | None = None  # the lifetime timer armed there: {"armed_at", "seconds"}
    torn_down: bool = False  # teardown done: the run holds nothing there any more
    final_status: dict[str, Any] | None = None  # the RunStatus it ended with, kept once final
