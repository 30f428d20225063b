"""`remote_step()`: a step of a dodo.py that runs on a backend (the doit adapter).

    def task_train():
        yield from remote_step("train", command=["python", "train.py"],
                               inputs=["data/"], outputs=["model/"])

yields one public doit task named after the step (its targets are the
outputs, so other tasks depend on it with ordinary `file_dep`) and one
hidden task `_<step>` whose actions are the phases (launch, setup, sync,
run, fetch, promote), chained as its `setup` so that an up-to-date step runs
none of them. Both carry the step's check
(`StepCheck`) and the user's own uptodate items, which doit ANDs: `doit`
with no default_tasks selects the hidden task too, and it must then be
skipped like the public one.
"""

from __future__ import annotations

import functools
import gc
import inspect
import os
import re
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from doit import loader as doit_loader
from doit.dependency import UptodateCalculator
from doit.exceptions import InvalidTask
from doit.runner import MRunner, MThreadRunner

from substrax_tasks.config.pyproject import config_key, config_stamp
from substrax_tasks.constants import PROGRAM_FOUND_HERE
from substrax_tasks.errors import SubstraxError
from substrax_tasks.interrupts import map_termination_signals
from substrax_tasks.run.step_driver import PROCESS_POOL_REFUSED, RunState, StepDriver
from substrax_tasks.step.args import check_doit_arguments, max_cost_of, name_list, path_list
from substrax_tasks.step.reporter import REMOTE_STEP, selected_closure
from substrax_tasks.step.spec import (
    ArgvItem,
    PathIndex,
    StepSpec,
    check_clear_of_state,
    make_spec,
    state_folder_of,
)
from substrax_tasks.store.project import Project
from substrax_tasks.uptodate.check import DOIT_VALUE, Step, status

# The outputs declared in this process, per project, for cross-step checks
# (overlapping outputs, producers of inputs).
_INDEXES: dict[str, PathIndex] = {}
# The checkpoints folders declared in this process, per project: no step's
# output may lie in another's (nor hold one).
_CHECKPOINTS: dict[str, PathIndex] = {}
_DECLARED_LOCK = threading.Lock()
# The driver of each step declared in this process, for `substrax-compute why`.
DRIVERS: dict[tuple[str, str], StepDriver] = {}
CLEAN_LABEL_CHARS = 60  # the outputs named in `doit clean`'s label of a step, beyond which it lists two
PASSTHROUGH_KEYS = ("doc", "title", "verbosity", "clean", "getargs", "params", "pos_arg", "watch")


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
        _check_checkpoints_apart(str(project), index, spec)
        producers: list[str] = []
        for path in spec.inputs:
            hit = index.overlapping(path)
            if hit is not None and hit[0] not in producers:
                producers.append(hit[0])
        for out in spec.outputs:
            index.add(spec.step, out)
    return producers


def _near_another(project: str, step: str, folder: str) -> bool:
    """Whether `folder` is, holds or lies in an output or a checkpoints
    folder of another step the loaded dodo declares: such a folder is never
    removed by `step`'s failed run, as another step's command may need it
    (made_folders.py)."""
    with _DECLARED_LOCK:
        return any(index.near_another(folder, step)
                   for index in (_INDEXES.get(project), _CHECKPOINTS.get(project)) if index is not None)


