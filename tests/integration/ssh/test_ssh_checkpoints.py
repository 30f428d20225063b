"""Checkpoints on the ssh backend, against a real sshd in a network
namespace (tests/support/testbeds/sshd_host.py), real rsync and bubblewrap
on the host: the checkpoints are brought home as verified snapshots every
`checkpoint_seconds` while the run goes; a client killed mid-run reattaches
on the next `doit`, and a run that failed meanwhile is resumed from the
last snapshot, put in place before the command starts; a snapshot pulled
while the command writes is never half a file."""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from checkpoint_parts import (
    COUNT_PY,
    NAMING_STEP,
    count_step,
    inside,
    kept_state,
    on_small_disk,
    rerun_and_reattach_naming_the_checkpoints,
    result_of,
    run_logs,
    starts,
)
from dodo_helpers import (
    DOIT,
    clean_env,
    doit,
    doit_ok,
    popen_doit,
    popen_output,
    show,
    stop,
    unsafe_modes,
    wait_for,
)
from progress import wait_exit
from ssh_helpers import (
    every_session_held,
    live_handles,
    make_ssh_project,
    needs_root,
    needs_sshd,
    remote_run_dir,
)
from testbeds.sshd_host import SshHost

from substrax_tasks.backends.ssh.connection import NoSession, connection
from substrax_tasks.backends.ssh.settings import SshSettings
from substrax_tasks.step.spec import make_spec
from substrax_tasks.store.project import Project

pytestmark = [needs_sshd, needs_root]

PAUSE = 0.3
EVERY = 0.5  # checkpoint_seconds


def counting_project(tmp_path: Path, host: SshHost, body: str) -> Path:
    return make_ssh_project(tmp_path, host, "def task_all():\n" + body, ["all"],
                            files={"count.py": COUNT_PY, "data.txt": "one\n"},
                            checkpoint_seconds=EVERY)  # fmt: skip


def killed_once_pulled(root: Path, step: str, at_least: int) -> None:
    """`doit STEP` SIGKILLed once a snapshot of `at_least` counts is home."""
    proc = popen_doit(root, step)
    try:
        wait_for(lambda: (kept_state(root, step) or {}).get("i", 0) >= at_least,
                 f"a snapshot of {at_least} counts", timeout=120)  # fmt: skip
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        stop(proc)


def test_a_killed_client_reattaches_and_the_snapshots_go_once_promoted(tmp_path: Path, host: SshHost) -> None:
    root = counting_project(tmp_path, host, count_step("count", 16, PAUSE))
    killed_once_pulled(root, "count", 3)
    snapshot = kept_state(root, "count")
    assert snapshot is not None and snapshot["n"] == 16
    # The snapshot is whole and as its manifest says.
    folder = next((root / ".substrax" / "checkpoints" / "count").glob("*/latest"))
    manifest = json.loads((folder / "manifest.json").read_text())
    assert [e["path"] for e in manifest["entries"]] == ["state.json"]
    data = (folder / "files" / "state.json").read_bytes()
    assert hashlib.sha256(data).hexdigest() == manifest["entries"][0]["sha256"]

    done = doit_ok(root, "count")
    assert len(live_handles(root, "count")) == 1, show(done)  # reattached, not launched again
    assert result_of(root, "count") == (16, list(range(1, 17)))
    assert not (root / ".substrax" / "checkpoints" / "count").exists()


def test_a_run_that_failed_without_its_client_resumes_from_the_last_snapshot(
    tmp_path: Path, host: SshHost
) -> None:
    root = counting_project(tmp_path, host, count_step("count", 8, PAUSE, "fail-fresh"))
    killed_once_pulled(root, "count", 2)
    # With no client, the command goes on and exits 3 at count 3.
    wait_for(lambda: any(h["backend_state"].get("remote_run_dir") and
                         (Path(h["backend_state"]["remote_run_dir"]) / "status.json").exists() and
                         json.loads((Path(h["backend_state"]["remote_run_dir"]) / "status.json").read_text())
                         .get("state") == "failed" for h in live_handles(root, "count")),
             "the run to fail on the host", timeout=60)  # fmt: skip
    pulled = kept_state(root, "count")
    assert pulled is not None and pulled["i"] in (2, 3)

    done = doit_ok(root, "count")
    assert len(live_handles(root, "count")) == 2, show(done)  # the failed run, then a new one
    started = starts(run_logs(root, "count")[-1])
    # The new run started from the latest snapshot: the one pulled while the
    # client lived, or the last one, taken as the failed run was seen to end.
    assert len(started) == 1 and started[0] >= pulled["i"], show(done)
    assert "checkpoints put in place from the last snapshot" in done.stdout + done.stderr, show(done)
    reached, seen = result_of(root, "count")
    assert reached == 8 and seen == list(range(1, 9))


