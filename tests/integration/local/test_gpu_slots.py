"""GPUs as a step's resources on the local and ssh backends (issue 17).

No GPU is needed: a fake `nvidia-smi` first on PATH lists two, as the real
one does (`nvidia-smi -L`), and the steps report the CUDA_VISIBLE_DEVICES
they were given. `doit` runs from the command line; the GPUs' lock folder
is under the HOME each test gives it, so tests never share one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from dodo_helpers import (
    DOIT,
    clean_env,
    compute,
    doit,
    doit_ok,
    handles,
    make_project,
    pid_alive,
    popen_doit,
    popen_output,
    run_dirs,
    show,
    status_records,
    stop,
    wait_for,
    write_pyproject,
)
from lost_tree import kill_recorded, kill_worker, status_of, step_argv, wait_tree_up, write_command
from progress import wait_exit
from sandbox_beds import CUDA_QUERY, free_gid, make_dev_script, nvidia_smi_gpus
from ssh_helpers import SANDBOX, make_ssh_project, needs_root, needs_sshd
from testbeds.sshd_host import SshHost

from substrax_tasks._remote import gpus

FAKE_SMI = """#!/bin/sh
[ "$1" = "-L" ] || exit 2
echo "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-1d6e2b7a-0000-0000-0000-000000000000)"
echo "GPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-9a41c3f0-0000-0000-0000-000000000000)"
"""
# A step that writes the GPUs it was given, then waits for gate/go (an
# input: visible, read-only, in the sandbox); "$0" is the test's marker.
STEP = """
def task_{name}():
    yield from remote_step(
        {name!r},
        command=["/bin/sh", "-c",
                 'echo "[${{CUDA_VISIBLE_DEVICES-unset}}] ${{CUDA_DEVICE_ORDER-unset}}" '
                 "> out_{name}/gpus.txt; "
                 "while [ ! -e gate/go ]; do sleep 0.05; done", {marker!r}],
        inputs=["gate/"],
        outputs=["out_{name}/"],
        resources={resources!r},
    )
