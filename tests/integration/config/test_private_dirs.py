"""Private folders on a shared machine (issue 18, item 3): the folder of
ssh's control sockets and the one of the cached resolved configuration are
used only when they are real folders, ours, writable by no one else; a
cached configuration is trusted only when it is ours alone.

The unit tests point the temp folder at a folder of the test's own (never
the real /tmp/substrax-<uid>); the others do what a user does, with TMPDIR
set: `doit` and an ssh step against a real sshd.
"""

from __future__ import annotations

import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from dodo_helpers import doit, make_project, run_count, show
from private_dirs_parts import PLANTED, UID, plant
from ssh_helpers import make_ssh_project, needs_root, needs_sshd, one_step
from testbeds.sshd_host import SshHost

STEP = one_step("step", command=["sh", "-c", "echo ok > out.txt"], outputs=["out.txt"])
LOCAL_STEP = """
def task_step():
    yield from remote_step("step", command=["sh", "-c", "echo ok > out.txt"], outputs=["out.txt"])
"""


@pytest.fixture
def short_base() -> Iterator[Path]:
    """A temp folder short enough for ssh's control sockets (pytest's own
    tmp_path is too long, and the control folder would go to /tmp)."""
    base = Path(tempfile.mkdtemp(prefix="sx-", dir="/tmp"))
    yield base
    shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------- the helper


# --------------------------------------------------- the cached configuration


# ------------------------------------------------------------ as a user sees it


@pytest.mark.parametrize(("how", "fragment"), PLANTED)
def test_doit_refuses_a_planted_configuration_folder(tmp_path: Path, how: str, fragment: str) -> None:
    base = tmp_path / "tmp"
    base.mkdir()
    planted = plant(base, f"substrax-{UID}", how)
    root = make_project(tmp_path, LOCAL_STEP, default_tasks=["step"])
    done = doit(root, env={"TMPDIR": str(base)})
    assert done.returncode == 1, show(done)
    assert f"substrax: error: {planted} " in done.stderr and fragment in done.stderr, show(done)
    assert "Traceback" not in done.stderr
    assert run_count(root) == 0 and not (root / "out.txt").exists()


def test_doit_keeps_its_cache_in_a_private_runtime_dir(tmp_path: Path) -> None:
    runtime = tmp_path / "run-user"
    runtime.mkdir(mode=0o700)
    root = make_project(tmp_path, LOCAL_STEP, default_tasks=["step"])
    done = doit(root, "list", env={"XDG_RUNTIME_DIR": str(runtime)})
    assert done.returncode == 0, show(done)
    (cached,) = (runtime / "substrax").iterdir()
    assert cached.name.startswith("config-") and stat.S_IMODE(cached.stat().st_mode) == 0o600


@needs_sshd
@needs_root
@pytest.mark.parametrize("how", ["symlink", "world-writable"])
def test_an_ssh_step_refuses_a_planted_control_folder_then_runs_once_it_is_gone(
    tmp_path: Path, short_base: Path, host: SshHost, how: str
) -> None:
    ssh_step_refuses_then_runs(tmp_path, short_base, host, how)


def ssh_step_refuses_then_runs(tmp_path: Path, short_base: Path, host: SshHost, how: str) -> None:
    planted = plant(short_base, f"substrax-ssh-{UID}", how)
    root = make_ssh_project(tmp_path, host, STEP)
    done = doit(root, env={"TMPDIR": str(short_base)})
    assert done.returncode != 0, show(done)
    assert str(planted) in done.stdout + done.stderr, show(done)
    assert "set XDG_RUNTIME_DIR or TMPDIR to a folder only you can write" in done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr, show(done)
    if how == "symlink":
        assert not list((short_base / "elsewhere").iterdir())  # no socket went where it leads
        planted.unlink()
    else:
        planted.rmdir()
    done = doit(root, env={"TMPDIR": str(short_base)})
    assert done.returncode == 0, show(done)
    assert (root / "out.txt").read_text() == "ok\n"
    control = short_base / f"substrax-ssh-{UID}"
    assert stat.S_IMODE(control.lstat().st_mode) == 0o700
