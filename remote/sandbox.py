"""The bubblewrap sandbox a step's command runs in, and the choice of it.

Stdlib only, Python 3.8+; shipped beside worker.py. `bwrap_argv` only builds
the argv (it reads the project's folders, changes nothing), so it is tested
without running bubblewrap.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import stat
import struct
import subprocess
from typing import Any, Callable, Mapping

# Own namespaces for everything bubblewrap can give one. The user namespace
# without capabilities is what holds root in: the task is still uid 0 (or the
# same user) for files, but cannot remount, unmount, nsenter or ptrace out.
ISOLATION = ["--unshare-user", "--cap-drop", "ALL", "--unshare-pid", "--unshare-ipc",
             "--unshare-uts", "--unshare-cgroup-try"]
# Where system services keep their Unix sockets and FIFOs (docker, dbus,
# agents, systemd's /run/initctl); emptied under network_isolation. The
# seccomp filter below already keeps the task from any Unix socket, wherever
# bound; a FIFO it cannot refuse (opening one for writing is allowed on a
# read-only mount), and these are the ones services listen on.
SERVICE_DIRS = ["/run", "/var/run"]
# What the task inherits from the worker's environment: the system's plain
# settings and the accelerator stacks', never credentials. Anything else
# reaches it only as the step's env or as a named secret.
PASSED_ENV = ("PATH", "LD_LIBRARY_PATH", "LANG", "LANGUAGE", "TZ", "TERM", "USER", "LOGNAME",
              "SHELL", "HOME", "TMPDIR")
PASSED_ENV_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "ROCR_", "HIP_", "OMP_", "MKL_")
# The GPU device nodes a task needs, named as the drivers make them in /dev:
# NVIDIA's per-GPU and control nodes (CUDA opens nvidiactl, nvidiaN and
# nvidia-uvm; nvidia-smi and MIG use the others), AMD's kfd (ROCm compute);
# and every node in the folders of NVIDIA's MIG capabilities and of DRM
# (dri/card*, dri/renderD*). `--dev /dev` shows none of them.
GPU_NODES = re.compile(r"nvidia[0-9]+|nvidiactl|nvidia-uvm|nvidia-uvm-tools|nvidia-modeset|kfd")
GPU_NODE_DIRS = ("nvidia-caps", "dri")
# What the NVIDIA driver tells its tools (nvidia-smi reads gpus/*/information);
# the fresh /proc shows it too, bound read-only here because some of its
# files (suspend) are root-writable and a root task keeps uid 0.
NVIDIA_PROC = "/proc/driver/nvidia"
# Where tools keep their files under the home, pointed into the run's home
# (the step's env can still change them): tools that read these variables
# first then agree with those that only know `~`, and matplotlib finds a
# writable config folder instead of warning on every run.
HOME_VARS = (("XDG_CACHE_HOME", ".cache"), ("XDG_CONFIG_HOME", ".config"),
             ("XDG_DATA_HOME", ".local/share"), ("XDG_STATE_HOME", ".local/state"),
             ("MPLCONFIGDIR", ".config/matplotlib"))


def plain_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """The part of `environ` any task may see. The local backend starts the
    worker with only this (and the step's secrets), so that no process the
    task can read holds more."""
    return {k: v for k, v in environ.items() if k in PASSED_ENV or k.startswith(PASSED_ENV_PREFIXES)}


# How long bubblewrap's probe may take (it takes milliseconds; seconds on
# a machine loaded far past its cores).
PROBE_SECONDS = 60.0


@functools.lru_cache(maxsize=None)
def bwrap_usable(bwrap: str) -> bool:
    """bubblewrap can be installed yet unusable (user namespaces disabled).
    Asked once per process: the local backend's spawner asks before it
    forks the workers, which then know. A probe that does not end in time
    is no answer, and raises: read as "unusable", sandbox = "auto" would
    run the command without its sandbox because the machine was busy."""
    try:
        probe = subprocess.run(
            [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", *ISOLATION, "true"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            timeout=PROBE_SECONDS,
        )
    except OSError:
        return False
    except subprocess.TimeoutExpired:
        raise RuntimeError(
            "bubblewrap's check (%s ... true) did not end in %.0f s: this machine is too busy to tell "
            "whether the sandbox works, and nothing is run without it; run doit again"
            % (bwrap, PROBE_SECONDS)
        ) from None
    return probe.returncode == 0


def writable_dirs(outputs: list[dict[str, str]]) -> list[str]:
    """Project-relative folders the task may write in: each folder output,
    and the folder holding each file output. Outer folders first."""
    dirs = set()
    for out in outputs:
        path = out["path"].rstrip("/")
        dirs.add(path if out["kind"] == "dir" else os.path.dirname(path) or ".")
    return sorted(dirs, key=outer_first)


def gpu_devices(dev: str = "/dev") -> list[str]:
    """The GPU device nodes under `dev`, relative to it, sorted. Only
    character devices count: the links in dri/by-path are not nodes."""
    try:
        names = os.listdir(dev)
    except OSError:
        return []
    found = [name for name in names if GPU_NODES.fullmatch(name)]
    for folder in GPU_NODE_DIRS:
        try:
            found += [folder + "/" + name for name in os.listdir(os.path.join(dev, folder))]
        except OSError:  # no such folder: no such GPU
            continue
    nodes = []
    for rel in sorted(found):
        try:
            if stat.S_ISCHR(os.lstat(os.path.join(dev, rel)).st_mode):
                nodes.append(rel)
        except OSError:  # gone since the listing
            continue
    return nodes


def gpu_argv(dev: str = "/dev", driver_info: str = NVIDIA_PROC) -> list[str]:
    """bubblewrap options showing the GPUs of this machine (none without):
    each node bound with device access (a plain bind is nodev, where opening
    a device fails with EACCES), and the NVIDIA driver's /proc folder."""
    argv = []
    for rel in gpu_devices(dev):
        argv += ["--dev-bind", os.path.join(dev, rel), "/dev/" + rel]
    if os.path.isdir(driver_info):
        argv += ["--ro-bind", driver_info, driver_info]
    return argv


def within(rel: str, paths: Any) -> bool:
    """Whether project path `rel` is one of `paths` or inside one."""
    return any(rel == p or rel.startswith(p + "/") for p in paths)


def view_folders(hidden: list[str], writable: list[str],
                 outputs: list[dict[str, str]]) -> tuple[list[str], list[str]]:
    """The project folders holding hidden entries, outer first: those
    mounted before the outputs' folders, and those inside an output's
    folder, mounted after it (they are shown there from the project). A
    hidden entry right in an output's folder is simply not shown there."""
    declared = {out["path"].rstrip("/") for out in outputs}
    before, after = set(), set()
    for rel in hidden:
        folder = os.path.dirname(rel) or "."
        if folder in writable:
            continue
        holders = [w for w in writable if w == "." or folder.startswith(w + "/")]
        if not holders:
            before.add(folder)
            continue
        deepest = max(holders, key=len)
        top = folder if deepest == "." else folder[len(deepest) + 1:]
        shown = top.split("/")[0] if deepest == "." else deepest + "/" + top.split("/")[0]
        if shown not in declared and not within(shown, hidden):  # else it is staging: nothing to hide
            after.add(folder)
    return sorted(before, key=outer_first), sorted(after, key=outer_first)


def outer_first(rel: str) -> tuple[int, str]:
    return (0 if rel == "." else rel.count("/") + 1, rel)


def view_argv(project: str, folder: str, hidden: Any, staging: str | None = None,
              shown: list[str] | None = None) -> list[str]:
    """A project folder shown without its `hidden` entries: an empty tmpfs
    (or the folder's writable `staging` copy) with the others bound back
    read-only (a link made again), so that a hidden file is absent as it
    is from a remote copy, not an empty stand-in. With `shown` (the view's
    paths), only those and the folders on the way to them come back: an
    entry made since the view was taken is in no list, and is not seen."""
    real = os.path.normpath(os.path.join(project, folder))
    argv = ["--tmpfs", real] if staging is None else ["--bind", staging, real]
    for name in sorted(os.listdir(real)):
        rel = name if folder == "." else folder + "/" + name
        if within(rel, hidden):
            continue
        if shown is not None and not within(rel, shown) and not any(s.startswith(rel + "/") for s in shown):
            continue
        path = os.path.join(real, name)
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        else:
            argv += ["--ro-bind", path, path]
    return argv


# The seccomp filter bubblewrap loads under network_isolation (`--seccomp
# FD`, read from a pipe): the task may not make a Unix socket at all. A
# network namespace covers abstract Unix sockets but not path ones, and a
# path socket can be bound at any time, in any namespace (a container's),
# or hard-linked anywhere the task can see: no list of them taken at start
# holds. Nor can seccomp read connect()'s address (a pointer), so "connect
# to path sockets only" cannot be filtered; refusing socket(AF_UNIX, ...)
# can. socketpair() stays allowed for stream and seqpacket pairs (pipes,
# multiprocessing and subprocess use them), which can never be connected
# elsewhere; a datagram pair is refused as socket() is, since sendto() and
# connect() take it to any host datagram socket (journald's /dev/log).
# io_uring is refused (it makes and connects sockets behind seccomp's back),
# and so is any system call of another ABI (x32, the 32-bit compat entry
# whose socketcall() hides socket()'s arguments).
#
# Values from the kernel's headers (linux/seccomp.h, audit.h, filter.h,
# bpf_common.h; asm/unistd_64.h and asm-generic/unistd.h).
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
ENOSYS = 38
# What the task's socket() fails with: "Address family not supported by
# protocol", which hints.py recognises in a failed run's log.
EAFNOSUPPORT = 97
AF_UNIX = 1
# A vsock reaches the hypervisor's host (CID 2) from inside a VM whatever
# the network namespace: under network_isolation it is refused too.
AF_VSOCK = 40
SOCK_DGRAM = 2
SOCK_TYPE_MASK = 0xF  # socket()'s type also carries SOCK_NONBLOCK and SOCK_CLOEXEC
X32_SYSCALL_BIT = 0x40000000
# machine (uname -m): (AUDIT_ARCH_*, socket, socketpair, io_uring_setup).
SECCOMP_ARCHES = {
    "x86_64": (0xC000003E, 41, 53, 425),
    "aarch64": (0xC00000B7, 198, 199, 425),
}
# struct seccomp_data: int nr; u32 arch; u64 ip; u64 args[6] (the low half
# of an argument first: both machines are little-endian).
DATA_NR, DATA_ARCH, DATA_ARG0, DATA_ARG1 = 0, 4, 16, 24
# Classic BPF opcodes: load a word of seccomp_data, and with a constant,
# compare with a constant, return.
BPF_LD_ABS, BPF_AND_K, BPF_JEQ_K, BPF_JGE_K, BPF_RET_K = 0x20, 0x54, 0x15, 0x35, 0x06


def seccomp_program(machine: str) -> bytes:
    """The filter for `machine` in the kernel's `struct sock_filter` layout
    (u16 code, u8 jt, u8 jf, u32 k, native order), as bubblewrap reads it.
    Jumps name a label (a string in the list); "" falls through."""
    arch, socket_nr, socketpair_nr, io_uring_setup_nr = SECCOMP_ARCHES[machine]
    x32 = [(BPF_JGE_K, X32_SYSCALL_BIT, "no_such_call", "")] if machine == "x86_64" else []
    code: list[str | tuple[int, int, str, str]] = [  # (opcode, k, label if true, label if false)
        (BPF_LD_ABS, DATA_ARCH, "", ""),
        (BPF_JEQ_K, arch, "", "no_such_call"),
        (BPF_LD_ABS, DATA_NR, "", ""),
        *x32,
        (BPF_JEQ_K, io_uring_setup_nr, "no_such_call", ""),
        (BPF_JEQ_K, socket_nr, "socket", ""),
        (BPF_JEQ_K, socketpair_nr, "", "allow"),
        (BPF_LD_ABS, DATA_ARG0, "", ""),  # socketpair: a Unix datagram pair is refused
        (BPF_JEQ_K, AF_UNIX, "", "allow"),
        (BPF_LD_ABS, DATA_ARG1, "", ""),
        (BPF_AND_K, SOCK_TYPE_MASK, "", ""),
        (BPF_JEQ_K, SOCK_DGRAM, "refuse", "allow"),
        "socket",  # a socket of the Unix or the vsock family is refused
        (BPF_LD_ABS, DATA_ARG0, "", ""),
        (BPF_JEQ_K, AF_UNIX, "refuse", ""),
        (BPF_JEQ_K, AF_VSOCK, "refuse", "allow"),
        "allow",
        (BPF_RET_K, SECCOMP_RET_ALLOW, "", ""),
        "refuse",
        (BPF_RET_K, SECCOMP_RET_ERRNO | EAFNOSUPPORT, "", ""),
        "no_such_call",
        (BPF_RET_K, SECCOMP_RET_ERRNO | ENOSYS, "", ""),
    ]
    instructions = [step for step in code if not isinstance(step, str)]
    labels, index = {}, 0
    for step in code:
        if isinstance(step, str):
            labels[step] = index
        else:
            index += 1
    program = b""
    for index, (opcode, k, if_true, if_false) in enumerate(instructions):
        # a jump counts the instructions it skips: forward only, as BPF's are
        jt, jf = (labels[label] - index - 1 if label else 0 for label in (if_true, if_false))
        program += struct.pack("=HBBI", opcode, jt, jf, k)
    return program


def refuse_unfiltered(machine: str) -> None:
    """Raise, naming the fix, when there is no seccomp filter for `machine`
    (uname -m): network_isolation cannot be kept there."""
    if machine not in SECCOMP_ARCHES:
        raise RuntimeError("network_isolation = true is supported on %s machines only (its seccomp filter of "
                           "Unix sockets is written for their system calls), and this one is %s; set "
                           "network_isolation = false for this machine"
                           % (" and ".join(sorted(SECCOMP_ARCHES)), machine))


def seccomp_fd(machine: str) -> int:
    """A pipe's read end holding the filter for bubblewrap's `--seccomp`.
    The program (under 200 bytes) fits in the pipe's buffer: the write
    never waits for a reader."""
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, seccomp_program(machine))
    finally:
        os.close(write_end)
    return read_end