"""


def fake_gpu_host(base: Path) -> dict[str, str]:
    """The environment of a client on a machine with two (fake) GPUs."""
    bin_dir = base / "fake-bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    home = base / "home"
    home.mkdir()
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(home)}


def gpu_project(tmp_path: Path, marker: str, steps: Mapping[str, object]) -> Path:
    body = "".join(STEP.format(name=name, marker=marker, resources=res) for name, res in steps.items())
    root = make_project(tmp_path, body, list(steps))
    (root / "gate").mkdir()
    return root


def given(root: Path, step: str) -> str:
    return (root / f"out_{step}" / "gpus.txt").read_text().strip()


def running(root: Path, count: int) -> bool:
    return [r.get("state") for r in status_records(root)].count("running") == count


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    yield fake_gpu_host(tmp_path)


def test_two_concurrent_steps_under_threads_get_different_gpus_shown_by_status(
    tmp_path: Path, marker: str, env: dict[str, str]
) -> None:
    root = gpu_project(tmp_path, marker, {"a": {"accelerators": "A100:1"}, "b": {"accelerators": "1"}})
    proc = popen_doit(root, "-n", "2", "-P", "thread", env=env)
    try:
        wait_for(lambda: running(root, 2), "both steps to run at once")
        listed = compute(root, "status", "--json")
        held = sorted(tuple(run["gpus"]) for run in json.loads(listed.stdout)["runs"])
        assert held == [("0",), ("1",)], show(listed)
        table = compute(root, "status")
        assert table.stdout.splitlines()[0].split()[-1] == "gpus", show(table)
        (root / "gate" / "go").write_text("")
        assert wait_exit(proc, "the doit to end", 60) == 0, popen_output(root)
    finally:
        stop(proc)
    assert {given(root, "a"), given(root, "b")} == {"[0] PCI_BUS_ID", "[1] PCI_BUS_ID"}


def test_two_doit_processes_get_different_gpus(tmp_path: Path, marker: str, env: dict[str, str]) -> None:
    root = gpu_project(tmp_path, marker, {name: {"accelerators": "A100:1"} for name in ("a", "b")})
    procs = [popen_doit(root, name, env=env) for name in ("a", "b")]
    try:
        wait_for(lambda: running(root, 2), "a and b to run at once")
        (root / "gate" / "go").write_text("")
        assert [wait_exit(proc, "the doit to end", 60) for proc in procs] == [0, 0], popen_output(root)
    finally:
        for proc in procs:
            stop(proc)
    assert {given(root, "a"), given(root, "b")} == {"[0] PCI_BUS_ID", "[1] PCI_BUS_ID"}


def test_a_request_for_more_gpus_than_the_machine_has_fails_before_anything_runs(
    tmp_path: Path, marker: str, env: dict[str, str]
) -> None:
    root = gpu_project(tmp_path, marker, {"big": {"accelerators": "A100:3"}})
    done = doit(root, env=env)
    assert done.returncode == 1, show(done)
    assert (
        "resources accelerators='A100:3' asks for 3 GPU(s), but this machine has 2: "
        "GPU 0: NVIDIA A100-SXM4-80GB; GPU 1: NVIDIA A100-SXM4-80GB" in done.stderr + done.stdout
    ), show(done)
    assert "ask for at most 2" in done.stderr + done.stdout
    assert all(not (d / "status.json").exists() for d in run_dirs(root)), "a worker started"


def test_the_gpus_of_a_killed_clients_runs_are_free_once_those_runs_end(
    tmp_path: Path, marker: str, env: dict[str, str]
) -> None:
    steps = {name: {"accelerators": "A100:1"} for name in ("a", "b", "c")}
    root = gpu_project(tmp_path, marker, steps)
    first = popen_doit(root, "-n", "2", "-P", "thread", "a", "b", env=env)
    try:
        wait_for(lambda: running(root, 2), "a and b to hold both GPUs")
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        # The runs go on without their client, and hold their GPUs: c waits.
        third = popen_doit(root, "c", env=env)
        try:
            wait_for(lambda: "waiting" in popen_output(root), "c to say it waits")
            assert running(root, 2)
            (root / "gate" / "go").write_text("")
            assert wait_exit(third, "the doit to end", 60) == 0, popen_output(root)
        finally:
            stop(third)
    finally:
        stop(first)
    out = popen_output(root)
    assert out.count("other runs hold them; waiting") == 1, out
    assert given(root, "c") in ("[0] PCI_BUS_ID", "[1] PCI_BUS_ID")


NODES_STEP = """
def task_{name}():
    yield from remote_step(
        {name!r},
        command=["/bin/sh", "-c",
                 'stat -c "%F %t:%T" /dev/nvidia0 /dev/nvidia1 > out_{name}/nodes.txt; '
                 'echo "[$CUDA_VISIBLE_DEVICES]" > out_{name}/gpus.txt; '
                 "while [ ! -e gate/go ]; do sleep 0.05; done", {marker!r}],
        inputs=["gate/"],
        outputs=["out_{name}/"],
        resources={{"accelerators": "A100:1"}},
    )
