#!/usr/bin/env python3
"""Run one step's command and make sure nothing it started outlives it.

This file is copied to the machine that runs the step, so it uses only the
standard library and must run on Python 3.8+.

    python3 worker.py JOB_JSON [--detach] [--env-stdin]

The job file (written by substrax_tasks) names the command, its folders and
where to write the status and the log. The worker:

* sends stdout and stderr of the command straight to the log file (no pipe
  it holds, so a descendant keeping them open can never make it wait);
* starts the command in its own session and, under bubblewrap, its own pid
  namespace (``--unshare-pid --die-with-parent``); it is always a child
  subreaper, so a descendant that double-forks and calls ``setsid`` is
  reparented to the worker and is found and killed as well;
* records SIGTERM/SIGINT/SIGHUP in handlers and acts on them between polls:
  SIGTERM to the whole tree, a grace period, SIGKILL, reap, final status;
* writes its status file atomically: ``running`` first, then one of
  ``succeeded``, ``failed``, ``timed_out``, ``cancelled``.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
PR_SET_PDEATHSIG = 1
POLL_SECONDS = 0.5  # only an upper bound: SIGCHLD and signals wake the loop
REAP_SECONDS = 5.0  # how long to wait for SIGKILLed processes to disappear
SETTLE_SECONDS = 0.2  # how long a finished command's exiting helpers may take
FINAL_STATES = ("succeeded", "failed", "timed_out", "cancelled")
START_LOCK = "start.lock"  # taken by the worker to start, by a cancel of a run not started
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# What the task inherits from the worker's environment: the system's plain
# settings and the accelerator stacks', never credentials. Anything else
# reaches it only as the step's env or as a named secret.
PASSED_ENV = ("PATH", "LD_LIBRARY_PATH", "LANG", "LANGUAGE", "TZ", "TERM", "USER", "LOGNAME",
              "SHELL", "HOME", "TMPDIR")
PASSED_ENV_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "ROCR_", "HIP_", "OMP_", "MKL_")


def task_environment(job, inherited, secrets):
    # type: (dict, dict, dict) -> dict
    """The command's environment: plain settings passed through, the step's
    env, its named secrets, and the environment's bin folder first on PATH."""
    env = {}
    for name, value in inherited.items():
        if name in PASSED_ENV or name.startswith(PASSED_ENV_PREFIXES):
            env[name] = value
    for name in job.get("forward_env", []):
        if name in secrets:
            env[name] = secrets[name]
        elif name in inherited:
            env[name] = inherited[name]
    env.update(job.get("env", {}))
    prepend = [p for p in job.get("path_prepend", []) if p]
    if prepend:
        env["PATH"] = os.pathsep.join(prepend + [env.get("PATH", os.defpath)])
    return env

# ----------------------------------------------------------------- helpers


def now_iso():
    # type: () -> str
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def write_json_atomic(path, data):
    # type: (str, dict) -> None
    """temp file + fsync + rename: a reader sees the old or the new file, whole."""
    tmp = "%s.%d.tmp" % (path, os.getpid())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, json.dumps(data, indent=1, sort_keys=True).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def log_note(log_fd, message):
    # type: (int, str) -> None
    """The worker's own notes go into the run's log, marked as ours."""
    os.write(log_fd, ("[substrax-worker %s] %s\n" % (now_iso(), message)).encode())


def proc_start_ticks(pid):
    # type: (object) -> int | None
    """Start time of a live process in clock ticks since boot (the guard
    against pid reuse); None for no such process, or a zombie."""
    if not isinstance(pid, int):
        return None
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


