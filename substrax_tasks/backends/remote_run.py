"""What the ssh and skypilot backends share: a run's folder on a machine
reached over ssh, and the scripts, environment and files it is made of.

`RemoteRun` is one run's folder there: remote/control.py's status and
remove, its log (and the copy of it kept here once the folder goes), and
the verified copy's fetch: the manifest the worker wrote as the command
ended (`<run dir>/manifest.json`), then the outputs by rsync into a fresh
local staging folder. The chain verifies the copy against that manifest;
nothing here decides whether it matches.

Nothing installed there is run unchecked: every script runs through
CHECKED_RUN, which compares each script of the bin folder with the sha256
of the one this client sent, refuses anything else there Python could
import in a script's place (byte code included), then runs the one asked
for, isolated from the host's own Python path (ISOLATED). A host that
changed one is damaged (DamagedHost), never obeyed; and each answer a host
sends back is held to a size (a status line to MAX_STATUS_BYTES, the log
stream to the log's limit), so even a host whose Python itself lies cannot
make this side write or hold without end.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import secrets
import shutil
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any, Protocol, cast

from substrax_tasks._remote import manifest as remote_manifest
from substrax_tasks._remote import runfiles
from substrax_tasks.backends import gpus as _gpus
from substrax_tasks.backends.base import MAX_LOG_BYTES, Backend, Fetched, RunStatus, log_cut_note
from substrax_tasks.backends.checkpoints import Snapshots
from substrax_tasks.backends.job import damaged_status, status_from_record
from substrax_tasks.backends.scripts import REMOTE_SCRIPTS, remote_script
from substrax_tasks.backends.state import RemoteState
from substrax_tasks.console import emit
from substrax_tasks.constants import TABLE
from substrax_tasks.errors import BackendError, HostRefused
from substrax_tasks.interrupts import check_interrupted
from substrax_tasks.store.handle import RunHandle
from substrax_tasks.transports.base import DiskFullHere, Transport, checked_manifest
from substrax_tasks.transports.openssh import MAX_ANSWER_BYTES, AnswerOverdue, AnswerTooBig, RemoteResult

# How long a host may take to answer a helper (docs/ssh.md "On the host").
# A short answer (a check, a status, a cancel, a small read) is whole
# within SHORT_ANSWER_SECONDS: each takes well under a second, and two
# minutes leave room for a host at a load of tens, or a connection
# opened anew. A long one (hashing an output or a checkpoints tree, a
# push or a restore, an environment's build) has no size-bound length:
# its helper writes a progress line (PROGRESS_LINE) at least every
# PROGRESS_SECONDS while it works (asked for through the variable
# remote_manifest.PROGRESS_VARIABLE), and the client gives up only once
# QUIET_ANSWER_SECONDS go by with nothing from it (60 lines missed).
# Its progress counts towards the answer's byte cap, so a host that
# sends progress without end is still bounded. The environment
# variable shrinks both, for tests only (no one waits minutes for a hang).
_TEST_ANSWER_SECONDS = os.environ.get("SUBSTRAX_TEST_ANSWER_SECONDS")
SHORT_ANSWER_SECONDS = float(_TEST_ANSWER_SECONDS or 120)
QUIET_ANSWER_SECONDS = float(_TEST_ANSWER_SECONDS or 120)
PROGRESS_LINE = remote_manifest.PROGRESS_LINE
PROGRESS_SECONDS = 2.0
MANIFEST_FILE = "manifest.json"  # in the run's folder, written by the worker as the command ended
LOG_CHUNK = 1 << 20
# The most a script's one-line JSON answer (a status, the environment's
# folder, the GPUs) may be: real ones are a few KiB. A manifest may be far
# bigger and is held to MAX_ANSWER_BYTES.
MAX_STATUS_BYTES = 1 << 20
# A follower still going this long after the run's lifetime ended (its
# timer removes the run's folder) is not ours to wait on: the status is read.
FOLLOW_PAST_LIFETIME_SECONDS = 120.0
# How CHECKED_RUN says that a script differs from the one sent: its exit
# status and the start of its last stderr line (then the names, as JSON).
DAMAGED_EXIT = 86
DAMAGED_MARK = "substrax-damaged-scripts:"
# How every script runs on a host, the check first: isolated (-I: no
# PYTHON* variable, no user site, not the script's own folder, nor the
# working folder, on sys.path), without the site module (-S: no
# site-packages, no .pth file, no sitecustomize or usercustomize) and
# without writing byte code (-B). The scripts are stdlib only, so what
# Python then reads is its own standard library and the bin folder's
# scripts (each adds its folder to sys.path for its siblings), nothing a
# host put elsewhere on its path. One argument, `-ISB`: Python 3.8 takes
# the flags together, and control.py finds a run's workers by the first
# three words of their command line. (The host's python3 itself, and its
# standard library, are the host's: no check from here can vouch for them.)
ISOLATED = "-ISB"
# `python3 -ISB -c CHECKED_RUN BIN_DIR DIGESTS NAME ARGS...`: Python 3.8 and
# stdlib only. Every script of the bin folder is hashed (the worker imports
# its siblings), and the folder must hold nothing else Python could import
# in a script's place: byte code (__pycache__: -B means no run of this
# client ever writes one there, so one found was put there, and Python
# -B still reads it), a package, an extension module or another module.
# Then the interpreter becomes `python3 -ISB BIN_DIR/NAME ARGS...`, the
# same argv in /proc, by which control.py finds a run's workers. A host
# that swaps a script in the moment between is hostile; what bounds it is
# the caps on its answers.
# A bin folder that is gone altogether is no damage: the host restarted
# with an empty scratch disk, or its remote root was removed (a lost run,
# which the status read then says: RemoteRun.status). Its own exit status
# and words, so that a checkpoint pull or a follower that meets it first
# fails as any unreachable read does, never as a tampered host.
SCRIPTS_GONE_EXIT = 87
# Written last by an install into the bin folder: the scripts are all there.
INSTALLED_MARK = ".complete"
# `sh -c REMOVE_OTHERS sh BIN_DIR NAME...`: every entry of the bin folder
# but the names given (dot files too), removed.
REMOVE_OTHERS = (
    'cd -- "$1" && shift && for entry in * .[!.]* ..?*; do '
    '[ -e "$entry" ] || [ -L "$entry" ] || continue; keep=; '
    'for name in "$@"; do [ "$entry" = "$name" ] && keep=1; done; '
    '[ -n "$keep" ] || rm -rf -- "$entry" || exit 1; done'
)
CHECKED_RUN = """\
import hashlib, importlib.machinery, json, os, sys
folder, expected, name = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
if not os.path.isdir(folder):
    sys.stderr.write("substrax: the scripts folder %s is gone from this host (restarted with an empty disk, "
                     "or its remote root removed)\\n" % folder)
    sys.exit(GONE)
