"""The unit half of tests/integration/local/test_sandbox.py: the same subject, the
tests that start no process and open no connection (see its docstring)."""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Sequence
from pathlib import Path

import pytest
from sandbox_beds import job_for

from substrax_tasks._remote import sandbox

# ------------------------------------------------- the argv, without bubblewrap


def pairs(argv: list[str], option: str) -> list[tuple[str, str]]:
    """(source, destination) of every `option SOURCE DEST` in argv."""
    return [(argv[i + 1], argv[i + 2]) for i, arg in enumerate(argv) if arg == option]


@pytest.mark.unit
def test_bwrap_argv_system_read_only_own_namespaces_then_the_command(tmp_path: Path) -> None:
    argv = sandbox.bwrap_argv("/usr/bin/bwrap", job_for(tmp_path, []), "/staging")
    assert argv[:8] == ["/usr/bin/bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    assert {"--unshare-pid", "--unshare-ipc", "--die-with-parent", "--new-session"} <= set(argv)
    assert "--unshare-net" not in argv
    assert argv[8:10] == ["--tmpfs", "/tmp"]  # a private, empty /tmp
    assert argv[-3:] == ["--chdir", str(tmp_path), "--"]  # the command follows
    assert (str(tmp_path), str(tmp_path)) in pairs(argv, "--ro-bind")


@pytest.mark.unit
def test_bwrap_argv_network_isolation_unshares_the_network_and_loads_the_filter(tmp_path: Path) -> None:
    job = job_for(tmp_path, [], network_isolation=True)
    argv = sandbox.bwrap_argv("bwrap", job, "/staging", filter_fd=7)
    assert "--unshare-net" in argv
    assert argv[argv.index("--seccomp") + 1] == "7"
    assert argv[-3:] == ["--chdir", str(tmp_path), "--"]
    with pytest.raises(ValueError, match="seccomp"):  # never an isolation without the filter
        sandbox.bwrap_argv("bwrap", job, "/staging")
    plain = sandbox.bwrap_argv("bwrap", job_for(tmp_path, []), "/staging", filter_fd=7)
    assert "--seccomp" not in plain


# The filter's verdicts, from linux/seccomp.h and asm-generic/errno.h.
ALLOW, ENOSYS, EAFNOSUPPORT = 0x7FFF0000, 0x00050000 | 38, 0x00050000 | 97
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7, "i386": 0x40000003, "arm": 0x40000028}
SYSCALLS = {"x86_64": {"socket": 41, "socketpair": 53, "io_uring_setup": 425, "connect": 42},
            "aarch64": {"socket": 198, "socketpair": 199, "io_uring_setup": 425, "connect": 203}}