def process_table():
    # type: () -> dict
    """pid -> (ppid, state) for every process we can see."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as f:
                raw = f.read().decode(errors="replace")
        except OSError:
            continue  # it exited while we looked
        fields = raw[raw.rfind(")") + 2 :].split()
        table[int(name)] = (int(fields[1]), fields[0])
    return table


def live_descendants(root_pid):
    # type: (int) -> list
    """Every live (non-zombie) descendant of root_pid, parents first."""
    table = process_table()
    children = {}  # type: dict
    for pid, (ppid, _state) in table.items():
        children.setdefault(ppid, []).append(pid)
    found = []
    stack = list(children.get(root_pid, []))
    while stack:
        pid = stack.pop()
        if table[pid][1] != "Z":
            found.append(pid)
        stack.extend(children.get(pid, []))
    return found


def signal_pids(pids, sig):
    # type: (list, int) -> None
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass  # already gone


def reap_children():
    # type: () -> list
    """Collect every exited child; returns [(pid, raw_status)]."""
    reaped = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        reaped.append((pid, status))


def libc_prctl(option, value):
    # type: (int, int) -> bool
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


# ----------------------------------------------------------------- sandbox


def bwrap_usable(bwrap):
    # type: (str) -> bool
    """bubblewrap can be installed yet unusable (user namespaces disabled)."""
    try:
        probe = subprocess.run(
            [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--unshare-pid", "true"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def writable_dirs(outputs):
    # type: (list) -> list
    """Project-relative folders the task may write in: each folder output,
    and the folder holding each file output. Outer folders first."""
    dirs = set()
    for out in outputs:
        path = out["path"].rstrip("/")
        if out["kind"] == "dir":
            dirs.add(path)
        else:
            dirs.add(os.path.dirname(path) or ".")
    return sorted(dirs, key=lambda d: (0 if d == "." else d.count("/") + 1, d))


def bwrap_argv(bwrap, job, staging):
    # type: (str, dict, str) -> list
    """The bubblewrap prefix: system and project read-only, /tmp replaced by
    an empty private tmpfs, home (the "hide" folders) by an empty read-only
    one, each output folder bound from the run's staging folder so that the
    task writes its outputs at their usual paths."""
    project = job["project"]
    argv = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    hidden = [h for h in job.get("hide", []) if os.path.isdir(h) and h != "/"]
    for path in ["/tmp", "/var/tmp"] + hidden:
        if os.path.isdir(path):
            argv += ["--tmpfs", path]
    # Re-expose the project (and inputs outside it) after hiding: the
    # project may live under $HOME or /tmp.
    argv += ["--ro-bind", project, project]
    for path in job.get("extra_ro", []):
        if os.path.exists(path):
            argv += ["--ro-bind", path, path]
    # Only now (the binds above made their mount points in the tmpfs): a
    # write to the hidden home fails instead of landing in a scratch tmpfs.
    for path in hidden:
        argv += ["--remount-ro", path]
    declared = set(out["path"].rstrip("/") for out in job["outputs"])
    for rel in writable_dirs(job["outputs"]):
        inside = os.path.normpath(os.path.join(project, rel))
        source = os.path.normpath(os.path.join(staging, rel))
        argv += ["--bind", source, inside]
        # What already stands in that folder stays visible, read-only;
        # earlier versions of the declared outputs do not.
        if rel in declared:
            continue
        for entry in sorted(os.listdir(inside)):
            entry_rel = entry if rel == "." else rel + "/" + entry
            if entry_rel in declared or (rel == "." and entry_rel == job.get("store_rel")):
                continue
            real = os.path.join(inside, entry)
            argv += ["--ro-bind", real, real]
    argv += ["--unshare-pid", "--unshare-ipc", "--die-with-parent", "--new-session"]
    if job.get("network_isolation"):
        argv.append("--unshare-net")
    argv += ["--chdir", job["cwd"], "--"]
    return argv


def remove_path(path):
    # type: (str) -> None
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def prepare_outputs(job, staging):
    # type: (dict, str) -> None
    """Folders must exist before bubblewrap can bind onto them; as Snakemake
    does, the output's parent folders are created in the project."""
    project = job["project"]
    for rel in writable_dirs(job["outputs"]):
        os.makedirs(os.path.join(staging, rel), exist_ok=True)
        os.makedirs(os.path.join(project, rel), exist_ok=True)


# ------------------------------------------------------------------ worker