changed = []
for script in sorted(expected):
    try:
        with open(os.path.join(folder, script), "rb") as f:
            data = f.read(4 << 20)
    except OSError:
        data = b""
    if hashlib.sha256(data).hexdigest() != expected[script]:
        changed.append(script)
importable = tuple(importlib.machinery.all_suffixes())
for entry in sorted(os.listdir(folder)):
    if entry not in expected and (entry.endswith(importable) or os.path.isdir(os.path.join(folder, entry))):
        changed.append(entry)
if changed or name not in expected:
    sys.stderr.write("%s%s\\n" % (MARK, json.dumps(changed or [name])))
    sys.exit(EXIT)
os.execv(sys.executable, [sys.executable, ISOLATED, os.path.join(folder, name)] + sys.argv[4:])
""".replace("MARK", repr(DAMAGED_MARK)).replace("EXIT", str(DAMAGED_EXIT))
CHECKED_RUN = CHECKED_RUN.replace("GONE", str(SCRIPTS_GONE_EXIT)).replace("ISOLATED", repr(ISOLATED))


class Remote(Protocol):
    """A machine that runs commands: an SSH host or a SkyPilot cluster."""

    @property
    def host(self) -> str: ...

    def run(
        self, argv: list[str], *, stdin: bytes | None = None, timeout: float | None = 120,
        limit: int = MAX_ANSWER_BYTES, moving: bool = False, longest: float | None = None,
    ) -> RemoteResult: ...

    def stream(self, argv: list[str], out: Callable[[bytes], None], tick: Callable[[], None]) -> RemoteResult:
        """Run argv for as long as it goes, stdout to `out`, `tick` every
        fraction of a second; closing its stdin ends it (see _ssh.py)."""
        ...


@functools.cache
def scripts_digest() -> str:
    """Names the folder the remote scripts are uploaded to: a run uses the
    scripts it was launched with, even after an upgrade here. Once per
    process: the installed scripts do not change under it, and every
    command sent to a host asks (checked_script)."""
    digest = hashlib.sha256()
    for name in REMOTE_SCRIPTS:
        digest.update(remote_script(name).read_bytes())
    # And how they are checked and run: a folder another release ran its
    # scripts from (one without -B may have written byte code there) is
    # never taken for this one's.
    digest.update(CHECKED_RUN.encode())
    return digest.hexdigest()[:12]


@functools.cache
def script_digests() -> dict[str, str]:
    """The sha256 of each script this installation sends (once per process,
    as scripts_digest)."""
    return {name: hashlib.sha256(remote_script(name).read_bytes()).hexdigest() for name in REMOTE_SCRIPTS}


def checked_script(python: str, bin_dir: str, name: str, *args: str) -> list[str]:
    """argv that runs `bin_dir/name` there only if every script in bin_dir is
    the one this installation sent (CHECKED_RUN). A bin folder of another
    release's scripts (a run launched before an upgrade here) cannot be
    checked from here: its scripts run as they are, as before."""
    if PurePosixPath(bin_dir).name != f"bin-{scripts_digest()}":
        return [python, f"{bin_dir}/{name}", *args]
    return [python, ISOLATED, "-c", CHECKED_RUN, bin_dir, json.dumps(script_digests(), sort_keys=True), name,
            *args]  # fmt: skip


class DamagedHost(HostRefused):
    """A script installed on the host is not the one this client sent, or
    something Python would import in a script's place lies beside them
    (`scripts`: the names CHECKED_RUN found)."""

    def __init__(self, message: str, scripts: list[str] | None = None) -> None:
        super().__init__(message)
        self.scripts = scripts or []


def damage_said(names: list[str], where: str) -> str:
    """What CHECKED_RUN found in the bin folder (`where`: "in BIN on HOST",
    "there"), in words: the scripts changed or removed, and what was put
    beside them."""
    changed = [name for name in names if name in REMOTE_SCRIPTS]
    foreign = [name for name in names if name not in REMOTE_SCRIPTS]
    said = []
    if changed:
        said.append(f"the script(s) {', '.join(changed)} {where} are not the ones this client installed "
                    "(changed or removed after the install)")  # fmt: skip
    if foreign:
        said.append(f"{', '.join(foreign)} {where} was not installed by this client (byte code, a package "
                    "or a module that Python would import in place of the scripts it sent)")  # fmt: skip
    return "; ".join(said)


def damaged_scripts(result: RemoteResult) -> list[str] | None:
    """The scripts CHECKED_RUN found changed, if that is why `result` failed."""
    if result.returncode != DAMAGED_EXIT:
        return None
    for line in reversed(result.stderr.decode(errors="replace").splitlines()):
        if line.startswith(DAMAGED_MARK):
            try:
                names = json.loads(line[len(DAMAGED_MARK) :])
            except ValueError:
                return None
            return [str(n) for n in names] if isinstance(names, list) else None
    return None


def helper_named(name: str, args: tuple[str, ...]) -> str:
    """How a helper call is named in messages: the script without .py and
    its operation if it takes one (`checkpoints list`, `control status`,
    `manifest`), never the start of the python -c that checks it."""
    script = name.removesuffix(".py")
    if args and args[0].isidentifier():
        return f"{script} {args[0]}"
    return script


def without_progress(result: RemoteResult) -> RemoteResult:
    """`result` with the progress lines a long helper wrote taken out of its
    stderr: they said it was working, and are no part of what it said."""
    if PROGRESS_LINE not in result.stderr:
        return result
    kept = b"".join(line for line in result.stderr.splitlines(keepends=True) if line != PROGRESS_LINE)
    return RemoteResult(result.returncode, result.stdout, kept)


def forwarded_env(handle: RunHandle) -> dict[str, str]:
    """The secrets named by the step, read from this process now: sent on
    stdin, never written to a file here or there."""
    return {name: os.environ[name] for name in handle.spec.forward_env if name in os.environ}


def read_kept_log(kept: Path, offset: int) -> bytes | None:
    """The log kept here once the run's folder went, from `offset`; None if none is kept."""
    try:
        with kept.open("rb") as f:
            f.seek(offset)
            return f.read(LOG_CHUNK)
    except FileNotFoundError:
        return None


