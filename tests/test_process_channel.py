"""ssh_watch.ProcessChannel: a command run by a local client process (for
SkyPilot, the OpenSSH client with SkyPilot's config), talked with as the
ManifestWatch talks with a paramiko channel. Here the command is the real
remote/manifest.py run directly, so every answer is the script's own."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from substrax_tasks._remote_files import remote_script
from substrax_tasks.backends import ssh_watch
from substrax_tasks.backends.ssh_watch import ManifestWatch, ProcessChannel
from substrax_tasks.manifest_cache import ManifestError


def watch_argv(base: Path, *outputs: str) -> list[str]:
    return [sys.executable, str(remote_script("manifest.py")), str(base), *outputs, "--watch"]


def test_a_watch_over_a_process_answers_its_manifest_then_its_check(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "a.txt").write_text("a\n")
    channel = ProcessChannel(watch_argv(tmp_path, "out/"))
    watch = ManifestWatch(channel, "here")
    try:
        manifest, line = watch.manifest()
        assert [e["path"] for e in manifest["entries"]] == ["out", "out/a.txt"]
        assert line.endswith(b"\n") and watch.digest_checked
        assert watch.check() is None  # nothing changed
    finally:
        watch.close()
    assert channel.proc.returncode == 0


def test_a_change_after_the_manifest_is_answered(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "a.txt").write_text("a\n")
    watch = ManifestWatch(ProcessChannel(watch_argv(tmp_path, "out/")), "here")
    try:
        watch.manifest()
        (tmp_path / "out" / "b.txt").write_text("new\n")
        assert watch.check() is not None
    finally:
        watch.close()


def test_a_refused_tree_comes_back_as_the_scripts_own_error(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    os.symlink("/etc/passwd", tmp_path / "out" / "escape")
    stopped: list[bool] = []
    channel = ProcessChannel(watch_argv(tmp_path, "out/"))
    watch = ManifestWatch(channel, "here")
    watch.on_failure = lambda: stopped.append(True)
    try:
        with pytest.raises(ManifestError, match="points outside its output"):
            watch.manifest()
        assert stopped == [True]  # the copy would have been stopped at once
        refusal = watch.refusal()
        assert isinstance(refusal, ManifestError) and "escape" in str(refusal)
    finally:
        watch.close()
    assert channel.proc.returncode == 1


def test_close_ends_a_process_that_ignores_its_closed_input(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ssh_watch, "CLOSE_GRACE_SECONDS", 0.3)
    channel = ProcessChannel([sys.executable, "-c", "import time; time.sleep(600)"])
    channel.sendall(b"ignored\n")
    pid = channel.proc.pid
    channel.close()
    assert channel.proc.returncode is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped, so the pid names nothing
    # its reader (the watch's thread) reads each stream to its end, which closes it
    while channel.recv(1024):
        pass
    assert channel.recv_exit_status() == channel.proc.returncode
    while channel.recv_stderr(1024):
        pass
    assert channel.proc.stdout is not None and channel.proc.stdout.closed