"""


def test_with_gpu_device_nodes_both_steps_see_every_node_and_use_their_own_gpu(
    tmp_path: Path, marker: str, env: dict[str, str]
) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("GPU NODES WITH GPU SLOTS NOT TESTED: making device nodes needs root and unshare")
    body = "".join(NODES_STEP.format(name=name, marker=marker) for name in ("a", "b"))
    root = make_project(tmp_path, body, ["a", "b"], sandbox="bwrap")
    (root / "gate").mkdir()
    # doit, its spawner and their workers in a mount namespace of the test's
    # own, whose /dev holds the nodes the NVIDIA driver makes; the host's
    # /dev is never touched, and the namespace ends with its processes.
    in_namespace = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                    make_dev_script(free_gid()), "make-gpu-dev"]  # fmt: skip
    log = tmp_path / "doit.log"
    with log.open("w") as sink:
        proc = subprocess.Popen([*in_namespace, str(DOIT), "-n", "2", "-P", "thread"], cwd=root,
                                env=clean_env(env), stdout=sink, stderr=sink, text=True)  # fmt: skip
    try:
        wait_for(lambda: running(root, 2), "both steps to run at once")
        (root / "gate" / "go").write_text("")
        assert wait_exit(proc, "the doit to end", 60) == 0, log.read_text()
    finally:
        stop(proc)
    for name in ("a", "b"):
        nodes = (root / f"out_{name}" / "nodes.txt").read_text().splitlines()
        assert nodes == ["character special file c3:0", "character special file c3:1"], nodes
    assert {given(root, "a"), given(root, "b")} == {"[0]", "[1]"}


@pytest.mark.parametrize("threads", [[], ["-n", "2", "-P", "thread"]], ids=["serial", "threads"])
def test_ctrl_c_while_waiting_for_gpus_stops_the_wait_and_the_run_never_starts(
    tmp_path: Path, marker: str, env: dict[str, str], threads: list[str]
) -> None:
    steps = {name: {"accelerators": "A100:1"} for name in ("a", "b", "c")}
    root = gpu_project(tmp_path, marker, steps)
    first = popen_doit(root, "-n", "2", "-P", "thread", "a", "b", env=env)
    try:
        wait_for(lambda: running(root, 2), "a and b to hold both GPUs")
        waiting = popen_doit(root, *threads, "c", env=env)
        try:
            wait_for(lambda: "waiting" in popen_output(root), "c to say it waits")
            waiting.send_signal(signal.SIGINT)
            assert waiting.wait(timeout=30) != 0, popen_output(root)
        finally:
            stop(waiting)
        (c_run,) = [h for h in handles(root) if h["step"] == "c"]
        status = json.loads((root / ".substrax" / "runs" / c_run["run_id"] / "status.json").read_text())
        assert status["state"] == "cancelled" and status["started_at"] is None, status
        (root / "gate" / "go").write_text("")
        assert wait_exit(first, "the doit to end", 60) == 0
    finally:
        stop(first)
    assert not (root / "out_c").exists()


@pytest.mark.parametrize("hide", [True, False], ids=["hidden", "unchanged"])
def test_a_step_asking_no_gpu_sees_none_only_when_the_setting_says(
    tmp_path: Path, marker: str, env: dict[str, str], hide: bool
) -> None:
    root = gpu_project(tmp_path, marker, {"cpu": {}})
    write_pyproject(root, extra=f"hide_gpus_when_unasked = {str(hide).lower()}\n")
    (root / "gate" / "go").write_text("")
    doit_ok(root, env=env)
    assert given(root, "cpu") == ("[] unset" if hide else "[unset] unset")


@pytest.mark.parametrize(
    "value", ["A100:0", "A100:0.5", "{A100:1,H100:1}", 2.0, ""], ids=str
)
def test_a_request_that_is_no_whole_number_of_gpus_is_refused_before_launch(
    tmp_path: Path, marker: str, env: dict[str, str], value: object
) -> None:
    root = gpu_project(tmp_path, marker, {"odd": {"accelerators": value}})
    done = doit(root, env=env)
    assert done.returncode == 1, show(done)
    assert "asks for a whole number of GPUs, 1 or more" in done.stderr + done.stdout, show(done)


def test_host_gpus_reads_nvidia_smi_then_the_drivers_proc_folder(tmp_path: Path) -> None:
    env = fake_gpu_host(tmp_path)
    found = gpus.host_gpus(env["PATH"])
    assert found["kind"] == "cuda"
    assert found["devices"] == [{"id": "0", "name": "NVIDIA A100-SXM4-80GB"},
                                {"id": "1", "name": "NVIDIA A100-SXM4-80GB"}]  # fmt: skip
    proc = tmp_path / "proc-gpus"
    for bus, model in (("0000:81:00.0", "NVIDIA H100 80GB HBM3"), ("0000:01:00.0", "NVIDIA L4")):
        (proc / bus).mkdir(parents=True)
        (proc / bus / "information").write_text(f"Model: \t\t {model}\nIRQ:   42\n")
    found = gpus.host_gpus(str(tmp_path / "empty"), proc_folder=str(proc))
    assert found["devices"] == [{"id": "0", "name": "NVIDIA L4"},
                                {"id": "1", "name": "NVIDIA H100 80GB HBM3"}]  # fmt: skip
    assert gpus.host_gpus(str(tmp_path / "empty"), proc_folder=str(tmp_path / "none"))["devices"] == []


# ------------------------------------------------- over ssh


@pytest.fixture
def host(root_host: SshHost) -> SshHost:
    """This module's host: root's."""
    return root_host


@needs_sshd
@needs_root
def test_over_ssh_the_hosts_gpus_are_listed_there_and_held_apart(
    tmp_path: Path, marker: str, host: SshHost
) -> None:
    # The host's nvidia-smi: first on the PATH of the python substrax runs there.
    there = host.scratch / tmp_path.name
    there.mkdir()
    fake = fake_gpu_host(there)
    python = there / "python3"
    python.write_text(f'#!/bin/sh\nPATH={fake["PATH"]} exec {host.python} "$@"\n')
    python.chmod(0o755)
    steps = {"a": {"accelerators": "A100:1"}, "b": {"accelerators": "A100:1"}, "big": {"accelerators": "3"}}
    body = "".join(STEP.format(name=name, marker=marker, resources=res) for name, res in steps.items())
    root = make_ssh_project(tmp_path, host, body, ("a", "b"), sandbox=SANDBOX, python=str(python),
                            remote_root=str(there / "remote"))  # fmt: skip
    (root / "gate").mkdir()
    big = doit(root, "big")
    assert big.returncode == 1, show(big)
    said = big.stdout + big.stderr
    assert f"asks for 3 GPU(s), but {host.address} has 2: GPU 0: NVIDIA A100-SXM4-80GB" in said, show(big)
    assert not list((there / "remote" / "runs").glob("*")), "a run folder was left on the host"
    proc = popen_doit(root, "-n", "2", "-P", "thread", "a", "b")
    runs = there / "remote" / "runs"

    def remote_running() -> list[Path]:
        found = [d for d in runs.glob("*") if (d / "status.json").exists()]
        return [d for d in found if json.loads((d / "status.json").read_text()).get("state") == "running"]

    try:
        wait_for(lambda: len(remote_running()) == 2, "a and b to run at once on the host", timeout=90)
        for run in remote_running():
            (run / "project" / "gate" / "go").write_text("")
        assert wait_exit(proc, "the doit to end", 120) == 0, popen_output(root)
    finally:
        stop(proc)
    assert {given(root, "a"), given(root, "b")} == {"[0] PCI_BUS_ID", "[1] PCI_BUS_ID"}


def test_on_a_real_gpu_a_step_asking_for_one_sees_exactly_one(tmp_path: Path) -> None:
    if nvidia_smi_gpus() is None:
        pytest.skip("REAL GPU NOT TESTED: no working nvidia-smi on this machine (runs on a GPU host)")
    body = """
