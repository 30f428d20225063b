"""Waiting for a descriptor to be readable, whatever its number.

`select.select` refuses descriptors past FD_SETSIZE (1,024) with "filedescriptor
out of range in select()": a doit of thousands of steps, or one run with a low
soft limit raised, opens descriptors that high. `poll` has no such bound.
"""

from __future__ import annotations

import math
import select
from typing import Protocol


class HasFileno(Protocol):
    def fileno(self) -> int: ...


def wait_readable(source: int | HasFileno, seconds: float) -> bool:
    """Whether `source` became readable (data, end of file, a pidfd's exit)
    within `seconds`."""
    poller = select.poll()
    poller.register(source, select.POLLIN)
    return bool(poller.poll(max(0, math.ceil(seconds * 1000))))
