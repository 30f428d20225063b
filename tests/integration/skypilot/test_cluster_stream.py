"""`ClusterTarget.stream` (OpenSSH to a SkyPilot cluster, through the ssh
config SkyPilot writes) against a real sshd in a network namespace: the
contract of `_ssh.SshConnection.stream`, which the log follower relies on.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from dodo_helpers import wait_for
from local_runs import marked_pids
from ssh_helpers import needs_root, needs_sshd
from testbeds.sshd_host import SshHost

from substrax_tasks.transports.openssh import ClusterTarget

pytestmark = [needs_sshd, needs_root]


@pytest.fixture
def cluster(tmp_path: Path, host: SshHost) -> Iterator[ClusterTarget]:
    """The host as a cluster: an ssh config as SkyPilot writes one, with the host's known key."""
    config = tmp_path / "ssh-config"
    config.write_text(
        f"Host cluster\n  HostName {host.address}\n  Port {host.port}\n  User {host.user}\n"
        f"  IdentityFile {host.client_key}\n  IdentitiesOnly yes\n"
        f"  UserKnownHostsFile {host.known_hosts}\n  StrictHostKeyChecking yes\n"
    )
    target = ClusterTarget("cluster", config)
    yield target
    target.stop_master()


def test_stream_hands_stdout_on_and_returns_the_exit_code_and_stderr(cluster: ClusterTarget) -> None:
    chunks: list[bytes] = []
    ticks: list[None] = []
    script = "printf 'one\\n'; printf 'said\\n' >&2; printf 'two\\n'; exit 3"
    result = cluster.stream(["sh", "-c", script], chunks.append, lambda: ticks.append(None))
    assert b"".join(chunks) == b"one\ntwo\n"
    assert result.returncode == 3 and result.stdout == b""
    assert b"said" in result.stderr
    assert ticks


def test_an_exception_from_tick_closes_the_commands_stdin_there_and_reaps_the_ssh_here(
    cluster: ClusterTarget, marker: str
) -> None:
    """As Ctrl-C in a doit thread: the remote command (`cat`, which ends when
    its stdin closes, as the follower does) and the local ssh both go."""
    chunks: list[bytes] = []

    def tick() -> None:
        if b"started" in b"".join(chunks):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cluster.stream(["sh", "-c", "echo started; cat", marker], chunks.append, tick)
    # The marker is in the local ssh's argv and the remote shell's.
    wait_for(lambda: not marked_pids(marker), "the command there and the ssh here to end")
