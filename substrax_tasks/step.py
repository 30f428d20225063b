"""`remote_step()`: a step of a dodo.py that runs on a backend.

    def task_train():
        yield from remote_step("train", command=["python", "train.py"],
                               inputs=["data/"], outputs=["model/"])

yields one public doit task named after the step (it verifies and promotes
the outputs; its targets are the outputs, so other tasks depend on it with
ordinary `file_dep`) and one hidden task `_<step>` whose actions are the
phases before it (launch, setup, sync, run, fetch), chained as its `setup`
so that an up-to-date step runs none of them.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from substrax_tasks.chain import StepCheck, StepRunner, project_of
from substrax_tasks.errors import SubstraxError
from substrax_tasks.spec import ArgvItem, PathIndex, StepSpec, make_spec

# The outputs declared in this process, per project, for cross-step checks
# (overlapping outputs, producers of inputs).
_INDEXES: dict[str, PathIndex] = {}
_DECLARED_LOCK = threading.Lock()
# The runner of each step declared in this process, for `substrax-compute why`.
RUNNERS: dict[tuple[str, str], StepRunner] = {}
PASSTHROUGH_KEYS = ("doc", "title", "verbosity", "clean", "getargs", "params", "pos_arg", "watch")


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


_SIGNALS_MAPPED = False


def map_termination_signals() -> None:
    """SIGTERM/SIGHUP become KeyboardInterrupt, so doit saves its DB and runs
    teardown (it does neither when killed by a signal it does not catch).
    Once per process (every step of a dodo calls it): a handler the program
    sets afterwards is its own choice."""
    global _SIGNALS_MAPPED
    if _SIGNALS_MAPPED or threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            signal.signal(sig, _interrupt)
    _SIGNALS_MAPPED = True


def _fail_at_load(exc: SubstraxError) -> None:
    """A bad declaration stops doit before anything is launched: exit 1."""
    print(f"substrax: error: {exc}", file=sys.stderr)
    raise SystemExit(1)


def _check_against_others(project: Path, spec: StepSpec) -> list[str]:
    """Refuse outputs that overlap another step's; return the steps whose
    outputs hold one of this step's inputs (they must run first)."""
    with _DECLARED_LOCK:
        index = _INDEXES.setdefault(str(project), PathIndex())
        index.remove_step(spec.step)  # a dodo loaded twice in one process
        for mine in spec.outputs:
            hit = index.overlapping(mine)
            if hit is not None:
                other, theirs = hit
                raise SubstraxError(
                    f"steps {other!r} and {spec.step!r} both declare output "
                    f"{theirs if len(theirs) <= len(mine.rstrip('/')) else mine.rstrip('/')}; "
                    "each path may be the output of one step only"
                )
        producers: list[str] = []
        for path in spec.inputs:
            hit = index.overlapping(path)
            if hit is not None and hit[0] not in producers:
                producers.append(hit[0])
        for out in spec.outputs:
            index.add(spec.step, out)
    return producers


