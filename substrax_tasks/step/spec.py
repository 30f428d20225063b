"""What a step is: its command, inputs, outputs, env and timeout.

Paths are stored relative to the project, in POSIX form; an output ending in
"/" is a folder. Bad declarations fail here, before anything is launched.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Union

from substrax_tasks.errors import SpecError
from substrax_tasks.step.args import argv_of, env_of, literal, name_list, path_list, seconds_of, shown

ArgvItem = Union[str, int, os.PathLike]  # type: ignore[type-arg]  # noqa: UP007 - a runtime alias
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
RESOURCE_KEYS = ("accelerators", "cpus", "memory", "disk_size")
# The longest step name: a name that is already safe is used as it is in
# file names (safe_name), and the longest the store makes of it is the temp
# file of its outputs cache (store.py, _atomic.py): "." + name +
# ".outputs.json." + mkstemp's 8 characters + ".tmp", where a file name is at
# most 255 bytes (NAME_MAX; safe names are ASCII). The run id, name + 23,
# is shorter; other names are shortened with a hash and always fit.
MAX_STEP_NAME = 255 - len(".") - len(".outputs.json.") - 8 - len(".tmp")


@dataclass(frozen=True)
class StepSpec:
    """A step as submitted: everything that decides what the run produces.

    A plain dataclass, checked by make_spec(): a dodo of many steps builds
    one per step on every `doit`, and pydantic is not imported for that."""

    step: str
    command: list[str]
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    timeout: float | None = None
    resources: dict[str, str | int | float] = field(default_factory=dict)
    forward_env: list[str] = field(default_factory=list)
    # The folder the command keeps its checkpoints in ("ckpt/"), or None.
    checkpoints: str | None = None

    def model_dump(self, mode: str = "json") -> dict[str, Any]:
        """The spec as JSON-ready data (the name pydantic models use). A
        step without checkpoints dumps as before they existed: its runs'
        digests, and so the runs a rerun reattaches to, stay the same."""
        data = dataclasses.asdict(self)
        if data["checkpoints"] is None:
            del data["checkpoints"]
        return data

    def output_entries(self) -> list[dict[str, str]]:
        """The outputs as the worker reads them: path and kind."""
        return [
            {"path": out.rstrip("/"), "kind": "dir" if out.endswith("/") else "file"}
            for out in self.outputs
        ]


def canonical_digest(data: Any) -> str:
    """sha256 of a canonical JSON form: equal data, equal digest."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


# Backend settings that cannot change a step's outputs: left out of the
# up-to-date key and of a run's digest, so adding or changing them reruns
# nothing (the kept folders' contents are never read for the key either;
# which GPUs a step sees is where it runs, as which host is).
NOT_IN_KEY = (
    "cache_dirs", "checkpoint_seconds", "hide_gpus_when_unasked", "keep_checkpoints", "max_parallel", "reuse",
    "hourly_cost", "max_cost", "on_demand_last_attempt", "max_checkpoint_size",
)


def settings_in_key(settings: dict[str, Any]) -> dict[str, Any]:
    """The backend settings that decide a step's outputs."""
    return {k: v for k, v in settings.items() if k not in NOT_IN_KEY}


def safe_name(name: str) -> str:
    """A form of a step name fit for folders, files and cluster names.
    Names that had to change get a short hash so two never collide."""
    cleaned = _UNSAFE.sub("-", name).strip("-.") or "step"
    if cleaned == name:
        return name
    return f"{cleaned[:40]}-{hashlib.sha256(name.encode()).hexdigest()[:6]}"


def relative_path(raw: str | os.PathLike[str], project: Path, what: str) -> str:
    """`raw` as a clean project-relative POSIX path, or a SpecError."""
    text = os.fspath(raw)
    is_dir = text.endswith("/")
    # The common case, already clean ("data/in.csv", "model/"), costs string
    # work only: a dodo of many steps declares thousands of these.
    probe = "/" + (text[:-1] if is_dir else text) + "/"
    # no empty, "." or ".." component, not absolute (that would start "//")
    if "//" not in probe and "/./" not in probe and "/../" not in probe:
        return text
    if not text.strip():
        raise SpecError(f"{what} is empty; give a path inside the project")
    if PurePosixPath(text).is_absolute():
        candidate = Path(text)
        try:
            text = candidate.resolve().relative_to(project.resolve()).as_posix()
        except ValueError:
            raise SpecError(
                f"{what} {raw!s} lies outside the project {project}; "
                "give a path inside the project"
            ) from None
    parts = PurePosixPath(text).parts
    if ".." in parts:
        raise SpecError(f"{what} {raw!s} contains '..'; give a plain path inside the project")
    clean = PurePosixPath(*[p for p in parts if p != "."]).as_posix()
    if clean in ("", "."):
        raise SpecError(f"{what} {raw!s} is the project itself; name a file or folder in it")
    return clean + "/" if is_dir else clean