def run_filter(program: bytes, arch: int, nr: int, args: Sequence[int] = ()) -> int:
    """What the kernel's classic BPF would return for this seccomp_data: the
    few instructions the filter uses, interpreted as the kernel does."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, *[*args, 0, 0, 0, 0, 0, 0][:6])
    code = list(struct.iter_unpack("=HBBI", program))
    accumulator, pc = 0, 0
    while True:
        op, jt, jf, k = code[pc]
        pc += 1
        if op == 0x20:  # ld [k]
            accumulator = struct.unpack_from("<I", data, k)[0]
        elif op == 0x54:  # and #k
            accumulator &= k
        elif op in (0x15, 0x35):  # jeq, jge #k
            hit = accumulator == k if op == 0x15 else accumulator >= k
            pc += jt if hit else jf
        elif op == 0x06:  # ret #k
            return int(k)
        else:
            raise AssertionError(f"unexpected opcode {op:#x}")


@pytest.mark.unit
@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_the_seccomp_filter_refuses_unix_sockets_io_uring_and_foreign_system_calls(machine: str) -> None:
    program = sandbox.seccomp_program(machine)
    assert len(program) % 8 == 0 and len(program) // 8 <= 20
    arch, nr = AUDIT_ARCH[machine], SYSCALLS[machine]
    af_unix, af_inet, af_netlink, af_vsock = 1, 2, 16, 40
    stream, dgram, seqpacket, cloexec = 1, 2, 5, 0o2000000

    def verdict(call: str, *args: int, on: int = arch) -> int:
        return run_filter(program, on, nr[call], args)

    assert verdict("socket", af_unix, stream) == EAFNOSUPPORT
    assert verdict("socket", af_unix, dgram | cloexec) == EAFNOSUPPORT
    assert verdict("socket", af_unix | 0xFFFF_FFFF_0000_0000, stream) == EAFNOSUPPORT  # int: low half only
    assert verdict("socket", af_inet, stream) == ALLOW
    assert verdict("socket", af_vsock, stream) == EAFNOSUPPORT  # the hypervisor's host, past the netns
    assert verdict("socket", af_netlink, dgram) == ALLOW
    assert verdict("socketpair", af_unix, stream | cloexec) == ALLOW
    assert verdict("socketpair", af_unix, seqpacket) == ALLOW
    assert verdict("socketpair", af_unix, dgram | cloexec) == EAFNOSUPPORT  # sendto() reaches any path
    assert verdict("connect", 3, 0x7FFF0000, 110) == ALLOW
    assert verdict("io_uring_setup", 8, 0) == ENOSYS
    assert run_filter(program, arch, 0, (af_unix,)) == ALLOW  # read (x86_64), io_setup (aarch64)
    foreign = AUDIT_ARCH["i386" if machine == "x86_64" else "arm"]
    assert run_filter(program, foreign, 102, (1, 0)) == ENOSYS  # socketcall(SYS_SOCKET, ...)
    assert run_filter(program, foreign, 0, ()) == ENOSYS
    if machine == "x86_64":  # x32: any call with the x32 bit, socket() or not
        assert run_filter(program, arch, 0x40000000 | 41, (af_inet,)) == ENOSYS


@pytest.mark.unit
def test_network_isolation_is_refused_on_a_machine_the_filter_is_not_written_for() -> None:
    sandbox.refuse_unfiltered("x86_64")
    sandbox.refuse_unfiltered("aarch64")
    with pytest.raises(RuntimeError) as refused:
        sandbox.refuse_unfiltered("riscv64")
    assert str(refused.value) == (
        "network_isolation = true is supported on aarch64 and x86_64 machines only (its seccomp filter of "
        "Unix sockets is written for their system calls), and this one is riscv64; set "
        "network_isolation = false for this machine"
    )


@pytest.mark.unit
def test_bwrap_argv_hides_home_yet_shows_a_project_inside_it(tmp_path: Path) -> None:
    home = tmp_path / "home"
    project = home / "work" / "project"
    project.mkdir(parents=True)
    python = tmp_path / "venv"
    python.mkdir()
    job = job_for(project, [], hide=[str(home), str(tmp_path / "no-such-folder")], extra_ro=[str(python)])
    argv = sandbox.bwrap_argv("bwrap", job, "/staging")
    tmpfs = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--tmpfs"]
    assert str(home) in tmpfs
    assert str(tmp_path / "no-such-folder") not in argv  # nothing to hide there
    binds = pairs(argv, "--ro-bind")
    assert (str(project), str(project)) in binds
    assert (str(python), str(python)) in binds
    # read-only only after the binds above made their mount points in it
    remount = argv.index("--remount-ro")
    assert argv[remount + 1] == str(home)
    assert remount > argv.index(str(python))


def options(argv: list[str], option: str) -> list[str]:
    """The PATH of every `option PATH` in argv."""
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == option]


@pytest.mark.unit
def test_bwrap_argv_hides_a_remote_root_with_the_home_it_lies_in(tmp_path: Path) -> None:
    """A remote root in the login's home is hidden with the home (a tmpfs
    of the home, or the run's own home bound over it): no tmpfs of its
    own, which could not be remounted read-only there. One elsewhere gets
    its own."""
    home, elsewhere = tmp_path / "home", tmp_path / "srv" / "root"
    inside = home / ".substrax-remote"
    project = inside / "runs" / "r1" / "project"
    project.mkdir(parents=True)
    elsewhere.mkdir(parents=True)
    for hide in ([str(home), str(inside)], [str(inside), str(home)]):
        argv = sandbox.bwrap_argv("bwrap", job_for(project, [], hide=hide), "/staging")
        assert str(home) in options(argv, "--tmpfs") and str(inside) not in options(argv, "--tmpfs")
        assert options(argv, "--remount-ro")[0] == str(home)
        assert str(inside) not in options(argv, "--remount-ro")
        argv = sandbox.bwrap_argv("bwrap", job_for(project, [], hide=hide), "/staging", home=str(home))
        assert not {str(home), str(inside)} & {*options(argv, "--tmpfs"), *options(argv, "--remount-ro")}
    argv = sandbox.bwrap_argv("bwrap", job_for(project, [], hide=[str(home), str(elsewhere)]), "/staging")
    assert {str(home), str(elsewhere)} <= set(options(argv, "--tmpfs")) & set(options(argv, "--remount-ro"))


@pytest.mark.unit
def test_bwrap_argv_binds_output_folders_from_staging(tmp_path: Path) -> None:
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "old.txt").write_text("kept\n")
    (tmp_path / "results" / "metrics.json").write_text("earlier\n")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "stale.txt").write_text("earlier\n")
    argv = sandbox.bwrap_argv("bwrap", job_for(tmp_path, ["out/", "results/metrics.json"]), "/staging")
    assert pairs(argv, "--bind") == [
        ("/staging/out", str(tmp_path / "out")),
        ("/staging/results", str(tmp_path / "results")),
    ]
    ro = [dest for _src, dest in pairs(argv, "--ro-bind")]
    assert str(tmp_path / "results" / "old.txt") in ro  # beside a file output: visible, read-only
    assert str(tmp_path / "results" / "metrics.json") not in ro  # an earlier version of an output
    assert not [d for d in ro if d.startswith(str(tmp_path / "out"))]  # a folder output starts empty


def fake_dev(root: Path, nodes: Sequence[str]) -> Path:
    """A folder standing for /dev, holding character devices at `nodes`
    (making one needs root: the test is skipped otherwise)."""
    if os.geteuid() != 0:
        pytest.skip("GPU DISCOVERY NOT UNIT-TESTED: making a device node needs root (CI runs as root)")
    dev = root / "dev"
    for rel in nodes:
        (dev / rel).parent.mkdir(parents=True, exist_ok=True)
        os.mknod(dev / rel, stat.S_IFCHR | 0o666, os.makedev(195, 0))
    return dev


@pytest.mark.unit
def test_gpu_devices_finds_nvidia_and_amd_nodes(tmp_path: Path) -> None:
    gpus = ["nvidia0", "nvidia12", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset",
            "nvidia-caps/nvidia-cap1", "kfd", "dri/card0", "dri/renderD128"]  # fmt: skip
    dev = fake_dev(tmp_path, [*gpus, "null", "nvidia-foo", "nvidiactl2", "kfd0", "sda"])
    (dev / "nvidia7").write_text("a file, not a node\n")
    (dev / "dri" / "by-path").mkdir()
    (dev / "dri" / "by-path" / "pci-0000:00:04.0-render").symlink_to("../renderD128")
    (dev / "nvidia3").symlink_to("nvidia0")
    assert sandbox.gpu_devices(str(dev)) == sorted(gpus)
    assert sandbox.gpu_devices(str(tmp_path / "none")) == []


@pytest.mark.unit
def test_gpu_argv_binds_each_node_with_device_access(tmp_path: Path) -> None:
    dev = fake_dev(tmp_path, ["nvidia0", "dri/renderD128"])
    driver_info = tmp_path / "proc-driver-nvidia"
    assert sandbox.gpu_argv(str(dev), str(driver_info)) == [
        "--dev-bind", str(dev / "dri" / "renderD128"), "/dev/dri/renderD128",
        "--dev-bind", str(dev / "nvidia0"), "/dev/nvidia0",
    ]  # fmt: skip
    driver_info.mkdir()
    shown = sandbox.gpu_argv(str(dev), str(driver_info))
    assert shown[-3:] == ["--ro-bind", str(driver_info), str(driver_info)]
    # In the whole argv: after the minimal /dev it lands in, before the command.
    argv = sandbox.bwrap_argv("bwrap", job_for(tmp_path, []), "/staging", dev=str(dev))
    assert argv.index("--dev-bind") > argv.index("--dev")
    assert pairs(argv, "--dev-bind") == [(str(dev / "dri" / "renderD128"), "/dev/dri/renderD128"),
                                         (str(dev / "nvidia0"), "/dev/nvidia0")]  # fmt: skip
    assert argv[-3:] == ["--chdir", str(tmp_path), "--"]


@pytest.mark.unit
def test_writable_dirs_outer_folders_first() -> None:
    outputs = [{"path": "a/b/c", "kind": "dir"}, {"path": "top.txt", "kind": "file"},
               {"path": "a/x.txt", "kind": "file"}, {"path": "z", "kind": "dir"}]
    assert sandbox.writable_dirs(outputs) == [".", "a", "z", "a/b/c"]


# ------------------------------------------------------ runs under bubblewrap


