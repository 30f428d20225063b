"""The kept proofs that steps are up to date: one small file per project.

A proof (uptodate.py) is a digest of what a step's check depends on, as seen
without reading a file. Once the full check found a step up to date, its
proof is kept here; the next `doit` computes the proof again and, if it is
the one kept, knows the answer without the full check.

The file is read once per process by the first step checked, and written at
exit when this process found new proofs (the hook is registered by the first
new proof, so only a doit that checked steps has one). It is only a cache: a
missing, damaged or stale file costs the full checks again, never a wrong
answer, since a proof counts only if it equals the one computed now. Two
doit processes of one project merge their proofs under an flock.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import threading
from pathlib import Path

from substrax_tasks.atomic import write_json_atomic

VERSION = 1

_FILES: dict[Path, ProofFile] = {}  # by path: one object per project for all its steps
_FILES_LOCK = threading.Lock()


class ProofFile:
    """The proofs of one project: step name -> proof (hex digest)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._proofs: dict[str, str] | None = None
        self._new: dict[str, str] = {}
        self._save_registered = False

    def _loaded(self) -> dict[str, str]:
        if self._proofs is None:
            self._proofs = _read(self.path)
        return self._proofs

    def holds(self, step: str, proof: str) -> bool:
        with self._lock:
            return self._loaded().get(step) == proof

    def record(self, step: str, proof: str) -> None:
        """Keep `proof` for `step`; written by `save`, at exit."""
        with self._lock:
            proofs = self._loaded()
            if proofs.get(step) == proof:
                return
            proofs[step] = proof
            self._new[step] = proof
            if not self._save_registered:
                self._save_registered = True
                atexit.register(self.save)

    def save(self) -> None:
        """Merge the new proofs into the file, under its flock. A folder
        that is gone (a test's project, removed) is left gone."""
        with self._lock:
            new, self._new = self._new, {}
        if not new:
            return
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(exist_ok=True, mode=0o700)
            lock_path = self.path.with_name(self.path.name + ".lock")
            lock = os.open(lock_path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released by the close
                proofs = {**_read(self.path), **new}
                write_json_atomic(self.path, {"version": VERSION, "proofs": proofs})
            finally:
                os.close(lock)


def _read(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != VERSION:
        return {}
    proofs = data.get("proofs")
    if not isinstance(proofs, dict):
        return {}
    return {k: v for k, v in proofs.items() if isinstance(k, str) and isinstance(v, str)}


def proof_file(path: Path) -> ProofFile:
    """The proof file at `path`, one object per process for all its steps."""
    with _FILES_LOCK:
        found = _FILES.get(path)
        if found is None:
            found = _FILES[path] = ProofFile(path)
        return found