def _resources_of(step: str, resources: object) -> dict[str, str | int | float]:
    """The step's resources: a mapping of known keys to strings or numbers."""
    if resources is None:
        return {}
    if not isinstance(resources, Mapping):
        example = {"accelerators": resources} if isinstance(resources, str) else {"cpus": 4}
        raise SpecError(
            f"step {step!r}: resources must be a mapping of {', '.join(RESOURCE_KEYS)} to values, "
            f"got {shown(resources)}: write resources={literal(example)}"
        )
    values = dict(resources)
    unknown = sorted(str(key) for key in set(values) - set(RESOURCE_KEYS))
    if unknown:
        raise SpecError(
            f"step {step!r}: unknown resources {', '.join(unknown)}; "
            f"valid keys: {', '.join(RESOURCE_KEYS)}"
        )
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise SpecError(
                f"step {step!r}: resources[{key!r}] must be a string or a number, got {shown(value)}"
            )
    return values


def check_name(step: str) -> None:
    """A SpecError unless `step` is a name a step can have."""
    if not isinstance(step, str) or not step.strip():
        raise SpecError(f"a step needs a non-empty name (a string), got {shown(step)}")
    group, colon, member = step.partition(":")
    if colon and not (group.strip() and member.strip()):
        raise SpecError(
            f"step {step!r}: a name with ':' is GROUP:MEMBER (doit's sub-task MEMBER of GROUP), "
            "both non-empty, for example 'ridge:alpha-0.1'"
        )
    if len(safe_name(step)) > MAX_STEP_NAME:
        raise SpecError(
            f"step {step[:40] + '...'!r}: the name is {len(step)} characters; at most {MAX_STEP_NAME} "
            "fit in the file names made from it (255 bytes a name); give the step a shorter name"
        )


def make_spec(
    step: str,
    command: Sequence[ArgvItem],
    project: Path,
    *,
    inputs: Iterable[str | os.PathLike[str]] = (),
    outputs: Iterable[str | os.PathLike[str]] = (),
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    resources: Mapping[str, str | int | float] | None = None,
    forward_env: Iterable[str] = (),
    checkpoints: str | os.PathLike[str] | None = None,
) -> StepSpec:
    """Check a step's declaration and turn it into a StepSpec. Each
    argument of a wrong type is named with what was expected and how to
    write it, before any path in it is looked at."""
    check_name(step)
    argv = argv_of(step, command)
    input_list = path_list(step, "inputs", inputs)
    output_list = path_list(step, "outputs", outputs)
    seconds = seconds_of(step, timeout)
    env_checked = env_of(step, env)
    forwarded = sorted(set(name_list(step, "secrets", forward_env, "WANDB_API_KEY")))
    resource_values = _resources_of(step, resources)
    input_paths = [relative_path(i, project, f"step {step!r}: input") for i in input_list]
    output_paths = [relative_path(o, project, f"step {step!r}: output") for o in output_list]
    if len(output_paths) > 1:  # one output cannot overlap itself
        check_no_overlap(step, output_paths)
    _refuse_path_folders(step, output_list, output_paths, project)
    checkpoint_path = _checkpoints_of(step, checkpoints, project, input_paths, output_paths)
    for name in forwarded:
        if not name or "=" in name or name in env_checked:
            raise SpecError(
                f"step {step!r}: secret {name!r} must be an environment variable name "
                "not also given in env"
            )
    return StepSpec(
        step=step,
        command=argv,
        inputs=input_paths,
        outputs=output_paths,
        env=env_checked,
        timeout=seconds,
        resources=resource_values,
        forward_env=forwarded,
        checkpoints=checkpoint_path,
    )


