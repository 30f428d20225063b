"""The validated `[tool.substrax.compute]` table and each backend's settings.

pydantic models that forbid unknown keys and coerce nothing: TOML has real
types, so "yes" for a bool or "5" for a number is a mistake to report. Every
error names the key path, the bad value and what would be valid. config.py
imports this module only when it has to validate.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from substrax_tasks.backends import BACKEND_NAMES, settings_model
from substrax_tasks.config.pyproject import BACKEND_ENV, TABLE
from substrax_tasks.errors import ConfigError

if TYPE_CHECKING:
    from typing_extensions import Self  # typing's own from Python 3.11

    from substrax_tasks.backends.ssh.openssh import SshTarget

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


class LocalSettings(BackendSettings):
    """`[tool.substrax.compute.backends.local]`"""

    network_isolation: NetworkIsolation = False
    hide_gpus_when_unasked: HideGpus = False

    @property
    def network_isolated(self) -> bool:
        return self.network_isolation


class SshCopySettings(Strict):
    """`[tool.substrax.compute.backends.ssh.copy]`: the rsync transport."""

    network_isolation: NetworkIsolation = False
    excludes: list[str] = Field(default_factory=list, description="rsync patterns never uploaded.")


class SshSettings(RemoteSettings):
    """`[tool.substrax.compute.backends.ssh]`"""

    host: str = Field(description='Host name or address; "user@host:port" is split into its pieces.')
    port: int = Field(22, ge=1, le=65535)
    user: str | None = Field(None, description="Login name (default: yours).")
    identity_file: str | None = Field(None, description="Private key (default: ssh agent and ~/.ssh keys).")
    known_hosts: str = Field("~/.ssh/known_hosts", description="Where host keys are checked.")
    trust_new_host_key: bool = Field(False, description="Accept and save an unknown host key (first use).")
    lifetime_minutes: LifetimeMinutes = 120.0
    max_parallel: int | None = Field(4, ge=1, description=MAX_PARALLEL_HELP + " Counted per host.")
    keep_remote: bool = Field(False, description="Keep the remote run folder after teardown.")
    hide_gpus_when_unasked: HideGpus = False
    connect_timeout: float = Field(15.0, gt=0)
    copy_: SshCopySettings = Field(default_factory=SshCopySettings, alias="copy")

    @property
    def network_isolated(self) -> bool:
        return self.copy_.network_isolation

    @model_validator(mode="before")
    @classmethod
    def _split_host(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("host"), str):
            given: str = data["host"]
            host = given
            if "@" in host:
                user, host = host.split("@", 1)
                if data.get("user", user) != user:
                    raise ValueError(
                        f"host {given!r} names user {user!r} but user = {data['user']!r}; give one"
                    )
                data = {**data, "user": user}
            if host.count(":") == 1 and host.split(":")[1].isdigit():
                host, port_text = host.split(":")
                if data.get("port", int(port_text)) != int(port_text):
                    raise ValueError(
                        f"host {given!r} names port {port_text} but port = {data['port']!r}; give one"
                    )
                data = {**data, "port": int(port_text)}
            data = {**data, "host": host}
        return data

    def with_absolute_paths(self, project: Path) -> Self:
        def absolute(path: str | None) -> str | None:
            if path is None:
                return None
            expanded = Path(path).expanduser()
            return str(expanded if expanded.is_absolute() else (project / expanded).resolve())

        return self.model_copy(
            update={"identity_file": absolute(self.identity_file), "known_hosts": absolute(self.known_hosts)}
        )

    def target(self) -> SshTarget:
        from substrax_tasks.backends.ssh.openssh import SshTarget  # paramiko: not to read a configuration

        return SshTarget(
            host=self.host,
            port=self.port,
            user=self.user,
            identity_file=self.identity_file,
            known_hosts=str(Path(self.known_hosts).expanduser()),
            trust_new_host_key=self.trust_new_host_key,
            connect_timeout=self.connect_timeout,
        )


_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


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
        cls.bytes_of(value)
        return value

    @field_validator("shared")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and "://" not in value:
            raise ValueError(f"{value!r} is not a store URL: write s3://bucket/prefix or file:///folder")
        return value

    @staticmethod
    def bytes_of(value: int | str) -> int:
        if isinstance(value, int):
            return value
        text = value.strip().lower().removesuffix("b").removesuffix("i")
        number, unit = (text[:-1], text[-1]) if text[-1:] in _SIZE_UNITS else (text, "")
        try:
            return int(float(number) * _SIZE_UNITS[unit])
        except ValueError:
            raise ValueError(f'{value!r} is not a size: write bytes, or as "500MiB", "20GiB"') from None

    def options(self) -> dict[str, Any]:
        """As `cache.CacheOptions` takes them (and the project keeps them)."""
        return {**self.model_dump(exclude={"max_size"}), "max_bytes": self.bytes_of(self.max_size)}


class ComputeConfig(Strict):
    """The validated `[tool.substrax.compute]` table."""

    default_backend: str = Field("local", description="Backend of steps that name none.")
    state_dir: str = Field(".substrax", description="Folder of run handles, relative to the project.")
    backends: dict[str, dict[str, Any]] = Field(default_factory=dict)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    # backend name -> pinned settings: `validate` checks every backend, and
    # the project's resolution then pins them without validating twice
    _pinned: dict[str, dict[str, Any]] = {}  # a private attribute: copied per instance

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
