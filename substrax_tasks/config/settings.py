"""The validated `[tool.substrax.compute]` table: the default backend, the
cache, and each backend's table (validated by the backend's own settings
model, found in backends/registry.py).

pydantic models that forbid unknown keys and coerce nothing: TOML has real
types, so "yes" for a bool or "5" for a number is a mistake to report. Every
error names the key path, the bad value and what would be valid. config.py
imports this module only when it has to validate.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, PrivateAttr, ValidationError, field_validator

from substrax_tasks.backends.registry import BACKEND_NAMES, settings_model
from substrax_tasks.backends.settings import BackendSettings, Strict, bytes_of
from substrax_tasks.constants import BACKEND_ENV, TABLE
from substrax_tasks.errors import ConfigError


class CacheSettings(Strict):
    """`[tool.substrax.compute.cache]`: the cache of verified runs (docs/cache.md)."""

    enabled: bool = Field(True, description="Restore steps from the cache and keep what they make.")
    path: str | None = Field(None, description="The local folder (default: $XDG_CACHE_HOME/substrax-tasks).")
    max_size: int | str = Field("20GiB", description='Bytes, or "500MiB", "20GiB": oldest entries go first.')
    shared: str | None = Field(None, description='A team\'s store: "s3://bucket/prefix", "file:///...".')
    mode: Literal["read", "readwrite"] = Field("read", description="readwrite: runs are kept there too.")
    allowed_signers: str | None = Field(None, description="Restore only entries of `shared` signed by these.")
    signing_key: str | None = Field(None, description="An SSH private key that signs the entries written.")
    key_backend: bool = Field(False, description="Make the backend and its settings part of the key.")

    @field_validator("max_size")
    @classmethod
    def _size(cls, value: int | str) -> int | str:
        bytes_of(value)
        return value

    @field_validator("shared")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and "://" not in value:
            raise ValueError(f"{value!r} is not a store URL: write s3://bucket/prefix or file:///folder")
        return value

    def options(self) -> dict[str, Any]:
        """As `cache.CacheOptions` takes them (and the project keeps them)."""
        return {**self.model_dump(exclude={"max_size"}), "max_bytes": bytes_of(self.max_size)}


class ComputeConfig(Strict):
    """The validated `[tool.substrax.compute]` table."""

    default_backend: str = Field("local", description="Backend of steps that name none.")
    state_dir: str = Field(".substrax", description="Folder of run handles, relative to the project.")
    backends: dict[str, dict[str, Any]] = Field(default_factory=dict)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    # backend name -> pinned settings: `validate` checks every backend, and
    # the project's resolution then pins them without validating twice
    _pinned: dict[str, dict[str, Any]] = PrivateAttr(default_factory=dict)

    def state_path(self, project: Path) -> Path:
        return (project / self.state_dir).resolve()

    def backend_settings(self, name: str, project: Path) -> BackendSettings:
        """The validated settings of backend `name`, paths made absolute."""
        model = settings_model(name)
        try:
            settings = model.model_validate(self.backends.get(name, {}))
        except ValidationError as exc:
            raise ConfigError(format_errors(exc, f"{TABLE}.backends.{name}", model)) from None
        return settings.with_absolute_paths(project)

    def pinned(self, name: str, project: Path) -> dict[str, Any]:
        """Backend `name`'s settings as a handle pins them (and a step's key holds them)."""
        check_backend_name(name, "backend")
        if name not in self._pinned:
            self._pinned[name] = self.backend_settings(name, project).model_dump(mode="json", by_alias=True)
        return self._pinned[name]


def validate(table: dict[str, Any], project: Path, backend_override: str | None) -> ComputeConfig:
    """The whole table validated, every backend's too, before anything runs."""
    try:
        config = ComputeConfig.model_validate(table)
    except ValidationError as exc:
        raise ConfigError(format_errors(exc, TABLE, ComputeConfig)) from None
    where = f"{TABLE}.default_backend"
    if backend_override:
        config, where = config.model_copy(update={"default_backend": backend_override}), BACKEND_ENV
    check_backend_name(config.default_backend, where)
    for name in config.backends:
        if name not in BACKEND_NAMES:
            raise ConfigError(
                f"pyproject.toml: unknown backend table [{TABLE}.backends.{name}]; "
                f"valid backends: {', '.join(BACKEND_NAMES)}"
            )
        config.pinned(name, project)
    return config


def check_backend_name(name: str, where: str) -> None:
    if name not in BACKEND_NAMES:
        raise ConfigError(f"{where} = {name!r} is not a backend; valid choices: {', '.join(BACKEND_NAMES)}")


def format_errors(exc: ValidationError, table: str, model: type[BaseModel]) -> str:
    """One message for every problem, each with key path, value and fix."""
    lines = [f"pyproject.toml: invalid configuration in [{table}]:"]
    for error in exc.errors():
        loc = [str(part) for part in error["loc"]]
        key = ".".join(loc)
        if error["type"] == "extra_forbidden":
            valid = _valid_keys(model, loc[:-1])
            lines.append(
                f"  - unknown key '{loc[-1]}' in [{'.'.join([table, *loc[:-1]])}]"
                + (f"; valid keys: {', '.join(valid)}" if valid else "")
            )
        else:
            value = error.get("input")
            shown = "a table" if isinstance(value, dict) else repr(value)
            lines.append(f"  - {f'{table}.{key}' if key else table} = {shown}: {error['msg']}")
    return "\n".join(lines)


def _valid_keys(model: type[BaseModel], loc: list[str]) -> list[str]:
    """The keys allowed at `loc` inside `model` (walking nested tables)."""
    current: type[BaseModel] = model
    for part in loc:
        field = next((f for n, f in current.model_fields.items() if part in (n, f.alias)), None)
        annotation = field.annotation if field is not None else None
        # an optional table (`Model | None`) lists the keys of its model
        candidates = (annotation, *typing.get_args(annotation))
        table = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if table is None:
            return []
        current = table
    return sorted(field.alias or name for name, field in current.model_fields.items())