def bwrap_argv(bwrap: str, job: Mapping[str, Any], staging: str, dev: str = "/dev",
               home: str | None = None, filter_fd: int | None = None) -> list[str]:
    """The bubblewrap prefix: system and project read-only, /tmp replaced by
    an empty private tmpfs, home (the "hide" folders) by an empty read-only
    one, each output folder bound from the run's staging folder so that the
    task writes its outputs at their usual paths, and the GPU nodes under
    `dev` bound into the minimal /dev. `home`: where the run's own home
    folder (`home_dir`, writable) appears, with the kept `cache_dirs` in
    it. Under network_isolation the network is unshared and the seccomp
    program readable from `filter_fd` (seccomp_fd) is loaded."""
    project = job["project"]
    isolated = bool(job.get("network_isolation"))
    if isolated and filter_fd is None:
        raise ValueError("network_isolation needs the seccomp filter's fd")
    argv = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    hidden = [h for h in job.get("hide", []) if os.path.isdir(h) and h != "/" and h != home]
    # A folder inside another hidden one, or inside the home the run's own
    # replaces (a remote root in the login's home), is hidden with it: a
    # tmpfs of its own there would be covered, and could not be remounted read-only.
    covering = [*hidden, *([home] if home is not None else [])]
    hidden = [h for h in hidden if not any(h.startswith(o.rstrip("/") + "/") for o in covering)]
    # A symlink (/var/run -> /run) is hidden with its target.
    emptied = [p for p in ["/tmp", "/var/tmp", *(SERVICE_DIRS if isolated else [])]
               if os.path.isdir(p) and not os.path.islink(p)]
    for path in [*emptied, *hidden]:
        argv += ["--tmpfs", path]
    if home is not None:
        # The run's home replaces the real one (a bind onto its path hides
        # it as a tmpfs would), then each kept cache folder goes in it.
        argv += ["--bind", job["home_dir"], home]
        for kept in job.get("cache_dirs", []):
            argv += ["--bind", kept["kept"], os.path.join(home, kept["path"])]
    # Re-expose the project (and inputs outside it) after hiding: the
    # project may live under $HOME or /tmp.
    argv += ["--ro-bind", project, project]
    writable = writable_dirs(job["outputs"])
    hidden_set = set(job.get("project_hidden", []))
    shown = job.get("project_shown")
    before, after = view_folders(job.get("project_hidden", []), writable, job["outputs"])
    for folder in before:
        argv += view_argv(project, folder, hidden_set, shown=shown)
    for path in job.get("extra_ro", []):
        if os.path.exists(path):
            argv += ["--ro-bind", path, path]
    # Only now (the binds above made their mount points in the tmpfs): a
    # write to a hidden folder fails instead of landing in a scratch tmpfs.
    for path in hidden:
        argv += ["--remount-ro", path]
    declared = {out["path"].rstrip("/") for out in job["outputs"]}
    for rel in writable:
        # What already stands in that folder stays visible, read-only;
        # earlier versions of the declared outputs do not.
        bound = os.path.normpath(os.path.join(staging, rel))
        if rel in declared:
            argv += ["--bind", bound, os.path.normpath(os.path.join(project, rel))]
        else:
            argv += view_argv(project, rel, hidden_set | declared, bound, shown)
    # The checkpoints folder, kept across attempts, writable at its path.
    checkpoints = job.get("checkpoints")
    if checkpoints:
        argv += ["--bind", checkpoints["kept"], os.path.normpath(os.path.join(project, checkpoints["path"]))]
    # Folders in output folders are shown from the project just above:
    # what is hidden in them goes now. Then every view folder is made
    # read-only, once nothing more is mounted in it.
    for folder in after:
        argv += view_argv(project, folder, hidden_set, shown=shown)
    for folder in [*before, *after]:
        argv += ["--remount-ro", os.path.normpath(os.path.join(project, folder))]
    # After every mount above, so the tests' view of their order holds on
    # a GPU machine too; /dev and /proc/driver are touched by nothing else.
    argv += gpu_argv(dev)
    if isolated:
        argv += ["--unshare-net", "--seccomp", str(filter_fd)]
    argv += [*ISOLATION, "--die-with-parent", "--new-session"]
    return [*argv, "--chdir", job["cwd"], "--"]


