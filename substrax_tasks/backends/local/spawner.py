"""Starts the local backend's workers for one client process.

    python spawner.py REMOTE_DIR

A new interpreter per run cost a trivial step most of its overhead. This
one interpreter, started by the client at its first local run, has the
worker's modules loaded and forks each run's worker from itself. Stdlib
only; a script, never imported by the package.

One request a line on stdin, JSON: {"job": JOB_JSON, "log": RUN_LOG,
"env": {...}, "secrets": {...}, "sandbox": SETTING}; one answer a line on
stdout: the exit code `worker.py JOB --detach` would have given (0 once the
worker confirmed that its command started).
Each worker is started as that command starts it: a child of its own,
in its own session, with exactly the request's environment (the secrets
held in memory, as `--env-stdin` gives them), that goes on
when this process and its client are gone. It exits when its stdin closes,
that is when its client exits, however it exits.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import sys
import traceback
from pathlib import Path


def start(worker: object, request: dict[str, object]) -> int:
    """In a forked child: what `worker.py JOB --detach` does, from here."""
    fd = os.open(str(request["log"]), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 2)  # a failure before the worker opens the log is still in the log
    os.close(fd)
    env = request["env"]
    os.environ.clear()
    os.environ.update(env if isinstance(env, dict) else {})
    job = json.loads(Path(str(request["job"])).read_text())
    secrets = request.get("secrets")
    # detach() forks the worker into its own session; this child exits once
    # it answered, so the worker is reparented away from this process.
    return int(worker.detach(job, secrets if isinstance(secrets, dict) else {}))  # type: ignore[attr-defined]


def learn_once(sandbox: object, request: dict[str, object]) -> None:
    """What every worker would find out for itself, found out here once and
    inherited by each fork: whether bubblewrap is usable (the probe runs
    it), looked up on the PATH the worker will have."""
    env = request.get("env")
    path = env.get("PATH") if isinstance(env, dict) else None
    bwrap = shutil.which("bwrap", path=path if isinstance(path, str) else None)
    if request.get("sandbox") != "none" and bwrap is not None:
        # A probe that did not end is no answer: the worker asks again and says why.
        with contextlib.suppress(RuntimeError):
            sandbox.bwrap_usable(bwrap)  # type: ignore[attr-defined]


def main() -> int:
    sys.path.insert(0, sys.argv[1])
    worker = importlib.import_module("worker")
    sandbox = importlib.import_module("sandbox")
    importlib.import_module("manifest")  # imported by each worker as its command ends
    for line in sys.stdin:
        request = json.loads(line)
        learn_once(sandbox, request)
        pid = os.fork()
        if pid == 0:
            try:
                code = start(worker, request)
            except BaseException:  # noqa: BLE001 - said in the log (fd 2), answered as a failure
                traceback.print_exc()
                code = 1
            os._exit(code)
        _pid, status = os.waitpid(pid, 0)
        sys.stdout.write(f"{os.waitstatus_to_exitcode(status)}\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
