"""Environments built on an ssh host are collected (issue 39, item 6):
`gc --machines` removes an environment under remote_root that no run
folder there names (a run going or kept, of any client: they share the
folder) and none used for 7 days; `status --machines` lists it first.

A real sshd in a network namespace as a test user; real doit building real
venvs offline from a wheel folder; a second client sharing the remote_root
whose kept run folder names its environment. Days pass by setting the
environments' use stamps back, as a host's clock would have moved.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from dodo_helpers import compute, doit, show
from ssh_helpers import build_wheel, make_ssh_project, needs_sshd, one_step
from testbeds.sshd_host import SshHost

ENV_STEP = one_step(
    command=[
        "python3",
        "-c",
        "import sys, sxtiny; open('out/v.txt', 'w').write(sxtiny.VALUE + ' ' + sys.prefix)",
    ],
    inputs=["wheels/"],  # pip_args' wheel folder: uploaded as an input
    outputs=["out/"],
)
EIGHT_DAYS = 8 * 86400


def env_project(base: Path, host: SshHost, remote_root: Path, version: str, **settings: Any) -> Path:
    root = make_ssh_project(base, host, ENV_STEP, files={"requirements.txt": f"sxtiny=={version}\n"},
                            pip_args=["--no-index", "--find-links", "wheels"], remote_root=str(remote_root),
                            **settings)  # fmt: skip
    build_wheel(root / "wheels", "sxtiny", version, f'VALUE = "{version}"\n')
    return root


def built_env(root: Path) -> Path:
    """The environment the step's last run used (its sys.prefix)."""
    done = doit(root, timeout=300)  # a venv built on a loaded machine
    assert done.returncode == 0, show(done)
    return Path((root / "out" / "v.txt").read_text().split()[1])


def age(env: Path) -> None:
    """As if its last use was eight days ago."""
    then = time.time() - EIGHT_DAYS
    os.utime(f"{env}.used", (then, then))


@needs_sshd
@pytest.mark.timeout(900)  # four environments built on a loaded machine
def test_gc_machines_removes_the_environments_no_run_names_and_none_used_for_days(
    tmp_path: Path, host: SshHost
) -> None:
    remote_root = host.scratch / f"envs-{tmp_path.name}"
    root = env_project(tmp_path / "one", host, remote_root, "0.1")
    old = built_env(root)
    (root / "requirements.txt").write_text("sxtiny==0.2\n")  # a new lock: a new environment
    build_wheel(root / "wheels", "sxtiny", "0.2", 'VALUE = "0.2"\n')
    recent = built_env(root)
    # Another client on the same host and remote_root: its run folder is kept, naming its environment.
    other = env_project(tmp_path / "two", host, remote_root, "0.3", keep_remote=True)
    others = built_env(other)
    assert len({old, recent, others}) == 3 and all(
        p.parent == remote_root / "envs" for p in (old, recent, others)
    )
    age(old)
    age(others)

    listed = compute(root, "status", "--machines")
    said = f"unused environment {old} on {host.address}: no run folder there names it"
    assert said in listed.stderr, show(listed)
    assert str(recent) not in listed.stderr and str(others) not in listed.stderr, show(listed)
    leaked = json.loads(compute(root, "status", "--machines", "--json").stdout)["leaked"]
    assert leaked == [{"backend": "ssh", "where": host.address, "name": str(old), "ours": True,
                       "kind": "environment"}], leaked  # fmt: skip

    dry = compute(root, "gc", "--machines", "--dry-run")
    assert f"would remove {old} on {host.address}" in dry.stdout and old.is_dir(), show(dry)
    removed = compute(root, "gc", "--machines")
    assert removed.returncode == 0, show(removed)
    assert f"removed {old} on {host.address}" in removed.stdout, show(removed)
    assert not old.exists() and recent.is_dir() and others.is_dir(), show(removed)
    assert str(recent) not in removed.stdout and str(others) not in removed.stdout

    # The lock of the collected environment back: it is built again, and used.
    (root / "requirements.txt").write_text("sxtiny==0.1\n")
    assert built_env(root) == old and (old / "bin").is_dir()
    assert (root / "out" / "v.txt").read_text().split()[0] == "0.1"