def task_home(job: Mapping[str, Any], environ: Mapping[str, str]) -> str:
    """Where the task's home is in the sandbox: at the path its $HOME names
    when that is a folder the job hides (the real home: then `~`, the
    user's passwd entry and paths written under the home agree), else at
    the run's home folder itself (no $HOME, "/", a home not hidden, whose
    files the task may need, as an interpreter installed there)."""
    home = os.path.normpath(environ.get("HOME") or ".")
    hidden = {os.path.normpath(h) for h in job.get("hide", []) if h}
    if os.path.isabs(home) and home != "/" and home in hidden and os.path.isdir(home):
        return home
    return str(job["home_dir"])


def home_settings(job: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, str]:
    """$HOME and the variables of HOME_VARS, for a task in the sandbox."""
    home = task_home(job, environ)
    settings = {"HOME": home}
    settings.update((name, home + "/" + rel) for name, rel in HOME_VARS)
    return settings


def make_home(job: Mapping[str, Any]) -> None:
    """The run's empty home folder, and the kept cache folders (made on
    their first run, then reused)."""
    remove_home(job)  # never a leftover: the home starts empty
    os.makedirs(job["home_dir"], mode=0o700)
    for kept in job.get("cache_dirs", []):
        os.makedirs(kept["kept"], mode=0o700, exist_ok=True)


