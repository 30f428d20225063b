"""Driving one run of a step: launch, setup, sync, run, fetch, verify and
promote, teardown.

doit executes these phases only when it decided the step must run (a check
said so, or `-a`), so each acts when executed. Each writes its durable
record (the handle's state, the step record) the moment it finishes: doit
saves its DB only at the end and loses it on SIGKILL, and a rerun reads
those records to reattach to a live run or fetch a finished one again.

`RunState` says what this process is doing with the step; under `doit -n N
-P thread` teardown may be called from any thread while another drives the
step, so the state changes under a lock.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import os
import threading
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any, cast

from doit.exceptions import TaskError, TaskFailed

from substrax_tasks.console import SWEEP, TextSink, elapsed, emit, lines_of
from substrax_tasks.errors import BackendError, HandleError, HostRefused, RunFolderDeleted, SubstraxError
from substrax_tasks.interrupts import (
    INTERRUPTED,
    check_interrupted,
    map_termination_signals,
    start_when_free,
    started_holding_signals,
)
from substrax_tasks.run.driven_run import DrivenRun, view_changes
from substrax_tasks.run.earlier_run import retire_unlaunched, reusable_run
from substrax_tasks.step import doit_db
from substrax_tasks.step.spec import check_inputs_exist, check_outputs_inside
from substrax_tasks.store.phase import Phase
from substrax_tasks.uptodate import check as uptodate
from substrax_tasks.uptodate.check import DOIT_VALUE, Step

if TYPE_CHECKING:  # pydantic models: imported by the phases that act, not by a no-op doit
    from substrax_tasks.backends.base import Backend, RunStatus
    from substrax_tasks.run.steplock import StepLock
    from substrax_tasks.slots import Slot
    from substrax_tasks.store.handle import RunHandle
    from substrax_tasks.store.project import Project


# How long a machine that stopped answering while its run was followed is
# waited for, reading the run's status every MACHINE_WAIT_POLL_SECONDS: a
# host rebooting comes back within minutes; one that does not, fails the
# step with how to reattach (the run may go on there).
MACHINE_WAIT_SECONDS = 600.0
MACHINE_WAIT_POLL_SECONDS = 2.0
# doit's process pool (`doit -n N` without `-P thread`, or `-P process`): refused
# before its first task (step/tasks.py), and by a phase reached in a worker process.
PROCESS_POOL_REFUSED = (
    "remote steps cannot run in doit's worker processes (`doit -n N` runs its tasks in processes "
    "unless given `-P thread`, and so does `-P process`): the phases of a step share state in one "
    "process. Run them concurrently with threads: `doit -n N -P thread`"
)


def timeline_now() -> str:
    from substrax_tasks.run.timeline import now  # a phase acts: not on a no-op's path

    return now()


def attempts_with(handle: RunHandle, **changes: Any) -> list[dict[str, Any]]:
    """The run's attempts with `changes` made to the last (the one going),
    as the handle records them. A run launched before attempts were
    recorded has none: nothing is changed."""
    attempts = [a.model_dump(mode="json") for a in handle.state.attempts]
    if attempts:
        attempts[-1].update(changes)
    return attempts


def relaunch_unfinished(handle: RunHandle) -> bool:
    """The run's last attempt is a relaunch whose command was never started."""
    attempts = handle.state.attempts
    return len(attempts) > 1 and attempts[-1].started_at is None


class RunState(enum.Enum):
    IDLE = "idle"  # nothing done for this step in this process
    OPEN = "open"  # launch acted: the step's lock is held and its run is being driven
    CLOSED = "closed"  # the chain ended: verified and promoted, or a phase failed
    INTERRUPTED = "interrupted"  # given up while the run went on (Ctrl-C, or doit ending)
    TORN_DOWN = "torn_down"  # teardown done; nothing more happens


