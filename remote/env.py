#!/usr/bin/env python3
"""The step's locked environment: one recipe for every backend.

Stdlib only, Python 3.8+. The local backend calls `ensure` in its own
process; ssh and skypilot run this file on their machine, where it prints
one JSON line ({} when the project has no lock file):

    python3 env.py PROJECT ENVS_DIR PYTHON [PIP_ARG ...]

The environment is built from the project's lock file (`uv.lock` -> `uv
sync --frozen`; a requirements lock -> a venv and `pip install -r`) into
ENVS_DIR/<digest>, and reused while the lock and how it is built stay the
same. The commands run from the project's folder, so relative paths in the
pip arguments (`--find-links wheels/`) and in the lock resolve as they do
for the user.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from typing import Dict, List, Optional, Sequence, Union

LOCK_FILES = ("uv.lock", "requirements.lock", "requirements.txt")  # the first found is used
READY = ".substrax-ready"  # written last: a folder without it is a build that did not finish


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
    if os.path.isfile(os.path.join(env_dir, READY)):
        return answer
    os.makedirs(os.path.dirname(env_dir), mode=0o700, exist_ok=True)
    with open(env_dir + ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if os.path.isfile(os.path.join(env_dir, READY)):  # built by the step we waited for
            return answer
        shutil.rmtree(env_dir, ignore_errors=True)
        for argv in build_steps(lock, env_dir, python, pip_args):
            try:
                done = subprocess.run(argv, cwd=project, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, check=False)
            except OSError as exc:
                raise BuildFailed("%s: %s" % (argv[0] if argv[0] != "env" else argv[2], exc)) from None
            if done.returncode != 0:
                said = done.stdout.decode(errors="replace").strip()[-2000:]
                raise BuildFailed("`%s` failed (exit %d): %s" % (" ".join(argv), done.returncode, said))
        open(os.path.join(env_dir, READY), "w").close()
    answer["reused"] = False
    return answer


def main(argv: List[str]) -> int:
    if len(argv) < 3:
        print("usage: env.py PROJECT ENVS_DIR PYTHON [PIP_ARG ...]", file=sys.stderr)
        return 2
    try:
        print(json.dumps(ensure(argv[0], argv[1], argv[2], argv[3:])))
    except BuildFailed as exc:
        print("env.py: %s" % exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
