"""The program a local step runs is the one plain doit would run (issue 17).

A user's `python3` is often a pyenv shim under their home, which the
sandbox hides: looked up in there, the name found /usr/bin/python3 (no
numpy), or nothing. Here doit runs from the command line with a HOME and a
PATH of the test's own: a pyenv-style shim folder first, as `pyenv init`
puts it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from dodo_helpers import BWRAP, doit, doit_ok, make_project, run_dirs, show
from sandbox_beds import SYSTEM_PYTHON

pytestmark = pytest.mark.skipif(not BWRAP, reason="SANDBOX NOT TESTED: bubblewrap is missing or unusable")

VERSION = "3.99.0"
# What pyenv writes in ~/.pyenv/shims: a script naming its root, which
# picks the version and execs that version's program.
SHIM = """#!/bin/sh
export PYENV_ROOT="{root}"
read -r version < "$PYENV_ROOT/version"
exec "$PYENV_ROOT/versions/$version/bin/${{0##*/}}" "$@"
"""
PREFIX_STEP = """
def task_which():
    yield from remote_step(
        "which",
        command=[{program!r}, "-c", "import sys; open('out/prefix.txt', 'w').write(sys.prefix)"],
        outputs=["out/"],
    )
"""


def pyenv_home(base: Path) -> tuple[dict[str, str], Path]:
    """A home with a pyenv-style install (a venv stands in for a built
    Python); the client's environment, and that version's folder."""
    if SYSTEM_PYTHON is None:
        pytest.skip("SHIM CASE NOT TESTED: no python3 in /usr/bin to make the version from")
    home = base / "home"
    root = home / ".pyenv"
    version = root / "versions" / VERSION
    subprocess.run([SYSTEM_PYTHON, "-m", "venv", "--without-pip", str(version)], check=True, timeout=120)
    (root / "version").write_text(VERSION + "\n")
    (root / "shims").mkdir()
    for name in ("python", "python3"):
        shim = root / "shims" / name
        shim.write_text(SHIM.format(root=root))
        shim.chmod(0o755)
    return {"HOME": str(home), "PATH": f"{root / 'shims'}:{os.environ['PATH']}"}, version


def test_a_pyenv_shim_under_the_hidden_home_runs_the_version_it_picks_here(tmp_path: Path) -> None:
    env, version = pyenv_home(tmp_path)
    root = make_project(tmp_path, PREFIX_STEP.format(program="python3"), ["which"], sandbox="bwrap")
    done = doit_ok(root, env=env)
    assert (root / "out" / "prefix.txt").read_text() == str(version), show(done)
    # the home stays hidden: only that version's folder is shown, read-only
    assert not any((run / "work" / "home" / ".pyenv" / "version").exists() for run in run_dirs(root))


def test_a_program_under_the_hidden_home_is_shown_with_its_folder(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "bin").mkdir(parents=True)
    cat = shutil.which("cat")
    assert cat is not None
    shutil.copy(cat, home / "bin" / "my-cat")
    body = """
def task_copy():
    yield from remote_step("copy", command=["my-cat", "data.txt"], inputs=["data.txt"], outputs=["out/"])
"""
    root = make_project(tmp_path, body, ["copy"], sandbox="bwrap", files={"data.txt": "kept\n"})
    done = doit_ok(root, env={"HOME": str(home), "PATH": f"{home / 'bin'}:{os.environ['PATH']}"})
    assert "kept" in done.stdout + done.stderr, show(done)


def test_a_script_whose_interpreter_the_sandbox_hides_fails_before_running_naming_both(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    (home / "tools").mkdir(parents=True)
    shell = home / "tools" / "my-sh"
    sh = shutil.which("sh")
    assert sh is not None
    shutil.copy(sh, shell)
    script = home / "bin" / "report"
    script.parent.mkdir()
    script.write_text(f"#!{shell}\necho ran > out/ran.txt\n")
    script.chmod(0o755)
    body = """
def task_report():
    yield from remote_step("report", command=["report"], outputs=["out/"])
"""
    root = make_project(tmp_path, body, ["report"], sandbox="bwrap")
    done = doit(root, env={"HOME": str(home), "PATH": f"{home / 'bin'}:{os.environ['PATH']}"})
    said = done.stdout + done.stderr
    assert done.returncode == 1, show(done)
    assert f"the step's program 'report' is {script} here, a script run by {shell}" in said, show(done)
    assert "name the interpreter by its path in the argv" in said
    assert all(not (run / "status.json").exists() for run in run_dirs(root)), "a worker started"


def test_a_program_not_on_the_path_fails_before_running(tmp_path: Path) -> None:
    body = """
def task_missing():
    yield from remote_step("missing", command=["substrax-no-such-program"], outputs=["out/"])
"""
    root = make_project(tmp_path, body, ["missing"], sandbox="bwrap")
    done = doit(root)
    assert done.returncode == 1, show(done)
    assert "the step's program 'substrax-no-such-program' is not on PATH here" in done.stdout + done.stderr
    assert all(not (run / "status.json").exists() for run in run_dirs(root)), "a worker started"
