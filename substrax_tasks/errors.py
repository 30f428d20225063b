"""Errors a user sees. Each message names the problem and the fix."""

from __future__ import annotations


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


class BackendError(SubstraxError):
    """The backend could not do what was asked (start, reach, cancel a run)."""


class HostRefused(SubstraxError):
    """What a host sent is refused (a run log that is no regular file): the
    run is recorded as failed and nothing it sent is used. Not a
    BackendError: no retry or "host unreachable" path may swallow it."""
