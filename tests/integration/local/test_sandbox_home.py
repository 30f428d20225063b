"""The sandbox's home (issue 17): a writable, empty home for each run that
leaves nothing in the real one and is gone when the run ends; `cache_dirs`
kept across runs of a project; and a write the sandbox refused named in the
run's failure with the fix.

First what needs no bubblewrap (the argv, the log scan, the settings), then
runs of the real worker under real bubblewrap, through `doit` on the local
backend, as an unprivileged user, and once over ssh.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from dodo_helpers import (
    doit,
    doit_ok,
    make_project,
    show,
    step_ran,
    step_skipped,
    tree_files,
    wait_for,
    write_pyproject,
)
from local_runs import needs_bwrap, run_dir, submit, wait_final
from sandbox_beds import Bed
from ssh_helpers import make_ssh_project, needs_root, needs_sshd
from testbeds.sshd_host import SshHost

from substrax_tasks.store.project import Project

# ------------------------------------------------- without bubblewrap


# ------------------------------------------------- the real worker and bubblewrap

HOME_WRITES = r"""
set -e
mkdir -p "$MPLCONFIGDIR" ~/.cache/x
echo config > ~/.config/matplotlib/matplotlibrc
echo cached > ~/.cache/x/blob
sleep "${1:-0}"
env | grep -E '^(HOME|XDG_[A-Z]+_HOME|MPLCONFIGDIR)=' | sort > out/env.txt
ls -A ~ > out/home.txt
"""


@needs_bwrap
@pytest.mark.parametrize("end", ["timed_out", "cancelled"])
def test_the_runs_home_is_removed_when_the_run_is_stopped(
    project: Project, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, end: str
) -> None:
    real_home = tmp_path / "home"
    real_home.mkdir()
    monkeypatch.setenv("HOME", str(real_home))  # the worker's, and the task's in the sandbox
    handle = submit(project, ["sh", "-c", HOME_WRITES, "sh", "120"], sandbox="bwrap", outputs=["out/"],
                    timeout=1 if end == "timed_out" else None)  # fmt: skip
    home = run_dir(project, handle) / "work" / "home"
    if end == "cancelled":
        wait_for((home / ".cache" / "x" / "blob").exists, "the task to write its home")
        assert project.backend_for(handle).cancel(handle)
    assert wait_final(project, handle, timeout=60) == end
    assert not home.exists()
    assert os.listdir(real_home) == []


@needs_bwrap
def test_matplotlib_style_writes_to_the_home_succeed_and_leave_nothing_in_the_real_home(
    tmp_path: Path,
) -> None:
    real_home = tmp_path / "home"
    real_home.mkdir()
    (real_home / ".config").mkdir()
    (real_home / ".config" / "mine.txt").write_text("the user's own\n")
    root = make_project(tmp_path, f"""
def task_plot():
    yield from remote_step("plot", shell={HOME_WRITES!r}, outputs=["out/"])
""", default_tasks=["plot"], sandbox="bwrap")  # fmt: skip
    done = doit_ok(root, env={"HOME": str(real_home)})
    assert step_ran(done, "plot"), show(done)
    assert "Read-only file system" not in done.stdout + done.stderr
    home = str(real_home)  # the run's home is at the real home's path
    assert (root / "out" / "env.txt").read_text().splitlines() == [
        f"HOME={home}", f"MPLCONFIGDIR={home}/.config/matplotlib", f"XDG_CACHE_HOME={home}/.cache",
        f"XDG_CONFIG_HOME={home}/.config", f"XDG_DATA_HOME={home}/.local/share",
        f"XDG_STATE_HOME={home}/.local/state",
    ]  # fmt: skip
    assert (root / "out" / "home.txt").read_text().split() == [".cache", ".config"]  # empty at the start
    assert tree_files(real_home) == {".config/mine.txt": "the user's own\n"}  # nothing left there
    assert tree_files(root / "out").keys() == {"env.txt", "home.txt"}  # the home is not an output
    (run,) = (root / ".substrax" / "runs").iterdir()
    assert not (run / "work").exists()


CACHED_STEPS = r"""
FETCH = '''
set -e
if [ -f ~/.cache/kept/model.bin ]; then echo "cached $1" > a/out.txt
else mkdir -p ~/.cache/kept && echo weights > ~/.cache/kept/model.bin && echo "downloaded $1" > a/out.txt; fi
echo scratch > ~/not-kept.txt
'''
USE = '''
set -e
{ cat ~/.cache/kept/model.bin 2>/dev/null || echo none; cat a/out.txt; } > b/out.txt
if [ -e ~/not-kept.txt ]; then echo leaked >> b/out.txt; fi
'''


def task_a():
    yield from remote_step("a", shell=FETCH.replace("$1", get_var("run", "1")), outputs=["a/"])


def task_b():
    yield from remote_step("b", shell=USE, inputs=["a/out.txt"], outputs=["b/"])