def task_query():
    yield from remote_step("query", command=["python3", "cuda_query.py"], inputs=["cuda_query.py"],
                           outputs=["out/"],
                           resources={"accelerators": "1"})
"""
    root = make_project(tmp_path, body, ["query"], sandbox="bwrap", files={"cuda_query.py": CUDA_QUERY})
    done = doit_ok(root)
    assert "CUDA 0 0 1" in done.stdout + done.stderr, show(done)


LOST_GPU_STEPS = """
def task_a():
    yield from remote_step("a", command={argv!r}, outputs=["out_a/result.txt"],
                           resources={{"accelerators": "A100:2"}})

def task_b():
    yield from remote_step("b", command=["/bin/sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES" > out_b/gpus.txt'],
                           outputs=["out_b/"], resources={{"accelerators": "A100:1"}})
"""


def test_gpus_held_by_what_a_killed_worker_left_stay_held_until_cancel_stops_it(
    tmp_path: Path, marker: str, env: dict[str, str]
) -> None:
    """Without bubblewrap, a's worker (holding both GPUs) is killed by
    SIGKILL while its command and a setsid grandchild go on: b waits for a
    GPU while they live, and `substrax-compute cancel` of a's run stops them
    (and removes their cgroup), after which b gets one."""
    flags = tmp_path / "flags"
    write_command(flags)
    root = make_project(tmp_path, LOST_GPU_STEPS.format(argv=step_argv(flags, marker, "out_a/result.txt")),
                        sandbox="none")  # fmt: skip
    (root / "out_b").mkdir()
    first = popen_doit(root, "a", env=env)
    second = None
    try:
        old = wait_tree_up(flags)
        stop(first)
        (run,) = run_dirs(root)
        record = status_of(root, run)
        assert record["gpus"] == ["0", "1"], record
        kill_worker(record)
        second = popen_doit(root, "b", env=env)
        wait_for(lambda: "waiting" in popen_output(root) or second.poll() is not None, "b to wait or end")
        assert second.poll() is None and not (root / "out_b" / "gpus.txt").exists(), popen_output(root)
        assert all(pid_alive(pid) for pid in old)
        cancelled = compute(root, "cancel", str(handles(root)[0]["run_id"]))
        assert cancelled.returncode == 0, show(cancelled)
        assert not [pid for pid in old if pid_alive(pid)]
        if isinstance(record.get("cgroup"), str):
            assert not Path(str(record["cgroup"])).exists()
        assert wait_exit(second, "the doit to end", 60) == 0, popen_output(root)
    finally:
        stop(first)
        if second is not None:
            stop(second)
        kill_recorded(flags, marker)
    assert (root / "out_b" / "gpus.txt").read_text().strip() in ("0", "1")
