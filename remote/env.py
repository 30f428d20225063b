#!/usr/bin/env python3
"""The step's locked environment: one recipe for every backend.

Stdlib only, Python 3.8+. The local backend calls `ensure` in its own
process; ssh and skypilot run this file on their machine, where it prints
one JSON line ({} when the project has no lock file):

    python3 env.py PROJECT ENVS_DIR PYTHON [PIP_ARG ...]
    python3 env.py --collect ENVS_DIR RUNS_DIR DAYS [--dry-run | --only ENV_DIR]

The environment is built from the project's lock file (`uv.lock` -> `uv
sync --frozen`; a requirements lock -> a venv and `pip install -r`) into
ENVS_DIR/<digest>, and reused while the lock and how it is built stay the
same. The commands run from the project's folder, so relative paths in the
pip arguments (`--find-links wheels/`) and in the lock resolve as they do
for the user.

Each use stamps ENVS_DIR/<digest>.used. `--collect` removes the
environments no run folder under RUNS_DIR names (a run going, or one kept,
of any client: they share the folder) and none used for DAYS days, and
prints them as one JSON line. A use and a removal take the environment's
lock (shared, exclusive): an environment in use as it is collected is kept.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Union

PACKAGED = bool(__package__)
if PACKAGED:
    from . import manifest
else:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import manifest

LOCK_FILES = ("uv.lock", "requirements.lock", "requirements.txt")  # the first found is used
READY = ".substrax-ready"  # written last: a folder without it is a build that did not finish
USED = ".used"  # beside the folder: stamped (its mtime) at each use


class BuildFailed(Exception):
    """A command of the recipe failed; the message holds its output."""


def lock_file(project: str) -> Optional[str]:
    """The lock file the environment is built from, if any."""
    return next((name for name in LOCK_FILES if os.path.isfile(os.path.join(project, name))), None)


def digest(project: str, lock: str, python: str, pip_args: Sequence[str]) -> str:
    """Names an environment: reused while the lock and how it is built stay."""
    with open(os.path.join(project, lock), "rb") as f:
        content = f.read()
    recipe = json.dumps([python, list(pip_args)]).encode()
    return hashlib.sha256(content + recipe).hexdigest()[:16]


def build_steps(lock: str, env_dir: str, python: str, pip_args: Sequence[str]) -> List[List[str]]:
    if lock == "uv.lock":
        return [["env", "UV_PROJECT_ENVIRONMENT=" + env_dir, "uv", "sync", "--frozen", "--project", "."]]
    pip = [env_dir + "/bin/pip", "install", "--disable-pip-version-check", "-q", *pip_args, "-r", lock]
    return [[python, "-m", "venv", env_dir], pip]


def ensure(project: str, envs_dir: str, python: str,
           pip_args: Sequence[str]) -> Dict[str, Union[str, bool]]:
    """The environment's folder, lock and digest, and whether it was reused;
    {} without a lock file. Concurrent steps wait for one build (a lock
    file beside it); a build killed half-way is started afresh."""
    lock = lock_file(project)
    if lock is None:
        return {}
    name = digest(project, lock, python, pip_args)
    env_dir = os.path.join(os.path.abspath(envs_dir), name)
    answer: Dict[str, Union[str, bool]] = {"env_dir": env_dir, "lock": lock, "digest": name, "reused": True}
    os.makedirs(os.path.dirname(env_dir), mode=0o700, exist_ok=True)
    with open(env_dir + ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_SH)  # not collected while it is stamped used
        if os.path.isfile(os.path.join(env_dir, READY)):
            _stamp_used(env_dir)
            return answer
    with open(env_dir + ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if os.path.isfile(os.path.join(env_dir, READY)):  # built by the step we waited for
            _stamp_used(env_dir)
            return answer
        shutil.rmtree(env_dir, ignore_errors=True)
        for argv in build_steps(lock, env_dir, python, pip_args):
            try:
                code, out = _built(argv, project)
            except OSError as exc:
                raise BuildFailed("%s: %s" % (argv[0] if argv[0] != "env" else argv[2], exc)) from None
            if code != 0:
                said = out.decode(errors="replace").strip()[-2000:]
                raise BuildFailed("`%s` failed (exit %d): %s" % (" ".join(argv), code, said))
        open(os.path.join(env_dir, READY), "w").close()
        _stamp_used(env_dir)
    answer["reused"] = False
    return answer


def _stamp_used(env_dir: str) -> None:
    with open(env_dir + USED, "a"):
        pass
    os.utime(env_dir + USED)


def _last_used(env_dir: str) -> float:
    """When it was last used: its stamp, or (built before stamps) its folder's mtime."""
    for path in (env_dir + USED, env_dir):
        try:
            return os.stat(path).st_mtime
        except OSError:
            continue
    return 0.0


