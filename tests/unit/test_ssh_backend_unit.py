"""The unit half of tests/integration/ssh/test_ssh_backend.py: the same subject, the
tests that start no process and open no connection (see its docstring)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from substrax_tasks.backends.ssh.settings import SshSettings

# ------------------------------------------------------------------ settings


@pytest.mark.unit
def test_host_string_is_split_into_user_host_and_port() -> None:
    settings = SshSettings.model_validate({"host": "ada@gpu-box.example:2222"})
    assert (settings.user, settings.host, settings.port) == ("ada", "gpu-box.example", 2222)
    same = SshSettings.model_validate({"host": "ada@gpu-box.example:2222", "user": "ada", "port": 2222})
    assert (same.user, same.host, same.port) == ("ada", "gpu-box.example", 2222)
    for conflict, needle in (({"user": "bob"}, "names user 'ada' but user = 'bob'"),
                             ({"port": 22}, "names port 2222 but port = 22")):  # fmt: skip
        with pytest.raises(ValidationError, match=needle):
            SshSettings.model_validate({"host": "ada@gpu-box.example:2222", **conflict})
    plain = SshSettings.model_validate({"host": "gpu-box", "copy": {"network_isolation": True}})
    assert (plain.user, plain.port, plain.copy_.network_isolation) == (None, 22, True)


@pytest.mark.unit
def test_relative_key_paths_are_pinned_absolute(tmp_path: Path) -> None:
    settings = SshSettings.model_validate({"host": "h", "identity_file": "keys/id", "known_hosts": "kh"})
    pinned = settings.with_absolute_paths(tmp_path)
    assert pinned.identity_file == str(tmp_path.resolve() / "keys" / "id")
    assert pinned.known_hosts == str(tmp_path.resolve() / "kh")


# ----------------------------------------------------------------- cancel


# --------------------------------------------------------------- progress