def _checkpoints_of(
    step: str, raw: object, project: Path, inputs: list[str], outputs: list[str]
) -> str | None:
    """The checkpoints folder as a clean project path ending in "/": a
    folder of the project that is neither an input nor an output, nor holds
    or lies in one (the command writes it, and it is never promoted)."""
    if raw is None:
        return None
    if not isinstance(raw, (str, os.PathLike)):
        raise SpecError(
            f"step {step!r}: checkpoints must be a folder of the project (a str or pathlib.Path), "
            f'got {shown(raw)}: write checkpoints="ckpt/"'
        )
    folder = relative_path(raw, project, f"step {step!r}: checkpoints").rstrip("/") + "/"
    for kind, paths in (("input", inputs), ("output", outputs)):
        index = PathIndex()
        for path in paths:
            index.add(step, path)
        hit = index.overlapping(folder)
        if hit is not None:
            raise SpecError(
                f"step {step!r}: checkpoints folder {folder} overlaps the {kind} {hit[1]}; the checkpoints "
                f"are neither uploaded nor promoted: give them a folder of their own, as "
                f'checkpoints="ckpt/"'
            )
    return folder


def _refuse_path_folders(
    step: str, given: list[str | os.PathLike[str]], outputs: list[str], project: Path
) -> None:
    """A `pathlib.Path` drops the trailing "/" that declares a folder output,
    so a Path output is refused now, before its command runs only to have its
    manifest refuse a folder as a file, unless it says it is a file: a file
    already there, or a name with a suffix (`model.pt`). One naming a folder
    of the project, or nothing yet and without a suffix (`Path("metrics")`),
    is refused with both ways to write it. Only Paths are looked at (a stat
    each): a string says what it means."""
    for raw, rel in zip(given, outputs, strict=True):
        if not isinstance(raw, os.PathLike) or rel.endswith("/"):
            continue
        where = project / rel
        if where.is_dir():
            raise SpecError(
                f"step {step!r}: output {rel} is a folder, but it is given as a pathlib.Path, which "
                'drops the trailing "/" that declares a folder output: '
                f'write "{rel}/" (a string, or str(path) + "/")'
            )
        if not PurePosixPath(rel).suffix and not where.is_file():
            raise SpecError(
                f"step {step!r}: output {rel} is given as a pathlib.Path, which drops the trailing "
                '"/" that declares a folder output, and nothing is there yet to tell a folder from '
                f'a file: write "{rel}/" for a folder (or str(path) + "/"), "{rel}" for a file'
            )


def state_folder_of(project: Path, store_root: Path) -> str | None:
    """The state folder (the store's root, resolved from `state_dir`, the
    SUBSTRAX_CONFIG overlay included) as a project path, or None when it
    lies outside the project (or is the project itself)."""
    try:
        rel = store_root.relative_to(project).as_posix()
    except ValueError:
        return None
    return None if rel == "." else rel


def check_clear_of_state(spec: StepSpec, state_folder: str | None) -> None:
    """Refuse, as the dodo loads, a path of the step that is, lies in or
    holds the state folder (`state_folder_of`), or lies in a `.git` folder.
    A run's outputs are promoted into place and, without a sandbox, its
    checkpoints folder is put in place over its path: there they would
    replace the store (its runs, locks and client id) or git's own files
    (hooks git runs). An input may lie in `.git` (read only, as
    `.git/HEAD` to stamp a version) but not in the store: every run changes
    it, so the step would never be up to date, and its client id would be
    uploaded to the host."""
    declared = [("output", out) for out in spec.outputs] + [("input", path) for path in spec.inputs]
    if spec.checkpoints is not None:
        declared.append(("checkpoints folder", spec.checkpoints))
    for kind, path in declared:
        clean = path.rstrip("/")
        where = None if state_folder is None else _where(clean, state_folder)
        if where is not None:
            raise SpecError(
                f"step {spec.step!r}: {kind} {path} {where} the state folder {state_folder}/, where "
                "substrax keeps the project's runs, locks and client id (state_dir in "
                f"[tool.substrax.compute]); a step's paths never touch it: {_elsewhere(kind)}"
            )
        if kind != "input" and ".git" in clean.split("/"):
            raise SpecError(
                f"step {spec.step!r}: {kind} {path} lies in .git, git's own folder: a run writing there "
                f"could change the repository or its hooks, which git runs; {_elsewhere(kind)}"
            )


def _where(path: str, folder: str) -> str | None:
    """How `path` stands to `folder`: "is", "lies in", "holds", or None (apart)."""
    if path == folder:
        return "is"
    if path.startswith(folder + "/"):
        return "lies in"
    return "holds" if folder.startswith(path + "/") else None


def _elsewhere(kind: str) -> str:
    if kind == "checkpoints folder":
        return 'give the checkpoints a folder of their own, as checkpoints="ckpt/"'
    return f"declare {'an' if kind == 'input' else 'the'} {kind} elsewhere in the project"


