"""The ssh backend's fetch against a real sshd in a network namespace
(tests/support/testbeds/sshd_host.py): rsync copies the outputs into staging, and the
copy is verified here against the manifest the worker wrote on the host as the
command ended. A copy that differs from it (outputs changed on the host
since, even during the copy) is refused and the run stays for a refetch; a
run that left no manifest has one taken on the host, once.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from dodo_helpers import compute, doit_ok, show, step_ran, unsafe_modes
from special_files import plant_specials, specials_under
from ssh_helpers import make_ssh_project, needs_root, needs_sshd, one_step, remote_run_dir
from testbeds.sshd_host import SshHost

from substrax_tasks._remote import manifest as remote_manifest
from substrax_tasks._remote import runfiles
from substrax_tasks.backends import base
from substrax_tasks.backends import remote_run as _remote_run
from substrax_tasks.backends.base import Fetched
from substrax_tasks.backends.remote_run import RemoteRun
from substrax_tasks.backends.ssh.backend import SshBackend
from substrax_tasks.errors import BackendError, HostRefused, OutputsRefused
from substrax_tasks.run.promote import RSYNC_SAFE_CHMOD, safe_mode, verify_staged
from substrax_tasks.step.spec import make_spec
from substrax_tasks.store.handle import RunHandle
from substrax_tasks.store.project import Project
from substrax_tasks.transports.base import TransferStats
from substrax_tasks.transports.rsync import RsyncTransport
from substrax_tasks.uptodate import manifests as manifest_cache
from substrax_tasks.uptodate.manifests import ManifestError

pytestmark = [needs_sshd, needs_root]

# Names rsync escapes in its output (a newline, a literal backslash-hash-
# digits, bytes that are not UTF-8) and a plain one, a link and a folder.
ODD_NAMES = {
    b"out/plain.txt": b"plain\n",
    b"out/new\nline.txt": b"newline\n",
    b"out/back\\#101slash": b"backslash\n",
    b"out/sub/\xe9t\xe9.bin": b"latin-1\n",
}
MAKE_ODD = r"""
import os, sys
for name, data in eval(sys.argv[1]).items():
    os.makedirs(os.path.dirname(name), exist_ok=True)
    with open(name, "wb") as f:
        f.write(data)
os.symlink("plain.txt", "out/link")
"""
MAKE_A = ["sh", "-c", "mkdir -p out && echo a > out/a.txt && head -c 3000000 /dev/zero > out/big.bin"]


def finished_run(
    tmp_path: Path, host: SshHost, argv: list[str], outputs: list[str]
) -> tuple[SshBackend, RunHandle]:
    root = make_ssh_project(tmp_path, host, "")
    project = Project.open(root)
    handle = project.submit(make_spec("step", argv, root, outputs=outputs))
    backend = project.backend_for(handle)
    assert isinstance(backend, SshBackend)
    assert backend.wait(handle, poll_seconds=0.05).state == "succeeded", backend.read_log(handle, 0)
    return backend, project.store.read(handle.run_id)


def on_host(handle: RunHandle, rel: str) -> Path:
    return Path(str(handle.backend_state["outputs_root"])) / rel


def worker_manifest(handle: RunHandle) -> Path:
    return remote_run_dir(handle.model_dump(mode="json")) / "manifest.json"


def problems(fetched: Fetched, outputs: list[str], tmp_path: Path) -> list[str]:
    return manifest_cache.verify_outputs(fetched.root, outputs, fetched.manifest, tmp_path / "cache.json")


def test_the_copy_comes_with_the_manifest_the_worker_wrote_odd_names_and_a_missing_output_included(
    tmp_path: Path, host: SshHost
) -> None:
    names = {os.fsdecode(k): v for k, v in ODD_NAMES.items()}
    argv = ["python3", "-c", MAKE_ODD, repr(ODD_NAMES)]
    outputs = ["out/", "absent.txt"]
    backend, handle = finished_run(tmp_path, host, argv, outputs)
    fetched = backend.fetch(handle)
    assert fetched.manifest == json.loads(worker_manifest(handle).read_text())
    assert fetched.manifest["missing"] == ["absent.txt"]  # skipped by rsync, named by the manifest
    for rel, data in names.items():
        assert (fetched.root / rel).read_bytes() == data
    assert (fetched.root / "out/link").readlink() == Path("plain.txt")
    assert problems(fetched, outputs, tmp_path) == ["output never produced: absent.txt"]


def test_a_copy_that_differs_from_the_workers_manifest_is_refused_and_the_run_kept(
    tmp_path: Path, host: SshHost
) -> None:
    backend, handle = finished_run(tmp_path, host, MAKE_A, ["out/"])
    on_host(handle, "out/a.txt").write_text("changed on the host after the run\n")
    fetched = backend.fetch(handle)  # the copy is what the host holds now ...
    assert (fetched.root / "out/a.txt").read_text() == "changed on the host after the run\n"
    found = problems(fetched, ["out/"], tmp_path)  # ... and not what the command made
    assert len(found) == 1 and found[0].startswith("changed content: out/a.txt"), found
    assert backend.outputs_available(handle)  # kept for a fetch again
    on_host(handle, "out/a.txt").write_text("a\n")  # put back as the command left it
    assert problems(backend.fetch(handle), ["out/"], tmp_path) == []


def test_outputs_changed_as_the_copy_runs_need_no_still_host_but_a_changed_file_is_refused(
    tmp_path: Path, host: SshHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, handle = finished_run(tmp_path, host, MAKE_A, ["out/"])
    big = on_host(handle, "out/big.bin")
    copy = RsyncTransport.download
    changes: list[Callable[[], object]] = [lambda: os.utime(big), lambda: rewrite(big)]

    def rewrite(path: Path) -> None:
        """Other contents, the same size and mode, and a time rsync's quick
        check cannot take for the staged copy's (a rewrite within the same
        second as the touch would be skipped, the staging's verified bytes
        kept: right, but not the case this test makes)."""
        touched = path.stat().st_mtime
        path.write_bytes(b"y" * 3_000_000)
        os.utime(path, (touched + 5, touched + 5))


    def change_then_copy(self: RsyncTransport, *args: Any, **kwargs: Any) -> TransferStats:
        """The host's outputs change once the manifest was read, as the copy begins."""
        changes.pop(0)()
        return copy(self, *args, **kwargs)

    monkeypatch.setattr(RsyncTransport, "download", change_then_copy)
    # a touch: the host did not hold still, yet the contents are what the command made
    assert problems(backend.fetch(handle), ["out/"], tmp_path) == []
    fetched = backend.fetch(handle)  # rewritten: same size and mode, other contents
    assert [p[:36] for p in problems(fetched, ["out/"], tmp_path)] == ["changed content: out/big.bin (300000"]


