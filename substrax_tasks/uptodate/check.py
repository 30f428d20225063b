"""Is a step up to date, and if not, why? The key, the proof and `status`,
the one function that answers both (doit's check and `why` call it).

Plain functions of a `Step` (what the dodo declares, the backend settings),
its record and the file system; nothing here knows doit.

* The *key* digests everything that decides the outputs: command, env,
  timeout, outputs, resources, secrets' names, backend and its settings'
  digest, the inputs' contents (hashed, cached by the hash cache) and the
  environment's lock file; without a lock file, the Python the command
  names as found here (interpreter.py). The step record's `verified` entry holds the key
  and the manifest digest of the run whose outputs were promoted.
* The step is up to date when that key is today's and the outputs here
  still have the verified digest (`reasons_to_run`: each failed test is a
  reason, named as `why` prints it).
* The *proof* is what lets a no-op skip that full check: one stat walk of
  the inputs, the outputs and the environment's lock files, plus the stat of
  the record and the step's declaration, digested together. Kept in
  proofs.py once the full check found the step up to date and everything it
  covers was older than the racy window, so any later change moves a ctime
  the proof holds.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import marshal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from substrax_tasks import __version__
from substrax_tasks._remote import manifest as remote_manifest
from substrax_tasks._remote.env import LOCK_FILES as ENV_LOCK_FILES
from substrax_tasks.atomic import write_json_atomic
from substrax_tasks.constants import LOCK_COMPANIONS
from substrax_tasks.errors import HandleError, SubstraxError
from substrax_tasks.step.spec import StepSpec, canonical_digest, settings_in_key
from substrax_tasks.uptodate import interpreter
from substrax_tasks.uptodate import manifests as manifest_cache
from substrax_tasks.uptodate import walk as tree
from substrax_tasks.uptodate.proofs import proof_file

if TYPE_CHECKING:
    from substrax_tasks.store.run_store import RunStore

DOIT_VALUE = "substrax_run"  # saved by doit with the public task's values
# Part of every proof: a release that changes what the key or the check
# means must not take an older release's proofs.
PROOF_VERSION = f"{__version__}/6"
# The key's part that names what a run sees (project_view.py): its declared
# inputs only. A step verified when runs saw every tracked file (no such
# part) may have read an undeclared file: stale once, and no cache entry of
# that time matches.
VIEW_RULE = "declared"
KEY_FIELDS = (
    "command", "env", "timeout", "outputs", "checkpoints", "resources", "secrets", "backend", "environment",
    "interpreter",
)
_LOCK_DIGESTS: dict[tuple[str, int, int, int], str] = {}
# every candidate lock file (and what one is read with), as the proof walks
# them: present or not, one appearing is a change
_LOCK_PATHS = [
    (name, False, False)
    for name in [*ENV_LOCK_FILES, *sorted({c for cs in LOCK_COMPANIONS.values() for c in cs})]
]


class StepFiles:
    """Where a step keeps its state, as the store lays the folder out. Each
    path is made when first asked for: a no-op asks for the record and the
    proofs only, and five paths made at load for each of 1,000 steps were
    ~20 ms of its `doit` (pathlib)."""

    def __init__(self, store: RunStore, step: str) -> None:
        self._store = store
        self._step = step

    @property
    def store(self) -> RunStore:
        return self._store

    @functools.cached_property
    def record(self) -> Path:
        return self._store.step_record(self._step)

    @functools.cached_property
    def inputs_cache(self) -> Path:
        return self._store.inputs_cache(self._step)

    @functools.cached_property
    def outputs_cache(self) -> Path:
        return self._store.outputs_cache(self._step)

    @property
    def proofs(self) -> Path:
        return self._store.proofs_file

    @functools.cached_property
    def lock(self) -> Path:
        return self._store.step_lock(self._step)


class Step:
    """What the check of one step reads: its declaration and its files."""

    def __init__(
        self,
        spec: StepSpec,
        root: Path,
        backend: str,
        settings: dict[str, Any],
        store: RunStore,
        *,
        tracked: list[str] | None = None,
        program_found_here: bool = False,
    ) -> None:
        """`program_found_here`: the backend runs the command's program as
        found on this machine's PATH (constants.PROGRAM_FOUND_HERE)."""
        self.spec = spec
        self.program_found_here = program_found_here
        self.name = spec.step
        self.root = root
        self.backend = backend
        self.settings = settings
        self.tracked = list(tracked or [])
        self.files = StepFiles(store, spec.step)

    @functools.cached_property
    def declared(self) -> bytes:
        """The declaration and settings as bytes for the proof: marshal (all
        of it is str, numbers, lists and JSON data), dict items sorted."""
        spec = self.spec
        items = [
            PROOF_VERSION, str(self.root), spec.step, spec.command, sorted(spec.env.items()),
            spec.timeout, spec.inputs, spec.outputs, sorted(spec.resources.items()),
            spec.forward_env, self.tracked, self.backend, sorted(self.settings.items()),
        ]
        if spec.checkpoints is not None:
            items.append(spec.checkpoints)
        return marshal.dumps(items, 2)

    @functools.cached_property
    def root_str(self) -> str:
        return str(self.root)

    @functools.cached_property
    def python(self) -> str | None:
        """The path of the Python the command names, found here; None when
        it names none, or runs where this PATH means nothing."""
        if not self.program_found_here or not self.spec.command:
            return None
        return interpreter.python_named(self.spec.command[0], self.root_str, self.spec.env)

    @functools.cached_property
    def walked_paths(self) -> list[tuple[str, bool, bool]] | None:
        """What the proof walks, checked once: the inputs and tracked files
        (a folder walked however it was declared), the outputs (walked
        where declared folders) and every candidate lock file, present or
        not (one appearing is a change). None when a path is refused."""
        check = remote_manifest.check_outputs
        try:
            inputs = check([*self.spec.inputs, *self.tracked])
            outputs = check(list(self.spec.outputs))
        except manifest_cache.ManifestError:
            return None
        return [
            *((rel, is_dir, True) for rel, is_dir in inputs),
            *((rel, is_dir, is_dir) for rel, is_dir in outputs),
            *_LOCK_PATHS,
        ]