def test_a_run_that_failed_after_its_client_was_killed_resumes_from_what_it_left(
    tmp_path: Path, host: SshHost
) -> None:
    """The gap: the command writes one more checkpoint after the last one a
    client pulled, then fails; the next doit brings that one home before
    the failed run's folder is left behind, and starts from it."""
    root = counting_project(tmp_path, host, count_step("count", 6, PAUSE, "fail-fresh", "hold-at-3"))
    killed_once_pulled(root, "count", 2)  # it holds at 2: the last snapshot a client pulled
    run_dir = Path(live_handles(root, "count")[0]["backend_state"]["remote_run_dir"])
    (run_dir / "work" / "checkpoints" / "go").write_text("")  # count 3, written by rename, then exit 3
    wait_for(lambda: (run_dir / "status.json").exists() and
             json.loads((run_dir / "status.json").read_text()).get("state") == "failed",
             "the run to fail on the host", timeout=60)  # fmt: skip
    assert (kept_state(root, "count") or {}).get("i") == 2

    done = doit_ok(root, "count")
    assert len(live_handles(root, "count")) == 2, show(done)  # the failed run, then a new one
    assert starts(run_logs(root, "count")[-1]) == [3], show(done)
    reached, seen = result_of(root, "count")
    assert reached == 6 and seen == list(range(1, 7))


def test_a_command_naming_its_checkpoints_folder_runs_again_after_an_edit_and_reattaches(
    tmp_path: Path, host: SshHost
) -> None:
    """Issue 39, item 1, on a host: the command's check is the client's, so
    a project holding ckpt/long (as a local run of the step leaves it: its
    mount point) had every launch refused, the reattach after a kill -9
    of the client included."""
    root = counting_project(tmp_path, host, NAMING_STEP)
    (root / "ckpt" / "long").mkdir(parents=True)

    def written_in() -> Path | None:  # on the host, bound at ckpt/long in its sandbox
        launched = [h for h in live_handles(root, "train") if h["backend_state"].get("remote_run_dir")]
        return remote_run_dir(launched[-1]) / "work" / "checkpoints" if launched else None

    rerun_and_reattach_naming_the_checkpoints(root, written_in, wait=120)


# A command that rewrites two big files for SECONDS, each by rename, every
# byte of a generation the same.
WRITER_PY = """\
import os, sys, time
size = 4 << 20
os.makedirs("ckpt", exist_ok=True)
end = time.time() + float(sys.argv[1])
generation = 0
while time.time() < end:
    generation += 1
    for name in ("a.bin", "b.bin"):
        with open("ckpt/" + name + ".tmp", "wb") as f:
            f.write(bytes([generation % 251]) * size)
        os.replace("ckpt/" + name + ".tmp", "ckpt/" + name)
open("done.txt", "w").write(str(generation))
"""


def test_a_snapshot_pulled_while_the_command_writes_is_never_half_a_file(
    tmp_path: Path, host: SshHost
) -> None:
    body = ("    yield from remote_step('write', command=['python3', 'writer.py', '5'], "
            "inputs=['writer.py'], outputs=['done.txt'], checkpoints='ckpt/')\n")
    root = make_ssh_project(tmp_path, host, "def task_all():\n" + body, ["all"],
                            files={"writer.py": WRITER_PY}, checkpoint_seconds=0.2,
                            keep_checkpoints=True)  # fmt: skip
    proc = popen_doit(root, "write")
    checked: set[str] = set()
    try:
        folder = root / ".substrax" / "checkpoints" / "write"
        while proc.poll() is None:
            time.sleep(0.02)
            for latest in folder.glob("*/latest"):
                try:
                    snapshot = latest.resolve(strict=True)
                    if snapshot.name in checked:
                        continue
                    manifest = json.loads((snapshot / "manifest.json").read_text())
                    files = {p.name: p.read_bytes() for p in (snapshot / "files").iterdir()}
                except (FileNotFoundError, NotADirectoryError):  # replaced by a newer one meanwhile
                    continue
                checked.add(snapshot.name)
                listed = {e["path"]: e["sha256"] for e in manifest["entries"]}
                assert set(files) == set(listed), (files.keys(), listed)  # never a .tmp
                for name, data in files.items():
                    assert len(data) == 4 << 20 and data == data[:1] * len(data), name
                    assert hashlib.sha256(data).hexdigest() == listed[name]
        code = wait_exit(proc, "the doit to end", 300)
    finally:
        stop(proc)
    assert code == 0, popen_output(root)
    assert len(checked) >= 3, checked  # several snapshots pulled while it wrote, each checked whole


