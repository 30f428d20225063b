"""The tests' side of the fake SkyPilot (tests/support/fakesky/sky): the environment
its processes get, and stopping every process it started under a HOME.

The fake is never imported here (its `sky` would shadow nothing, but the
rule is that `sky` stays out of the test process): `cleanup` runs
`python -m sky cleanup STATE`, which stops by pid every request, job and
autostop timer recorded under HOME/.fakesky, and every process still
carrying one of its clusters' FAKESKY_CLUSTER_ID markers. `leftovers` then
checks /proc on its own. Not collected by pytest (no test_ prefix).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

FAKESKY = Path(__file__).resolve().parent / "fakesky"  # the folder holding the fake `sky` package
MARKER = "FAKESKY_CLUSTER_ID"


def fakesky_env(home: Path, **extra: str) -> dict[str, str]:
    """A whole environment for the helper and the fake: HOME, PATH, the
    fake on PYTHONPATH; nothing of this machine's SkyPilot or clouds."""
    tmp = home / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env = {
        "HOME": str(home),
        "TMPDIR": str(tmp),
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "PYTHONPATH": str(FAKESKY),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    env.update(extra)
    return env


def state_dir(home: Path) -> Path:
    return home / ".fakesky"


def cleanup(home: Path) -> list[str]:
    """Stop everything the fake started under `home`, by pid; what it stopped."""
    if not state_dir(home).exists():
        return []
    done = subprocess.run(
        [sys.executable, "-m", "sky", "cleanup", str(state_dir(home))],
        env=fakesky_env(home), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"fakesky cleanup failed: {done.stderr.strip()}")
    stopped: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return stopped


def _live(pid: str) -> bool:
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return raw[raw.rfind(")") + 2 :].split()[0] not in ("Z", "X")


def leftovers(home: Path) -> list[int]:
    """Live processes of the fake under `home`: its state folder in their
    argv (requests, jobs, timers), or one of its cluster markers in their
    environment (what jobs started)."""
    state = str(state_dir(home)).encode()
    ids_file = state_dir(home) / "cluster-ids"
    markers = {f"{MARKER}={i}".encode() for i in ids_file.read_text().split()} if ids_file.exists() else set()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            environ = set(Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if (state in cmdline.split(b"\0") or markers & environ) and _live(entry):
            found.append(int(entry))
    return found


def kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
