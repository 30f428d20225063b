#!/usr/bin/env python3
"""Run one step's command and make sure nothing it started outlives it.

Copied with its siblings to the machine that runs the step: stdlib only,
Python 3.8+. The job file names the command, its folders and files.

    python3 worker.py JOB_JSON [--detach] [--env-stdin]

It takes the GPUs the job asks for first (too few free: exit BUSY, having
written nothing, and the client tries again later). The command's stdout
and stderr go straight to the log file: no pipe the worker holds, so a
descendant keeping them open can never make it wait. The command runs in
its own session (under bubblewrap, its own pid namespace too), below a
worker that is a child subreaper, so nothing it starts escapes the end of
the run. The status file (control.py) says ``starting``, ``running``, then
how it ended; a succeeded run leaves its outputs' manifest beside it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Mapping, cast

# Run as a script on a host, beside its siblings; imported as
# substrax_tasks._remote.worker only by the project's own checks.
PACKAGED = bool(__package__)
if PACKAGED:
    from . import checkpoints, control, gpus, guard, hints, manifest, proctree, runfiles, sandbox
else:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run isolated (python3 -I), as control.py
    import checkpoints
    import control
    import gpus
    import guard
    import hints
    import manifest
    import proctree
    import runfiles
    import sandbox

POLL_SECONDS = 0.5  # only an upper bound: SIGCHLD and signals wake the loop
SETTLE_SECONDS = 0.2  # how long a finished command's exiting helpers may take
# Room kept on the run's disk for the final status, should the command fill it.
RESERVE_BYTES = 1 << 16
RESERVE_FILE = "status.reserve"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# How often a guard whose worker is gone looks for the tree (a read of all
# /proc) and the run's end (a client's cancel or relaunch): often at first,
# where a tree that dies with its worker (bubblewrap) is seen, then seldom
# while it waits for the deadline, which may be hours away.
GUARD_POLL_SECONDS = (0.5, 5.0)
GUARD_QUICK_SECONDS = 5.0
BUSY = 75  # EX_TEMPFAIL: the GPUs the job asks for are held by other runs
PATH_FIELDS = ("cwd", "project", "staging", "home_dir", "status_file", "log_file", "manifest_copy")
PATH_LIST_FIELDS = ("hide", "extra_ro", "path_prepend")


def task_environment(job: runfiles.Job, inherited: dict[str, str], secrets: dict[str, str],
                     ours: dict[str, str] | None = None) -> dict[str, str]:
    """The command's environment: plain settings passed through, `ours`
    (the sandbox's home, the GPUs the run holds), the step's env, its named
    secrets, and the environment's bin folder first on PATH."""
    env = sandbox.plain_settings(inherited)
    env.update(ours or {})
    for name in job.get("forward_env", []):
        value = secrets.get(name, inherited.get(name))
        if value is not None:
            env[name] = value
    env.update(job.get("env", {}))
    prepend = [p for p in job.get("path_prepend", []) if p]
    if prepend:
        env["PATH"] = os.pathsep.join([*prepend, env.get("PATH", os.defpath)])
    return env


class Worker:
    """One run: claim its start, start the command, watch it, end it."""

    def __init__(self, job: runfiles.Job, secrets: dict[str, str] | None = None) -> None:
        self.job = job
        self.run_dir = os.path.dirname(job["status_file"])
        self.secrets = secrets or {}  # values only in memory, never written
        self.cgroup: str | None = None  # the command's own cgroup v2, where one could be made
        self.stop_reason: str | None = None
        self.stop_signal = "signal"
        self.wake_r, self.wake_w = os.pipe()
        self.log_fd = -1
        self.child: subprocess.Popen[bytes] | None = None
        self.gpu_locks: list[int] = []  # open while the run lasts: they hold its GPUs
        self.gpu_env: dict[str, str] = {}
        self.task_path = ""  # the command's PATH, named when a program was not found
        self.checkpoints_root: str | None = None  # where the command writes its checkpoints
        self.guard_fd: int | None = None  # the pipe to the run's guard (guard.py), while one is armed
        self.deadline: float | None = None  # time.monotonic() at which the command's timeout ends it
        self.status: runfiles.Status = {
            "version": runfiles.STATUS_VERSION, "state": "starting", "worker_pid": os.getpid(),
            "worker_start_ticks": control.start_ticks(os.getpid()),
            "pid": None, "start_ticks": None, "exit_code": None, "signal": None,
            "started_at": None, "ended_at": None, "sandbox": None, "outputs_root": None, "message": None,
            # In the command's environment (control.RUN_MARK): how its tree
            # is found should this worker die without ending it.
            "mark": os.urandom(16).hex(),
        }

    def note(self, message: str) -> None:
        """The worker's own notes go into the run's log, marked as ours (a
        full disk loses them, never the run's end)."""
        with contextlib.suppress(OSError):
            os.write(self.log_fd, ("[substrax-worker %s] %s\n" % (control.now_iso(), message)).encode())

    def write_status(self, **changes: Any) -> None:
        """On a disk the command filled, the room kept (keep_room) is given
        back for it: the run's end is always recorded."""
        self.status = cast(runfiles.Status, {**self.status, **changes})
        try:
            control.write_json_atomic(self.job["status_file"], self.status)
        except OSError as exc:
            room = os.path.join(self.run_dir, RESERVE_FILE)
            if exc.errno != errno.ENOSPC or not os.path.exists(room):
                raise
            os.unlink(room)
            control.write_json_atomic(self.job["status_file"], self.status)

    def keep_room(self) -> None:
        with contextlib.suppress(OSError), open(os.path.join(self.run_dir, RESERVE_FILE), "wb") as f:
            f.write(b"\0" * RESERVE_BYTES)

    # -- signals: recorded here, acted on by the poll loop
    def install_handlers(self) -> None:
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self.wake_w)
        for sig in STOP_SIGNALS:
            signal.signal(sig, self.on_stop_signal)
        signal.signal(signal.SIGCHLD, lambda _s, _f: None)  # only wakes the poll loop

    def on_stop_signal(self, signum: int, _frame: object) -> None:
        if self.stop_reason is None:
            self.stop_reason = "cancelled"
            self.stop_signal = signal.Signals(signum).name

    def sleep(self, seconds: float) -> None:
        """Sleep until a signal arrives or `seconds` pass."""
        select.select([self.wake_r], [], [], max(0.0, seconds))  # retried after a handler (PEP 475)
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wake_r, 512):
                pass

    def claim_start(self) -> bool:
        """Under the run's start lock: refuse a run already ended (cancelled
        before its worker got here) or claimed by another live worker (a
        client that restarted it), else record `starting` with our pid so
        that a cancel from now on signals us."""
        with control.start_lock(self.run_dir):
            record = control.read_json(self.job["status_file"]) or {}
            if record.get("state") in control.FINAL_STATES:
                self.note("the run was cancelled before it started; not starting it")
                return False
            if control.alive(record.get("worker_pid"), record.get("worker_start_ticks")):
                self.note("worker %s already starts this run; not starting it twice" % record["worker_pid"])
                return False
            self.write_status(state="starting")
            self.keep_room()
            return True

    def claim_gpus(self) -> bool:
        """Take the GPUs the job asks for (job["gpus"]: the host's ids, the
        count, the lock folder); False when too few are free. A count of 0
        hides every GPU from the task."""
        wanted = self.job.get("gpus")
        if not wanted:
            return True
        held: list[str] = []
        if wanted["count"]:
            # A GPU whose lock is free is still held while what a killed
            # worker's command left runs on it.
            claimed = gpus.claim(
                wanted["lock_dir"], wanted["ids"], wanted["count"], holder=self.run_dir,
                still_held=lambda holder: holder != self.run_dir and control.tree_alive(holder))
            if claimed is None:
                return False
            held, self.gpu_locks = claimed
            self.status["gpus"] = held
        self.gpu_env = gpus.visible_env(wanted.get("kind"), held)
        return True

    # -- the run
    def run(self, ready_fd: int | None = None) -> int:
        if not self.claim_gpus():  # before the log and the status: this try leaves no trace
            if ready_fd is not None:
                os.write(ready_fd, b"busy")
                os.close(ready_fd)
            return BUSY
        self.log_fd = os.open(self.job["log_file"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(self.log_fd, 2)  # our own stderr (tracebacks included) goes to the log as well
        if self.job.get("timeout") is not None:  # before the subreaper: the guard is not below us
            self.start_guard()
        self.install_handlers()
        proctree.become_subreaper()
        claimed = self.claim_start()
        started = claimed and self.start_command()
        if ready_fd is not None:  # the detached parent may return now
            os.write(ready_fd, b"started")
            os.close(ready_fd)
        pid, outputs_root = self.status.get("pid"), self.status.get("outputs_root")
        if started and pid is not None and outputs_root is not None:  # start_command recorded both
            self.watch(pid, outputs_root)
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.run_dir, RESERVE_FILE))
        os.close(self.log_fd)
        return 0 if started or not claimed else 1

    def start_command(self) -> bool:
        """Start the command (in its sandbox) and record `running`; a command
        that cannot start is recorded as the run's failure."""
        job = self.job
        try:
            argv, sandbox_name, outputs_root, passed_fds = sandbox.sandboxed_command(
                job, self.note, os.environ)
            try:
                home = sandbox.home_settings(job, os.environ) if sandbox_name == "bwrap" else {}
                # Under bubblewrap the command's pid namespace already holds
                # every process it starts and dies whole with it: a cgroup adds
                # nothing there, and joining one makes each start wait for the
                # kernel (an RCU grace period).
                if sandbox_name != "bwrap":
                    self.cgroup = proctree.make_cgroup(
                        "substrax-%d-%s" % (os.getpid(), self.status["worker_start_ticks"]), stale_cgroup)
                    if self.cgroup is not None:  # recorded before anything is in it: a reap finds it
                        self.write_status(cgroup=self.cgroup)
                cgroup = self.cgroup
                # Kept on self: a Popen object dropped while its process has
                # exited reaps it, and the poll loop would never see its end.
                self.checkpoints_root = self.place_checkpoints(sandbox_name)
                env = task_environment(job, dict(os.environ), self.secrets, {**home, **self.gpu_env})
                env[control.RUN_MARK] = self.status["mark"]  # last: no setting of the step's replaces it
                self.task_path = env.get("PATH", "")
                timeout = job.get("timeout")
                self.deadline = None if timeout is None else time.monotonic() + float(timeout)
                self.arm_guard()
                self.child = subprocess.Popen(
                    argv, cwd=job["cwd"], env=env,
                    stdin=subprocess.DEVNULL, stdout=self.log_fd, stderr=self.log_fd,
                    start_new_session=True, close_fds=True, pass_fds=passed_fds,
                    # before exec, so that nothing the command starts is outside it
                    preexec_fn=None if cgroup is None else lambda: proctree.join_cgroup(cgroup),
                )
            finally:  # bubblewrap has its copies (the seccomp filter's pipe)
                for fd in passed_fds:
                    os.close(fd)
        except Exception as exc:  # any start failure is the run's failure
            self.note("could not start the command: %s" % exc)
            sandbox.remove_home(job)
            now = control.now_iso()
            self.write_status(state="failed", message=str(exc), started_at=now, ended_at=now)
            return False
        pid = self.child.pid
        self.write_status(state="running", pid=pid, start_ticks=control.start_ticks(pid),
                          started_at=control.now_iso(), sandbox=sandbox_name, outputs_root=outputs_root,
                          cgroup=self.cgroup, checkpoints_root=self.checkpoints_root)
        return True

    # -- the guard: what stops the command at its deadline should this worker die (guard.py)
    def start_guard(self) -> None:
        try:
            self.guard_fd = guard.start(self.orphaned)
        except OSError as exc:  # no fork left: the command would not start either
            self.note("could not start the run's guard (%s): a kill of this worker would let the "
                      "command run past its timeout" % exc)

    def arm_guard(self) -> None:
        """Give the guard the command's deadline; the pipe is then held
        open until this worker exits: its end is what the guard waits for."""
        if self.guard_fd is not None and self.deadline is not None:
            guard.arm(self.guard_fd, self.deadline)

    def orphaned(self, deadline: float) -> None:
        """In the guard, this worker gone. A run with an end recorded, or
        another worker's now (a relaunch's: another mark), is left alone.
        A tree that died with the worker (bubblewrap's --die-with-parent)
        has its end stamped (`ended_at`; the run reads `lost`, its machine
        time counted to then). One still going is stopped at the deadline."""
        mark, orphaned_at = self.status["mark"], time.monotonic()
        while True:
            record = control.read_status(self.run_dir)
            if record is not None and (record.get("mark") != mark
                                       or record.get("state") in control.FINAL_STATES):
                return
            # Our copy from before the command started names its mark and
            # this worker's start: enough to find its tree (control.leftovers).
            found = record if record is not None else dict(self.status)
            if not control.leftovers(found):
                self.record_end(lambda ended: dict(ended, ended_at=control.now_iso()))
                return
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop_orphaned_tree(found)
                return
            quick = time.monotonic() - orphaned_at < GUARD_QUICK_SECONDS
            time.sleep(min(GUARD_POLL_SECONDS[0 if quick else 1], left))

    def stop_orphaned_tree(self, found: dict[str, Any]) -> None:
        """Stop what is left of the tree, keep its checkpoints as this
        worker would have, and record the run timed out with the reason
        (its cap's, when the cap set the deadline)."""
        with contextlib.suppress(OSError):  # the run's folder may be gone: the tree is stopped all the same
            self.log_fd = os.open(self.job["log_file"], os.O_WRONLY | os.O_APPEND)
        reason = self.job.get("timeout_message") or "stopped at its timeout of %ss" % self.job.get("timeout")
        self.note("the worker (pid %s) is gone without ending the run: its guard stops the task tree (%s)"
                  % (self.status["worker_pid"], reason))
        left = control.stop_leftovers(found)
        if left:  # not recorded ended: a rerun must not start beside them
            self.note("%d process(es) of the command did not stop: %s" % (len(left), left))
            return
        root = found.get("checkpoints_root")
        self.checkpoints_root = root if isinstance(root, str) else None
        self.keep_checkpoints()
        message = "%s; its worker was gone, so the run's guard stopped the command" % reason
        self.record_end(lambda ended: dict(ended, state="timed_out", ended_at=control.now_iso(),
                                           message=message))

    def record_end(self, change: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        """Write `change` of the run's status, under its start lock, if the
        status is still this worker's and records no end."""
        if not os.path.isdir(self.run_dir):
            return
        with control.start_lock(self.run_dir):
            record = control.read_status(self.run_dir)
            if record is None or record.get("mark") != self.status["mark"] or \
                    record.get("state") in control.FINAL_STATES or record.get("ended_at"):
                return
            control.write_json_atomic(self.job["status_file"], change(record))

    def place_checkpoints(self, sandbox_name: str) -> str | None:
        """Where the command writes its checkpoints: the kept folder itself,
        bound at its project path in the sandbox; without one, a copy of it
        at that path in the project (kept back as the command ends)."""
        wanted = self.job.get("checkpoints")
        if not wanted:
            return None
        os.makedirs(wanted["kept"], mode=0o700, exist_ok=True)
        if sandbox_name == "bwrap":
            return wanted["kept"]
        return checkpoints.put_in_place(wanted["kept"], self.job["project"], wanted["path"])

    def keep_checkpoints(self) -> None:
        """Without a sandbox: the checkpoints the command left in the
        project, copied back to the kept folder for the next attempt. With
        or without: what the command left there made safe (no setuid bit,
        nothing world-writable), now that nothing of it runs."""
        wanted = self.job.get("checkpoints")
        if wanted and self.checkpoints_root and self.checkpoints_root != wanted["kept"]:
            try:
                checkpoints.keep_from_place(self.checkpoints_root, wanted["kept"])
            except OSError as exc:
                self.note("could not keep the checkpoints from %s: %s" % (self.checkpoints_root, exc))
        for folder in {wanted["kept"], self.checkpoints_root} if wanted and self.checkpoints_root else ():
            try:
                checkpoints.make_safe(folder)
            except OSError as exc:
                self.note("could not make the checkpoints in %s safe: %s" % (folder, exc))

    def watch(self, child_pid: int, outputs_root: str) -> None:
        """Poll until the command ends, its timeout passes or a signal asks
        us to stop; then end the tree and write the final status."""
        timeout, deadline = self.job.get("timeout"), self.deadline
        returncode = None
        while returncode is None and self.stop_reason is None:
            returncode = proctree.code_of(child_pid, proctree.reap_children())
            if returncode is not None:
                break
            if deadline is not None and time.monotonic() >= deadline:
                self.stop_reason = "timed_out"
                break
            if not os.path.isdir(self.run_dir):  # deleted by hand: no one can follow the run
                self.stop_reason = "cancelled"
                self.stop_signal = "its run folder was deleted"
                break
            self.sleep(POLL_SECONDS if deadline is None else min(POLL_SECONDS, deadline - time.monotonic()))
        if self.stop_reason is not None:
            timed_out = self.job.get("timeout_message") or "timeout of %ss" % timeout
            self.note("stopping the task tree (%s)" % (
                timed_out if self.stop_reason == "timed_out" else self.stop_signal))
            # Spare the bubblewrap processes: SIGTERM to them would end the
            # namespace at once, with SIGKILL and no grace for the task.
            spared = proctree.with_children(child_pid) if self.status["sandbox"] == "bwrap" else set()
            proctree.signal_pids([p for p in proctree.live_descendants(os.getpid()) if p not in spared],
                                 signal.SIGTERM)
            grace = float(self.job.get("grace_seconds", 5.0))
            returncode = proctree.wait_tree(child_pid, grace, self.sleep, self.cgroup)[0]
            state = self.stop_reason
        else:
            # The command is done; anything it left behind dies now.
            leftovers = proctree.wait_tree(child_pid, SETTLE_SECONDS, self.sleep, self.cgroup)[1]
            if leftovers:
                self.note("killing %d process(es) the command left running" % len(leftovers))
            state = "succeeded" if returncode == 0 else "failed"
        # Always: a process forking too fast to be seen in /proc is not among
        # the leftovers found, but it is in the command's group or cgroup.
        reaped = proctree.kill_all(proctree.REAP_SECONDS, self.sleep, child_pid, self.cgroup)
        returncode = proctree.code_of(child_pid, reaped) if returncode is None else returncode
        if self.cgroup:
            proctree.remove_cgroup(self.cgroup)
        # Nothing runs in the sandbox's home any more; it goes before the
        # end is recorded, so an ended run never leaves one behind.
        sandbox.remove_home(self.job)
        self.keep_checkpoints()
        message = None
        if state == "timed_out":
            message = self.job.get("timeout_message")
        if state == "succeeded":
            self.write_manifest(outputs_root)
        elif state == "failed":
            # Said in the status, so every backend's failure shows it.
            tail = hints.log_tail(self.job)
            boxed = self.status["sandbox"] == "bwrap"
            said = [hints.erofs_hint(self.job, tail) if boxed else None,
                    hints.unix_socket_hint(self.job, tail) if boxed else None]
            # Left out of a copy (remote), or hidden by the sandbox (local).
            if boxed or not self.job.get("project_hidden"):
                said.append(hints.left_out_hint(self.job, tail))
            said.append(hints.not_found_hint(self.job, returncode, self.task_path, boxed))
            message = "; ".join(h for h in said if h) or None
        if state == "failed" and disk_full(outputs_root):
            message = ("no space left on device where its outputs go (%s): the command filled the disk; "
                       "free space (or make the outputs smaller) and run again" % outputs_root)
        signame = signal.Signals(-returncode).name if returncode is not None and returncode < 0 else None
        self.write_status(state=state, exit_code=returncode, signal=signame, ended_at=control.now_iso(),
                          message=message)

    def write_manifest(self, outputs_root: str) -> None:
        """The outputs' manifest, taken now that nothing can touch them: the
        fetch verifies its copy against it (the bucket transport fetches its
        `manifest_copy` with the outputs)."""
        try:
            outputs = [o["path"] + ("/" if o["kind"] == "dir" else "") for o in self.job["outputs"]]
            taken = manifest.build_manifest(outputs_root, outputs)
            control.write_json_atomic(os.path.join(self.run_dir, "manifest.json"), taken)
            if self.job.get("manifest_copy"):
                control.write_json_atomic(self.job["manifest_copy"], taken)
        except Exception as exc:  # the fetch then takes its own and says what is wrong
            self.note("could not take the outputs' manifest: %s" % exc)


def stale_cgroup(name: str) -> bool:
    """Whether the cgroup `name` ("substrax-<worker pid>-<its start ticks>")
    belongs to a worker that is gone: it is removed once empty, as what a
    worker killed before it could remove its cgroup left."""
    parts = name.split("-")[1:]
    try:
        pid, ticks = int(parts[0]), (int(parts[1]) if len(parts) > 1 else None)
    except (IndexError, ValueError):
        return False
    now = control.start_ticks(pid)
    return now is None or (ticks is not None and now != ticks)


def disk_full(path: str) -> bool:
    try:
        found = os.statvfs(path)
    except OSError:
        return False
    return found.f_bavail * found.f_frsize < RESERVE_BYTES


def absolute_paths(raw: Mapping[str, Any], base: str) -> runfiles.Job:
    """A job written before its machine's home folder was known (SkyPilot)
    names its folders relative to where the worker starts: resolve them."""
    job = dict(raw)
    for key in PATH_FIELDS:
        if job.get(key):
            job[key] = os.path.normpath(os.path.join(base, job[key]))
    for key in PATH_LIST_FIELDS:
        if job.get(key):
            job[key] = [os.path.normpath(os.path.join(base, p)) if p else p for p in job[key]]
    if job.get("cache_dirs"):
        job["cache_dirs"] = [{**kept, "kept": os.path.normpath(os.path.join(base, kept["kept"]))}
                             for kept in job["cache_dirs"]]
    if job.get("checkpoints"):
        job["checkpoints"] = {**job["checkpoints"],
                              "kept": os.path.normpath(os.path.join(base, job["checkpoints"]["kept"]))}
    return cast(runfiles.Job, job)


def refused(job: Mapping[str, Any]) -> bool:
    """Refuse a job of another version (runfiles.job_refusal), saying why
    where the client looks: in the run's status (failed) and log, and on
    stderr. A status already there (another worker's run) is left alone."""
    reason = runfiles.job_refusal(job)
    if reason is None:
        return False
    sys.stderr.write("substrax-worker: %s\n" % reason)
    log_file, status_file = job.get("log_file"), job.get("status_file")
    if isinstance(log_file, str):
        with contextlib.suppress(OSError), open(log_file, "a") as log:
            log.write("[substrax-worker %s] %s\n" % (control.now_iso(), reason))
    if isinstance(status_file, str) and os.path.isdir(os.path.dirname(status_file)):
        with control.start_lock(os.path.dirname(status_file)):
            if control.read_json(status_file) is None:
                now = control.now_iso()
                ended: runfiles.Status = {"version": runfiles.STATUS_VERSION, "state": "failed",
                                          "message": reason, "exit_code": None, "started_at": now,
                                          "ended_at": now}
                control.write_json_atomic(status_file, ended)
    return True


def detach(job: runfiles.Job, secrets: dict[str, str]) -> int:
    """Start a worker as a daemon; return once it has written its first
    status, so the caller learns at once whether the command started."""
    if refused(job):
        return 1
    answer = control.daemon(lambda ready: Worker(job, secrets).run(ready_fd=ready))
    return {b"started": 0, b"busy": BUSY}.get(answer, 1)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    flags = ("--detach", "--env-stdin")
    paths = [a for a in args if a not in flags]
    if len(paths) != 1:
        sys.stderr.write("usage: worker.py JOB_JSON [--detach] [--env-stdin]\n")
        return 2
    # Secrets arrive as a JSON object on stdin, so they touch no file.
    secrets = json.load(sys.stdin) if "--env-stdin" in args else {}
    with open(paths[0]) as f:
        job = absolute_paths(json.load(f), os.getcwd())
    if "--detach" in args:
        return detach(job, secrets)
    if refused(job):
        return 1
    return Worker(job, secrets).run()


if __name__ == "__main__":
    sys.exit(main())