def _named_by_runs(runs_dir: str) -> List[str]:
    """The environments the jobs of the run folders there use (every
    client's: a run going, or kept, may start again from its job)."""
    named = []
    try:
        folders = os.listdir(runs_dir)
    except OSError:
        return []
    for folder in folders:
        try:
            with open(os.path.join(runs_dir, folder, "job.json")) as f:
                job = json.load(f)
        except (OSError, ValueError):
            continue
        extra = job.get("extra_ro") if isinstance(job, dict) else None
        named += [p for p in extra if isinstance(p, str)] if isinstance(extra, list) else []
    return named


def collect(envs_dir: str, runs_dir: str, days: float, dry_run: bool,
            only: Optional[str] = None) -> Dict[str, Any]:
    """Remove (or with `dry_run` list) the environments under `envs_dir`
    that no run folder under `runs_dir` names and none used for `days`
    (with `only`, that one if it is such)."""
    envs_dir = os.path.abspath(envs_dir)
    before = time.time() - days * 86400
    named = set(_named_by_runs(runs_dir))
    found: List[Dict[str, Any]] = []
    try:
        names = sorted(os.listdir(envs_dir))
    except OSError:
        names = []
    for name in names:
        env_dir = os.path.join(envs_dir, name)
        if only is not None and env_dir != only:
            continue
        if name.startswith(".") or os.path.islink(env_dir) or not os.path.isdir(env_dir) or env_dir in named:
            continue
        if _last_used(env_dir) >= before:
            continue
        if not dry_run and not _remove(env_dir, before):
            continue
        found.append({"path": env_dir, "last_used": _last_used(env_dir) if dry_run else None})
    return {"removed" if not dry_run else "unused": found}


def _remove(env_dir: str, before: float) -> bool:
    """Removed under its lock, unless used since it was listed (or a build holds it)."""
    with open(env_dir + ".lock", "a") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        if _last_used(env_dir) >= before:
            return False
        gone = "%s/.%s.removed-%d" % (os.path.dirname(env_dir), os.path.basename(env_dir), os.getpid())
        os.rename(env_dir, gone)
        for leftover in (env_dir + USED,):
            if os.path.exists(leftover):
                os.remove(leftover)
    shutil.rmtree(gone, ignore_errors=True)
    return True


def _built(argv: List[str], project: str) -> "tuple[int, bytes]":
    """One build step's exit status and output, a progress line said
    (manifest.PROGRESS) while it runs: a build takes minutes."""
    with subprocess.Popen(argv, cwd=project, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT) as proc:  # fmt: skip
        while True:
            try:
                out, _ = proc.communicate(timeout=manifest.PROGRESS.every or None)
            except subprocess.TimeoutExpired:
                manifest.PROGRESS.tick()
                continue
            return proc.returncode, out


def main(argv: List[str]) -> int:
    if argv[:1] == ["--collect"] and len(argv) in (4, 5, 6):
        only = argv[5] if argv[4:5] == ["--only"] and len(argv) == 6 else None
        print(json.dumps(collect(argv[1], argv[2], float(argv[3]), argv[4:] == ["--dry-run"], only)))
        return 0
    if len(argv) < 3:
        print("usage: env.py PROJECT ENVS_DIR PYTHON [PIP_ARG ...]", file=sys.stderr)
        return 2
    manifest.PROGRESS.start()
    try:
        print(json.dumps(ensure(argv[0], argv[1], argv[2], argv[3:])))
    except BuildFailed as exc:
        print("env.py: %s" % exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