"""


@needs_bwrap
def test_cache_dirs_kept_for_the_next_step_and_the_next_run_never_in_the_outputs_nor_the_key(
    tmp_path: Path,
) -> None:
    real_home = tmp_path / "home"
    real_home.mkdir()
    env = {"HOME": str(real_home)}
    root = make_project(tmp_path, CACHED_STEPS, default_tasks=["a", "b"], sandbox="bwrap")
    doit_ok(root, env=env)
    assert (root / "a" / "out.txt").read_text() == "downloaded 1\n"
    assert (root / "b" / "out.txt").read_text() == "none\ndownloaded 1\n"  # no folder kept yet
    # adding cache_dirs changes nothing a step makes: nothing reruns
    write_pyproject(root, "bwrap", extra='cache_dirs = ["~/.cache/kept"]\n')
    again = doit_ok(root, env=env)
    assert step_skipped(again, "a") and step_skipped(again, "b"), show(again)

    changed = doit_ok(root, "run=2", env=env)  # a changed command: both rerun
    assert step_ran(changed, "a") and step_ran(changed, "b"), show(changed)
    assert (root / "a" / "out.txt").read_text() == "downloaded 2\n"  # the first run with the folder kept
    assert (root / "b" / "out.txt").read_text() == "weights\ndownloaded 2\n"  # the next step found it
    kept = root / ".substrax" / "cache" / "home" / ".cache" / "kept"
    assert (kept / "model.bin").read_text() == "weights\n"

    rerun = doit_ok(root, "run=3", env=env)
    assert step_ran(rerun, "a"), show(rerun)
    assert (root / "a" / "out.txt").read_text() == "cached 3\n"  # the next run found it
    assert (root / "b" / "out.txt").read_text() == "weights\ncached 3\n"  # and the rest of the home is new
    assert tree_files(root / "a").keys() == {"out.txt"} and tree_files(root / "b").keys() == {"out.txt"}
    assert os.listdir(real_home) == []


@needs_bwrap
def test_an_undeclared_write_fails_naming_the_path_and_the_fix(tmp_path: Path) -> None:
    write = "import pathlib; pathlib.Path('reports/sub01-report.h5').write_bytes(b'x')"
    root = make_project(tmp_path, f"""
def task_report():
    yield from remote_step("report", command=["python3", "-c", {write!r}], inputs=["reports/README"],
                           outputs=["out/"])
""", default_tasks=["report"], sandbox="bwrap", files={"reports/README": "declared elsewhere\n"})  # fmt: skip
    done = doit(root)
    assert done.returncode != 0, show(done)
    said = done.stdout + done.stderr
    assert (
        "run" in said
        and "failed (exit code 1): the sandbox refused a write to reports/sub01-report.h5 "
        "(Read-only file system): only the declared outputs, $HOME and $TMPDIR are writable there; "
        "declare it as an output, or write under $TMPDIR"
        in said
    ), show(done)
    assert not (root / "reports" / "sub01-report.h5").exists()


# ------------------------------------------------- as root and as another user


@needs_bwrap
def test_the_home_is_removed_whatever_the_task_did_to_it(bed: Bed, marker: str) -> None:
    script = r"""
set -e
echo x > ~/planted
mkdir -p ~/closed/deep && echo x > ~/closed/deep/file && chmod 500 ~/closed/deep ~/closed
ln -s "$PWD" ~/project-link
ln -s "$PWD/code.txt" ~/code-link
echo result > out/result.txt
"""
    log, status = bed.run(script, marker, network_isolation=False)
    assert status["state"] == "succeeded", log
    assert (bed.base / "runs" / marker[-8:] / "work" / "home").exists() is False
    assert sorted(os.listdir(bed.home)) == ["secret.txt"]  # the real home: as it was
    assert (bed.project / "code.txt").read_text() == "original\n"  # links were not followed


# ------------------------------------------------- over ssh


@needs_sshd
@needs_root
@needs_bwrap
def test_over_ssh_the_home_is_writable_and_fresh_and_cache_dirs_are_kept_on_the_host(
    tmp_path: Path, host: SshHost
) -> None:
    before = set(os.listdir(host.remote_home))
    caches = host.remote_home / ".substrax-remote" / "cache"
    cached_before = set(caches.iterdir()) if caches.is_dir() else set()  # other tests' projects
    root = make_ssh_project(tmp_path, host, CACHED_STEPS, ("a", "b"), sandbox="bwrap",
                            cache_dirs=["~/.cache/kept"])  # fmt: skip
    done = doit_ok(root)
    assert (root / "a" / "out.txt").read_text() == "downloaded 1\n", show(done)
    assert (root / "b" / "out.txt").read_text() == "weights\ndownloaded 1\n"  # kept; ~/not-kept.txt not
    rerun = doit_ok(root, "run=2")
    assert step_ran(rerun, "a"), show(rerun)
    assert (root / "a" / "out.txt").read_text() == "cached 2\n"
    # on the host: the kept folder under remote_root, keyed by the project; nothing else in the home
    (kept,) = set(caches.iterdir()) - cached_before
    assert kept.name.startswith("proj-")
    assert (kept / ".cache" / "kept" / "model.bin").read_text() == "weights\n"
    assert set(os.listdir(host.remote_home)) - before <= {".substrax-remote"}