class Worker(object):
    def __init__(self, job, secrets=None):
        # type: (dict, dict | None) -> None
        self.job = job
        self.secrets = secrets or {}  # values only in memory, never written
        self.stop_reason = None  # type: str | None
        self.stop_signal = "signal"
        self.wake_r, self.wake_w = os.pipe()
        self.status = {
            "state": "starting",
            "worker_pid": os.getpid(),
            "worker_start_ticks": proc_start_ticks(os.getpid()),
            "pid": None,
            "start_ticks": None,
            "exit_code": None,
            "signal": None,
            "started_at": None,
            "ended_at": None,
            "sandbox": None,
            "outputs_root": None,
            "message": None,
        }

    # -- signals
    def install_handlers(self):
        # type: () -> None
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self.wake_w)
        for sig in STOP_SIGNALS:
            signal.signal(sig, self.on_stop_signal)
        # SIGCHLD only needs to wake the poll loop.
        signal.signal(signal.SIGCHLD, lambda _s, _f: None)

    def on_stop_signal(self, signum, _frame):
        # type: (int, object) -> None
        if self.stop_reason is None:
            self.stop_reason = "cancelled"
            self.stop_signal = signal.Signals(signum).name

    def sleep(self, seconds):
        # type: (float) -> None
        """Sleep until a signal arrives or `seconds` pass."""
        try:
            select.select([self.wake_r], [], [], max(0.0, seconds))
        except InterruptedError:
            pass
        try:
            while os.read(self.wake_r, 512):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def claim_start(self):
        # type: () -> bool
        """Under the run's start lock: refuse a run already ended (cancelled
        before its worker got here), else record `starting` with our pid so
        that a cancel from now on signals us."""
        import fcntl

        lock_path = os.path.join(os.path.dirname(self.job["status_file"]), START_LOCK)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                with open(self.job["status_file"]) as f:
                    if json.load(f).get("state") in FINAL_STATES:
                        return False
            except (OSError, ValueError):
                pass
            self.write_status(state="starting")
            return True
        finally:
            os.close(fd)  # closing releases the lock

    def write_status(self, **changes):
        # type: (...) -> None
        self.status.update(changes)
        write_json_atomic(self.job["status_file"], self.status)

    # -- the run
    def command_argv(self, log_fd):
        # type: (int) -> tuple
        """(argv, sandbox name, folder the outputs end up in)."""
        job = self.job
        wanted = job.get("sandbox", "auto")
        command = [str(part) for part in job["argv"]]
        staging = job["staging"]
        if wanted == "none" and job.get("network_isolation"):
            raise RuntimeError(
                'network_isolation = true needs the sandbox, but sandbox = "none"; '
                'set sandbox = "auto" or "bwrap", or network_isolation = false'
            )
        if wanted != "none":
            bwrap = shutil.which("bwrap")
            usable = bwrap is not None and bwrap_usable(bwrap)
            if usable:
                prepare_outputs(job, staging)
                return bwrap_argv(str(bwrap), job, staging) + command, "bwrap", staging
            if wanted == "bwrap":
                raise RuntimeError(
                    "sandbox = \"bwrap\" but bubblewrap is %s on this machine; install it "
                    "(apt-get install bubblewrap) or set sandbox = \"auto\" or \"none\""
                    % ("not installed" if bwrap is None else "not usable (user namespaces off?)")
                )
            log_note(
                log_fd,
                "bubblewrap is %s: running WITHOUT a sandbox (outputs are written in place)"
                % ("not installed" if bwrap is None else "not usable"),
            )
            if job.get("network_isolation"):
                raise RuntimeError(
                    "network_isolation = true needs bubblewrap, which is not usable here; "
                    "install bubblewrap or set network_isolation = false"
                )
        # Without a sandbox the outputs are written in place: remove the
        # previous ones first (as Snakemake does), so that a run that does
        # not write an output is never taken to have made the old one.
        for out in job["outputs"]:
            remove_path(os.path.join(job["project"], out["path"]))
        # The same folders as in the sandbox, so a task runs alike in both.
        for rel in writable_dirs(job["outputs"]):
            os.makedirs(os.path.join(job["project"], rel), exist_ok=True)
        return command, "none", job["project"]

    def run(self, ready_fd=None):
        # type: (int | None) -> int
        job = self.job
        log_fd = os.open(job["log_file"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        # Our own stderr (tracebacks included) goes to the log as well.
        os.dup2(log_fd, 2)
        self.install_handlers()
        libc_prctl(PR_SET_CHILD_SUBREAPER, 1)
        if not self.claim_start():
            log_note(log_fd, "the run was cancelled before it started; not starting it")
            if ready_fd is not None:
                os.write(ready_fd, b"started")
                os.close(ready_fd)
            return 0
        try:
            argv, sandbox, outputs_root = self.command_argv(log_fd)
            env = task_environment(job, os.environ, self.secrets)
            child = subprocess.Popen(
                argv,
                cwd=job["cwd"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log_fd,
                stderr=log_fd,
                start_new_session=True,
                close_fds=True,
            )
        except Exception as exc:  # noqa: BLE001 - any start failure is the run's failure
            log_note(log_fd, "could not start the command: %s" % exc)
            self.write_status(state="failed", message=str(exc), started_at=now_iso(), ended_at=now_iso())
            if ready_fd is not None:
                os.write(ready_fd, b"started")
                os.close(ready_fd)
            return 1
        started = time.monotonic()
        self.write_status(
            state="running",
            pid=child.pid,
            start_ticks=proc_start_ticks(child.pid),
            started_at=now_iso(),
            sandbox=sandbox,
            outputs_root=outputs_root,
        )
        if ready_fd is not None:
            os.write(ready_fd, b"started")
            os.close(ready_fd)
        timeout = job.get("timeout")
        deadline = None if timeout is None else started + float(timeout)
        returncode = None
        while returncode is None and self.stop_reason is None:
            for pid, raw in reap_children():
                if pid == child.pid:
                    returncode = _exitcode(raw)
            if returncode is not None:
                break
            if deadline is not None and time.monotonic() >= deadline:
                self.stop_reason = "timed_out"
                break
            wait = POLL_SECONDS if deadline is None else min(POLL_SECONDS, deadline - time.monotonic())
            self.sleep(wait)
        if self.stop_reason is not None:
            log_note(log_fd, "stopping the task tree (%s)" % (
                "timeout of %ss" % timeout if self.stop_reason == "timed_out" else self.stop_signal))
            code = self.stop_tree(child.pid, float(job.get("grace_seconds", 5.0)))
            state = self.stop_reason
            returncode = code
        else:
            # The command is done; anything it left behind dies now.
            leftovers = self.settle(SETTLE_SECONDS)
            if leftovers:
                log_note(log_fd, "killing %d process(es) the command left running" % len(leftovers))
                self.kill_all(0.5)
            state = "succeeded" if returncode == 0 else "failed"
            if state == "succeeded":
                self.hash_outputs(log_fd, outputs_root)
        self.write_status(
            state=state,
            exit_code=returncode,
            signal=signal.Signals(-returncode).name if returncode is not None and returncode < 0 else None,
            ended_at=now_iso(),
        )
        os.close(log_fd)
        return 0

    def hash_outputs(self, log_fd, outputs_root):
        # type: (int, str) -> None
        """Take the outputs' manifest now, while nothing else can touch them,
        and keep its hash cache: the fetched copy is verified against it."""
        run_dir = os.path.dirname(self.job["status_file"])
        try:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import manifest  # the stdlib-only manifest.py shipped beside this file

            outputs = [o["path"] + ("/" if o["kind"] == "dir" else "") for o in self.job["outputs"]]
            cache_file = os.path.join(run_dir, "manifest-cache.json")
            taken = manifest.manifest_with_cache_file(outputs_root, outputs, cache_file)
            write_json_atomic(os.path.join(run_dir, "manifest.json"), taken)
            if self.job.get("manifest_copy"):  # the bucket transport fetches it with the outputs
                write_json_atomic(self.job["manifest_copy"], taken)
        except Exception as exc:  # noqa: BLE001 - the fetch takes its own and says what is wrong
            log_note(log_fd, "could not take the outputs' manifest: %s" % exc)

    def stop_tree(self, child_pid, grace):
        # type: (int, float) -> int | None
        """SIGTERM the whole tree, wait up to `grace`, then SIGKILL and reap.
        Returns the command's exit code if it was reaped."""
        me = os.getpid()
        # Spare the bubblewrap processes: SIGTERM to them would end the
        # namespace at once, with SIGKILL and no grace for the task.
        spared = self.sandbox_pids(child_pid)
        signal_pids([p for p in live_descendants(me) if p not in spared], signal.SIGTERM)
        code = None
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            for pid, raw in reap_children():
                if pid == child_pid:
                    code = _exitcode(raw)
            if code is not None and not live_descendants(me):
                return code
            self.sleep(0.02)
        for pid, raw in self.kill_all(REAP_SECONDS):
            if pid == child_pid:
                code = _exitcode(raw)
        return code

    def settle(self, seconds):
        # type: (float) -> list
        """Live descendants left once those already exiting are gone: when
        bubblewrap's outer process ends first, its inner one is reparented
        to us while it is still exiting, and is no leftover of the command."""
        deadline = time.monotonic() + seconds
        while True:
            reap_children()
            alive = live_descendants(os.getpid())
            if not alive or time.monotonic() >= deadline:
                reap_children()  # those that turned zombie since
                return alive
            self.sleep(0.01)

    def sandbox_pids(self, child_pid):
        # type: (int) -> set
        if self.status.get("sandbox") != "bwrap":
            return set()
        table = process_table()
        inner = [pid for pid, (ppid, _s) in table.items() if ppid == child_pid]
        return set([child_pid] + inner)

    def kill_all(self, seconds):
        # type: (float) -> list
        """SIGKILL every descendant until none is left; reap them all."""
        reaped = []
        deadline = time.monotonic() + seconds
        while True:
            alive = live_descendants(os.getpid())
            signal_pids(alive, signal.SIGKILL)
            reaped.extend(reap_children())
            if not alive or time.monotonic() >= deadline:
                break
            self.sleep(0.01)
        reaped.extend(reap_children())
        return reaped


PATH_FIELDS = ("cwd", "project", "staging", "status_file", "log_file", "manifest_copy")
PATH_LIST_FIELDS = ("hide", "extra_ro", "path_prepend")


def absolute_paths(job, base):
    # type: (dict, str) -> dict
    """A job written before its machine's home folder was known (SkyPilot)
    names its folders relative to where the worker starts: resolve them."""
    job = dict(job)
    for key in PATH_FIELDS:
        if job.get(key):
            job[key] = os.path.normpath(os.path.join(base, job[key]))
    for key in PATH_LIST_FIELDS:
        if job.get(key):
            job[key] = [os.path.normpath(os.path.join(base, p)) if p else p for p in job[key]]
    return job


def read_json(path):
    # type: (str) -> dict | None
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _exitcode(raw):
    # type: (int) -> int
    if os.WIFSIGNALED(raw):
        return -os.WTERMSIG(raw)
    return os.WEXITSTATUS(raw)


def main(argv=None):
    # type: (list | None) -> int
    args = list(sys.argv[1:] if argv is None else argv)
    detach = "--detach" in args
    # Secrets arrive as a JSON object on stdin, so they touch no file.
    secrets = json.load(sys.stdin) if "--env-stdin" in args else {}
    # --exit-status: exit 0 only if the command succeeded, so a runner that
    # reads exit codes (SkyPilot's job status) sees the run's outcome.
    exit_status = "--exit-status" in args
    args = [a for a in args if a not in ("--detach", "--env-stdin", "--exit-status")]
    if len(args) != 1:
        sys.stderr.write("usage: worker.py JOB_JSON [--detach] [--env-stdin] [--exit-status]\n")
        return 2
    with open(args[0]) as f:
        job = absolute_paths(json.load(f), os.getcwd())
    if not detach:
        code = Worker(job, secrets).run()
        if exit_status and code == 0:
            final = read_json(job["status_file"]) or {}
            return 0 if final.get("state") == "succeeded" else 1
        return code
    # Detach: the parent returns once the child has written its first
    # status, so the caller learns at once whether the command started.
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(ready_w)
        answer = b""
        while True:
            chunk = os.read(ready_r, 64)
            if not chunk:
                break
            answer += chunk
        os.waitpid(pid, os.WNOHANG)
        return 0 if answer == b"started" else 1
    os.close(ready_r)
    if os.getpid() != os.getsid(0):
        os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    try:
        code = Worker(job, secrets).run(ready_fd=ready_w)
    except BaseException:  # noqa: BLE001 - the traceback is in the log (fd 2)
        import traceback

        traceback.print_exc()
        code = 1
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
