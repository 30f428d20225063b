"""Errors a user sees. Each message names the problem and the fix."""

from __future__ import annotations


def not_valid_toml(path: object, exc: BaseException) -> str:
    """What a TOML file that does not parse is told with, by the CLI and under doit."""
    return f"{path}: not valid TOML ({exc}); fix the file and run again"


class SubstraxError(Exception):
    """A failure the user can act on: the CLI prints it and exits 1."""


class ConfigError(SubstraxError):
    """The project's configuration is wrong; nothing was started."""


class SpecError(SubstraxError):
    """A step was declared wrongly; nothing was started."""


class HandleError(SubstraxError):
    """A run's handle cannot be read or used."""


class NoSuchRun(HandleError):
    """No run has this id, nor an id that starts with it."""


class RunFolderDeleted(HandleError):
    """The run's folder in the state folder was deleted while this client
    drove the run: nothing can record its end here any more."""


class BackendError(SubstraxError):
    """The backend could not do what was asked (start, reach, cancel a run)."""


class OutputsRefused(BackendError):
    """What a finished run left where it ran does not verify: its manifest
    is damaged, or its outputs changed after the manifest was taken.
    Nothing is promoted. A BackendError, so that `retries` fetch again; a
    run refused twice is given up (see _outputs_phases.fetch_outputs)."""


class HostRefused(SubstraxError):
    """What a host sent is refused (a run log that is no regular file): the
    run is recorded as failed and nothing it sent is used. Not a
    BackendError: no retry or "host unreachable" path may swallow it."""


class StartLater(SubstraxError):
    """The run cannot start yet (the GPUs it asks for are held by other
    runs): nothing was started, and starting it again later may succeed."""
