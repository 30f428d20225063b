"""What the bench scripts share: /proc scans by marker, scratch space on
tmpfs, the CLI's argv, and the small figures-and-tables helpers."""

from __future__ import annotations

import math
import os
import shutil
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path


def read_cmdline(pid: int) -> list[bytes] | None:
    """argv of a live process; None when it is gone (or a zombie: empty)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw.rstrip(b"\0").split(b"\0") if raw else None


def marker_processes(marker: bytes) -> dict[int, list[bytes]]:
    """Every process whose cmdline contains `marker`, with its argv."""
    me = os.getpid()
    found: dict[int, list[bytes]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        argv = read_cmdline(int(name))
        if argv is not None and any(marker in arg for arg in argv):
            found[int(name)] = argv
    return found


def scratch_parent() -> str | None:
    """/dev/shm when writable (files on tmpfs), else the default temp folder."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None


def cli_argv() -> list[str]:
    """The project's console script beside this interpreter (the venv's)."""
    beside = Path(sys.executable).with_name("substrax-compute")
    if beside.is_file():
        return [str(beside)]
    found = shutil.which("substrax-compute")
    return [found] if found else [sys.executable, "-m", "substrax_tasks.cli.main"]


def doit_argv() -> list[str]:
    """The venv's doit (beside this interpreter)."""
    beside = Path(sys.executable).with_name("doit")
    return [str(beside)] if beside.is_file() else [sys.executable, "-m", "doit"]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def fmt_s(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.3f}"


def load_average() -> str:
    """Other work on the machine shows in the figures: say how busy it was."""
    one, five, _fifteen = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min)"


def smoke_verdict(script: str, figures: Mapping[str, float]) -> int:
    """What a `--smoke` run checks of itself: it ended with every figure
    measured (a finite number above zero), not only without an exception.
    Says which were not and returns the exit status (0: sane)."""
    if not figures:
        print(f"{script} --smoke: FAILED: no figure was measured", file=sys.stderr)
        return 1
    bad = [name for name, value in figures.items() if not (math.isfinite(value) and value > 0)]
    if bad:
        print(f"{script} --smoke: FAILED: not measured: {', '.join(bad)}", file=sys.stderr)
        return 1
    print(f"{script} --smoke: ok, {len(figures)} figures measured")
    return 0