def remote_step(  # noqa: PLR0917 - the documented signature: remote_step(name, command, ...)
    name: str,
    command: Sequence[ArgvItem] | None = None,
    inputs: Iterable[str | os.PathLike[str]] = (),
    outputs: Iterable[str | os.PathLike[str]] = (),
    backend: str | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    *,
    shell: str | None = None,
    resources: Mapping[str, str | int | float] | None = None,
    secrets: Iterable[str] = (),
    retries: int = 0,
    file_dep: Iterable[str | os.PathLike[str]] = (),
    task_dep: Iterable[str] = (),
    uptodate: Iterable[Any] = (),
    project: str | os.PathLike[str] | None = None,
    **task_keys: Any,
) -> Iterator[dict[str, Any]]:
    """Declare a step that runs on a backend; yields its doit tasks.

    command: argv (str, int or pathlib.Path items), or `shell="..."` for a
      /bin/sh command line with pipes and redirects.
    inputs: files or folders the command reads (uploaded, read-only).
    outputs: files, or folders written with a trailing "/".
    backend: "local", "ssh", "skypilot"; default: the project's default_backend.
    env: environment variables for the command (part of the digest).
    timeout: seconds before the run is stopped and recorded as timed_out.
    resources: accelerators, cpus, memory, disk_size (override the backend's).
    secrets: names of environment variables forwarded from this process:
      their values reach the command but never a digest, handle, DB or log.
    retries: how often to retry a failure of the machinery (never of the command).
    file_dep: extra files tracked for changes but not uploaded.
    task_dep, uptodate, doc, title, verbosity, clean, ...: passed to doit
      (uptodate is combined with the step's own check: all must hold).
    """
    map_termination_signals()
    try:
        proj = project_of(project)
        if (command is None) == (shell is None):
            raise SubstraxError(
                f"step {name!r}: give either command=[...] or shell='...', not both or neither"
            )
        argv: Sequence[ArgvItem] = ["/bin/sh", "-c", shell] if shell is not None else (command or [])
        spec = make_spec(
            name, argv, proj.root, inputs=inputs, outputs=outputs, env=env, timeout=timeout,
            resources=resources, forward_env=secrets,
        )
        if retries < 0:
            raise SubstraxError(f"step {name!r}: retries must be 0 or more, got {retries}")
        unknown = sorted(set(task_keys) - set(PASSTHROUGH_KEYS)) if task_keys else []
        if unknown:
            raise SubstraxError(
                f"step {name!r}: unknown argument(s) {', '.join(unknown)}; doit keys passed "
                f"through are {', '.join(PASSTHROUGH_KEYS)}, plus file_dep, task_dep and uptodate"
            )
        producers = _check_against_others(proj.root, spec)
        tracked = [os.fspath(p) for p in file_dep]
        runner = StepRunner(
            spec, proj, backend, retries=retries, tracked=tracked, user_uptodate=list(uptodate)
        )
    except SubstraxError as exc:
        _fail_at_load(exc)
        raise  # unreachable: _fail_at_load exits
    RUNNERS[(str(proj.root), spec.step)] = runner
    yield from step_tasks(runner, producers, list(task_dep), tracked, task_keys)


def step_tasks(
    runner: StepRunner,
    producers: list[str],
    task_dep: list[str],
    tracked: list[str],
    task_keys: dict[str, Any],
) -> Iterator[dict[str, Any]]:
    spec = runner.spec
    hidden = f"_{spec.step}"
    # One hidden task whose actions are the phases, in order (doit stops at
    # the first that fails): a task per phase cost 0.25 ms each on every
    # no-op, four times over, for nothing a user can call.
    yield {
        "basename": hidden,
        "actions": [runner.launch, runner.setup, runner.sync, runner.run, runner.fetch],
        "teardown": [runner.teardown],
        "doc": f"phases of step {spec.step}: launch, setup, sync, run, fetch (internal)",
        "verbosity": 2,
    }
    # os.path on strings: no Path object per input of every step, each doit.
    isdir, join, root = os.path.isdir, os.path.join, os.fspath(runner.root)
    input_files = [i for i in spec.inputs if not i.endswith("/") and not isdir(join(root, i))]
    public: dict[str, Any] = {
        "basename": spec.step,
        "actions": [runner.verify],
        "file_dep": input_files + tracked,
        "targets": [o.rstrip("/") for o in spec.outputs],
        "task_dep": task_dep + producers,
        "setup": [hidden],
        "uptodate": [StepCheck(runner)],
        "doc": task_keys.pop("doc", None) or f"remote step {spec.step}: {' '.join(spec.command)[:60]}",
        "verbosity": 2,
    }
    if task_keys.get("clean") is True:
        # doit's clean=True leaves a non-empty folder output: remove outputs whole
        task_keys["clean"] = [runner.clean_outputs]
    public.update(task_keys)
    yield public