@dataclass(frozen=True)
class RemoteRun:
    """One run's folder on `remote`, and the scripts uploaded beside it."""

    remote: Remote
    python: str
    bin_dir: str
    run_dir: str
    # When (time.time()) the run's lifetime timer removes its folder there,
    # if known: a long answer that goes on sending progress is not waited
    # on past it (and a quiet spell).
    lifetime_end: float | None = None

    @property
    def run_id(self) -> str:
        return PurePosixPath(self.run_dir).name

    def script(self, name: str, *args: str) -> list[str]:
        return checked_script(self.python, self.bin_dir, name, *args)

    def run_script(
        self, name: str, *args: str, what: str, stdin: bytes | None = None, long: bool = False,
        limit: int = MAX_STATUS_BYTES, home: str | None = None, waits: float = 0.0,
    ) -> RemoteResult:
        """One of the scripts there, checked first (CHECKED_RUN), its answer
        held to `limit` bytes and in time (SHORT_ANSWER_SECONDS; `long`:
        QUIET_ANSWER_SECONDS after its last progress line, which are taken
        out of its stderr): a damaged host, an answer too big or too late
        is refused with the helper, the host and this run named. `home`:
        run it in that folder with it as $HOME (where ssh lands may be
        another home: a SkyPilot job's on Slurm is not the login's).
        `waits`: seconds the helper is asked to wait there (a cancel's
        grace), on top of the deadline."""
        argv = self.script(name, *args)
        if long:  # its progress lines asked for (env: POSIX, and argv stays a list)
            argv = ["env", f"{remote_manifest.PROGRESS_VARIABLE}={PROGRESS_SECONDS:g}", *argv]
        if home is not None:
            argv = ["sh", "-c", 'cd -- "$1" && shift && HOME="$PWD" && export HOME && exec "$@"', "sh", home,
                    *argv]  # fmt: skip
        result = self.ask(argv, helper_named(name, args), what, stdin=stdin, limit=limit, long=long,
                          waits=waits)  # fmt: skip
        self.refuse_damaged(result)
        if long:
            result = without_progress(result)
        return result

    def ask(
        self, argv: list[str], helper: str, what: str, *, stdin: bytes | None = None,
        limit: int = MAX_STATUS_BYTES, long: bool = False, waits: float = 0.0,
    ) -> RemoteResult:
        """argv's answer from the host, bounded in bytes and time; either
        bound missed is said naming `helper` (what runs there), the host
        and this run."""
        seconds = (QUIET_ANSWER_SECONDS if long else SHORT_ANSWER_SECONDS) + waits
        longest = None
        if long and self.lifetime_end is not None:
            longest = max(self.lifetime_end - time.time(), 0.0) + QUIET_ANSWER_SECONDS
        try:
            return self.remote.run(argv, stdin=stdin, timeout=seconds, limit=limit, moving=long,
                                   longest=longest)  # fmt: skip
        except AnswerTooBig as exc:
            raise HostRefused(f"{what} for run {self.run_id}: {exc}") from None
        except AnswerOverdue as exc:
            if exc.moving:
                quiet = f"sent nothing for {seconds:g} s"
            elif exc.seconds == longest:
                quiet = f"gave no answer within {exc.seconds:.0f} s, past the run's lifetime"
            else:
                quiet = f"gave no answer within {seconds:g} s"
            raise BackendError(
                f"{what} for run {self.run_id}: `{helper}` on {self.remote.host} {quiet}; given up on "
                "(the host is overloaded, stalled or hostile: see that its python3 runs, then run doit again)"
            ) from None

    def refuse_damaged(self, result: RemoteResult) -> None:
        changed = damaged_scripts(result)
        if changed is not None:
            raise DamagedHost(
                f"run {self.run_id}: {damage_said(changed, f'in {self.bin_dir} on {self.remote.host}')}: the "
                "host is damaged or tampered with, and nothing is run there. "
                f"`substrax-compute teardown {self.run_id}` puts the scripts back (and removes what "
                "was put beside them), stops the run and removes its folder",
                changed,
            )

    def reinstall(self) -> None:
        """Put the scripts this client sent back in the bin folder, and
        remove everything else from it but the install's mark (a damaged
        host's: only the teardown does this, to stop and remove the run)."""
        write = 'umask 077 && mkdir -p "$1" && cat > "$1/$2.$3" && mv "$1/$2.$3" "$1/$2"'
        for name in REMOTE_SCRIPTS:
            temp = f"{secrets.token_hex(6)}.tmp"
            self.check(["sh", "-c", write, "sh", self.bin_dir, name, temp], f"reinstalling {name}",
                       stdin=remote_script(name).read_bytes())  # fmt: skip
        self.check(["sh", "-c", REMOVE_OTHERS, "sh", self.bin_dir, INSTALLED_MARK, *REMOTE_SCRIPTS],
                   "removing what was put beside the scripts")  # fmt: skip

    def check(self, argv: list[str], what: str, stdin: bytes | None = None) -> RemoteResult:
        result = self.remote.run(argv, stdin=stdin)
        if result.returncode != 0:
            raise result.failure(what, self.remote.host)
        return result

    def checked_script(
        self, name: str, *args: str, what: str, stdin: bytes | None = None, waits: float = 0.0
    ) -> RemoteResult:
        """run_script, failing unless it exits 0."""
        result = self.run_script(name, *args, what=what, stdin=stdin, waits=waits)
        if result.returncode != 0:
            raise result.failure(what, self.remote.host)
        return result

    def control(self, operation: str, *args: str, what: str, waits: float = 0.0) -> dict[str, Any]:
        """remote/control.py's answer (one JSON line) for this run."""
        result = self.checked_script("control.py", operation, self.run_dir, *args, what=what, waits=waits)
        return self.answer(result, what)

    def answer(self, result: RemoteResult, what: str) -> dict[str, Any]:
        try:
            data = json.loads(result.text().strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise BackendError(f"{what}: unexpected answer {result.text()[:200]!r}") from None
        if not isinstance(data, dict):
            raise BackendError(f"{what}: unexpected answer {data!r}")
        return data

    def status(self) -> runfiles.StatusAnswer:
        """The run's status record; `exists` False once its folder is gone,
        even with the scripts gone too (the host restarted with an empty
        scratch disk, or its whole remote root was removed)."""
        what = "reading the run's status"
        result = self.ask(self.script("control.py", "status", self.run_dir), "control status", what)
        if result.returncode != 0:
            # Asked only now: a lost folder is rare, a status read is not.
            # Before the scripts' check: gone with the folder, they are no damage.
            if self.remote.run(["test", "-e", self.run_dir]).returncode == 1:
                return {"state": None, "exists": False}
            self.refuse_damaged(result)
            raise result.failure(what, self.remote.host)
        # control.py's `status` answer, checked there (damage_of) as on any backend
        return cast("runfiles.StatusAnswer", self.answer(result, what))

    def follow_argv(self, offset: int, limit: int) -> list[str]:
        """remote/control.py's follower: the log from `offset` until the run
        ends (see there)."""
        return self.script("control.py", "follow", self.run_dir, str(offset), str(limit))

    def remove(self) -> None:
        """Cancel the run and remove its folder there; an error, the folder
        kept, while processes of the run that would not stop are alive."""
        answer = self.control("remove", what="removing the run folder")
        if answer.get("removed") is False and answer.get("reason"):
            raise BackendError(f"run folder {self.run_dir} on {self.remote.host} kept: {answer['reason']}")

    def read_log(self, offset: int) -> bytes:
        """The run's log there from `offset` (b"" when there is none)."""
        # Only a regular file: a log replaced by a link or a device
        # (/dev/zero) would be read without end. The worker writes a
        # regular file, so anything else was put there behind its back.
        tail = (
            'if [ -L "$2" ] || { [ -e "$2" ] && [ ! -f "$2" ]; }; then exit 3; fi; '
            'tail -c +"$1" "$2" 2>/dev/null | head -c "$3"'
        )
        log = f"{self.run_dir}/run.log"
        result = self.remote.run(["sh", "-c", tail, "sh", str(offset + 1), log, str(LOG_CHUNK)])
        if result.returncode == 3:
            raise HostRefused(
                f"the run's log {log} on {self.remote.host} is not a regular file (a link or a "
                "device, not what the worker writes): refused unread, and the run with it"
            )
        if result.returncode != 0:
            raise result.failure("reading the log", self.remote.host)
        return result.stdout

    def keep_log(self, kept: Path) -> None:
        """Copy the log here before the run's folder goes: teardown keeps
        the handle and the logs."""
        partial = kept.with_name(kept.name + ".partial")
        offset = 0
        with partial.open("wb") as f:
            try:
                while chunk := self.read_log(offset)[: MAX_LOG_BYTES - offset]:
                    f.write(chunk)
                    offset += len(chunk)
            except HostRefused as exc:  # the run is going: keep what says why
                f.write(f"[substrax: {exc}]\n".encode())
            if offset >= MAX_LOG_BYTES:
                f.write(log_cut_note(f"the rest was not kept from {self.remote.host}"))
        partial.replace(kept)

    def manifest(self, outputs_root: str, outputs: list[str]) -> dict[str, Any]:
        """The outputs' manifest the worker wrote as the command ended. A
        run that left none (made by an older release, or its tree was
        refused) has one taken now, once, and saved beside the run: refused
        again, that is a ManifestError with remote/manifest.py's message."""
        path = f"{self.run_dir}/{MANIFEST_FILE}"
        # Exit 3 only when there is none: a broken connection must not
        # stand in a manifest of the outputs as they are now for this one.
        try:
            kept = self.remote.run(["sh", "-c", '[ -e "$1" ] || exit 3; exec cat "$1"', "sh", path])
        except AnswerTooBig as exc:
            raise HostRefused(f"reading {path} for run {self.run_id}: {exc}") from None
        if kept.returncode == 0:
            return checked_manifest(kept.stdout, f"{path} on {self.remote.host}")
        if kept.returncode != 3:
            raise kept.failure(f"reading {path}", self.remote.host)
        taken = self.run_script("manifest.py", "--", outputs_root, *outputs,
                                what="taking the outputs' manifest", long=True, limit=MAX_ANSWER_BYTES)
        said = taken.stderr.decode(errors="replace").strip()
        if taken.returncode == 1 and said.startswith("manifest.py:"):
            from substrax_tasks.uptodate.manifests import ManifestError

            raise ManifestError(said)
        if taken.returncode != 0:
            raise taken.failure("taking the outputs' manifest", self.remote.host)
        manifest = checked_manifest(taken.stdout, f"taken on {self.remote.host}")
        save = 'cat > "$1.$2" && mv "$1.$2" "$1"'  # a temp name of its own: fetches may race
        temp = f"{secrets.token_hex(6)}.partial"
        self.check(["sh", "-c", save, "sh", path, temp], "saving the outputs' manifest", stdin=taken.stdout)
        return manifest

    def fetch(
        self, transport: Transport, outputs: list[str], staging: Path, outputs_root: object = None
    ) -> Fetched:
        """The manifest, then a copy of the outputs into `staging`. A staging
        folder a fetch of this run left (verified, then not promoted: a
        promotion that failed, a doit killed before it, a second `fetch`)
        is updated, not copied afresh: the transport copies only what
        differs and removes what is not there (a file since deleted, a
        killed copy's temp files). A copy that failed or that verification
        refused is removed (promote.verify_staged), so only a copy that was
        whole is ever updated. Outputs changed on the host after the
        command ended do not match the manifest, so verification refuses
        the copy; the run's folder stays for a fetch again. `outputs_root`:
        where the outputs are there, if noted when the run was seen to end;
        otherwise its status says."""
        if not isinstance(outputs_root, str):
            outputs_root = self.status().get("outputs_root")
        if not isinstance(outputs_root, str):
            raise BackendError(f"the status of run {self.run_dir} names no outputs folder")
        manifest = self.manifest(outputs_root, outputs)
        present = [o for o in outputs if o not in manifest["missing"]]
        if present:
            try:
                transport.download(outputs_root, present, staging)
            except BaseException as exc:
                # A refused or broken copy leaves nothing behind: what it
                # brought is never verified, so it has no use here.
                shutil.rmtree(staging, ignore_errors=True)
                if isinstance(exc, DiskFullHere):  # the phase says where, what is kept, the fix
                    raise exc.full_disk() from None
                raise
        return Fetched(staging, manifest, updated_in_place=True, modes_safe=transport.writes_safe_modes)


@dataclass(frozen=True)
class SnapshotBound:
    """The most a snapshot of a step's checkpoints may take
    (`max_checkpoint_size`), and the backend whose table sets it."""

    max_bytes: int
    backend: str

    def refusal(self, total: int, largest: str, size: int) -> BackendError:
        """The one line a snapshot over the bound is refused with: checked
        from the sizes listed there, before a byte is copied."""
        return BackendError(
            f"the checkpoints there take {_size(total)} (the largest, {largest}: {_size(size)}), over "
            f"max_checkpoint_size {_size(self.max_bytes)}: not brought home, the last snapshot is kept "
            f"and the run goes on; raise max_checkpoint_size in [{TABLE}.backends.{self.backend}] to "
            "keep them"
        )

    def check_answer(self, answer: dict[str, Any]) -> None:
        """Refuse a snapshot the host found over the bound (its `over`: total,
        largest file and its size, from a stat of each)."""
        over = answer.get("over")
        if isinstance(over, dict):
            total, size = over.get("bytes"), over.get("size")
            raise self.refusal(total if isinstance(total, int) else 0, str(over.get("largest"))[:200],
                               size if isinstance(size, int) else 0)  # fmt: skip

    def check(self, entries: list[dict[str, Any]]) -> None:
        """Refuse the listed snapshot (path, size each) if it is over the bound."""
        sizes = [(int(e["size"]) if isinstance(e.get("size"), int) else 0, e["path"]) for e in entries]
        total = sum(size for size, _ in sizes)
        if total > self.max_bytes:
            size, largest = max(sizes)
            raise self.refusal(total, largest, size)


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


class Checkpointing(ABC):
    """A run's checkpoints snapshotted while it runs, every `every` seconds
    (`pull`, by the subclass). A snapshot that fails (the host out of reach
    a moment) is said and tried again at the next; the run goes on."""

    def __init__(self, run: RemoteRun, every: float, step: str, bound: SnapshotBound) -> None:
        self.run = run
        self.every = every
        self.step = step
        self.bound = bound
        self.next_at = time.monotonic() + every
        self.root: str | None = None  # where the command writes them there (its status says)
        self.failed_with: str | None = None  # why the last pull failed, as said

    @abstractmethod
    def pull(self) -> int | None:
        """One snapshot now; the number of files it holds (None: nothing to take yet)."""

    def when_due(self) -> None:
        if time.monotonic() >= self.next_at:
            try:
                self.pull()
                self.failed_with = None
            except BackendError as exc:
                # Said once while the cause stays the same (a disk full for
                # an hour is one line, not one a pull).
                if str(exc) != self.failed_with:
                    emit(f"{self.step}: checkpoints not brought home this time: {exc}", err=True)
                self.failed_with = str(exc)
            self.next_at = time.monotonic() + self.every

    def checkpoints_root(self) -> str | None:
        """Where the command writes its checkpoints there (None: not started yet)."""
        if self.root is None:
            root = self.run.status().get("checkpoints_root")
            if not isinstance(root, str):
                return None
            self.root = root
        return self.root



class CheckpointPuller(Checkpointing):
    """The snapshots brought home (backends/checkpoints.py): the worker's
    `checkpoints.py list` names the finished files there with their
    sha256, the transport copies them, and only a copy that matches is
    kept."""

    def __init__(self, run: RemoteRun, transport: Transport, snapshots: Snapshots, every: float,  # noqa: PLR0917
                 step: str, bound: SnapshotBound) -> None:  # fmt: skip
        super().__init__(run, every, step, bound)
        self.transport = transport
        self.snapshots = snapshots
        self.copied = 0  # bytes the last pull copied

    def pull(self) -> int | None:
        root = self.checkpoints_root()
        if root is None:
            return None
        began, self.copied = time.monotonic(), 0
        what = "listing the checkpoints"
        result = self.run.run_script("checkpoints.py", "list", root, str(self.bound.max_bytes), what=what,
                                     long=True, limit=MAX_ANSWER_BYTES)  # fmt: skip
        if result.returncode != 0:
            raise result.failure(what, self.run.remote.host)
        answer = self.run.answer(result, what)
        self.bound.check_answer(answer)  # over it there: nothing hashed nor copied
        entries = checked_entries(answer.get("entries"), f"{what} on {self.run.remote.host}")
        self.bound.check(entries)  # the listing's own sizes, before a byte is copied
        kept = self.snapshots.pull(entries, lambda paths, into: self._download(root, paths, into))
        # What it cost, said: a big checkpoint is copied whole at each pull.
        emit(f"{self.step}: checkpoints brought home ({kept} file(s), {self.copied / 1e6:.1f} MB copied "
             f"in {time.monotonic() - began:.1f} s)", err=True)  # fmt: skip
        return kept

    def _download(self, root: str, paths: list[str], into: Path) -> None:
        self.copied += self.transport.download(root, paths, into).bytes


class BucketCheckpointPusher(Checkpointing):
    """With the bucket transport: the snapshot goes from the machine to the
    bucket it mounts (`checkpoints.py push`: a snapshot folder and its
    manifest, then `latest.json` replaced last), not through the client."""

    def __init__(self, run: RemoteRun, every: float, step: str, dest: str, bound: SnapshotBound) -> None:
        super().__init__(run, every, step, bound)
        self.dest = dest

    def pull(self) -> int | None:
        root = self.checkpoints_root()
        if root is None:
            return None
        what = "putting a checkpoints snapshot in the bucket"
        began = time.monotonic()
        lock = f"{self.run.run_dir}/checkpoints.lock"
        limit = str(self.bound.max_bytes)
        result = self.run.run_script("checkpoints.py", "push", root, self.dest, lock, limit, what=what,
                                     long=True)  # fmt: skip
        if result.returncode != 0:
            raise result.failure(what, self.run.remote.host)
        answer = self.run.answer(result, what)
        self.bound.check_answer(answer)  # over it there: nothing copied
        files, copied = answer.get("files"), answer.get("bytes")
        size = f"{copied / 1e6:.1f} MB copied " if isinstance(copied, int) else ""
        emit(f"{self.step}: checkpoints snapshot put in the bucket ({files} file(s), {size}in "
             f"{time.monotonic() - began:.1f} s)", err=True)  # fmt: skip
        return files if isinstance(files, int) else None


def restore_from_bucket(run: RemoteRun, dest: str, kept: str, step: str) -> None:
    """The latest snapshot in the bucket (mounted at `dest` there) put in
    place before the command starts, each file checked against its manifest."""
    what = "putting the checkpoints in place from the bucket"
    result = run.run_script("checkpoints.py", "restore", dest, kept, what=what, long=True)
    if result.returncode != 0:
        said = result.stderr.decode(errors="replace").strip().splitlines()
        raise BackendError(
            f"{step}: the latest checkpoints snapshot in the bucket could not be put in place "
            f"({said[-1] if said else f'exit {result.returncode}'}); remove the snapshot folder "
            f"{dest} in the bucket to start the step from nothing"
        )
    files = run.answer(result, what).get("files")
    if files:
        emit(f"{step}: checkpoints put in place from the bucket's last snapshot ({files} file(s))")


def pull_as_ended(puller: Checkpointing | None, step: str) -> None:
    """What the command left as it ended, kept: the next run starts from it.
    A failure is said, not raised: the snapshot kept before stays."""
    if puller is None:
        return
    try:
        puller.pull()
    except BackendError as exc:
        emit(f"{step}: the last checkpoints were not kept: {exc}", err=True)


def checked_entries(listed: object, where: str) -> list[dict[str, Any]]:
    """The host's list of finished checkpoint files, each a plain relative
    path with a size and a sha256: anything else is refused, never copied."""
    if not isinstance(listed, list):
        raise HostRefused(f"{where}: not a list of files")
    entries = []
    for entry in listed:
        path = entry.get("path") if isinstance(entry, dict) else None
        digest = entry.get("sha256") if isinstance(entry, dict) else None
        parts = PurePosixPath(path).parts if isinstance(path, str) else ()
        if (not parts or path.startswith("/") or ".." in parts or not isinstance(digest, str)  # type: ignore[union-attr]
                or len(digest) != 64):  # fmt: skip
            raise HostRefused(f"{where}: refused the entry {str(entry)[:200]}")
        entries.append({"path": path, "size": entry.get("size"), "sha256": digest})
    return entries


def push_checkpoints(
    run: RemoteRun, upload: Callable[[Path, list[str], str], object], snapshots: Snapshots, kept: str,
    step: str,
) -> None:
    """The latest verified snapshot put in place there (`upload(local
    folder, paths, remote folder)`) before the command starts."""
    run.check(["mkdir", "-p", "-m", "700", kept], "making the checkpoints folder")
    latest = snapshots.latest()
    if latest is None:
        return
    files, manifest = latest
    upload(files, sorted(manifest), kept)
    emit(f"{step}: checkpoints put in place from the last snapshot ({len(manifest)} file(s))")


class _LogFull(Exception):
    """The follower sent the log up to its limit (or, from a lying host, past it)."""


class _FollowOverdue(Exception):
    """The follower outlived the run's lifetime."""


def follow_log(backend: Backend, handle: RunHandle, out: IO[bytes], offset: int, run: RemoteRun,  # noqa: PLR0917
               checkpoints: Checkpointing | None = None) -> RunStatus:  # fmt: skip
    """A run's log from `offset` to `out` until it ends, through one
    follower there (control.py follow: one channel, the status read there
    each tick) instead of a status and a log read started every fraction of
    a second; then its status, read once. The base's polling reads the log
    again only when the follower did not see the end (the connection broke)
    or the log was cut: when it did, what it sent is the whole log (it reads
    the log after the status that says the run ended). Nothing past the
    log's limit is taken, whatever the host sends: the stream is closed
    there and the cut noted once, as for any log that long; nor is the
    follower waited on past the run's lifetime."""
    room = max(MAX_LOG_BYTES - offset, 0)
    sent = 0
    left = backend.lifetime_left(handle)
    deadline = None if left is None else time.monotonic() + left + FOLLOW_PAST_LIFETIME_SECONDS

    def tick() -> None:
        check_interrupted()
        backend.check_recorded(handle)  # the store deleted under the run: torn down
        if deadline is not None and time.monotonic() > deadline:
            raise _FollowOverdue
        if checkpoints is not None:
            checkpoints.when_due()

    def write(chunk: bytes) -> None:
        nonlocal sent
        chunk = chunk[: room - sent]
        out.write(chunk)
        out.flush()
        sent += len(chunk)
        if sent >= room:
            raise _LogFull

    # Ctrl-C in a doit thread is seen within a tick; the stream then closes
    # the follower's stdin, which ends it there.
    try:
        result = run.remote.stream(run.follow_argv(offset, MAX_LOG_BYTES), write, tick)
    except _LogFull:
        result = RemoteResult(0, b"", b"")
    except _FollowOverdue:  # as a broken connection: the polling below reads the status
        result = RemoteResult(-1, b"", b"")
    offset += sent
    run.refuse_damaged(result)
    if result.returncode == 3:
        raise HostRefused(
            f"the run's log {run.run_dir}/run.log on {run.remote.host} is not a regular file "
            "(a link or a device, not what the worker writes): refused unread, and the run with it"
        )
    status = backend.poll(handle)
    if status.final and result.returncode == 0 and offset < MAX_LOG_BYTES:
        return status
    # The rest of the log, or the cut noted; and, for a run still going, the
    # polling that follows it: the follower's connection broke (a network
    # blip must not fail a run that goes on there; a host that stays out of
    # reach fails the polling's reads) or, not expected, it ended early.
    return Backend.stream_log(backend, handle, out, follow=not status.final, offset=offset)


def lifetime_end(left: float | None) -> float | None:
    """When (time.time()) a run with `left` seconds of lifetime has none."""
    return None if left is None else time.time() + left


def lifetime_left(state: RemoteState, now: float | None = None) -> float | None:
    """From the lifetime timer the launch armed where the run runs (its
    `watchdog` record: when, for how long), until the run is torn down."""
    timer = state.watchdog
    if state.torn_down or timer is None:
        return None
    armed, seconds = timer.get("armed_at"), timer.get("seconds")
    if not isinstance(armed, (int, float)) or not isinstance(seconds, (int, float)):
        return None
    return float(armed) + float(seconds) - (time.time() if now is None else now)


# ---- A run's worker on a machine over ssh: what the ssh and skypilot
# backends do alike once the run's folder, files and job are there.


def start_worker(
    run: RemoteRun, handle: RunHandle, job_file: str, gpus: Any, where: str, *, home: str | None = None
) -> None:
    """Start the worker of the job in `job_file` there, detached (it
    outlives this connection), in `home` if given (RemoteRun.run_script);
    the step's secrets go on its stdin."""
    result = run.run_script("worker.py", job_file, "--detach", "--env-stdin", what="starting the worker",
                            stdin=json.dumps(forwarded_env(handle)).encode(), home=home)  # fmt: skip
    if result.returncode == _gpus.WORKER_BUSY:
        raise _gpus.busy(gpus, where)
    if result.returncode != 0:
        raise BackendError(
            f"run {handle.run_id}: the worker did not start on {where}: "
            + (result.stderr + result.stdout).decode(errors="replace")[-1500:]
        )


def worker_status(backend: Backend, handle: RunHandle, run: RemoteRun, where: str) -> RunStatus:
    """The run's status from its worker's record there (remote/control.py's
    status); a final one is kept in the handle."""
    record = run.status()
    if record.get("damaged"):
        return damaged_status(record, where)
    if record.get("state") is None:
        if not record.get("exists"):
            gone = "its remote folder is gone (torn down, the lifetime ran out, or the host restarted)"
            return RunStatus("lost", message=gone)
        return RunStatus("pending")
    status = status_from_record(record, worker_alive=bool(record.get("worker_alive")))
    if status.final and status.state != "lost":  # a lost run can still be cancelled
        # outputs_root too: the fetch then starts without asking for it
        root = record.get("outputs_root")
        noted = {"outputs_root": root} if isinstance(root, str) else {}
        backend.save_state(handle, final_status=status.__dict__, **noted)
    return status


def cancel_worker(backend: Backend, handle: RunHandle, run: RemoteRun, status: RunStatus, *, where: str,
                  grace_seconds: float) -> bool:  # fmt: skip
    """Stop the run's tree there (its worker, or what is left of it), not
    the machine; False when there was nothing left to stop."""
    if status.state == "lost" and not run.status().get("exists"):
        return False  # its folder is gone (torn down, or the lifetime ran out): nothing left
    # lost: its worker was killed, but the task's tree may still run
    # It waits there up to its grace and 10 s for the tree to stop: a
    # long grace must not be cut by the deadline of a short answer.
    answer = run.control("cancel", "--wait", str(grace_seconds + 10), what="cancelling the run",
                         waits=grace_seconds + 10)  # fmt: skip
    if answer.get("reason") == "not started":
        return True
    if answer.get("reason") == "finished":  # it ended meanwhile: left alone
        backend.poll(handle)
        return False
    if not answer.get("cancelled"):
        raise BackendError(f"run {handle.run_id}: cancel on {where} failed: {answer.get('reason')}")
    # Recorded from the answer, not polled again: a doit driving the run
    # may tear its folder down the moment it sees the end.
    with contextlib.suppress(BackendError):
        backend.poll(handle)
    kept = backend.State.of(backend.store.read(handle.run_id))
    if isinstance(kept, RemoteState) and kept.final_status is None:
        ended = RunStatus(str(answer.get("state") or "cancelled"), message=answer.get("reason"))
        backend.save_state(handle, final_status=ended.__dict__)
    return True