class StepDriver(DrivenRun):
    """The phases of one step in one doit process, as doit actions."""

    def __init__(self, step: Step, project: Project, *, retries: int = 0, preemptions: int = 0,
                 near_another: Callable[[str], bool] = lambda folder: True) -> None:
        super().__init__(step, project, retries=retries, near_another=near_another)
        # How many times a run lost with its machine is relaunched (its own budget, not `retries`)
        self.preemptions = preemptions
        self.state = RunState.IDLE
        self._lock = threading.Lock()
        self._step_lock: StepLock | None = None
        self._slot: Slot | None = None  # of the backend's max_parallel pool, from launch to the chain's end
        self._slot_shared = False
        self.pid = os.getpid()
        # The step's start line said (its place in the sweep and when), for its end line
        self._started: tuple[str, float] | None = None

    def _set(self, state: RunState) -> None:
        with self._lock:
            self.state = state

    def _say_started(self) -> None:
        """The step's start line: `fit:lr3: [5/14] starting on local`."""
        place = SWEEP.reached(self.spec.step)
        self._started = (place, time.monotonic())
        emit(f"{self.spec.step}: {place + ' ' if place else ''}starting on {self.step.backend}")

    def _say_ended(self, outcome: str) -> None:
        """The step's end line, once: its place, outcome, backend and time."""
        with self._lock:
            started, self._started = self._started, None
        if started is not None:
            place, at = started
            emit(f"{self.spec.step}: {place + ' ' if place else ''}{outcome} on {self.step.backend} "
                 f"in {elapsed(time.monotonic() - at)}")  # fmt: skip

    def _close(self, outcome: str = "succeeded") -> None:
        """The chain ended here: promoted, failed, or given up (an interrupted
        one stays INTERRUPTED). What it holds goes now, not as doit ends (doit
        runs teardowns only then, so a sweep would hold a lock and a run
        folder per step it ran): the run is torn down and kept in the cache,
        the slot and the step's lock released. A machine shared by a pool's
        runs stays warm for the next one: its teardown waits for doit's, as
        the last one out takes it down (see sky_pool.py)."""
        with self._lock:
            if self.state is RunState.OPEN:
                self.state = RunState.CLOSED
        self._say_ended("restored from the cache" if outcome == "succeeded" and self.restored else outcome)
        if self._slot_shared:
            try:
                self._keep()
            finally:
                self._release()
            return
        try:
            self._teardown()  # a full disk here is the phase's (StepDriver._action)
        except SubstraxError as exc:
            emit(f"{self.spec.step}: teardown failed: {exc}", err=True)

    def _take_slot(self, backend: Backend, handle: RunHandle, *, running: bool = False) -> RunHandle:
        """A slot of the backend's max_parallel pool for `handle`, waited
        for if all are held. A run whose command is `running` (reattached)
        counts whether or not it holds one: it takes its own back (or a
        free one) and never waits; in a shared pool a launched run takes
        only the slot of the machine it is on."""
        from substrax_tasks.slots import take_in_pool

        pool = backend.slot_pool(handle)
        if pool is None or self._slot is not None:
            return handle
        bound = handle.state.slot if pool.shared else None
        try:
            slot = take_in_pool(
                self.project.store.slots_dir(pool.name), pool, self.spec.step, handle.run_id,
                self._command_running, wait=not running,
                only=int(bound["index"]) if isinstance(bound, dict) else None,
            )
        except KeyboardInterrupt:
            # Nothing launched, so nothing to detach or cancel: the step fails
            # as under threads, with no traceback, and later phases do nothing.
            INTERRUPTED.set()
            raise
        if slot is None:
            return handle
        self._slot = slot
        self._slot_shared = pool.shared
        if not pool.shared or isinstance(bound, dict):
            return handle
        return self.save(handle, slot={"pool": pool.name, "index": slot.index})

    def _command_running(self, run_id: str) -> bool:
        """Whether the run `run_id`, which a slot names, has its command
        running (it holds that slot though no client does). A run that
        cannot be read holds none; one whose host cannot be asked, does."""
        try:
            handle = self.project.store.read(run_id)
            return self.backend(handle).poll(handle).state == "running"
        except HandleError:
            return False
        except SubstraxError:
            return True

    def _release(self) -> None:
        """Give back the slot and the step's lock (each once, from any thread)."""
        with self._lock:
            slot, self._slot = self._slot, None
            step_lock, self._step_lock = self._step_lock, None
        try:
            if slot is not None:
                slot.release()
        finally:
            if step_lock is not None:
                step_lock.release()

    def _keep(self) -> None:
        """Once the outputs are home: keep the run in the cache, or drop a
        restore's staging folder (once, whichever of the chain's end and
        doit's teardown comes first)."""
        with self._lock:
            fetched, self.fetched = self.fetched, None
        if fetched is not None:  # a run's or a restore's
            from substrax_tasks.run.cached_runs import keep_after

            keep_after(self, fetched)

    # ------------------------------------------------------------ doit glue
    def _action(self, phase: str, body: Callable[[], Any]) -> Any:
        """The `phase` as a doit action: our errors become doit failures with
        their message, and a failure closes the chain (doit runs no later
        phase). Its time goes into the run's handle for the report: as it
        moves the run's phase, or here when it failed or was interrupted."""
        if os.getpid() != self.pid:  # refused before any task ran (step/tasks.py): a backstop
            return TaskError(f"step {self.spec.step!r}: {PROCESS_POOL_REFUSED}")
        map_termination_signals()  # in a worker thread: notes that steps run in threads
        self.start_phase(phase)
        try:
            if INTERRUPTED.is_set():  # a phase doit dispatches after an interrupt does nothing
                raise KeyboardInterrupt("interrupted")
            with lines_of(self.spec.step):
                result = body()
        except BackendError as exc:
            result = TaskError(self._named(exc))
        except SubstraxError as exc:
            result = TaskFailed(self._named(exc))
        except OSError as exc:
            if not doit_db.no_space_left(exc, str(exc.filename or self.root)):
                self._end_phase("failed")
                self._close("failed")
                raise
            result = TaskFailed(self._named_full(exc))
        except KeyboardInterrupt:
            # The chain stays open (or INTERRUPTED, from the run phase): the
            # teardown that doit runs next detaches from a run that goes on,
            # or cancels it, as the backend's capabilities say.
            self._end_phase("interrupted")
            with lines_of(self.spec.step):
                self._say_ended("interrupted")
            if threading.current_thread() is threading.main_thread() and not INTERRUPTED.is_set():
                raise
            # doit's worker threads cannot pass an interrupt on: a failure can,
            # one doit does not list (the step said it was interrupted, the
            # closing line counts it and the exit status is a Ctrl-C's)
            result = TaskError(f"step {self.spec.step!r}: interrupted", report=False)
        except BaseException:
            self._end_phase("failed")
            self._close("failed")
            raise
        if isinstance(result, (TaskFailed, TaskError)):
            self._end_phase("failed")
            with lines_of(self.spec.step):
                self._close("failed")
        self.clock = None  # a phase with nothing to do (done before) has no time of its own
        return result

    def _end_phase(self, outcome: str) -> None:
        """The phase's time, if it can be written: a report is not worth
        hiding why the phase ended."""
        with contextlib.suppress(SubstraxError, OSError):
            self.end_phase(outcome)

    def _named_full(self, exc: OSError) -> str:
        """A phase that found the disk full: where, what is kept, the fix.
        Every phase records its progress in the run's handle before the
        next starts, so the next doit goes on from where this one stopped."""
        where, mount = self._full_at(exc)
        return (f"step {self.spec.step!r}: no space left on the file system mounted at "
                f"{mount} (writing {where}); the run and the outputs "
                f"already in place are kept. Free space there and run `doit` again: it goes on from "
                f"where this one stopped and does not run a command again whose run has ended")  # fmt: skip

    def _full_at(self, exc: OSError) -> tuple[str, str]:
        """The file being written when the disk was found full, and its file
        system's mount point (told doit_db: its own save says no more)."""
        where = str(exc.filename or self.root)
        mount = doit_db.mount_point(where)
        doit_db.told_full(mount)
        return where, mount

    def _named(self, exc: Exception) -> str:
        text = str(exc)
        prefix = f"step {self.spec.step!r}"
        return text if text.startswith(prefix) else f"{prefix}: {text}"

    # ------------------------------------------------------------ phases
    def launch(self) -> Any:
        return self._action("launch", self._launch)

    def _launch(self) -> None:
        from substrax_tasks.run.steplock import StepLock

        self._set(RunState.OPEN)
        self._say_started()
        self._step_lock = StepLock(self.step.files.lock, self.spec.step)
        self._step_lock.acquire()
        check_inputs_exist(self.spec, self.root)
        check_outputs_inside(self.spec.outputs, self.root)
        from substrax_tasks.step.view import check_command_in_view  # not on a no-op's path

        check_command_in_view(self.spec, self.root)
        from substrax_tasks.run.outputs_phases import recover_promotion  # not on a no-op's path

        recover_promotion(self)
        unset = [name for name in self.spec.forward_env if name not in os.environ]
        if unset:
            raise SubstraxError(
                f"secret(s) {', '.join(unset)} named in secrets=[...] are not set in this "
                "environment; set them (their values are forwarded to the command, never stored)"
            )
        self._refuse_unkept_checkpoints()
        self.parts = parts = uptodate.key_parts(self.step)
        key = uptodate.key(parts)
        handle = reusable_run(self, key)
        if handle is None:
            from substrax_tasks.run.cached_runs import restored_from_cache

            if restored_from_cache(self):  # no run: the later phases find no handle and pass
                return
            retire_unlaunched(self)
            # A step's own max_cost= overrides the backend's: pinned with the settings.
            _name, configured = self.project.settings_for(self.step.backend)
            handle = self.project.new_run(self.spec, self.step.backend,
                                          None if self.step.settings == configured else self.step.settings,
                                          key=key, key_parts=parts)  # fmt: skip
            uptodate.write_record(self.step, run_id=handle.run_id)
            emit(f"{self.spec.step}: new run {handle.run_id} on {self.step.backend}")
        self.handle = handle
        backend = self.backend(handle)
        if not handle.state.reached(Phase.LAUNCHED):
            handle = self._take_slot(backend, handle)
            from substrax_tasks.run.made_folders import absent_folders  # a launch: not a no-op's path

            # Before the launch: the folders missing now are the ones this run makes.
            self.made_folders = absent_folders(self.root, self.spec.outputs)
            from substrax_tasks.run import spending  # a launch: not a no-op's path
            from substrax_tasks.store.handle import Attempt

            handle, free = spending.before_launch(self, backend, handle, attempts=self.preemptions + 1)
            launched_at = timeline_now()
            launched = self.retrying("launch", lambda: backend.launch(handle))
            first = Attempt(number=1, machine=backend.ran_on(launched), launched_at=launched_at)
            launched = self.advance(launched, Phase.LAUNCHED, attempts=[first.model_dump(mode="json")],
                                    **({"machine": free} if free else {}))  # fmt: skip
            spending.after_launch(self, backend, launched)
        elif not (status := backend.poll(handle)).final:  # reattached: it holds a slot as a new run does
            self._take_slot(backend, handle, running=status.state == "running")

    def _refuse_unkept_checkpoints(self) -> None:
        """A step whose checkpoints its backend would not keep is refused
        before anything launches: a run that silently starts from nothing
        each time is what checkpoints= is there to prevent."""
        if self.spec.checkpoints is None:
            return
        from substrax_tasks.backends.registry import backend_class  # not on a no-op's path

        if not backend_class(self.step.backend).capabilities.checkpoints:
            raise SubstraxError(
                f"checkpoints={self.spec.checkpoints!r}: the {self.step.backend} backend does not keep "
                "checkpoints across runs (the local, ssh and skypilot backends do); run the step on one of "
                "those (backend=...), or remove checkpoints= to run it without them"
            )

    def setup(self) -> Any:
        return self._action(
            "setup", lambda: self._backend_phase(Phase.SET_UP, "setup", lambda b, h: b.setup(h))
        )

    def sync(self) -> Any:
        return self._action("sync", lambda: self._backend_phase(Phase.SYNCED, "sync", lambda b, h: b.sync(h)))

    def _backend_phase(
        self, phase: Phase, what: str, call: Callable[[Backend, RunHandle], RunHandle]
    ) -> None:
        handle = self.handle
        if handle is None or handle.state.reached(phase):
            return
        backend = self.backend(handle)
        self.advance(self.retrying(what, lambda: call(backend, handle)), phase)

    def run(self) -> Any:
        return self._action("run", self._run)

    def _run(self) -> Any:
        handle = self.handle
        if handle is None:
            return None
        backend = self.backend(handle)
        try:
            if not handle.state.reached(Phase.STARTED):
                snapshot = backend.snapshot_of(handle)
                if backend.poll(handle).state == "pending":
                    handle = self._start(backend, handle)
                handle = self.advance(handle, Phase.STARTED, attempts=attempts_with(
                    handle, started_at=timeline_now(), snapshot=snapshot))  # fmt: skip
            elif relaunch_unfinished(handle) and backend.poll(handle).state in ("pending", "lost"):
                handle = self._relaunch(backend, handle, None)  # a relaunch this doit's last stopped in
            while True:
                status = self._follow(backend, handle)
                if status.state != "lost" or self._not_relaunched(handle) is not None:
                    break
                backend.check_recorded(handle)  # its folder here deleted: torn down, not relaunched
                handle = self._relaunch(backend, handle, status)
            handle = self.save(handle, attempts=attempts_with(
                handle, ended_at=status.ended_at or timeline_now(), outcome=status.state,
                message=status.message))  # fmt: skip
        except RunFolderDeleted:
            return TaskFailed(f"step {self.spec.step!r}: {self._forget(backend, handle)}")
        except HostRefused as exc:  # as a refused manifest: the run failed, its machine goes
            self.save(handle, verdict={"state": "failed", "message": str(exc)})
            with contextlib.suppress(BackendError, HostRefused):  # else its lifetime timer ends it
                if not backend.poll(handle).final:
                    backend.cancel(handle)
            said = str(exc)  # a host's refusal names its run already
            return TaskFailed(f"step {self.spec.step!r}: " + (said if handle.run_id in said else
                                                              f"run {handle.run_id}: {said}"))  # fmt: skip
        except KeyboardInterrupt:
            self._set(RunState.INTERRUPTED)
            self._on_interrupt(backend, handle)
            raise
        if status.state != "succeeded":
            return self._failed(backend, handle, status)
        # The run phase's time, with what the backend noted as the run ended
        # (its final status, where its outputs are).
        self.end_phase("ok")
        return None

    def _failed(self, backend: Backend, handle: RunHandle, status: RunStatus) -> TaskFailed:
        """The step's failure for a run that ended otherwise than succeeded."""
        if status.final:
            self.remove_made_folders()
        from substrax_tasks.run.spending import stopped_at_cap  # a run failed: not a no-op's path

        at_cap = stopped_at_cap(handle, status)
        if at_cap is not None:  # the outcome, recorded; its machine goes as the chain closes
            self.save(handle, verdict={"state": "failed", "message": at_cap})
            return TaskFailed(f"step {self.spec.step!r}: run {handle.run_id} {at_cap}")
        tail = backend.read_log(handle, 0)[-1500:].decode(errors="replace")
        why_not = self._not_relaunched(handle) if status.state == "lost" else None
        return TaskFailed(
            f"step {self.spec.step!r}: run {handle.run_id} {status.state}"
            + (f" (exit code {status.exit_code})" if status.exit_code is not None else "")
            + (f": {status.message}" if status.message else "")
            + (f"\nits machine was lost while the command ran; {why_not}" if why_not else "")
            + f"\nlast lines of its log (substrax-compute logs {handle.run_id}):\n{tail}"
        )

    def _start(self, backend: Backend, handle: RunHandle) -> RunHandle:
        """Start the run's command (waiting while its GPUs are held)."""
        return start_when_free(
            lambda: self.retrying("start", lambda: started_holding_signals(lambda: backend.start(handle))),
            lambda said: emit(f"{self.spec.step}: {said}; waiting"),
        )

    def _follow(self, backend: Backend, handle: RunHandle) -> RunStatus:
        """Follow the run's log until it ends. A machine that does not
        answer is waited for (MACHINE_WAIT_SECONDS), then followed again
        from where its log was: a status read that failed is no sign the
        run is gone, and relaunching a run that goes on would run its
        command twice."""
        sink = TextSink()
        try:
            while True:
                try:
                    return backend.stream_log(handle, cast(IO[bytes], sink), follow=True, offset=sink.written)
                except HostRefused:
                    raise
                except BackendError as exc:
                    self._wait_for_machine(backend, handle, exc)
        finally:
            sink.close()

    def _wait_for_machine(self, backend: Backend, handle: RunHandle, failed: BackendError) -> None:
        """Read the run's status until its machine answers again, bounded."""
        emit(f"{self.spec.step}: run {handle.run_id}: its machine does not answer ({failed}); waiting up to "
             f"{MACHINE_WAIT_SECONDS:.0f} s for it to answer again", err=True)  # fmt: skip
        deadline = time.monotonic() + MACHINE_WAIT_SECONDS
        while True:
            check_interrupted()
            time.sleep(MACHINE_WAIT_POLL_SECONDS)
            try:
                backend.poll(handle)
            except BackendError as exc:
                if time.monotonic() < deadline:
                    continue
                raise BackendError(
                    f"run {handle.run_id}: its machine did not answer for {MACHINE_WAIT_SECONDS:.0f} s "
                    f"({exc}); the run may go on there: `doit {self.spec.step}` reattaches to it, "
                    f"`substrax-compute cancel {handle.run_id}` stops it"
                ) from None
            emit(f"{self.spec.step}: run {handle.run_id}: its machine answers again; following the run")
            return

    def _not_relaunched(self, handle: RunHandle) -> str | None:
        """Why a lost run is not relaunched (no preemption left, its
        timeout or its max_cost spent), with what to do; None: it is."""
        lost = max(len(handle.state.attempts), 1)  # attempts lost so far, this one included
        if lost > self.preemptions:
            if self.preemptions == 0:
                return (f"remote_step({self.spec.step!r}, ..., preemptions=1) relaunches it once such a "
                        "loss, its command starting again from its latest checkpoints")  # fmt: skip
            return (f"it was lost {lost} time(s), past preemptions={self.preemptions}: raise preemptions= "
                    "to relaunch it more often")  # fmt: skip
        timeout = self.spec.timeout
        if timeout is not None and handle.state.command_seconds_spent() >= timeout:
            return f"its timeout ({timeout:g} s over all its attempts) is spent"
        from substrax_tasks.run.spending import budget_spent  # a run lost: not a no-op's path

        # Its max_cost over all its attempts, from its record as it is now,
        # not the one this driver last held: a cost record damaged since
        # reads as spent, and must stop a paid relaunch before it launches.
        try:
            recorded = self.project.store.read(handle.run_id)
        except SubstraxError:
            recorded = handle
        return budget_spent(recorded)

    def _relaunch(self, backend: Backend, handle: RunHandle, lost: RunStatus | None) -> RunHandle:
        """A new attempt of the run on a new machine (Backend.relaunch),
        its command started again from the latest checkpoints. `lost`: the
        status of the attempt whose machine went away; None: the last
        attempt recorded is a relaunch that never started its command (the
        doit driving it was stopped), driven again as the same attempt."""
        from substrax_tasks.store.handle import Attempt, checkpoints_words  # a relaunch: not a no-op's path

        attempts = list(handle.state.attempts) or [Attempt(number=1, machine=backend.ran_on(handle),
                                                           launched_at=handle.created_at)]  # fmt: skip
        if lost is not None:
            gone = attempts[-1]
            attempts[-1] = gone.model_copy(update={"ended_at": timeline_now(), "outcome": "lost",
                                                   "message": lost.message})  # fmt: skip
            attempts.append(Attempt(number=gone.number + 1, machine=gone.machine, launched_at=timeline_now(),
                                    last=gone.number + 1 > self.preemptions or None))  # fmt: skip
            emit(f"{self.spec.step}: run {handle.run_id}: attempt {gone.number} lost its machine "
                 f"({gone.machine}: {lost.message or 'lost'}); relaunching it, attempt {gone.number + 1} "
                 f"of at most {self.preemptions + 1}")  # fmt: skip
        number = attempts[-1].number
        handle = self.save(handle, attempts=[a.model_dump(mode="json") for a in attempts])
        from substrax_tasks.run import spending

        self._refuse_changed_view(handle)  # before a machine is asked for (or priced)
        if lost is not None:  # the lost machine's time ends; the new one's starts (its cost, its cap)
            handle = spending.before_relaunch(self, handle)
        relaunched = self.retrying("relaunch", lambda: backend.relaunch(handle))
        # Priced as relaunched (an on-demand last attempt's price is not the spot one's); the budget
        # left, at that price, is the new worker's timeout and lifetime timer (setup, start).
        relaunched = spending.after_launch(self, backend, relaunched)
        set_up = self.retrying("setup", lambda: backend.setup(relaunched))
        synced = self.retrying("sync", lambda: backend.sync(set_up))
        self._refuse_changed_view(synced)  # again: what was uploaded (or is bound) is what the key says
        snapshot = backend.snapshot_of(synced)
        handle = self.save(synced, attempts=attempts_with(synced, machine=backend.ran_on(synced),
                                                          snapshot=snapshot))  # fmt: skip
        emit(f"{self.spec.step}: run {handle.run_id}: attempt {number} on {backend.ran_on(handle)} starts "
             + (f"from {checkpoints_words(snapshot)}" if snapshot else "with no checkpoints kept"))
        handle = self._start(backend, handle)
        return self.save(handle, attempts=attempts_with(handle, started_at=timeline_now()))

    def _refuse_changed_view(self, handle: RunHandle) -> None:
        """A relaunch runs on the files the run's key was made from, or not
        at all: its outputs are kept (promoted, recorded, put in the cache)
        under that key, so a new attempt that saw a declared input (or the
        lock file) edited since would leave outputs of other files under
        it. Raises SubstraxError, the run recorded failed and its new
        attempt never started; the next `doit` starts a new run on the
        files as they are then."""
        now = uptodate.key_parts(self.step)
        if uptodate.key(now) == handle.state.key:
            return
        changed = view_changes(handle.state.key_parts or {}, now)
        number = handle.state.attempts[-1].number if handle.state.attempts else 2
        message = (f"{', '.join(changed) or 'its key'} changed since the run started; attempt {number} "
                   "would run on other files than its outputs would be kept for, "
                   "so it is not relaunched")  # fmt: skip
        self.save(handle, verdict={"state": "failed", "message": message}, attempts=attempts_with(
            handle, ended_at=timeline_now(), outcome="cancelled", message=message))  # fmt: skip
        raise SubstraxError(
            f"run {handle.run_id} lost its machine and {message}. Run `doit {self.spec.step}` again: a new "
            "run starts on the files as they are now (from the checkpoints kept, if any)"
        )

    def _on_interrupt(self, backend: Backend, handle: RunHandle) -> None:
        if backend.capabilities.interrupt_cancels:
            emit(f"\n{self.spec.step}: interrupted; cancelling local run {handle.run_id}", err=True)
            backend.cancel(handle)
        else:
            emit(
                f"\n{self.spec.step}: detached from run {handle.run_id}, which goes on. "
                f"`doit {self.spec.step}` reattaches; `substrax-compute cancel {handle.run_id}` stops it.",
                err=True,
            )

    def fetch(self) -> Any:
        from substrax_tasks.run.outputs_phases import fetch_outputs  # not on a no-op's path

        return self._action("fetch", lambda: fetch_outputs(self))

    def promote(self) -> Any:
        """The last phase: verify the fetched outputs, promote them, record.
        A phase, not the public task's action: a step's outputs are home as
        soon as its own run is fetched, whatever doit does with the other
        tasks of the run (it stops dispatching at the first failure)."""
        from substrax_tasks.run.outputs_phases import promote_outputs  # not on a no-op's path

        try:
            return self._action("promote", lambda: promote_outputs(self))
        finally:
            with lines_of(self.spec.step):
                self._close()

    def recorded(self) -> Any:
        """The public task's action: what doit saves for it is the verified
        run (promoted by the phases just now, or earlier when the phases were
        up to date while a user's uptodate item was not)."""
        run_id = (uptodate.read_record(self.step).get("verified") or {}).get("run_id", "")
        if run_id:
            # Acknowledged only once doit holds that value (it saves its DB
            # before the process exits): without it, a later doit that finds
            # no value for this task trusts the record, as after a SIGKILL.
            from substrax_tasks.run.outputs_phases import acknowledge

            atexit.register(acknowledge, self.step, run_id)
        return {DOIT_VALUE: run_id}

    # ------------------------------------------------------------ teardown
    def teardown(self) -> None:
        """doit's teardown (after success, failure or Ctrl-C). Idempotent.

        Under `-n N -P thread` doit calls every teardown from each worker
        thread that runs out of tasks, while another thread may still drive
        this step: such a call leaves an open chain alone, and doit's last
        call, from the main thread as it finishes, tears it down. A full
        disk here (a warm cluster's run is let go as doit ends, its cost and
        release written then) is one message and exit status 1: doit would
        print a traceback and exit as its tasks did."""
        held = self.handle
        try:
            self._teardown()
        except OSError as exc:
            if held is None or not doit_db.no_space_left(exc, str(exc.filename or self.root)):
                raise
            where, mount = self._full_at(exc)
            # The step is done, so the next doit leaves it be: the teardown is the user's to finish.
            emit(f"step {self.spec.step!r}: no space left on the file system mounted at {mount} (writing "
                 f"{where}) as doit let run {held.run_id} go; the run and its outputs are kept. Free space "
                 f"there and run `substrax-compute teardown {held.run_id}`: it lets the run's machine go "
                 "and keeps its cost", err=True)  # fmt: skip
            doit_db.failed_as_doit_ended()

    def _teardown(self) -> None:
        with self._lock:
            was = self.state
            if was is RunState.TORN_DOWN or (
                was is RunState.OPEN and threading.current_thread() is not threading.main_thread()
            ):
                return
            self.state = RunState.TORN_DOWN
        try:
            if self.handle is not None:
                self._tear_down(was)
            self._keep()
        finally:
            self._release()

    def _forget(self, backend: Backend, handle: RunHandle) -> str:
        """The run's folder here is gone (the state folder was deleted):
        nothing could find the run again, so it is torn down now, from the
        handle this process holds; and nothing more is done with it here.
        What was done, for the message."""
        self.handle = None
        try:
            done = backend.forget(handle)
        except SubstraxError as exc:
            done = f"it could not be torn down ({exc}); its lifetime timer ends it"
        return (
            f"the folder of run {handle.run_id} here ({self.project.store.run_dir(handle.run_id)}) was "
            f"deleted while this doit drove the run: {done}; `doit {self.spec.step}` launches it again"
        )

    def _tear_down(self, was: RunState) -> None:
        held = cast("RunHandle", self.handle)
        try:
            handle = self.project.store.read(held.run_id)
        except HandleError as exc:
            if not self.project.store.run_dir(held.run_id).exists():  # deleted, not damaged
                emit(f"{self.spec.step}: {self._forget(self.backend(held), held)}", err=True)
                return
            emit(f"{self.spec.step}: not torn down: {exc}", err=True)  # damaged: nothing to act on
            return
        backend = self.backend(handle)
        try:
            status = backend.status(handle)
        except HostRefused as exc:  # a damaged host: its message says how to tear it down
            emit(f"{self.spec.step}: not torn down: {exc}", err=True)
            return
        interrupted = was is RunState.INTERRUPTED
        if was is RunState.OPEN and not status.final and status.state != "pending":
            # doit is ending (a Ctrl-C seen by another thread, a failure
            # elsewhere) while this step's run goes on: abandoned.
            interrupted = True
            self._on_interrupt(backend, handle)
            status = backend.status(handle)
        launched = handle.state.reached(Phase.LAUNCHED)
        done = (
            handle.state.phase is Phase.PROMOTED
            or (status.final and status.state != "succeeded")
            or (status.state == "pending" and launched)  # setup or sync failed: nothing to keep
        )
        if done or (interrupted and backend.capabilities.interrupt_cancels):
            backend.teardown(handle)
            from substrax_tasks.run.spending import record_release  # a teardown: not a no-op's path

            record_release(self.project.store, handle)
        elif status.final:
            emit(f"{self.spec.step}: keeping run {handle.run_id} until its outputs are home; "
                 f"`doit {self.spec.step}` fetches them again")
