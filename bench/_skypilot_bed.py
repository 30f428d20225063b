"""What the SkyPilot benches on the Slurm test bed share: a project of
remote steps on the bed, the environment its doit runs in, and the times
SkyPilot runs record."""

from __future__ import annotations

import datetime
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "support"))

from testbeds.slurm_cluster import SlurmBed  # noqa: E402


def bed_folder_ready(bed: Path) -> None:
    """The folder the bed lives in, made and opened to the cluster's user
    (mode 755: it lives under it). Never a shared folder such as /tmp
    itself: opening that would take away its sticky bit and let every user
    write in it. Exits with a usage error naming the fix instead."""
    parent = bed.resolve().parent
    if parent.exists() and (parent.stat().st_mode & 0o1002 or parent == Path("/tmp")):
        raise SystemExit(
            f"--bed {bed}: its folder {parent} is shared with other users (world-writable or sticky); "
            f"give the bed a folder of its own, e.g. --bed {parent / 'sxt-bench' / bed.name}"
        )
    parent.mkdir(parents=True, exist_ok=True)
    parent.chmod(0o755)


def sky_project(
    base: Path, bed: SlurmBed, prefix: str, reuse: bool, *, dodo: str, idle_minutes: int,
    files: dict[str, str] | None = None,
) -> Path:  # fmt: skip
    """A project in `base/prefix` whose steps (`dodo`) run on the bed:
    copy transport, bubblewrap, one cluster at a time, the run cache off
    (each doit runs its steps)."""
    root = base / prefix
    root.mkdir(parents=True)
    settings: dict[str, Any] = {
        "infra": bed.infra, "cpus": 1, "sky_python": str(bed.sky_python), "cluster_prefix": prefix,
        "sandbox": "bwrap", "idle_minutes": idle_minutes, "poll_seconds": 2, "reuse": reuse,
        "max_parallel": 1,
    }  # fmt: skip
    lines = ["[tool.substrax.compute]", 'default_backend = "skypilot"', "",
             "[tool.substrax.compute.backends.skypilot]"]  # fmt: skip
    lines += [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
    lines += ["", "[tool.substrax.compute.backends.skypilot.copy]", "lifetime_minutes = 30"]
    lines += ["", "[tool.substrax.compute.cache]", "enabled = false"]
    (root / "pyproject.toml").write_text("\n".join(lines) + "\n")
    (root / "dodo.py").write_text(textwrap.dedent(dodo))
    for name, text in (files or {}).items():
        (root / name).write_text(text)
    return root


def env_for(bed: SlurmBed, src: Path | None) -> dict[str, str]:
    """The bed's SkyPilot environment, this venv's tools first; `src`: the
    substrax_tasks to run instead of this tree's (an A/B of two versions)."""
    env = bed.sky_env()
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    if src is not None:
        env["PYTHONPATH"] = str(src)
    return env


def parse(stamp: str) -> float:
    """An ISO time a handle or status records, as a POSIX timestamp."""
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
