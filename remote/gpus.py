#!/usr/bin/env python3
"""The GPUs of the machine that runs a step, and which of them a run holds.

Stdlib only, Python 3.8+; shipped beside worker.py, and loaded into the
client by the local backend. `python3 gpus.py` prints the machine's GPUs as
JSON (the ssh backend asks the host so at launch).

A run holds a GPU by an exclusive flock on `<lock dir>/gpu-<id>.lock`,
taken by its worker before the command starts and kept until the worker
exits: the kernel drops it when the run ends however it ends, and a killed
client holds nothing.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

NVIDIA_GPUS = "/proc/driver/nvidia/gpus"  # one folder per GPU, named by its PCI bus id
SMI_SECONDS = 60
# `nvidia-smi -L`: "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-...)"
SMI_LINE = re.compile(r"GPU (\d+): (.*?)(?: \(UUID: [^)]*\))?$")
# `rocm-smi --showproductname`: "GPU[0]		: Card series:		Instinct MI210"
ROCM_LINE = re.compile(r"GPU\[(\d+)\]\s*:\s*(.*)$")
# What each vendor's runtime reads to choose the GPUs a process sees.
VISIBLE = {"cuda": "CUDA_VISIBLE_DEVICES", "hip": "HIP_VISIBLE_DEVICES"}

Gpus = Dict[str, Any]  # {"kind": "cuda" | "hip" | None, "devices": [{"id": "0", "name": ...}], "source": ...}


def _listed(argv: List[str], line: "re.Pattern[str]") -> List[Dict[str, str]]:
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, timeout=SMI_SECONDS)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if done.returncode != 0:
        return []
    found: Dict[str, str] = {}
    for text in done.stdout.decode(errors="replace").splitlines():
        match = line.match(text.strip())
        if match:
            found.setdefault(match.group(1), match.group(2).strip())
    return [{"id": gpu, "name": name} for gpu, name in sorted(found.items(), key=lambda kv: int(kv[0]))]


def _proc_nvidia(folder: str) -> List[Dict[str, str]]:
    """The driver's own list, when nvidia-smi is missing or broken; in PCI
    bus order, the order nvidia-smi numbers them in."""
    try:
        buses = sorted(os.listdir(folder))
    except OSError:
        return []
    devices = []
    for index, bus in enumerate(buses):
        name = bus
        try:
            with open(os.path.join(folder, bus, "information")) as info:
                for text in info:
                    if text.startswith("Model:"):
                        name = text.split(":", 1)[1].strip()
        except OSError:
            pass
        devices.append({"id": str(index), "name": name})
    return devices


def host_gpus(path: Optional[str] = None, proc_folder: str = NVIDIA_GPUS) -> Gpus:
    """This machine's GPUs: NVIDIA's (`nvidia-smi -L`, else the driver's
    /proc folder), else AMD's (`rocm-smi`). `path`: the PATH to find the
    tools on (default: this process's)."""
    smi = shutil.which("nvidia-smi", path=path)
    if smi is not None:
        devices = _listed([smi, "-L"], SMI_LINE)
        if devices:
            return {"kind": "cuda", "devices": devices, "source": smi + " -L"}
    devices = _proc_nvidia(proc_folder)
    if devices:
        return {"kind": "cuda", "devices": devices, "source": proc_folder}
    rocm = shutil.which("rocm-smi", path=path)
    if rocm is not None:
        devices = _listed([rocm, "--showproductname"], ROCM_LINE)
        if devices:
            return {"kind": "hip", "devices": devices, "source": rocm + " --showproductname"}
    return {"kind": None, "devices": [], "source": None}


def claim(lock_dir: str, ids: List[str], count: int, holder: str = "",
          still_held: Callable[[str], bool] = lambda _holder: False,
          ) -> Optional[Tuple[List[str], List[int]]]:
    """Take `count` of the GPUs `ids` that no other run holds: (their ids,
    the open lock files, to keep open while the run lasts); None, holding
    nothing, when fewer are free. Each lock file names its last holder (the
    worker's run folder): a lock its worker no longer holds (killed) is
    still held while `still_held(that holder)`, which says whether the
    processes its command left are alive."""
    os.makedirs(lock_dir, mode=0o700, exist_ok=True)
    taken: List[str] = []
    fds: List[int] = []
    for gpu in ids:
        if len(taken) == count:
            break
        fd = os.open(os.path.join(lock_dir, "gpu-%s.lock" % gpu), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                continue
            raise
        last = os.pread(fd, 4096, 0).decode(errors="replace")
        if last and still_held(last):
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode(), 0)
        taken.append(gpu)
        fds.append(fd)
    if len(taken) < count:
        for fd in fds:
            os.close(fd)
        return None
    return taken, fds


def visible_env(kind: Optional[str], ids: List[str]) -> Dict[str, str]:
    """The variables that show a task only the GPUs `ids` (none: no GPU).
    CUDA numbers GPUs fastest first unless told PCI_BUS_ID, the order of
    nvidia-smi's numbers used here. Without a known kind, both vendors'."""
    shown = ",".join(ids)
    if kind == "cuda":
        return {"CUDA_VISIBLE_DEVICES": shown, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    if kind == "hip":
        return {"HIP_VISIBLE_DEVICES": shown}
    return {name: shown for name in VISIBLE.values()}


def main() -> int:
    sys.stdout.write(json.dumps(host_gpus()) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