def test_two_steps_under_threads_keep_their_snapshots_apart(tmp_path: Path, host: SshHost) -> None:
    """Each run that failed is pulled once more as it ends: both resume
    from count 3, each from its own snapshot."""
    root = counting_project(tmp_path, host,
                            count_step("a", 5, 0.05, "fail-fresh") + count_step("b", 7, 0.05, "fail-fresh"))
    failed = doit(root, "-n", "2", "-P", "thread", "a", "b")
    assert failed.returncode != 0, show(failed)
    assert kept_state(root, "a") == {"n": 5, "i": 3, "seen": [1, 2, 3]}, show(failed)
    assert kept_state(root, "b") == {"n": 7, "i": 3, "seen": [1, 2, 3]}, show(failed)
    done = doit_ok(root, "-n", "2", "-P", "thread", "a", "b")
    assert starts(run_logs(root, "a")[-1]) == [3], show(done)
    assert starts(run_logs(root, "b")[-1]) == [3], show(done)
    assert result_of(root, "a") == (5, [1, 2, 3, 4, 5])
    assert result_of(root, "b") == (7, list(range(1, 8)))


def test_a_run_followed_by_polling_is_pulled_between_polls(tmp_path: Path, host: SshHost) -> None:
    """When one connection already holds as many followers as it may (a
    sweep of many steps on one host), a run is followed by polling: its
    checkpoints are pulled between the polls all the same."""
    root = make_ssh_project(tmp_path, host, "", [], files={"count.py": COUNT_PY, "data.txt": "one\n"},
                            checkpoint_seconds=0.2)  # fmt: skip
    project = Project.open(root)
    spec = make_spec("count", ["python3", "count.py", "8", "0.3", "count.txt"], root,
                     inputs=["count.py", "data.txt"], outputs=["count.txt"], checkpoints="ckpt/")  # fmt: skip
    backend = project.backend_for(handle := project.submit(spec))
    conn = connection(SshSettings.model_validate(handle.settings).target())
    with every_session_held(conn):
        with pytest.raises(NoSession):  # every session is held: what follows polls
            conn.stream(["true"], lambda chunk: None, lambda: None)
        status = backend.stream_log(handle, io.BytesIO(), follow=True)
    assert status.state == "succeeded", status
    # A run that succeeded is not pulled as it ends: this one was pulled while it ran.
    pulled = kept_state(root, "count")
    assert pulled is not None and 1 <= pulled["i"] <= 8, pulled


# The host's non-root login makes a setuid and a world-writable setuid file
# in its checkpoints, then fails; run again, it says the modes it finds.
PRIVILEGED = """\
def task_all():
    yield from remote_step("priv", command=["sh", "-c", MAKE], inputs=["data.txt"], outputs=["out.txt"],
                           checkpoints="ckpt/")
MAKE = (
    "if [ -e ckpt/s ]; then stat -c 'mode %a %n' ckpt/s ckpt/o; echo done > out.txt; exit 0; fi; "
    "mkdir -p ckpt && echo s > ckpt/s && echo o > ckpt/o && chmod 6755 ckpt/s && chmod 4777 ckpt/o && exit 3"
)
"""


def test_setuid_checkpoints_a_hosts_login_made_come_home_without_those_bits(
    tmp_path: Path, host: SshHost
) -> None:
    """Issue 28, item 2, for snapshots: pulled by rsync (--chmod) and kept
    (the one rule again), a root client's store holds no setuid or
    world-writable file a host's user made."""
    root = make_ssh_project(tmp_path, host, PRIVILEGED, ["all"], files={"data.txt": "one\n"},
                            checkpoint_seconds=EVERY)  # fmt: skip
    failed = doit(root, "priv")
    assert failed.returncode != 0, show(failed)
    (latest,) = (root / ".substrax" / "checkpoints" / "priv").glob("*/latest")
    assert sorted(p.name for p in (latest / "files").iterdir()) == ["o", "s"], show(failed)
    assert unsafe_modes(latest.resolve().parent, ["."]) == {}, show(failed)

    done = doit_ok(root, "priv")
    said = set(run_logs(root, "priv")[-1].splitlines())
    assert {"mode 755 ckpt/s", "mode 775 ckpt/o"} <= said, show(done)


