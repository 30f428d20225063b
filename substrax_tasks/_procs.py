"""Local process checks that survive pid reuse."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def start_ticks(pid: int) -> int | None:
    """A process's start time in clock ticks since boot, or None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes().decode(errors="replace")
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()
    if fields[0] == "Z":
        return None  # a zombie has finished; only its parent's wait is left
    return int(fields[19])


def same_process_alive(pid: int | None, ticks: int | None) -> bool:
    """True when `pid` is still the process that had start time `ticks`."""
    return pid is not None and ticks is not None and start_ticks(pid) == ticks


def signal_if_same(pid: int | None, ticks: int | None, sig: signal.Signals, group: bool = False) -> bool:
    if not same_process_alive(pid, ticks):
        return False
    assert pid is not None
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True