def test_a_run_that_left_no_manifest_gets_one_taken_on_the_host_once(tmp_path: Path, host: SshHost) -> None:
    backend, handle = finished_run(tmp_path, host, MAKE_A, ["out/"])
    written = json.loads(worker_manifest(handle).read_text())
    worker_manifest(handle).unlink()  # as a run of an older release left it
    fetched = backend.fetch(handle)
    assert fetched.manifest["digest"] == written["digest"]
    assert json.loads(worker_manifest(handle).read_text()) == fetched.manifest  # saved beside the run
    on_host(handle, "out/a.txt").write_text("changed since\n")
    again = backend.fetch(handle)  # the saved one is reused, not taken anew
    assert again.manifest == fetched.manifest
    assert problems(again, ["out/"], tmp_path)[0].startswith("changed content: out/a.txt")


def test_a_tree_the_manifest_refuses_is_a_manifest_error_not_a_copy_error(
    tmp_path: Path, host: SshHost
) -> None:
    argv = ["sh", "-c", "mkdir -p out && echo x > out/x && ln -s /etc/passwd out/leak"]
    backend, handle = finished_run(tmp_path, host, argv, ["out/"])
    assert not worker_manifest(handle).exists()  # the worker's manifest refused it too
    with pytest.raises(ManifestError, match=r"symlink out/leak -> /etc/passwd points outside its output"):
        backend.fetch(handle)


