"""The end-to-end tier: SkyPilot against a real one-node Slurm cluster on
this machine (tests/support/testbeds/slurm_cluster.py), through substrax's own
SkyPilot helper.

It runs with `make test-e2e`, which brings the bed up in SUBSTRAX_E2E_BED,
runs `pytest tests/e2e` and brings the bed down again even on failure; or by
hand with `SUBSTRAX_E2E=1 pytest tests/e2e`, when the session fixture brings
a bed up in a fresh /tmp/sxt-e2e-* folder and always takes it down. Without
either variable the tier is skipped (plain `pytest` stays fast). It needs
root (daemons, a user, apt-get) and SkyPilot in .sky-venv (`make sky-venv`);
without them, or when a tool cannot be installed, it skips LOUDLY. A launch
that fails because PyPI cannot be reached (the cluster's first runtime
install downloads from it) says so.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from testbeds.slurm_cluster import (
    DEFAULT_SKY_VENV,
    SlurmBed,
    bed_down,
    bed_status,
    bed_up,
    ensure_packages,
    load_bed,
)
from testbeds.sshd_host import TestbedError

BED_VAR = "SUBSTRAX_E2E_BED"  # a bed folder the caller brings up and down (make test-e2e)
RUN_VAR = "SUBSTRAX_E2E"  # "1": this session brings its own bed up and down
SKY_VENV = Path(os.environ.get("SUBSTRAX_SKY_VENV", str(DEFAULT_SKY_VENV)))


@dataclasses.dataclass(frozen=True)
class ClusterUser:
    """The Slurm login user SkyPilot reaches over ssh."""

    name: str
    uid: int
    home: Path
    host: str
    ssh_port: int
    identity_file: Path


@dataclasses.dataclass(frozen=True)
class SlurmBedInfo:
    """What a test needs to run SkyPilot against the bed."""

    root: Path
    client_home: Path  # SkyPilot's HOME: ~/.slurm/config, ~/.sky
    env: dict[str, str]  # run SkyPilot (its python, `sky`, skypilot/helper/sky_sdk.py) with this
    sky_python: Path
    infra: str  # a task's resources.infra: "slurm/<alias>"
    stock_infra: str  # the same cluster through a login sshd with a stock AcceptEnv, SkyPilot's tmpdir set
    slurm_conf: Path  # SLURM_CONF for squeue/sinfo/scancel as root
    user: ClusterUser
    bed: SlurmBed
    up_seconds: float  # how long bringing the bed up took (0 when it was up already)


def _loud(config: pytest.Config, message: str) -> None:
    reporter: Any = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("")
        reporter.write_line(f"!!! {message}", red=True, bold=True)


def _note(config: pytest.Config, message: str) -> None:
    reporter: Any = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"[e2e] {message}")


def _skip_loudly(config: pytest.Config, why: str) -> None:
    message = f"END-TO-END TIER NOT RUN: {why}"
    _loud(config, message)
    pytest.skip(message)


def _info(bed: SlurmBed, up_seconds: float) -> SlurmBedInfo:
    return SlurmBedInfo(
        root=bed.root,
        client_home=bed.client_home,
        env=bed.sky_env(),
        sky_python=bed.sky_python,
        infra=bed.infra,
        stock_infra=bed.stock_infra,
        slurm_conf=bed.slurm_conf,
        user=ClusterUser(
            name=bed.user,
            uid=bed.uid,
            home=bed.home,
            host="127.0.0.1",
            ssh_port=bed.ssh_port,
            identity_file=bed.client_key,
        ),
        bed=bed,
        up_seconds=up_seconds,
    )


@pytest.fixture(scope="session")
def slurm_bed(request: pytest.FixtureRequest) -> Iterator[SlurmBedInfo]:
    """A running Slurm test bed for the whole session; taken down at the end
    when this session brought it up (also when a test failed)."""
    config = request.config
    given = os.environ.get(BED_VAR)
    if not given and os.environ.get(RUN_VAR) != "1":
        pytest.skip(f"the end-to-end tier runs with `make test-e2e` (or {RUN_VAR}=1 pytest tests/e2e)")
    if os.geteuid() != 0:
        _skip_loudly(config, "the Slurm test bed needs root (daemons, a throwaway user, apt-get)")
    if not (SKY_VENV / "bin" / "sky").exists():
        _skip_loudly(config, f"no SkyPilot in {SKY_VENV}: run `make sky-venv`")
    try:
        ensure_packages()
    except TestbedError as exc:
        _skip_loudly(config, f"the Slurm test bed's tools cannot be installed: {exc}")
    if given:
        root = Path(given)
        existing = load_bed(root)
        owned = existing is None or not bed_status(existing)["healthy"]
    else:
        root = Path(tempfile.mkdtemp(prefix="sxt-e2e-", dir="/tmp")) / "bed"
        root.parent.chmod(0o755)  # the cluster user lives under it
        owned = True
    started = time.monotonic()
    bed = bed_up(root, sky_venv=SKY_VENV)
    up_seconds = time.monotonic() - started if owned else 0.0
    try:
        yield _info(bed, up_seconds)
    finally:
        if owned:
            failed = request.session.testsfailed > 0
            stopping = time.monotonic()
            bed_down(root, keep_logs=failed)
            _note(config, f"Slurm test bed: up {up_seconds:.1f} s, down {time.monotonic() - stopping:.1f} s")
            if failed:
                _loud(config, f"the Slurm test bed's logs are kept in {root / 'logs'}")
            elif not given:
                shutil.rmtree(root.parent, ignore_errors=True)
