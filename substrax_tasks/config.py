"""`[tool.substrax.compute]` in the project's pyproject.toml.

Validated by pydantic models that forbid unknown keys; every error names the
key path, the bad value and what would be valid, before anything runs.
"""

from __future__ import annotations

import os
import sys
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from substrax_tasks.backends import BACKEND_NAMES, settings_model
from substrax_tasks.errors import ConfigError
from substrax_tasks.resolved import BACKEND_ENV, CONFIG_ENV

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

TABLE = "tool.substrax.compute"


class ComputeConfig(BaseModel):
    """The validated `[tool.substrax.compute]` table."""

    # strict: TOML has real types, so "yes" for a bool or "5" for a number is
    # a mistake to report, not a value to coerce.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    default_backend: str = Field("local", description="Backend of steps that name none.")
    state_dir: str = Field(".substrax", description="Folder of run handles, relative to the project.")
    backends: dict[str, dict[str, Any]] = Field(default_factory=dict)

    def state_path(self, project: Path) -> Path:
        return (project / self.state_dir).resolve()

    def backend_settings(self, name: str, project: Path) -> BaseModel:
        """The validated settings of backend `name`, paths made absolute."""
        model = settings_model(name)
        try:
            settings = model.model_validate(self.backends.get(name, {}))
        except ValidationError as exc:
            raise ConfigError(format_errors(exc, f"{TABLE}.backends.{name}", model)) from None
        absolutize = getattr(settings, "with_absolute_paths", None)
        return absolutize(project) if absolutize else settings


def _describe_value(value: Any) -> str:
    return repr(value) if not isinstance(value, dict) else "a table"


def format_errors(exc: ValidationError, table: str, model: type[BaseModel]) -> str:
    """One message for every problem, each with key path, value and fix."""
    lines = [f"pyproject.toml: invalid configuration in [{table}]:"]
    for error in exc.errors():
        loc = [str(part) for part in error["loc"]]
        key = ".".join(loc)
        where = f"{table}.{key}" if key else table
        if error["type"] == "extra_forbidden":
            parent_path = ".".join([table, *loc[:-1]])
            valid = _valid_keys(model, loc[:-1])
            lines.append(
                f"  - unknown key '{loc[-1]}' in [{parent_path}]"
                + (f"; valid keys: {', '.join(valid)}" if valid else "")
            )
        else:
            value = _describe_value(error.get("input"))
            lines.append(f"  - {where} = {value}: {error['msg']}")
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


def read_pyproject_table(project: Path) -> dict[str, Any]:
    table = read_table(project / "pyproject.toml")
    overlay = os.environ.get(CONFIG_ENV)
    if overlay:
        extra = Path(overlay)
        if not extra.is_file():
            raise ConfigError(f"{CONFIG_ENV}={overlay}: no such file; point it at a TOML file or unset it")
        table = merged(table, read_table(extra))
    return table


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` laid on `base`, table by table."""
    result = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merged(result[key], value)
        else:
            result[key] = value
    return result


def read_table(path: Path) -> dict[str, Any]:
    """`[tool.substrax.compute]` of one TOML file ({} when absent)."""
    if not path.is_file():
        return {}
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc}); fix the file and run again") from None
    table: Any = data
    for part in TABLE.split("."):
        table = table.get(part, {}) if isinstance(table, dict) else {}
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [{TABLE}] must be a table")
    return table


def load_config(project: Path) -> ComputeConfig:
    """Read and validate the project's configuration (embedded defaults when absent)."""
    raw = dict(read_pyproject_table(project))
    try:
        config = ComputeConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_errors(exc, TABLE, ComputeConfig)) from None
    override = os.environ.get(BACKEND_ENV)
    if override:
        config = config.model_copy(update={"default_backend": override})
    check_backend_name(config.default_backend, f"{TABLE}.default_backend" if not override else BACKEND_ENV)
    for name in config.backends:
        if name not in BACKEND_NAMES:
            raise ConfigError(
                f"pyproject.toml: unknown backend table [{TABLE}.backends.{name}]; "
                f"valid backends: {', '.join(BACKEND_NAMES)}"
            )
        config.backend_settings(name, project)  # validate every table now
    return config


def check_backend_name(name: str, where: str) -> None:
    if name not in BACKEND_NAMES:
        raise ConfigError(
            f"{where} = {name!r} is not a backend; valid choices: {', '.join(BACKEND_NAMES)}"
        )