# Issue 28, item 8, for a snapshot: a checkpoint bigger than the client's
# disk. The command writes a first checkpoint and waits for `go` (the test
# makes it there once that snapshot is home), then one of BIG_MB that no
# pull can bring, and waits for `end` (made once the client has said so).
SMALL_DISK_MB = 16
FILL_PY = """\
import os, sys, time
def wait(name):
    while not os.path.exists("ckpt/" + name):
        time.sleep(0.05)
def put(name, data):
    with open("ckpt/" + name + ".tmp", "wb") as f:
        f.write(data)
    os.replace("ckpt/" + name + ".tmp", "ckpt/" + name)
os.makedirs("ckpt", exist_ok=True)
put("state.json", b'{"i": 1}')
wait("go")
put("big", b"x" * (int(sys.argv[1]) << 20))  # not zeros: a copy home is sparse
put("state.json", b'{"i": 2}')
wait("end")
open("out.txt", "w").write("done\\n")
"""
FILL_STEP = """\
def task_all():
    yield from remote_step("fill", command=["python3", "fill.py", "{big}"], inputs=["fill.py"],
                           outputs=["out.txt"], checkpoints="ckpt/")
"""


def test_a_snapshot_that_fills_the_disk_keeps_the_last_one_and_the_run_goes_on(
    tmp_path: Path, host: SshHost
) -> None:
    body = FILL_STEP.format(big=2 * SMALL_DISK_MB)
    source = make_ssh_project(tmp_path, host, body, ["all"], files={"fill.py": FILL_PY},
                              checkpoint_seconds=EVERY, keep_checkpoints=True)  # fmt: skip
    said = tmp_path / "doit.out"
    with on_small_disk(source, SMALL_DISK_MB) as (root, seen, pid), said.open("w") as out:
        proc = inside(pid, root, str(DOIT), "fill", out=out)
        try:
            wait_for(lambda: kept_state(seen, "fill") == {"i": 1}, "the first snapshot", timeout=60)
            run_dir = Path(live_handles(seen, "fill")[0]["backend_state"]["remote_run_dir"])
            (run_dir / "work" / "checkpoints" / "go").write_text("")
            wait_for(lambda: "no space left" in said.read_text(), "a pull to find the disk full")
            (run_dir / "work" / "checkpoints" / "end").write_text("")
            code = wait_exit(proc, "the doit to end", 120)
        finally:
            stop(proc)
        text = said.read_text()
        assert code == 0 and (seen / "out.txt").read_text() == "done\n", text
        assert "Traceback" not in text, text
        full = [line for line in text.splitlines() if "no space left" in line]
        assert len(full) == 1, text  # once, however many pulls found it so
        assert full[0].startswith(
            "fill: checkpoints not brought home this time: no space left on the file system mounted at "
            f"{root} (writing {root}/.substrax/checkpoints/fill/"
        ), text
        assert full[0].endswith("the last whole snapshot is kept and the run goes on. Free space there: "
                                "the next pull brings them home"), text  # fmt: skip
        # The first snapshot, whole; nothing of the pull that failed.
        assert kept_state(seen, "fill") == {"i": 1}
        (latest,) = (seen / ".substrax" / "checkpoints" / "fill").glob("*/latest")
        entries = json.loads((latest / "manifest.json").read_text())["entries"]
        assert [e["path"] for e in entries] == ["state.json"]
        digest = hashlib.sha256((latest / "files" / "state.json").read_bytes()).hexdigest()
        assert entries[0]["sha256"] == digest
        assert not [p for p in (seen / ".substrax" / "checkpoints").rglob("*") if "partial" in p.name]

        again = subprocess.run(["nsenter", "-t", str(pid), "-m", f"--wd={root}", "--", str(DOIT), "fill"],
                               env=clean_env(), capture_output=True, text=True, timeout=120,
                               check=False)  # fmt: skip
        assert again.returncode == 0, again.stdout + again.stderr
        assert len(live_handles(seen, "fill")) == 1, again.stdout  # nothing ran again


# Issue 28, item 3, for the checkpoints' listing: the host's Python (the
# `python` setting, which runs every script; the scripts themselves are
# checked against their digest) answers `checkpoints.py list` without end.
ENDLESS_LISTING = """#!/bin/sh
case "$*" in *"checkpoints.py list"*) exec yes '{"entries": [' ;; esac
exec python3 "$@"
"""
CLIENT_MEMORY_BOUND = 512 << 20  # doit takes about 100 MB, the answer at most 64 MiB of it