def check_inputs_exist(spec: StepSpec, project: Path) -> None:
    """Inputs may be made by earlier steps, so this is checked at launch."""
    missing = [rel for rel in spec.inputs if not (project / rel.rstrip("/")).exists()]
    if missing:
        raise SpecError(
            f"step {spec.step!r}: input {', '.join(missing)} does not exist in {project}; "
            "create it first (or declare the step that makes it) or fix the path"
        )


def check_outputs_inside(outputs: list[str], root: Path) -> None:
    """An output reached through a symlink could be written outside the
    project (without a sandbox) or not at all (bubblewrap cannot bind onto
    it): refused at launch, before anything runs."""
    for out in outputs:
        rel = Path(out.rstrip("/"))
        for parent in reversed(rel.parents[:-1]):  # outer folders first, "." left out
            if (root / parent).is_symlink():
                raise SpecError(
                    f"output {out} lies under {parent.as_posix()}, a symlink to "
                    f"{(root / parent).readlink()}: outputs must be real paths inside the project; "
                    "replace the link by a folder or declare the output where it really is"
                )
        try:
            (root / rel).resolve().relative_to(root.resolve())
        except ValueError:
            raise SpecError(
                f"output {out} is a symlink leading outside the project "
                f"({(root / rel).resolve()}); remove it or declare the output where it really is"
            ) from None


def _ancestors(path: str) -> Iterator[str]:
    """"a/b/c" -> "a", "a/b" (string work: this runs for every output)."""
    at = path.find("/")
    while at != -1:
        yield path[:at]
        at = path.find("/", at + 1)


def _ancestors_deepest_first(path: str) -> Iterator[str]:
    """"a/b/c" -> "a/b", "a"."""
    at = path.rfind("/")
    while at != -1:
        yield path[:at]
        at = path.rfind("/", 0, at)


class PathIndex:
    """Who declared which output, answering "does this path overlap one?"
    in time proportional to its depth, not to the number of outputs: a dodo
    of 1,000 steps checks in milliseconds, not seconds."""

    def __init__(self) -> None:
        self.owner: dict[str, str] = {}  # output path -> its step
        self.below: dict[str, str] = {}  # folder holding an output -> that output's step
        self.by_step: dict[str, list[str]] = {}

    def overlapping(self, path: str) -> tuple[str, str] | None:
        """(step, output) of an output that `path` is, holds, or lies in."""
        clean = path.rstrip("/")
        if clean in self.owner:
            return self.owner[clean], clean
        if clean in self.below:
            step = self.below[clean]
            held = next(o for o in self.by_step[step] if o.startswith(clean + "/"))
            return step, held
        for folder in _ancestors(clean):
            if folder in self.owner:
                return self.owner[folder], folder
        return None

    def near_another(self, path: str, step: str) -> bool:
        """Whether `path` is, holds, or lies in an output of a step other
        than `step`. Asked only as a failed run removes its folders: the
        scan of the other steps' outputs that `below` (one step per folder)
        cannot spare is paid then, never as a dodo loads."""
        clean = path.rstrip("/")
        for folder in (*_ancestors(clean), clean):
            if self.owner.get(folder, step) != step:
                return True
        if self.below.get(clean, step) != step:
            return True
        if clean not in self.below:
            return False
        inside = clean + "/"
        return any(
            out.startswith(inside) for other, outs in self.by_step.items() if other != step for out in outs
        )

    def add(self, step: str, path: str) -> None:
        clean = path.rstrip("/")
        self.owner[clean] = step
        self.by_step.setdefault(step, []).append(clean)
        below = self.below
        # A folder already noted has its own folders noted too: outputs
        # declared file by file in one folder stop at the first look.
        for folder in _ancestors_deepest_first(clean):
            if folder in below:
                break
            below[folder] = step

    def remove_step(self, step: str) -> None:
        if step not in self.by_step:
            return
        for path in self.by_step.pop(step):
            self.owner.pop(path, None)
        self.below = {k: v for k, v in self.below.items() if v != step}
        for other, paths in self.by_step.items():
            for path in paths:
                for folder in _ancestors(path):
                    self.below.setdefault(folder, other)


def check_no_overlap(step: str, outputs: list[str]) -> None:
    index = PathIndex()
    for out in outputs:
        hit = index.overlapping(out)
        if hit is not None:
            raise SpecError(
                f"step {step!r}: outputs {hit[1]} and {out.rstrip('/')} overlap; "
                "declare each file or folder once"
            )
        index.add(step, out)