def _check_checkpoints_apart(project: str, outputs: PathIndex, spec: StepSpec) -> None:
    """A checkpoints folder is its step's alone: refused where it overlaps
    another step's output (or this step's outputs, another's checkpoints).
    Steps without checkpoints in a project without any check nothing."""
    folders = _CHECKPOINTS.get(project)
    if folders is None and spec.checkpoints is None:
        return
    folders = _CHECKPOINTS.setdefault(project, PathIndex())
    folders.remove_step(spec.step)
    clashes = []
    if spec.checkpoints is not None:
        hit = outputs.overlapping(spec.checkpoints)
        if hit is not None and hit[0] != spec.step:
            clashes.append((spec.checkpoints, hit[0], f"output {hit[1]}"))
    for mine in spec.outputs:
        hit = folders.overlapping(mine)
        if hit is not None:
            clashes.append((mine.rstrip("/"), hit[0], f"checkpoints folder {hit[1]}/"))
    if clashes:
        what, other, theirs = clashes[0]
        raise SubstraxError(
            f"step {spec.step!r}: {what} overlaps the {theirs} of step {other!r}; a checkpoints folder "
            "belongs to its step alone: give it a folder of its own"
        )
    if spec.checkpoints is not None:
        folders.add(spec.step, spec.checkpoints)


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
    preemptions: int = 0,
    checkpoints: str | os.PathLike[str] | None = None,
    max_cost: float | None = None,
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
    preemptions: how often a run whose machine is lost while its command
      runs (a preempted cluster, a rebooted host, a killed worker) is
      relaunched, its command started again from its latest checkpoints;
      a command that fails, times out or is cancelled never is
      (docs/steps.md, Preemptions).
    checkpoints: a folder ("ckpt/") the command writes its checkpoints in
      (by rename) and reads back as it starts: kept in the store, put back
      in place for the next run of the same step and key, removed once the
      outputs are promoted (docs/checkpoints.md).
    max_cost: the most this step may spend, in US dollars (its machine time
      at the backend's price): overrides the backend's max_cost (docs/cost.md).
    file_dep: extra files tracked for changes but not uploaded.
    task_dep, uptodate, doc, title, verbosity, clean, ...: passed to doit
      (uptodate is combined with the step's own check: all must hold).
    """
    _freeze_declared()
    try:
        check_doit_arguments(name, backend=backend, shell=shell, retries=retries, preemptions=preemptions,
                             uptodate=uptodate, project=project)  # fmt: skip
        tracked = [os.fspath(p) for p in path_list(name, "file_dep", file_dep)]
        dependencies = name_list(name, "task_dep", task_dep, "prepare")
        proj = project_of(project)
        if (command is None) == (shell is None):
            raise SubstraxError(
                f"step {name!r}: give either command=[...] or shell='...', not both or neither"
            )
        argv: Sequence[ArgvItem] = ["/bin/sh", "-c", shell] if shell is not None else (command or [])
        spec = make_spec(
            name, argv, proj.root, inputs=inputs, outputs=outputs, env=env, timeout=timeout,
            resources=resources, forward_env=secrets, checkpoints=checkpoints,
        )
        unknown = sorted(set(task_keys) - set(PASSTHROUGH_KEYS))
        if unknown:
            raise SubstraxError(
                f"step {name!r}: unknown argument(s) {', '.join(unknown)}; doit keys passed "
                f"through are {', '.join(PASSTHROUGH_KEYS)}, plus file_dep, task_dep and uptodate"
            )
        _refuse_own_group_task(spec.step)
        check_clear_of_state(spec, state_folder_of(proj.root, proj.store.root))
        producers = _check_against_others(proj.root, spec)
        backend_name, settings = proj.settings_for(backend)
        cap = max_cost_of(name, max_cost)
        if cap is not None:  # the step's own cap, pinned with the settings (not part of the key)
            settings = {**settings, "max_cost": cap}
        step = Step(spec, proj.root, backend_name, settings, proj.store, tracked=tracked,
                    program_found_here=backend_name in PROGRAM_FOUND_HERE)  # fmt: skip
    except SubstraxError as exc:  # a bad declaration stops doit before anything is launched
        print(f"substrax: error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    driver = StepDriver(step, proj, retries=retries, preemptions=preemptions,
                        near_another=functools.partial(_near_another, str(proj.root), spec.step))
    DRIVERS[(str(proj.root), spec.step)] = driver
    yield from step_tasks(driver, producers, dependencies, list(uptodate), task_keys)


def _refuse_own_group_task(name: str) -> None:
    """Refuse a sweep whose dodo also declares the group task itself
    (`def task_fit(): return {"actions": None, "task_dep": [...]}`, as
    versions before sweeps were doit groups needed): doit makes the group,
    and would stop on the second one with "Task names must be unique" and
    no hint. The dodo is the module of the first caller outside this one;
    its `task_<group>` is fine when it is the function declaring the step."""
    group, colon, _member = name.partition(":")
    if not colon:
        return
    frame = inspect.currentframe()
    while frame is not None and frame.f_globals is globals():
        frame = frame.f_back
    if frame is None:
        return
    declared = frame.f_globals.get(f"task_{group}")
    code = getattr(declared, "__code__", None)
    if code is None:
        return
    caller: FrameType | None = frame
    while caller is not None:
        if caller.f_code is code:
            return  # the group's own function declares its members
        caller = caller.f_back
    raise SubstraxError(_own_group_said(name, group, f"declares its own task_{group}", code, f"task_{group}"))


def _own_group_said(member: str, group: str, what: str, code: Any, remove: str) -> str:
    """The hint for a dodo that declares the group task of a sweep itself."""
    where = f"{code.co_filename}:{code.co_firstlineno}"
    return (
        f"step {member!r} is a member of the sweep {group!r}, and doit makes the group task {group!r} "
        f"itself; the dodo also {what} ({where}), the workaround older versions needed: remove "
        f"{remove}: `doit {group}` runs every member and task_dep=[{group!r}] waits for them all"
    )


# doit's words when a task function yields a task of a name it made a group
# of (or the other way round): the other form of the workaround above.
_DUPLICATED = re.compile(r"Task generation '(?P<func>[^']*)' has duplicated definition of '(?P<name>[^']*)'")


def _generate_tasks(func_name: str, gen_result: Any, gen_doc: str | None = None) -> Any:
    """doit's generate_tasks, with the hint of _refuse_own_group_task when a
    task function yields `{"basename": "fit", ...}` beside its members
    `remote_step("fit:...")` (doit would say only "duplicated definition").
    doit has no hook for what a task function yields: this one call per
    task function, not per task, is wrapped."""
    try:
        return _DOIT_GENERATE_TASKS(func_name, gen_result, gen_doc)
    except InvalidTask as exc:
        found = _DUPLICATED.fullmatch(str(exc))
        code = getattr(gen_result, "gi_code", None)
        if found is None or code is None:
            raise
        group = found["name"]
        members = [step for _, step in DRIVERS if step.startswith(f"{group}:")]
        if not members:  # not a sweep of remote steps: doit's own words
            raise
        said = _own_group_said(members[0], group, f"yields its own {{'basename': {group!r}}} from "
                               f"task_{found['func']}", code, "that yield")  # fmt: skip
        print(f"substrax: error: {said}", file=sys.stderr)
        raise SystemExit(1) from None


_DOIT_GENERATE_TASKS = doit_loader.generate_tasks
doit_loader.generate_tasks = _generate_tasks


def _run_tasks(runner: Any, task_dispatcher: Any) -> Any:
    """doit's process pool (MRunner.run_tasks), refused before its first
    task when a remote step is among those it would run: the phases'
    own check (StepDriver._action) comes only once a phase is reached, after
    the plain tasks before it ran. doit tells neither the dodo nor the
    reporter which runner it chose: this one call per `doit`, the pool's
    start, is wrapped, as generate_tasks is above. Its threads
    (MThreadRunner, `-P thread`) go through."""
    if not isinstance(runner, MThreadRunner):
        steps = {name for _root, step in DRIVERS for name in (step, f"_{step}")}
        closure = selected_closure(task_dispatcher.tasks, task_dispatcher.selected_tasks)
        if any(task.name in steps for task in closure):
            print(f"substrax: error: {PROCESS_POOL_REFUSED}", file=sys.stderr)
            raise SystemExit(2)
    return _DOIT_RUN_TASKS(runner, task_dispatcher)


_DOIT_RUN_TASKS = MRunner.run_tasks
MRunner.run_tasks = _run_tasks


def step_tasks(
    driver: StepDriver,
    producers: list[str],
    task_dep: list[str],
    user_uptodate: list[Any],
    task_keys: dict[str, Any],
) -> Iterator[dict[str, Any]]:
    step = driver.step
    spec = step.spec
    hidden = f"_{spec.step}"
    # One hidden task whose actions are the phases, in order (doit stops at
    # the first that fails): a task per phase cost 0.25 ms each on every
    # no-op, four times over, for nothing a user can call.
    yield {
        **doit_name(hidden),
        "actions": [driver.launch, driver.setup, driver.sync, driver.run, driver.fetch, driver.promote],
        "teardown": [driver.teardown],
        "uptodate": [StepCheck(driver), *user_uptodate],
        "doc": f"phases of step {spec.step}: launch, setup, sync, run, fetch, promote (internal)",
        "verbosity": 2,
        # doit captures a Python action's output by swapping sys.stdout and
        # sys.stderr for a Writer of its own and putting back what it found;
        # under `-P thread` interleaved swaps put back stale Writers, a chain
        # that grew by one every few steps until a sweep died of
        # RecursionError (issue 40). The steps' lines go to the console's
        # held streams (console.hold_streams); doit captures nothing of them.
        "io": {"capture": False},
    }
    # doit's file_dep takes files only; a str path, not a Path, for each of
    # every step's inputs (a third of the time)
    root = str(step.root)
    input_files = [i for i in spec.inputs if not i.endswith("/") and not os.path.isdir(f"{root}/{i}")]  # noqa: PTH112
    public: dict[str, Any] = {
        **doit_name(spec.step),
        "actions": [driver.recorded],
        "file_dep": input_files + step.tracked,
        "targets": [o.rstrip("/") for o in spec.outputs],
        "task_dep": task_dep + producers,
        "setup": [hidden],
        "meta": {REMOTE_STEP: True},  # the reporter counts the remote steps of a sweep
        "uptodate": [StepCheck(driver), *user_uptodate],
        "doc": task_keys.pop("doc", None) or f"remote step {spec.step}: {' '.join(spec.command)[:60]}",
        "verbosity": 2,
        "io": {"capture": False},  # as the phases' task
    }
    if spec.inputs:
        # `doit info` lists file_dep, which holds files only: the inputs,
        # folders included, are shown there through doit's `meta`.
        public["meta"] = {**public["meta"], "inputs": list(spec.inputs)}
    if task_keys.get("clean") is True:
        # doit's clean=True leaves a non-empty folder output: remove outputs whole
        task_keys["clean"] = [CleanOutputs(step)]
    public.update(task_keys)
    yield public


def doit_name(name: str) -> dict[str, str]:
    """How doit names a task: "group:member" is the sub-task `member` of
    the group `group` (doit makes the group task, which runs them all);
    any other name is a task of its own."""
    group, colon, member = name.partition(":")
    return {"basename": group, "name": member} if colon else {"basename": name}


class StepCheck(UptodateCalculator):  # type: ignore[misc]  # doit is untyped
    """The step's own uptodate item, in the shape of doit's `config_changed`:
    called with the task and its saved values. Both tasks of a step ask it
    about the public task's values (the hidden one saves none), which tell
    a `doit forget` from a doit killed before it saved its DB.

    What it said of the hidden task is kept on the driver: doit runs the
    phases after it held only when something else asked for a run (`doit
    -a`, or a user's uptodate item), and then the phases run the command for
    real (doit tells a task nothing of `-a`, but it does check the task)."""

    # doit asks inspect.signature() of each uptodate callable which magic
    # arguments it takes, at every check: given here, it is not worked out
    # again from __call__ for each step (~30 us a step of a no-op).
    __signature__ = inspect.Signature([
        inspect.Parameter("task", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("values", inspect.Parameter.POSITIONAL_OR_KEYWORD),
    ])

    def __init__(self, driver: StepDriver) -> None:
        super().__init__()
        self.driver = driver
        self.step = driver.step
        self._dep_manager: Any = None

    def setup(self, dep_manager: Any, tasks_dict: Any) -> None:
        self._dep_manager = dep_manager

    def __call__(self, task: Any, values: dict[str, Any]) -> bool:
        map_termination_signals()  # doit is running tasks now, not just loading the dodo
        _freeze_what_loading_made()
        dep_manager, self._dep_manager = self._dep_manager, None  # no cycle through doit's tasks
        public = task.name == self.step.name
        if public and self.driver.state is not RunState.IDLE:
            # The phases acted in this doit before the public task was
            # checked: doit ran the hidden task on its own (plain `doit`
            # with no default_tasks selects it too). The public task runs to
            # save the verified run, and is not reported as up to date
            # right after the step's run.
            return False
        if not public and dep_manager is not None:
            values = dep_manager.get_values(self.step.name)
        try:
            held = status(self.step, values).up_to_date  # `why` asks the same function
        except SubstraxError:
            held = False
        if not public:
            self.driver.check_held = held
        # doit holds no value for the public task (its run was promoted by a
        # doit that stopped before the task, or was killed before it saved):
        # the phases stay skipped, and the task runs once to save it.
        return held and (not public or bool(values and values.get(DOIT_VALUE)))

    def __repr__(self) -> str:
        # doit info names each false uptodate object by its str()
        return (
            f"the verified outputs of step {self.step.name!r} "
            f"(`substrax-compute why {self.step.name!r}` says what changed)"
        )


_FROZEN = [False]
_DECLARED = [0]  # remote_step() calls in this process
FREEZE_EVERY = 100


def _freeze_declared() -> None:
    """Every 100 declarations, what was made so far (these steps, doit's
    tasks, the modules) is moved out of the garbage collector's reach: a
    full collection walks every object it tracks, and the collections while
    10,000 steps were declared walked the ones before them again and again
    (1 s of a 5 s no-op; issue 29). Loading makes next to no garbage; what
    it does make is freed at exit."""
    _DECLARED[0] += 1
    if _DECLARED[0] % FREEZE_EVERY == 0:
        gc.freeze()


def _freeze_what_loading_made() -> None:
    """At the first check doit has loaded every task: what loading made
    (doit's tasks, the dodo's and this package's objects, the modules) is
    moved out of the garbage collector's reach (`gc.freeze`), so that later
    collections, and the interpreter's last one at exit, do not walk it
    again. That walk was ~15 ms of a no-op `doit` of 100 steps, most of it
    at exit (bench/README.md). Objects made later are collected as usual."""
    if not _FROZEN[0]:
        _FROZEN[0] = True
        gc.freeze()


class CleanOutputs:
    """`doit clean STEP` with clean=True: remove the declared outputs,
    folders included (doit's own clean leaves non-empty folders). doit names
    an action by `str(callable)` without its first character (the "<" of
    "<function ..."), cut at " at " (the address): this says what it does."""

    def __init__(self, step: Step) -> None:
        self.step = step

    def __call__(self, dryrun: bool = False) -> None:  # `dryrun`: doit passes it under `clean -n`
        from substrax_tasks.console import emit
        from substrax_tasks.run.promote import remove_path

        for out in self.step.spec.outputs:
            path = self.step.root / out.rstrip("/")
            if path.exists() or path.is_symlink():
                emit(f"{self.step.name} - {'would remove' if dryrun else 'removing'} {out}")
                if not dryrun:
                    remove_path(path)

    def __str__(self) -> str:
        # One line however many outputs (a step of 100 outputs made a label
        # of 1,400 characters): each output removed has a line of its own.
        outputs = self.step.spec.outputs
        listed = ", ".join(outputs)
        if len(listed) > CLEAN_LABEL_CHARS:
            listed = f"{', '.join(outputs[:2])}, ... ({len(outputs)} in all)"
        return f"<remove the outputs of step {self.step.name}: {listed}"


_PROJECTS: dict[tuple[Path, tuple[Any, ...]], Project] = {}
# The resolved root of each (working folder, project argument): resolving
# lstats every folder of the path, and every step of a dodo asks.
_ROOTS: dict[tuple[str, str | None], Path] = {}


def project_of(path: str | os.PathLike[str] | None) -> Project:
    """The project's configuration, resolved once per dodo load: a dodo with
    1,000 steps reads pyproject.toml once, and a no-op doit validates nothing
    while the configuration is unchanged (see config.py)."""
    where = (os.getcwd(), None if path is None else os.fspath(path))  # noqa: PTH109
    root = _ROOTS.get(where)
    if root is None:
        root = _ROOTS[where] = Path(where[0]).joinpath(where[1] or "").resolve()
    config = config_key(root)
    project = _PROJECTS.get((root, config))
    if project is None:
        project = _PROJECTS[root, config] = Project.open(root, stamp=config_stamp(root, config))
    return project