def test_a_host_that_lists_checkpoints_without_end_is_refused_with_the_run_named(
    tmp_path: Path, host: SshHost
) -> None:
    python = host.scratch / f"python-{tmp_path.name}"
    python.write_text(ENDLESS_LISTING)
    python.chmod(0o755)
    root = make_ssh_project(tmp_path, host, "def task_all():\n" + count_step("count", 40, PAUSE), ["all"],
                            files={"count.py": COUNT_PY, "data.txt": "one\n"}, checkpoint_seconds=EVERY,
                            python=str(python))  # fmt: skip
    proc = popen_doit(root, "count")
    try:
        _pid, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    finally:
        stop(proc)
    said = popen_output(root)
    run_id = live_handles(root, "count")[0]["run_id"]
    assert proc.returncode == 1, said
    assert usage.ru_maxrss * 1024 < CLIENT_MEMORY_BOUND and len(said) < 1 << 20, (usage.ru_maxrss, len(said))
    refused = f"listing the checkpoints for run {run_id}: {host.address} answered with more than 64 MiB"
    assert refused in said, said
    assert "Traceback" not in said, said


# Issue 39, item 6: a checkpoint made sparse there (truncate -s 3G, no disk
# used on the host) would land here as 3 GB of zeros. The command writes a
# first snapshot's worth (its state and a sparse 64 MiB file under the
# bound), waits for `go` (made once that snapshot is home), then a sparse
# 3 GiB file over max_checkpoint_size, and waits for `end` (made once the
# client has refused it).
SPARSE_PY = """\
import os, time
def wait(name):
    while not os.path.exists("ckpt/" + name):
        time.sleep(0.05)
def put(name, data=None, sparse=0):
    with open("ckpt/" + name + ".tmp", "wb") as f:
        f.write(data or b"")
        f.truncate(sparse or len(data or b""))
    os.replace("ckpt/" + name + ".tmp", "ckpt/" + name)
os.makedirs("ckpt", exist_ok=True)
put("hole.bin", sparse=64 << 20)
put("state.json", b'{"i": 1}')
wait("go")
put("big.bin", sparse=3 << 30)
put("state.json", b'{"i": 2}')
wait("end")
open("out.txt", "w").write("done\\n")
"""
SPARSE_STEP = """\
def task_all():
    yield from remote_step("sparse", command=["python3", "sparse.py"], inputs=["sparse.py"],
                           outputs=["out.txt"], checkpoints="ckpt/")
"""


@pytest.mark.timeout(600)  # the host hashes 64 MiB per pull; 3 GiB more, if the bound were not kept
def test_a_snapshot_over_max_checkpoint_size_is_refused_by_name_and_sparse_files_stay_sparse(
    tmp_path: Path, host: SshHost
) -> None:
    root = make_ssh_project(tmp_path, host, SPARSE_STEP, ["all"], files={"sparse.py": SPARSE_PY},
                            checkpoint_seconds=EVERY, keep_checkpoints=True,
                            max_checkpoint_size="1GiB")  # fmt: skip
    refused = "sparse: checkpoints not brought home this time: the checkpoints there take 3.1 GiB"
    proc = popen_doit(root, "sparse")
    try:
        wait_for(lambda: kept_state(root, "sparse") == {"i": 1}, "the first snapshot", timeout=120)
        (hole,) = (root / ".substrax" / "checkpoints" / "sparse").glob("*/latest/files/hole.bin")
        assert hole.stat().st_size == 64 << 20 and hole.stat().st_blocks * 512 < 1 << 20  # a hole here too
        run_dir = Path(live_handles(root, "sparse")[0]["backend_state"]["remote_run_dir"])
        (run_dir / "work" / "checkpoints" / "go").write_text("")
        wait_for(lambda: refused in popen_output(root), "the snapshot over the bound refused", timeout=180)
        (run_dir / "work" / "checkpoints" / "end").write_text("")
        code = proc.wait(timeout=180)
    finally:
        stop(proc)
    text = popen_output(root)
    assert code == 0 and (root / "out.txt").read_text() == "done\n", text
    said = [line for line in text.splitlines() if "over max_checkpoint_size" in line]
    assert said[0].startswith(refused), text
    assert "(the largest, big.bin: 3.0 GiB), over max_checkpoint_size 1.0 GiB: not brought home, the last " \
           "snapshot is kept and the run goes on; raise max_checkpoint_size in " \
           "[tool.substrax.compute.backends.ssh] to keep them" in said[0], text  # fmt: skip
    assert len(said) == 1, said  # once, however many pulls found it so
    # The last snapshot under the bound, whole; nothing of the 3 GiB came here.
    assert kept_state(root, "sparse") == {"i": 1}
    store = root / ".substrax" / "checkpoints"
    assert not [p for p in store.rglob("*") if p.is_file() and p.stat().st_size > 64 << 20]
    assert not [p for p in store.rglob("*") if "partial" in p.name]
