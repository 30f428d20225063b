"""Backends by name, imported lazily so that naming one costs nothing.

The public views are read-only; each entry is "module:Class". A backend's
settings model is registered apart from its class, so that validating a
configuration imports no backend (nor paramiko).
"""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from substrax_tasks.backends.base import Backend
    from substrax_tasks.backends.settings import BackendSettings

REGISTRY = MappingProxyType(
    {
        "local": "substrax_tasks.backends.local.backend:LocalBackend",
        "ssh": "substrax_tasks.backends.ssh.backend:SshBackend",
        "skypilot": "substrax_tasks.backends.skypilot.backend:SkypilotBackend",
    }
)
SETTINGS = MappingProxyType(
    {
        "local": "substrax_tasks.backends.local.settings:LocalSettings",
        "ssh": "substrax_tasks.backends.ssh.settings:SshSettings",
        "skypilot": "substrax_tasks.backends.skypilot.settings:SkypilotSettings",
    }
)
BACKEND_NAMES = tuple(REGISTRY)


def _load(table: MappingProxyType[str, str], name: str) -> Any:
    try:
        target = table[name]
    except KeyError:
        raise KeyError(f"unknown backend {name!r}; valid choices: {', '.join(BACKEND_NAMES)}") from None
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def backend_class(name: str) -> type[Backend]:
    cls: type[Backend] = _load(REGISTRY, name)
    return cls


def settings_model(name: str) -> type[BackendSettings]:
    model: type[BackendSettings] = _load(SETTINGS, name)
    return model
