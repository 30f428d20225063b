"""`[tool.substrax.compute.backends.ssh]`: the ssh backend's settings."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field, model_validator

from substrax_tasks.backends.settings import (
    MAX_PARALLEL_HELP,
    HideGpus,
    LifetimeMinutes,
    NetworkIsolation,
    RemoteSettings,
    Strict,
)

if TYPE_CHECKING:
    from typing_extensions import Self  # typing's own from Python 3.11

    from substrax_tasks.transports.openssh import SshTarget


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
        from substrax_tasks.transports.openssh import SshTarget  # paramiko: not to read a configuration

        return SshTarget(
            host=self.host,
            port=self.port,
            user=self.user,
            identity_file=self.identity_file,
            known_hosts=str(Path(self.known_hosts).expanduser()),
            trust_new_host_key=self.trust_new_host_key,
            connect_timeout=self.connect_timeout,
        )
