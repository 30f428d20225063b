"""What every backend's settings are made of: the contract of a backend's
`[tool.substrax.compute.backends.<name>]` table. Each backend's own model is
in its package (local/settings.py, ssh/settings.py, skypilot/settings.py).

pydantic models that forbid unknown keys and coerce nothing: TOML has real
types, so "yes" for a bool or "5" for a number is a mistake to report.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

if TYPE_CHECKING:
    from typing_extensions import Self  # typing's own from Python 3.11

# Fields some backends keep in a sub-table (a transport), so shared as types.
NetworkIsolation = Annotated[bool, Field(description="Run the command with no network.")]
# Local and ssh only: on SkyPilot a run's cluster and its GPUs are its own.
HideGpus = Annotated[
    bool,
    Field(description='Steps that ask for no accelerators see no GPU (CUDA_VISIBLE_DEVICES="").'),
]
LifetimeMinutes = Annotated[
    float, Field(gt=0, description="No run (or cluster) outlives this: it is stopped and removed.")
]
MAX_PARALLEL_HELP = "At most this many steps run at once (across every doit of the project); more wait."


_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def bytes_of(value: int | str) -> int:
    """A size given as bytes, or as "500MiB", "20GiB"."""
    if isinstance(value, int):
        return value
    text = value.strip().lower().removesuffix("b").removesuffix("i")
    number, unit = (text[:-1], text[-1]) if text[-1:] in _SIZE_UNITS else (text, "")
    try:
        return int(float(number) * _SIZE_UNITS[unit])
    except ValueError:
        raise ValueError(f'{value!r} is not a size: write bytes, or as "500MiB", "20GiB"') from None


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class BackendSettings(Strict):
    """What every backend's worker takes: the sandbox and how a run is stopped."""

    sandbox: Literal["auto", "bwrap", "none"] = Field(
        "auto",
        description="bwrap: always sandbox (error if bubblewrap is missing); auto: when "
        "bubblewrap is usable, noted in the run's log otherwise; none: no sandbox.",
    )
    grace_seconds: float = Field(
        5.0, gt=0, description="Time between SIGTERM and SIGKILL when a run is stopped."
    )
    pip_args: list[str] = Field(
        default_factory=list,
        description="Extra `pip install` arguments for the environment of a requirements lock, "
        'as ["--no-index", "--find-links", "wheels/"] (relative to the project).',
    )
    cache_dirs: list[str] = Field(
        default_factory=list,
        description="Folders of the sandbox's home kept across runs of the project, "
        'as "~/.cache/huggingface".',
    )
    max_parallel: int | None = Field(None, ge=1, description=MAX_PARALLEL_HELP + " Default: no limit.")
    keep_checkpoints: bool = Field(
        False, description="Keep a step's checkpoints once its outputs are promoted (default: removed)."
    )
    hourly_cost: float | None = Field(
        None, ge=0, allow_inf_nan=False,
        description="What a machine of this backend costs, in USD an hour: a run's cost is its machine "
        "time at this price. Overrides SkyPilot's catalog price; local: nothing unless set.",
    )
    max_cost: float | None = Field(
        None, gt=0, allow_inf_nan=False,
        description="The most one step may spend, in USD (all its machine time): the run is stopped when "
        "its cost reaches it. Needs a known price. remote_step(max_cost=...) overrides it.",
    )

    @field_validator("cache_dirs")
    @classmethod
    def _cache_dirs_in_home(cls, folders: list[str]) -> list[str]:
        """Each folder is "~/" and a plain relative path (no ".", "..", empty
        part), none twice or inside another; kept without a trailing "/"."""
        kept: list[str] = []
        for folder in folders:
            parts = folder.rstrip("/").split("/")
            if parts == ["~"]:
                raise ValueError(
                    "'~' is the whole home, which each run starts empty; name folders in it "
                    '(as "~/.cache/huggingface")'
                )
            if parts[0] != "~":
                raise ValueError(
                    f"{folder!r} is not under ~: give it as \"~/\" and a path "
                    '(as "~/.cache/huggingface"); ~ is the home the task sees in the sandbox'
                )
            if any(part in ("", ".", "..") for part in parts[1:]):
                raise ValueError(
                    f'{folder!r}: write the path without "", "." or ".." parts (as "~/.cache/huggingface")'
                )
            name = "/".join(parts)
            for other in kept:
                if name == other or name.startswith(other + "/") or other.startswith(name + "/"):
                    raise ValueError(f"{folder!r} overlaps {other!r}: keep one of them")
            kept.append(name)
        return kept

    @property
    def network_isolated(self) -> bool:
        """Whether the command runs with no network (each backend keeps the
        key in its own table)."""
        return False

    @model_validator(mode="after")
    def _isolation_needs_sandbox(self) -> BackendSettings:
        if self.network_isolated and self.sandbox == "none":
            raise ValueError(
                'network_isolation = true needs the sandbox, but sandbox = "none"; '
                'set sandbox = "auto" or "bwrap", or network_isolation = false'
            )
        return self

    def with_absolute_paths(self, project: Path) -> Self:
        """As pinned in a handle: the settings' own paths made absolute."""
        return self


class RemoteSettings(BackendSettings):
    """What a backend that runs on another machine adds (ssh, skypilot)."""

    remote_root: str = Field(".substrax-remote", description="Folder over there, relative to its home.")
    python: str = Field("python3", description="The machine's Python (3.8+) for the worker.")
    setup_commands: list[str] = Field(
        default_factory=list, description="Shell commands run before the environment is synced."
    )
    checkpoint_seconds: float = Field(
        300.0, gt=0, description="How often a step's checkpoints are brought home while it runs."
    )
    max_checkpoint_size: int = Field(
        20 << 30, gt=0,
        description='The most a snapshot of a step\'s checkpoints may take, in bytes or as "500MiB", '
        '"20GiB" (default 20GiB): a larger one is not brought home (nor put in the bucket), said '
        "in one line, and the last snapshot is kept.",
    )

    @field_validator("max_checkpoint_size", mode="before")
    @classmethod
    def _checkpoint_bytes(cls, value: object) -> object:
        return bytes_of(value) if isinstance(value, str) else value