def remove_home(job: Mapping[str, Any]) -> None:
    """Remove the run's home folder once nothing runs in it, also what the
    task made unwritable: its folders are made writable first (links are
    never followed, and the kept cache folders are not in it on the host:
    their binds were the sandbox's own)."""
    path = job.get("home_dir")
    if not path or not os.path.isdir(path):
        return
    for top, dirs, _files in os.walk(path):
        for name in dirs:
            folder = os.path.join(top, name)
            if not os.path.islink(folder):
                try:
                    os.chmod(folder, 0o700)
                except OSError:  # rmtree below says nothing either; what stays, teardown retries
                    continue
    shutil.rmtree(path, ignore_errors=True)


def sandboxed_command(job: Mapping[str, Any], note: Callable[[str], None],
                      environ: Mapping[str, str]) -> tuple[list[str], str, str, list[int]]:
    """(argv, sandbox name, folder the outputs end up in, fds the argv
    names) for the job's `sandbox` setting; a setting this machine cannot
    honour raises. The caller passes the fds to the command and closes
    them once it started. The sandbox's home is made here; remove_home
    removes it."""
    wanted = job.get("sandbox", "auto")
    command = [str(part) for part in job["argv"]]
    bwrap = shutil.which("bwrap") if wanted != "none" else None
    if bwrap is not None and bwrap_usable(bwrap):
        machine = os.uname().machine
        isolated = bool(job.get("network_isolation"))
        if isolated:
            refuse_unfiltered(machine)
        staging = job["staging"]
        # bubblewrap binds onto folders that exist; as Snakemake does,
        # the outputs' parent folders are made in the project too.
        for rel in writable_dirs(job["outputs"]):
            os.makedirs(os.path.join(staging, rel), exist_ok=True)
            os.makedirs(os.path.join(job["project"], rel), exist_ok=True)
        checkpoints = job.get("checkpoints")
        if checkpoints:  # bound onto a folder that exists, as the outputs'
            os.makedirs(checkpoints["kept"], mode=0o700, exist_ok=True)
            os.makedirs(os.path.join(job["project"], checkpoints["path"]), exist_ok=True)
        make_home(job)
        filter_fd = seccomp_fd(machine) if isolated else None
        try:
            argv = bwrap_argv(bwrap, job, staging, home=task_home(job, environ), filter_fd=filter_fd)
        except BaseException:
            if filter_fd is not None:
                os.close(filter_fd)
            raise
        return argv + command, "bwrap", staging, [] if filter_fd is None else [filter_fd]
    # The settings refuse these before launch; a job made by hand is held
    # to the same line.
    problem = "not installed" if bwrap is None else "not usable (user namespaces off?)"
    if wanted == "bwrap":
        raise RuntimeError('sandbox = "bwrap" but bubblewrap is %s on this machine; install it '
                           '(apt-get install bubblewrap) or set sandbox = "auto" or "none"' % problem)
    if job.get("network_isolation"):
        raise RuntimeError('network_isolation = true needs the sandbox, but %s; set sandbox = "auto" or '
                           '"bwrap" (with bubblewrap usable), or network_isolation = false'
                           % ('sandbox = "none"' if wanted == "none" else "bubblewrap is " + problem))
    if wanted != "none":
        note("bubblewrap is %s: running WITHOUT a sandbox (outputs are written in place)" % problem)
    # Without a sandbox the outputs are written in place: remove the
    # previous ones first (as Snakemake does), so that a run that does
    # not write an output is never taken to have made the old one.
    for out in job["outputs"]:
        path = os.path.join(job["project"], out["path"])
        if os.path.islink(path) or os.path.isfile(path):
            os.unlink(path)
        elif os.path.isdir(path):
            shutil.rmtree(path)
    # The same folders as in the sandbox, so a task runs alike in both.
    for rel in writable_dirs(job["outputs"]):
        os.makedirs(os.path.join(job["project"], rel), exist_ok=True)
    return command, "none", job["project"], []
