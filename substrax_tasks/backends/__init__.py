"""Backends by name, imported lazily so that naming one costs nothing.

The public view is read-only; each entry is "module:Class".
"""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import BaseModel

    from substrax_tasks.backends.base import Backend

REGISTRY = MappingProxyType(
    {
        "local": "substrax_tasks.backends.local:LocalBackend",
        "ssh": "substrax_tasks.backends.ssh:SshBackend",
        "skypilot": "substrax_tasks.backends.skypilot:SkypilotBackend",
    }
)
BACKEND_NAMES = tuple(REGISTRY)


def backend_class(name: str) -> type[Backend]:
    try:
        target = REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown backend {name!r}; valid choices: {', '.join(BACKEND_NAMES)}") from None
    module_name, _, class_name = target.partition(":")
    cls: type[Backend] = getattr(importlib.import_module(module_name), class_name)
    return cls


def settings_model(name: str) -> type[BaseModel]:
    return backend_class(name).Settings
