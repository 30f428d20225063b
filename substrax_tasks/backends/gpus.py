"""A step's `accelerators` on a machine that runs it as it is (local, ssh):
how many GPUs it asks for, checked against what the machine has before
anything runs, and what the worker is told to take (remote/gpus.py)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from substrax_tasks._remote import runfiles
from substrax_tasks.errors import StartLater, SubstraxError
from substrax_tasks.step.spec import StepSpec

# A GPU's name, as "A100" or "A100-80GB": SkyPilot's to match; on a
# machine of its own a step gets any of its GPUs.
GPU_NAME = re.compile(r"[A-Za-z0-9][\w.-]*")
WORKER_BUSY = 75  # remote/worker.py's exit when the GPUs it asks for are held by other runs


def requested(spec: StepSpec) -> int | None:
    """The number of GPUs the step asks for (None: it asks for none)."""
    value = spec.resources.get("accelerators")
    if value is None:
        return None
    text = str(value).strip()
    name, colon, number = text.rpartition(":")
    if isinstance(value, float):
        count = -1
    elif not colon:  # "2", or "A100": one
        count = int(text) if text.isdigit() else 1 if GPU_NAME.fullmatch(text) else -1
    else:
        count = int(number) if number.isdigit() and GPU_NAME.fullmatch(name) else -1
    if count < 1:
        raise SubstraxError(
            f"resources accelerators={value!r}: on this backend a step asks for a whole number of "
            'GPUs, 1 or more: write "2" or "A100:2" (a fraction or a set of choices is SkyPilot\'s)'
        )
    return count


def job_gpus(
    spec: StepSpec, hide_unasked: bool, host: Callable[[], dict[str, Any]], lock_dir: str, where: str
) -> runfiles.JobGpus | None:
    """The job's `gpus` entry; None leaves the task's GPUs as they are. A
    step asking for more GPUs than `host()` finds fails here, naming them."""
    count = requested(spec)
    if count is None:
        return {"count": 0, "kind": None, "ids": [], "lock_dir": lock_dir} if hide_unasked else None
    found = host()
    devices = found["devices"]
    if count > len(devices):
        has = (
            f"{len(devices)}: " + "; ".join(f"GPU {d['id']}: {d['name']}" for d in devices)
            + f" (from {found['source']})"
            if devices
            else "none (no nvidia-smi, /proc/driver/nvidia/gpus or rocm-smi there)"
        )
        raise SubstraxError(
            f"resources accelerators={spec.resources['accelerators']!r} asks for {count} GPU(s), but "
            f"{where} has {has}; ask for at most {len(devices)}, or run the step on a backend "
            "with more GPUs"
        )
    return {"count": count, "kind": found["kind"], "ids": [d["id"] for d in devices], "lock_dir": lock_dir}


def busy(gpus: runfiles.JobGpus, where: str) -> StartLater:
    """What a run is told while the GPUs it asks for are held by others."""
    return StartLater(
        f"{gpus['count']} of the {len(gpus['ids'])} GPU(s) of {where} must be free to start, "
        "and other runs hold them"
    )
