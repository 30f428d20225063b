"""The backend contract: where a run executes.

A backend is built from validated settings alone (from the project's
configuration on submit, from the handle's pinned copy ever after) and acts
on a run through its handle. Each method says when it is called and what an
implementation must guarantee; the contract tests hold every backend to it.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, ClassVar

from substrax_tasks.errors import BackendError, HandleError, RunFolderDeleted
from substrax_tasks.interrupts import check_interrupted
from substrax_tasks.slots import Pool

if TYPE_CHECKING:  # pydantic: not imported by a restore from the run cache, which needs Fetched only
    from pydantic import BaseModel

    from substrax_tasks.backends.state import BackendState
    from substrax_tasks.store.handle import RunHandle
    from substrax_tasks.store.run_store import RunStore

# The states a run's worker writes as its command ends: remote/control.py's
# FINAL_STATES (a script that runs on hosts and imports nothing of this
# package; tests/unit/test_phase.py holds the two equal). A run in one is over,
# whatever else of its records is damaged.
ENDED_BY_ITS_WORKER = frozenset({"succeeded", "failed", "timed_out", "cancelled"})
# The one final state only the client concludes: the worker vanished without
# writing one (it may have left its command's tree behind).
LOST = "lost"
FINAL_STATES = ENDED_BY_ITS_WORKER | {LOST}
LOG_POLL_SECONDS = 0.2
# The most of one run's log shown or kept here: a host that streams without
# end (a run.log replaced by /dev/zero) cannot fill this machine's disk or
# hold `logs` forever. The whole log stays in the run's folder there.
MAX_LOG_BYTES = 256 << 20


def log_cut_note(rest: str) -> bytes:
    return f"\n[substrax: the log is cut at {MAX_LOG_BYTES >> 20} MiB here; {rest}]\n".encode()


@dataclass(frozen=True)
class RunStatus:
    """What a backend knows of a run right now.

    state: pending (handle written, command not started), running,
    succeeded, failed, timed_out, cancelled, or lost (its worker vanished
    without writing a final status). gpus: the ids of the GPUs the run was
    given (held while it runs), on a backend that hands them out.
    """

    state: str
    exit_code: int | None = None
    started_at: str | None = None
    ended_at: str | None = None
    message: str | None = None
    gpus: list[str] | None = None

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES


@dataclass(frozen=True)
class Capabilities:
    """What a backend does, as data the chain reads (it never asks a
    backend's name).

    interrupt_cancels: Ctrl-C in the client cancels the run (it runs on
    this machine, tied to the client); otherwise the client detaches and the
    run goes on, reachable again by a rerun or the CLI.

    What the core needs to know of one run it asks the backend, never its
    part of the handle (`backend_state`, which the core does not read):
    whether its outputs stay where it ran until teardown
    (`outputs_available`), whether it wrote them in place (`fetch`'s root
    is the project's), where it ran (`ran_on`), whether it still holds a
    machine and for how long (`released`, `lifetime_left`). The contract
    tests bind each for every backend.
    checkpoints: a step's `checkpoints` folder is kept across its runs (in
    the store, or brought home as snapshots) and put back in place for the
    next; a step declaring one is refused before launch elsewhere.
    """

    interrupt_cancels: bool = False
    checkpoints: bool = False


@dataclass(frozen=True)
class Fetched:
    """Outputs brought to this machine, not yet verified nor promoted.

    root: a local folder holding the outputs at their project-relative
    paths; the project root itself when they were written in place (no
    sandbox), and then there is nothing to promote;
    manifest: what they must match, the manifest the worker took where the
    run ran when its command ended;
    saw_whole_project: the run could read every file of the project, not
    only its view (a local run without the sandbox): its key does not cover
    what it read, so it is never kept in the run cache;
    updated_in_place: `root` is a staging folder of the run's own that a
    fetch again updates rather than copies afresh (rsync): a copy refused by
    verification is removed, so that it never seeds the next fetch;
    modes_safe: the transport cleared the unsafe mode bits as it wrote
    every file and folder (rsync's --chmod, promote.RSYNC_SAFE_CHMOD), so
    verification needs no walk of its own to clear them: it compares every
    mode with the safe manifest, and refuses one that is not safe.
    """

    root: Path
    manifest: dict[str, Any]
    saw_whole_project: bool = False
    updated_in_place: bool = False
    modes_safe: bool = False


@dataclass(frozen=True)
class Leak:
    """A remote run folder or a cluster no live handle accounts for."""

    backend: str
    where: str  # the host, or "SkyPilot"
    name: str  # the folder's path there, or the cluster's name
    ours: bool  # provably this project's: `gc --machines` removes it
    remove: Callable[[], None] = field(compare=False, repr=False)
    # Kept on purpose, not leaked: a machine left warm for the next step
    # (what holds it, and for how long); `gc --machines` removes it all the same.
    warm: str | None = field(default=None, compare=False)
    # What it is when neither a run folder nor a cluster: an environment a host built, unused for days.
    kind: str | None = field(default=None, compare=False)


@dataclass(frozen=True)
class KeptCheckpoints:
    """The checkpoints of one step and key, kept in the store or by a
    backend elsewhere (a bucket): what `gc` removes once no step of the
    dodo has that key."""

    step: str  # the step's name as folders carry it (spec.safe_name)
    key: str  # the key's folder name (its start)
    where: str  # a path, or a bucket's URI
    remove: Callable[[], None] = field(compare=False, repr=False)



class Backend(ABC):
    name: ClassVar[str]
    Settings: ClassVar[type[BaseModel]]
    # What it keeps in the handle (`handle.backend_state`), read as `State.of(handle)`.
    State: ClassVar[type[BackendState]]
    capabilities: ClassVar[Capabilities] = Capabilities()

    def __init__(self, settings: BaseModel, store: RunStore) -> None:
        self.settings = settings
        self.store = store

    @classmethod
    def from_handle(cls, handle: RunHandle, store: RunStore) -> Backend:
        """The backend as the run was submitted: from the pinned settings,
        never from the project's current configuration."""
        from pydantic import ValidationError

        try:
            settings = cls.Settings.model_validate(handle.settings)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise HandleError(
                f"run {handle.run_id}: its pinned {cls.name} settings are not valid for this release "
                f"({where}: {first['msg']}); reach it with the release that made it, or remove "
                f"{store.run_dir(handle.run_id)} to forget it"
            ) from None
        return cls(settings, store)

    def save_state(self, handle: RunHandle, **changes: Any) -> RunHandle:
        """Record `changes` in the backend's part of the handle, checked
        against `State` (an undeclared key is refused)."""
        return self.store.update_backend_state(handle, self.State, **changes)

    def slot_pool(self, handle: RunHandle) -> Pool | None:
        """The pool a new run of `handle` takes a slot in before its launch,
        held until its chain ends; None: no limit."""
        limit = getattr(self.settings, "max_parallel", None)
        return None if limit is None else Pool(self.name, limit, "this machine")

    def hourly_price(self, handle: RunHandle) -> float | None:
        """The machine's price in USD an hour from the provider's catalog:
        before the launch, what would be launched; after it, what was.
        None when no catalog prices it (then only `hourly_cost` does).
        Default: none."""
        return None

    def machine_share(self, handle: RunHandle) -> float:
        """The part of its machine a run holds, which its cost is charged:
        1, unless runs share a machine side by side (a reused SkyPilot
        cluster's GPUs shared out, one seat each)."""
        return 1.0

    def shared_machine(self, handle: RunHandle) -> Path | None:
        """The record of the life of the machine the run was given, when
        runs use it in turn (store/shared_machine.py: a reused SkyPilot
        cluster): the run is charged its piece of that life. None: the
        machine is the run's alone."""
        return None

    def keep_warm_seconds(self, handle: RunHandle) -> float:
        """How long the run's machine may stay up, waiting warm for the next
        step, after the run: the last run on it pays that. 0: it goes with the run."""
        return 0.0

    def lifetime_seconds(self) -> float | None:
        """How long a run's machine may live (its lifetime timer), for the
        worst case said before a launch; None: no timer bounds it."""
        minutes = getattr(self.settings, "lifetime_minutes", None)
        return None if minutes is None else float(minutes) * 60

    def leaks(self, project: str, handles: list[RunHandle]) -> list[Leak]:
        """The run folders or clusters where this backend runs that no live
        handle among `handles` accounts for (machines.py). Default: none,
        nothing is left anywhere but here."""
        return []

    # -- the chain, in order
    @abstractmethod
    def launch(self, handle: RunHandle) -> RunHandle:
        """Called once, right after the handle was written: provision,
        connect or prepare the run's folder. Records what it made in its
        part of the handle (`save_state`) before returning."""

    def setup(self, handle: RunHandle) -> RunHandle:
        """Prepare the machine (setup commands). Default: nothing to do."""
        return handle

    def sync(self, handle: RunHandle) -> RunHandle:
        """Move the project and inputs there. Default: they are already here."""
        return handle

    @abstractmethod
    def start(self, handle: RunHandle) -> RunHandle:
        """Start the worker, detached from this process, and return once it
        has confirmed the command started (or raise BackendError)."""

    @abstractmethod
    def poll(self, handle: RunHandle) -> RunStatus:
        """The run's status now. Never raises for a run that merely ended."""

    @abstractmethod
    def cancel(self, handle: RunHandle) -> bool:
        """Stop the run's whole task tree and wait until it is gone.
        Returns False, doing nothing, when the run had already finished."""

    @abstractmethod
    def read_log(self, handle: RunHandle, offset: int) -> bytes:
        """The run's log from byte `offset` on (b"" when nothing new)."""

    @abstractmethod
    def fetch(self, handle: RunHandle) -> Fetched:
        """Called after the run succeeded: bring its outputs into a local
        staging folder and return them with the manifest the worker took as
        the command ended. It does not verify them: the caller verifies
        `root` against `manifest` and promotes nothing that differs. Raises
        BackendError when the copy broke off, ManifestError when the run's
        outputs are a tree no manifest accepts."""

    def forget(self, handle: RunHandle) -> str:
        """Stop the run and remove what it holds where it runs, from the
        handle in memory alone: its folder here was deleted (with the state
        folder, say), so nothing here may be read or written, and no later
        `doit` or teardown can find the run again. Returns what was done,
        for the message. Default: nothing to do."""
        return "nothing of it is left to remove"

    def check_recorded(self, handle: RunHandle) -> None:
        """RunFolderDeleted once the run's folder here is gone: called while
        a run is followed, so that the client that still holds its handle
        tears it down instead of following it to its end."""
        folder = self.store.run_dir(handle.run_id)
        if not folder.is_dir():
            raise RunFolderDeleted(f"run {handle.run_id}: its folder {folder} was deleted as the run went on")

    def outputs_available(self, handle: RunHandle) -> bool:
        """Whether a finished run's outputs can still be fetched again."""
        return False

    def keep_last_checkpoints(self, handle: RunHandle) -> None:
        """A run of a step with checkpoints ended (failed, timed out,
        cancelled) with no client following it: what the command left there
        is kept as the step's latest snapshot before a new run starts from
        it. A failure to reach it is said, not raised: the new run then
        starts from the snapshot kept before. Default: nothing to bring (the
        local backend's checkpoints are in the store already)."""
        return

    def checkpoints_kept_elsewhere(self) -> list[KeptCheckpoints]:
        """The snapshots this backend keeps outside the store (a bucket), one
        per step and key. Default: none."""
        return []

    def remove_checkpoints(self, handle: RunHandle) -> None:
        """The step's outputs are home: the snapshots of its checkpoints kept
        where the backend keeps them (not in the store here) go. Default:
        none are kept elsewhere."""
        return

    def ran_on(self, handle: RunHandle) -> str:
        """Where the run ran, in words a user knows (a host, a cluster): the
        provenance of an entry of the run cache. Default: this machine."""
        import socket

        return socket.gethostname()

    # -- what the run holds, read from its handle alone: asked of runs whose
    # pinned settings this release may not accept, so no backend is built.
    @classmethod
    def released(cls, handle: RunHandle) -> bool:
        """The run was torn down: it holds nothing where it ran any more.
        Default: it never held anything there but its folder here."""
        return False

    @classmethod
    def lifetime_left(cls, handle: RunHandle, now: float | None = None) -> float | None:
        """Seconds until the run's lifetime timer ends it and what it holds
        (negative: overdue); None for a run that holds no machine (never
        armed, torn down, or a backend with no timer)."""
        return None

    # -- a machine lost while the command ran (remote_step(..., preemptions=N))
    def relaunch(self, handle: RunHandle) -> RunHandle:
        """Called by the core when the run reads `lost` while its command
        ran (its machine went away: a preempted cluster, a rebooted host, a
        killed worker) and the step has preemptions left. By then the lost
        attempt's end is recorded and the new attempt appended to
        `handle.state.attempts` (its number and launch time). Get the new
        attempt a machine and a fresh run there, as `launch` does for the
        first: what the lost attempt left that can still be reached is
        stopped first (its command's tree may outlive its worker). The core
        then calls `setup`, `sync`, `snapshot_of` and `start` again, each
        as for a new run, and follows the new attempt; a BackendError here
        is retried as any machinery failure (`retries`). The new attempt's
        job gets what is left of the step's timeout
        (`handle.state.command_seconds_spent()`, see job.build_job).
        Default: stop what is left (`cancel`), then `launch`."""
        import contextlib

        with contextlib.suppress(BackendError):  # a machine that is gone has nothing left to stop
            self.cancel(handle)
        return self.launch(handle)

    def snapshot_of(self, handle: RunHandle) -> str | None:
        """Called by the core just before it starts each attempt's command
        (after sync): the checkpoints the attempt starts from, as the
        attempt records them (a snapshot's name), or None when it starts
        with none (the step declares none, or nothing was kept yet).
        Default: the latest verified snapshot brought home
        (backends/checkpoints.py), which `start` puts in place."""
        from substrax_tasks.backends.checkpoints import Snapshots, checkpoints_folder

        folder = checkpoints_folder(self.store, handle)
        latest = None if folder is None else Snapshots(folder).latest()
        return None if latest is None else latest[0].parent.name

    @abstractmethod
    def teardown(self, handle: RunHandle, *, force: bool = False) -> None:
        """Remove what the run holds (folders, machines). Keeps the handle
        and the logs. Idempotent; a run still going is cancelled first.
        `force` (the CLI's explicit teardown) overrides settings that keep
        things for reuse."""

    # -- built on the above
    def status(self, handle: RunHandle) -> RunStatus:
        """poll(), except where the chain has since judged the run: a run
        whose command succeeded but did not produce its outputs is failed."""
        verdict = handle.state.verdict
        status = self.poll(handle)
        if isinstance(verdict, dict) and (status.final or status.state == "pending"):
            return replace(status, state=str(verdict.get("state", status.state)),
                           message=str(verdict.get("message", "")) or status.message)  # fmt: skip
        return status

    def pause(self, handle: RunHandle, seconds: float) -> bool:
        """Wait up to `seconds` while the run is waited on. True when it
        returned early because the run may have ended: the caller reads the
        status now instead of at its next poll. Default: sleep."""
        time.sleep(seconds)
        return False

    @property
    def poll_seconds(self) -> float:
        """How often the run's status is read while it is waited on (the log
        is read more often)."""
        return LOG_POLL_SECONDS

    def stream_log(
        self, handle: RunHandle, out: IO[bytes], follow: bool = False, offset: int = 0
    ) -> RunStatus:
        """Copy the log from `offset` to `out`; with follow, until the run
        has finished."""
        status = self.poll(handle)
        next_poll = time.monotonic() + self.poll_seconds
        cut = offset > MAX_LOG_BYTES  # past it: noted once, then only the status is followed
        while True:
            chunk = b"" if cut else self.read_log(handle, offset)[: MAX_LOG_BYTES - offset]
            if offset + len(chunk) >= MAX_LOG_BYTES and not cut:
                chunk += log_cut_note("the rest is in run.log in the run's folder")
                cut = True
            if chunk:
                out.write(chunk)
                out.flush()
                offset += len(chunk)
                continue
            if not follow or status.final:  # read after the status: the log is whole
                return status
            check_interrupted()
            self.check_recorded(handle)
            if self.pause(handle, LOG_POLL_SECONDS) or time.monotonic() >= next_poll:
                status = self.poll(handle)
                next_poll = time.monotonic() + self.poll_seconds

    def wait(self, handle: RunHandle, poll_seconds: float | None = None) -> RunStatus:
        while True:
            status = self.poll(handle)
            if status.final:
                return status
            check_interrupted()
            self.pause(handle, poll_seconds or self.poll_seconds)