def read_record(step: Step, strict: bool = False) -> dict[str, Any]:
    """The step's record ({} if none). `strict` (a launch): a damaged one
    is an error, since the run it names may still be going."""
    try:
        data = json.loads(step.files.record.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        data = None
    if isinstance(data, dict):
        return data
    if strict:
        raise SubstraxError(
            f"step {step.name!r}: its record {step.files.record} is damaged, so its last run is unknown "
            "and may still be going. Stop any run of it still going (`substrax-compute status`, then "
            f"`substrax-compute cancel RUN`), then remove {step.files.record} and run again"
        )
    return {}


def write_record(step: Step, **changes: Any) -> None:
    path = step.files.record
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_json_atomic(path, {**read_record(step), "step": step.name, **changes})


def key_parts(step: Step) -> dict[str, Any]:
    """Everything that decides the outputs, split so `why` can name what
    changed. Raises SubstraxError when the inputs are refused."""
    spec = step.spec
    cache = manifest_cache.HashCache.load(step.files.inputs_cache)
    try:
        manifest = manifest_cache.build_manifest(step.root, _input_paths(step), cache.entries)
    except manifest_cache.ManifestError as exc:
        raise SubstraxError(f"step {spec.step!r}: inputs refused: {exc}") from None
    finally:
        cache.save()
    files = {e["path"]: e.get("sha256") or e.get("target") or e["type"] for e in manifest["entries"]}
    # Only when declared: the key of a step without checkpoints is the one
    # it had before they existed (no rerun after an upgrade).
    declared: dict[str, Any] = {"checkpoints": spec.checkpoints} if spec.checkpoints is not None else {}
    environment = environment_lock(step.root)
    if step.python is not None and not environment:  # a lock file's environment names its own Python
        declared["interpreter"] = interpreter.described(step.python, step.root_str)
    return {
        **declared,
        "command": spec.command,
        "env": spec.env,
        "timeout": spec.timeout,
        "outputs": spec.outputs,
        "resources": spec.resources,
        "secrets": spec.forward_env,
        "backend": step.backend,
        "settings": canonical_digest(settings_in_key(step.settings)),
        "inputs": files,
        "missing_inputs": manifest["missing"],
        "environment": environment,
        "view": VIEW_RULE,
    }


def key(parts: dict[str, Any]) -> str:
    return canonical_digest(parts)


def _input_paths(step: Step) -> list[str]:
    """The inputs as the key sees them (a folder given without its "/" gets
    one), then the tracked files that exist."""
    root = step.root
    inputs = [i if not (root / i).is_dir() else i.rstrip("/") + "/" for i in step.spec.inputs]
    return inputs + [t for t in step.tracked if (root / t).exists()]


def environment_lock(root: Path) -> dict[str, str]:
    """The lock file the environment is built from (first found), and what
    it is read with (LOCK_COMPANIONS: in the run's view too): a new lock, a
    new env. Hashed once per process and version of the file."""
    for name in ENV_LOCK_FILES:
        digest = _file_digest(root / name)
        if digest is None:
            continue
        found = {name: digest}
        for companion in LOCK_COMPANIONS.get(name, ()):
            found[companion] = _file_digest(root / companion) or "missing"
        return found
    return {}


def _file_digest(path: Path) -> str | None:
    try:
        st = path.stat()
    except OSError:
        return None
    stamp = (str(path), st.st_mtime_ns, st.st_size, st.st_ino)
    if stamp not in _LOCK_DIGESTS:
        _LOCK_DIGESTS[stamp] = hashlib.sha256(path.read_bytes()).hexdigest()
    return _LOCK_DIGESTS[stamp]


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    """The answer to "is the step up to date?": it is when nothing says it
    must run. `reasons` are what does, in the order `why` prints them; the
    check stops at the first one, `why` asks for them all."""

    reasons: tuple[str, ...] = ()

    @property
    def up_to_date(self) -> bool:
        return not self.reasons


UP_TO_DATE = Verdict()


def status(step: Step, values: dict[str, Any] | None, *, every_reason: bool = False) -> Verdict:
    """Up to date, or why not: the one answer doit's check (step.StepCheck)
    and `substrax-compute why` both take, as doit's own `get_status` is.

    The kept proof answers first; else the full check (`reasons_to_run`),
    which stops at its first reason unless `every_reason`. A full check that
    found no reason keeps a new proof when everything it covers is older
    than the racy window (a later change cannot hide in its timestamps) and
    held still meanwhile. `values`: doit's saved values of the public task
    (None: unknown)."""
    now = proof(step)
    proofs = proof_file(step.files.proofs)
    trusting = values is None or bool(values.get(DOIT_VALUE))
    if now is not None and trusting and proofs.holds(step.name, now[0]):
        return UP_TO_DATE
    found = reasons_to_run(step, values)
    if every_reason:
        reasons = tuple(found)
    else:
        first = next(found, None)
        reasons = () if first is None else (first,)
    if reasons:
        return Verdict(reasons)
    racy_limit = time.time_ns() - int(remote_manifest.RACY_SECONDS * 1e9)
    if now is not None and now[1] < racy_limit and proof(step) == now:
        proofs.record(step.name, now[0])
    return UP_TO_DATE


def reasons_to_run(step: Step, values: dict[str, Any] | None) -> Iterator[str]:
    """The full check, as the reasons it finds, each once: the step is up to
    date when the verified run has today's key, the outputs here still have
    its digest, and doit did not forget the task. Each test decides on the
    digests alone; the diff that follows only names what changed, and says
    something whenever a test failed."""
    record = read_record(step)
    verified = record.get("verified")
    if not isinstance(verified, dict):
        yield "no verified run yet: the step has never completed (or its record was removed)"
        return
    try:
        parts = key_parts(step)
    except SubstraxError as exc:
        yield str(exc)
        return
    if verified.get("key") != key(parts):
        yield from _key_changes(step, verified, parts)
    yield from _output_changes(step, verified)
    if _forgotten_by_doit(record, values):
        yield (
            f"doit has no record of task {step.name!r} (after `doit forget`, or a new "
            "dependency file): doit runs it again"
        )


def _forgotten_by_doit(record: dict[str, Any], values: dict[str, Any] | None) -> bool:
    """doit holds no value of ours for the public task though the verified
    run was acknowledged (its doit saved its DB): `doit forget`, a rerun.
    Without our value and no acknowledgement, doit was killed before it
    saved its DB: the record is trusted (never pay twice for a run whose
    outputs are home)."""
    verified = record.get("verified") or {}
    no_value = values is not None and not values.get(DOIT_VALUE)
    return no_value and verified.get("run_id") == record.get("acknowledged")


def proof(step: Step) -> tuple[str, int] | None:
    """The step's proof as things stand now, and the newest ctime it covers;
    None if the step has no record (never up to date) or a path is refused.
    It reads no file."""
    walked = step.walked_paths
    if walked is None:
        return None
    try:
        st = step.files.record.stat()
    except OSError:
        return None
    items: list[Any] = [step.declared, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    if step.python is not None:  # another Python found on PATH, or its binary replaced
        items.append(interpreter.stamp(step.python))
    newest = tree.walk_checked(step.root_str, walked, items)
    return tree.stamp_of(items), max(newest, st.st_ctime_ns)


def _key_changes(step: Step, verified: dict[str, Any], new: dict[str, Any]) -> Iterator[str]:
    """The verified run's key is not today's: each part that changed, naming
    the paths; something, even when the record's parts cannot say what."""
    old = verified.get("key_parts")
    old = old if isinstance(old, dict) else {}
    said = False
    for reason in _part_changes(step, verified, old, new):
        said = True
        yield reason
    if not said:
        differ = sorted(part for part in set(old) | set(new) if old.get(part) != new.get(part))
        yield (
            f"the key changed ({', '.join(differ)})" if differ else
            f"the verified run's key is not the one its own parts give: the record {step.files.record} "
            "is damaged, so the step runs again"
        )


def _part_changes(
    step: Step, verified: dict[str, Any], old: dict[str, Any], new: dict[str, Any]
) -> Iterator[str]:
    # Another backend first, in one line: its settings are another table's,
    # and a key-by-key diff of the two would only bury that line.
    moved = old.get("backend") != new.get("backend")
    if moved:
        yield f"backend changed: {old.get('backend')} -> {new.get('backend')}"
    if old.get("view") != new["view"]:
        yield (
            "the run's view changed: runs now see only the step's declared inputs (and the lock file), "
            "so the step runs once more under that rule"
        )
    for field in KEY_FIELDS:
        if field != "backend" and old.get(field) != new.get(field):
            yield _field_change(field, old.get(field), new.get(field))
    if not moved and old.get("settings") != new.get("settings"):
        yield _settings_change(step, _pinned_settings(step, str(verified.get("run_id"))))
    old_inputs: dict[str, Any] = old.get("inputs") or {}
    new_inputs: dict[str, Any] = new["inputs"]
    for path in sorted(set(old_inputs) | set(new_inputs)):
        if path not in new_inputs:
            yield f"input removed: {path}"
        elif path not in old_inputs:
            yield f"input added: {path}"
        elif old_inputs[path] != new_inputs[path]:
            yield f"input changed: {path}"
    was_missing = old.get("missing_inputs") or []
    for path in new["missing_inputs"]:
        if path not in was_missing:
            yield f"input missing: {path}"


def _field_change(field: str, old: Any, new: Any) -> str:
    """A part of the key that changed, in words."""
    if field == "environment":
        return _environment_change(old or {}, new or {})
    if field == "interpreter":
        return (
            f"interpreter changed: the command's Python was {old or 'not part of the key'}, "
            f"now {new or 'not part of the key (a lock file names the environment)'}"
        )
    return f"{field} changed: was {old!r}, now {new!r}"


def _environment_change(old: dict[str, str], new: dict[str, str]) -> str:
    """Which lock file changed, in words: the key holds their sha256s, which
    tell a user nothing."""
    was = next((name for name in old if name in ENV_LOCK_FILES), None)
    now = next((name for name in new if name in ENV_LOCK_FILES), None)
    if was is None:
        return f"environment changed: {now} appeared, the environment is built from it now"
    if now is None:
        return f"environment changed: {was} is gone, the step now runs without a locked environment"
    if was != now:
        return f"environment changed: it is built from {now} now, no longer from {was}"
    changed = [name for name in [was, *sorted(set(old) | set(new))] if old.get(name) != new.get(name)]
    return f"environment changed: {', '.join(dict.fromkeys(changed))} changed"


def _pinned_settings(step: Step, run_id: str) -> dict[str, Any] | None:
    """The backend settings the run was made with (None: its handle is
    unreadable)."""
    try:
        return step.files.store.read(run_id).settings
    except HandleError:
        return None


def _output_changes(step: Step, verified: dict[str, Any]) -> Iterator[str]:
    """The outputs here against the verified run's: the test is their
    manifest's digest (files hashed through the outputs' hash cache, so an
    untouched tree costs a stat per file); the names come from a diff with
    the run's manifest file."""
    outputs = list(step.spec.outputs)
    cache = manifest_cache.HashCache.load(step.files.outputs_cache)
    try:
        actual = manifest_cache.build_manifest(step.root, outputs, cache.entries)
    except manifest_cache.ManifestError as exc:
        refused: str | None = str(exc)
    else:
        refused = None
    finally:
        cache.save()
    if refused is not None:
        yield f"outputs: refused: {refused}"
        return
    if not actual["missing"] and actual["digest"] == verified.get("digest"):
        return
    yield from (f"outputs: missing output: {out}" for out in actual["missing"])
    try:
        expected = json.loads(Path(str(verified.get("manifest_file"))).read_text())
        differences = manifest_cache.diff_manifests(expected, actual)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        yield (
            "outputs: they are not the verified run's, and that run's manifest "
            f"{verified.get('manifest_file')} is gone or damaged, so which ones changed cannot be said"
        )
        return
    # A missing output is named once, not again by the entry-by-entry diff.
    gone = set(actual["missing"])
    shown = [
        f"outputs: {line}" for line in differences
        if not (line.startswith("missing: ") and line[len("missing: "):].split(" (")[0] in gone)
    ]
    yield from shown
    if not actual["missing"] and not shown:
        yield (
            f"outputs: their entries are the verified manifest's but their digest is not the one "
            f"recorded ({verified.get('digest')!r}): the record {step.files.record} is damaged"
        )


def _settings_change(step: Step, pinned: dict[str, Any] | None) -> str:
    """Which backend settings differ from those pinned in the verified run."""
    table = f"[tool.substrax.compute.backends.{step.backend}]"
    if pinned is None:
        return f"settings changed: the backend settings {table} differ from the verified run's"
    pinned, now = settings_in_key(pinned), settings_in_key(step.settings)
    keys = sorted(k for k in set(pinned) | set(now) if pinned.get(k) != now.get(k))
    changes = ", ".join(f"{k} was {pinned.get(k)!r}, now {now.get(k)!r}" for k in keys)
    return f"settings changed in {table}: {changes or 'the backend changed'}"
