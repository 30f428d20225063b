"""Two doit processes on one SSH host share ssh's multiplexing master
(issue 18, item 8): the teardown of one (`ssh -O exit`) must not cut the
other's fetch. A real sshd in a network namespace, real rsync: the fetch
runs in a process of its own, held on the host by the user's ~/.ssh/rc
while this process tears down as a second doit would.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from dodo_helpers import wait_for
from local_runs import marked_pids
from ssh_helpers import held_sessions, needs_root, needs_sshd
from testbeds.sshd_host import SshHost

from substrax_tasks.transports.openssh import SshTarget

FETCH = """
import json, sys
from pathlib import Path
from substrax_tasks.transports.openssh import SshTarget
from substrax_tasks.transports.rsync import RsyncTransport
target = SshTarget(**json.loads(sys.argv[1]))
RsyncTransport(target, show_progress=False).download(sys.argv[2], ["a.txt"], Path(sys.argv[3]))
"""


@needs_sshd
@needs_root
def test_a_teardown_in_another_process_leaves_a_fetch_on_the_shared_master_alone(
    tmp_path: Path, host: SshHost
) -> None:
    target = SshTarget(
        host=host.address, port=host.port, user=host.user,
        identity_file=str(host.client_key), known_hosts=str(host.known_hosts),
    )  # fmt: skip
    source = host.scratch / "shared"
    source.mkdir()
    (source / "a.txt").write_text("payload\n")
    # sshd runs ~/.ssh/rc before each session's command: it holds the
    # fetch's session on the host until the hold file goes.
    rc = host.remote_home / ".ssh" / "rc"
    rc.parent.mkdir(exist_ok=True)
    hold = host.scratch / "hold"  # where the host user can see it
    hold.touch()
    rc.write_text(f"while [ -e {hold} ]; do sleep 0.05; done\n")
    fetch = subprocess.Popen(
        [sys.executable, "-c", FETCH, json.dumps(dataclasses.asdict(target)), str(source),
         str(tmp_path / "got")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for(lambda: held_sessions(host), "the fetch's session to be held on the host")
        target.stop_master()  # the other doit's teardown, while this fetch goes on
        hold.unlink()
        err = fetch.communicate(timeout=60)[1]
    finally:
        hold.unlink(missing_ok=True)
        if fetch.poll() is None:
            fetch.kill()
            fetch.communicate()
        rc.unlink()
    assert fetch.returncode == 0, err
    assert "had died" not in err, err  # not cut and copied again: never cut
    assert (tmp_path / "got" / "a.txt").read_text() == "payload\n"
    target.stop_master()  # its last user gone, the teardown ends it
    wait_for(lambda: not marked_pids(Path(target.control_path()).name), "the master to exit")