def test_the_status_is_not_asked_again_once_the_run_was_seen_to_end(
    tmp_path: Path, host: SshHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, handle = finished_run(tmp_path, host, MAKE_A, ["out/"])
    assert isinstance(handle.backend_state.get("outputs_root"), str)
    asked: list[str] = []
    original = RemoteRun.status

    def counting(run: RemoteRun) -> runfiles.StatusAnswer:
        asked.append(run.run_dir)
        return original(run)

    monkeypatch.setattr(RemoteRun, "status", counting)
    fetched = backend.fetch(handle)
    assert (fetched.root / "out" / "a.txt").read_text() == "a\n"
    assert asked == []


# ------------------------------------------------ a hostile host (issue 15)
def as_host_user(path: Path, like: Path) -> None:
    """Give a file made here (as root) to the login user of the host."""
    owner = like.stat()
    os.chown(path, owner.st_uid, owner.st_gid, follow_symlinks=False)








def test_fifos_sockets_and_devices_put_in_on_the_host_are_never_made_here(
    tmp_path: Path, host: SshHost
) -> None:
    backend, handle = finished_run(tmp_path, host, MAKE_A, ["out/"])
    planted = on_host(handle, "out")
    plant_specials(planted)
    staging = backend.store.run_dir(handle.run_id) / "fetched"
    with pytest.raises(BackendError, match=r"hold out/node, out/pipe, out/sock, which are not a file"):
        backend.fetch(handle)
    assert specials_under(backend.store.root) == []
    assert not staging.exists()  # nothing of the refused copy stays, its files neither
    assert backend.outputs_available(handle)  # the run stays for a fetch again
    for name in ("node", "pipe", "sock"):  # the host is mended
        (planted / name).unlink()
    assert problems(backend.fetch(handle), ["out/"], tmp_path) == []
    backend.teardown(handle)
    assert not staging.exists()  # teardown leaves no fetched copy in the store
    assert specials_under(tmp_path) == []  # the client: project, store and all


def test_a_manifest_that_lists_a_device_is_refused_before_anything_is_copied(
    tmp_path: Path, host: SshHost
) -> None:
    backend, handle = finished_run(tmp_path, host, MAKE_A, ["out/"])
    plant_specials(on_host(handle, "out"))
    manifest = json.loads(worker_manifest(handle).read_text())
    node = {
        "path": "out/node",
        "type": "char device",
        "size": 0,
        "mode": 0o666,
        "sha256": None,
        "target": None,
    }
    manifest["entries"] = sorted([*manifest["entries"], node], key=lambda e: e["path"])
    manifest["digest"] = remote_manifest.entries_digest(manifest["entries"])
    worker_manifest(handle).write_text(json.dumps(manifest))
    with pytest.raises(
        BackendError, match=r"lists 'out/node' as a 'char device': outputs are files, folders"
    ):
        backend.fetch(handle)
    assert not (backend.store.run_dir(handle.run_id) / "fetched").exists()


def peak_memory_of_a_fetch(root: Path, run_id: str) -> tuple[int, str]:
    """A fetch in a process of its own: its peak resident memory (bytes)
    and what it said."""
    script = (
        "import sys\nfrom substrax_tasks.store.project import Project\n"
        "project = Project.open(sys.argv[1]); handle = project.store.read(sys.argv[2])\n"
        "try:\n    project.backend_for(handle).fetch(handle)\nexcept Exception as exc:\n    print(exc)\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", script, str(root), run_id], stdout=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdout is not None
        said = proc.stdout.read()
        _, code, usage = os.wait4(proc.pid, 0)  # reaped here, for its rusage
        proc.returncode = os.waitstatus_to_exitcode(code)
    assert proc.returncode == 0, said
    return usage.ru_maxrss * 1024, said


def test_an_endless_manifest_is_refused_with_the_clients_memory_bounded(
    tmp_path: Path, host: SshHost
) -> None:
    _, handle = finished_run(tmp_path, host, MAKE_A, ["out/"])
    path = worker_manifest(handle)
    with path.open("r+b") as f:  # 1 GiB in one line (sparse: costs the host no disk)
        f.truncate(1 << 30)
    peak, said = peak_memory_of_a_fetch(tmp_path / "proj", handle.run_id)
    refused = f"run {handle.run_id}: {host.address} answered with more than 64 MiB to one command: refused"
    assert refused in said, said
    assert peak < 400 << 20, f"peak {peak >> 20} MiB"  # holding the answer whole would take over 1 GiB


def test_a_log_that_is_not_a_regular_file_is_refused_unread(tmp_path: Path, host: SshHost) -> None:
    backend, handle = finished_run(tmp_path, host, MAKE_A, ["out/"])
    log = remote_run_dir(handle.model_dump(mode="json")) / "run.log"
    log.unlink()
    log.symlink_to("/dev/zero")
    out = io.BytesIO()
    with pytest.raises(HostRefused, match="is not a regular file"):
        backend.stream_log(handle, out, follow=True)
    assert out.getvalue() == b""
    kept = tmp_path / "kept.log"  # teardown keeps the reason, not the device's bytes
    backend.remote_run(handle).keep_log(kept)
    assert f"{log} on {host.address} is not a regular file" in kept.read_text()


def test_a_log_past_the_cap_is_cut_with_a_note_shown_and_kept(
    tmp_path: Path, host: SshHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    cap = 3 << 20  # 256 MiB in use: the test would copy half a GiB
    monkeypatch.setattr(base, "MAX_LOG_BYTES", cap)
    monkeypatch.setattr(_remote_run, "MAX_LOG_BYTES", cap)
    backend, handle = finished_run(tmp_path, host, MAKE_A, ["out/"])
    log = remote_run_dir(handle.model_dump(mode="json")) / "run.log"
    with log.open("r+b") as f:  # a regular file longer than the cap (sparse)
        f.truncate(cap + (2 << 20))
    out = io.BytesIO()
    assert backend.stream_log(handle, out).state == "succeeded"
    note = b"\n[substrax: the log is cut at 3 MiB here; the rest is in run.log in the run's folder]\n"
    assert out.getvalue() == bytes(cap) + note
    kept = tmp_path / "kept.log"
    backend.remote_run(handle).keep_log(kept)
    kept_note = f"\n[substrax: the log is cut at 3 MiB here; the rest was not kept from {host.address}]\n"
    assert kept.read_bytes() == bytes(cap) + kept_note.encode()


# ------------------------------------------------- outputs carry no privileges


def test_rsyncs_chmod_makes_every_mode_what_the_promotions_rule_makes_it(tmp_path: Path) -> None:
    """The fetch's `--chmod` and `safe_mode` are one rule in two words:
    every file and folder mode comes out of a real rsync as safe_mode says."""
    source, dest = tmp_path / "src", tmp_path / "dest"
    source.mkdir()
    # every special bit and "other" bit with a few owner and group bits: 576
    # modes (all 4,096 of them cost 10 s and prove no more)
    special_and_other = [special << 9 | other for special in range(8) for other in range(8)]
    for mode in [bits | user << 6 | group << 3 for bits in special_and_other
                 for user in (0, 5, 7) for group in (0, 5, 7)]:  # fmt: skip
        (source / f"f{mode:04o}").write_text("x")
        (source / f"f{mode:04o}").chmod(mode)
        (source / f"d{mode:04o}").mkdir()
        (source / f"d{mode:04o}").chmod(mode)
    subprocess.run(["rsync", "--archive", RSYNC_SAFE_CHMOD, f"{source}/", f"{dest}/"], check=True)
    wrong = {
        name: f"{mode:04o} -> {(dest / name).lstat().st_mode & 0o7777:04o}"
        for name, mode in ((p.name, int(p.name[1:], 8)) for p in source.iterdir())
        if (dest / name).lstat().st_mode & 0o7777 != safe_mode(mode)
    }
    assert wrong == {}


def test_setuid_and_world_writable_outputs_a_hosts_user_made_arrive_without_those_bits(
    tmp_path: Path, host: SshHost
) -> None:
    """The host's non-root login user makes 6755, 4777 and 1777 outputs
    (and its manifest says so); a root client promotes them as 0755, 0775
    and 0775 rather than refusing them, and the next doit is a no-op."""
    make = ("mkdir -p out/d && echo a > out/suid && echo b > out/open && echo c > out/d/c "
            "&& chmod 6755 out/suid && chmod 4777 out/open && chmod 1777 out/d")  # fmt: skip
    root = make_ssh_project(tmp_path, host, one_step(shell=make, outputs=["out/"]))
    done = doit_ok(root)
    assert step_ran(done, "step"), show(done)
    assert unsafe_modes(root, ["out"]) == {}
    modes = {name: (root / "out" / name).stat().st_mode & 0o7777 for name in ("suid", "open", "d")}
    assert modes == {"suid": 0o755, "open": 0o775, "d": 0o775}
    assert (root / "out" / "suid").stat().st_uid == os.getuid()
    again = doit_ok(root)
    assert not step_ran(again, "step"), show(again)
    assert "up to date" in compute(root, "why", "step").stdout

def test_a_status_answer_past_its_cap_is_refused_naming_the_host_and_the_run(
    tmp_path: Path, host: SshHost
) -> None:
    backend, handle = finished_run(tmp_path, host, MAKE_A, ["out/"])
    status_file = remote_run_dir(handle.model_dump(mode="json")) / "status.json"
    record = json.loads(status_file.read_text())
    record["message"] = "x" * (2 << 20)  # a status line of 2 MiB: real ones are a few KiB
    status_file.write_text(json.dumps(record))
    with pytest.raises(HostRefused, match=rf"reading the run's status for run {handle.run_id}: "
                       rf"{host.address} answered with more than 1 MiB to one command: refused"):  # fmt: skip
        backend.remote_run(handle).status()


def test_a_follower_that_sends_past_the_logs_cap_is_cut_there_with_one_note(
    tmp_path: Path, host: SshHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the host runs in the follower's place (here `yes`, as a host
    whose own python lied would), the client takes the log up to its cap."""
    cap = 3 << 20
    monkeypatch.setattr(base, "MAX_LOG_BYTES", cap)
    monkeypatch.setattr(_remote_run, "MAX_LOG_BYTES", cap)
    backend, handle = finished_run(tmp_path, host, MAKE_A, ["out/"])
    monkeypatch.setattr(RemoteRun, "follow_argv", lambda self, offset, limit: ["yes"])
    out = io.BytesIO()
    status = _remote_run.follow_log(backend, handle, out, 0, backend.remote_run(handle))
    assert status.state == "succeeded"
    note = b"\n[substrax: the log is cut at 3 MiB here; the rest is in run.log in the run's folder]\n"
    assert out.getvalue() == b"y\n" * (cap // 2) + note


def test_a_follower_that_outlives_the_runs_lifetime_is_given_up_for_the_status(
    tmp_path: Path, host: SshHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A follower that neither sends nor ends (here `cat`, as a host whose
    own python lied could run) is waited on only until the run's lifetime
    is over; then the status and the log are read as after a broken link."""
    backend, handle = finished_run(tmp_path, host, MAKE_A, ["out/"])
    timer = {**handle.backend_state["watchdog"], "armed_at": time.time() - 3600}  # its lifetime long over
    handle = backend.save_state(handle, watchdog=timer)
    monkeypatch.setattr(RemoteRun, "follow_argv", lambda self, offset, limit: ["cat"])
    out = io.BytesIO()
    ended: list[base.RunStatus] = []
    run = backend.remote_run(handle)
    follower = threading.Thread(
        target=lambda: ended.append(_remote_run.follow_log(backend, handle, out, 0, run)),
        daemon=True,  # on the code before, it would follow `cat` for ever
    )
    follower.start()
    follower.join(timeout=120)
    assert [s.state for s in ended] == ["succeeded"]
    assert out.getvalue() == backend.read_log(handle, 0)


# ----------------------------------------- a fetch again updates its staging

MANY = 300
MANY_FILES = (
    "import os\nos.makedirs('out/sub', exist_ok=True)\n"
    f"for i in range({MANY}):\n"
    "    open('out/sub/f%03d.bin' % i, 'wb').write(os.urandom(512))\n"
)


def test_a_fetch_again_of_a_verified_copy_brings_nothing_the_staging_holds(
    tmp_path: Path, host: SshHost, capfd: pytest.CaptureFixture[str]
) -> None:
    """A copy that verified and was not promoted (a doit killed before the
    promotion, a promotion that failed before it moved anything) is kept in
    the run's staging: a fetch again brings only what differs (nothing:
    rsync's 'fetch: 0 files'), not all of it again, and what a killed copy
    would have left in a folder output (rsync's temp file) goes, as a
    fresh copy would have it."""
    backend, handle = finished_run(tmp_path, host, ["python3", "-c", MANY_FILES], ["out/"])
    cache = tmp_path / "outputs-cache.json"
    first = backend.fetch(handle)
    verify_staged(first, ["out/"], cache, "the run")
    assert f"fetch: {MANY} files" in capfd.readouterr().err
    leftover = first.root / "out" / "sub" / ".f000.bin.Xy12Zq"  # as a copy killed mid-file leaves it
    leftover.write_bytes(b"half a file")

    again = backend.fetch(handle)
    said = capfd.readouterr().err
    assert "fetch: 0 files" in said, said  # before: all 300 copied again
    assert not leftover.exists()
    verify_staged(again, ["out/"], cache, "the run")
    staged = sorted(p.name for p in (again.root / "out" / "sub").iterdir())
    assert staged == [f"f{i:03d}.bin" for i in range(MANY)]


def test_a_copy_refused_by_verification_is_not_kept_for_the_next_fetch(
    tmp_path: Path, host: SshHost
) -> None:
    """Only a copy that verified is ever updated by a fetch again: one
    verification refused (a staged file that differs from the manifest)
    is removed, so the next fetch copies afresh rather than trusting
    rsync's size-and-time check on top of it."""
    make = ["sh", "-c", "mkdir -p out && echo data > out/a.txt"]
    backend, handle = finished_run(tmp_path, host, make, ["out/"])
    fetched = backend.fetch(handle)
    staged = fetched.root / "out" / "a.txt"
    stat = staged.stat()
    staged.write_text("DATA\n")  # same size; its time put back: rsync's quick check passes it
    os.utime(staged, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    cache = tmp_path / "outputs-cache.json"
    with pytest.raises(OutputsRefused):
        verify_staged(backend.fetch(handle), ["out/"], cache, "the run")
    assert not fetched.root.exists()
    again = backend.fetch(handle)
    verify_staged(again, ["out/"], cache, "the run")
    assert (again.root / "out" / "a.txt").read_text() == "data\n"
