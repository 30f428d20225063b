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
from dodo_helpers import BWRAP, DOIT, clean_env, doit, doit_ok, make_project, run_dirs, show, step_skipped
from sandbox_beds import SYSTEM_PATH, SYSTEM_PYTHON, Bed

pytestmark = pytest.mark.skipif(not BWRAP, reason="SANDBOX NOT TESTED: bubblewrap is missing or unusable")

VERSION = "3.99.0"
LOCAL_VERSION = "3.98.0"  # what `pyenv local` names in a project
# What pyenv writes in ~/.pyenv/shims: a script naming its root, which runs
# the root's libexec/pyenv.
SHIM = """#!/bin/sh
export PYENV_ROOT="{root}"
exec "{root}/libexec/pyenv" exec "${{0##*/}}" "$@"
"""
# `pyenv exec PROGRAM ARGS`, as pyenv picks the version: PYENV_VERSION, a
# .python-version in the working folder or above it, the root's version file.
PYENV = """#!/bin/sh
shift
program=$1
shift
version=$PYENV_VERSION
dir=$PWD
while [ -z "$version" ]; do
    if [ -f "$dir/.python-version" ]; then read -r version < "$dir/.python-version"; fi
    if [ "$dir" = / ]; then break; fi
    dir=$(dirname "$dir")
done
if [ -z "$version" ]; then read -r version < "$PYENV_ROOT/version"; fi
exec "$PYENV_ROOT/versions/$version/bin/$program" "$@"
"""
PREFIX_STEP = """
def task_which():
    yield from remote_step(
        "which",
        command=[{program!r}, "-c", "import sys; open('out/prefix.txt', 'w').write(sys.prefix)"],
        outputs=["out/"],
    )
"""


def pyenv_home(base: Path, versions: tuple[str, ...] = (VERSION,)) -> tuple[dict[str, str], Path]:
    """A home with a pyenv-style install (a venv stands in for each built
    Python, the first the global one); the client's environment, and the
    global version's folder."""
    if SYSTEM_PYTHON is None:
        pytest.skip("SHIM CASE NOT TESTED: no python3 in /usr/bin to make the version from")
    home = base / "home"
    root = home / ".pyenv"
    for version in versions:
        made = root / "versions" / version
        subprocess.run([SYSTEM_PYTHON, "-m", "venv", "--without-pip", str(made)], check=True, timeout=120)
    (root / "version").write_text(versions[0] + "\n")
    (root / "libexec").mkdir()
    (root / "libexec" / "pyenv").write_text(PYENV)
    (root / "libexec" / "pyenv").chmod(0o755)
    (root / "shims").mkdir()
    for name in ("python", "python3"):
        shim = root / "shims" / name
        shim.write_text(SHIM.format(root=root))
        shim.chmod(0o755)
    client = {"HOME": str(home), "PATH": f"{root / 'shims'}:{os.environ['PATH']}"}
    return client, root / "versions" / versions[0]


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


# ------------------------------------------- the toolchains on the task's PATH (issue 33)

# Three ways a step reaches `python3`/`python` by name: the argv, a shell
# line, a script the step runs; each writes the prefix of the Python it got.
THREE_WAYS = """
def task_argv():
    yield from remote_step("argv", outputs=["out/argv.txt"], command=[
        "python3", "-c", "import sys; open('out/argv.txt', 'w').write(sys.prefix)"])

def task_shell():
    yield from remote_step("shell", outputs=["out/shell.txt"],
                           shell="python3 -c 'import sys; sys.stdout.write(sys.prefix)' > out/shell.txt")

def task_script():
    yield from remote_step("script", inputs=["job.sh"], outputs=["out/script3.txt", "out/script.txt"],
                           command=["sh", "job.sh"])
"""
SCRIPT = """#!/bin/sh
set -e
python3 -c 'import sys; sys.stdout.write(sys.prefix)' > out/script3.txt
python -c 'import sys; sys.stdout.write(sys.prefix)' > out/script.txt
"""
OUTPUTS = ("argv.txt", "shell.txt", "script3.txt", "script.txt")


def test_a_shell_step_and_a_script_run_the_python_of_the_pyenv_shims_as_the_argv_does(tmp_path: Path) -> None:
    env, version = pyenv_home(tmp_path)
    root = make_project(tmp_path, THREE_WAYS, ["argv", "shell", "script"], sandbox="bwrap",
                        files={"job.sh": SCRIPT})  # fmt: skip
    done = doit_ok(root, env=env)
    got = {name: (root / "out" / name).read_text() for name in OUTPUTS}
    assert got == dict.fromkeys(OUTPUTS, str(version)), show(done)
    # The Python an argv names is in the key (issue 39: another Python first
    # on PATH is another key): the argv step runs again under the PATH
    # without the shims. A shell line's or a script's own Python is not seen
    # (docs/steps.md says so): those steps are not stale for the PATH alone.
    again = doit_ok(root, env={**env, "PATH": os.environ["PATH"]})
    assert not step_skipped(again, "argv"), show(again)
    assert all(step_skipped(again, step) for step in ("shell", "script")), show(again)


def test_pyenv_local_in_the_project_picks_the_same_python_for_a_shell_step_as_for_the_argv(
    tmp_path: Path,
) -> None:
    env, _global = pyenv_home(tmp_path, (VERSION, LOCAL_VERSION))
    root = make_project(tmp_path, THREE_WAYS, ["argv", "shell", "script"], sandbox="bwrap",
                        files={"job.sh": SCRIPT, ".python-version": LOCAL_VERSION + "\n"})  # fmt: skip
    done = doit_ok(root, env=env)
    local = tmp_path / "home" / ".pyenv" / "versions" / LOCAL_VERSION
    got = {name: (root / "out" / name).read_text() for name in OUTPUTS}
    assert got == dict.fromkeys(OUTPUTS, str(local)), show(done)


CREDENTIAL_PROBES = """
def task_probe():
    yield from remote_step("probe", outputs=["out/"], shell=(
        "for f in ~/.ssh/id_x ~/.aws/credentials ~/.config/tool/bin/tool ~/notes.txt; do "
        "if cat $f > /dev/null 2>&1; then echo READ $f; else echo HIDDEN $f; fi; done > out/seen.txt; "
        "python3 -c 'import sys; print(sys.prefix)' >> out/seen.txt"
    ))
"""


def test_the_home_and_its_credentials_stay_hidden_whatever_the_path_names(tmp_path: Path) -> None:
    env, version = pyenv_home(tmp_path)
    home = Path(env["HOME"])
    for rel, text in {".ssh/id_x": "KEY", ".aws/credentials": "AWS", ".config/tool/bin/tool": "#!/bin/sh\n",
                      "notes.txt": "private"}.items():  # fmt: skip
        (home / rel).parent.mkdir(parents=True, exist_ok=True)
        (home / rel).write_text(text)
    # The home itself and folders holding credentials on PATH: none is shown.
    path = f"{home}:{home / '.ssh'}:{home / '.config' / 'tool' / 'bin'}:{env['PATH']}"
    root = make_project(tmp_path, CREDENTIAL_PROBES, ["probe"], sandbox="bwrap")
    done = doit_ok(root, env={**env, "PATH": path})
    seen = (root / "out" / "seen.txt").read_text().splitlines()
    probed = (".ssh/id_x", ".aws/credentials", ".config/tool/bin/tool", "notes.txt")
    assert seen == [*(f"HIDDEN {home / rel}" for rel in probed), str(version)], show(done)


MISSING_INTERPRETER = """
def task_old():
    yield from remote_step("old", outputs=["out/"], shell="python3.7 -c 'print(1)' > out/one.txt")
"""


def test_an_interpreter_not_found_names_the_steps_path_and_what_the_sandbox_hid(tmp_path: Path) -> None:
    env, _version = pyenv_home(tmp_path)
    root = make_project(tmp_path, MISSING_INTERPRETER, ["old"], sandbox="bwrap")
    done = doit(root, env=env)
    said = done.stdout + done.stderr
    assert done.returncode == 1, show(done)
    assert f"a program the step ran was not found (exit 127): the step's PATH was {env['PATH']}" in said, (
        show(done)
    )
    assert f"the sandbox hides {env['HOME']}, /tmp, /var/tmp (of them it shows, read-only, only " in said
    assert str(Path(env["HOME"]) / ".pyenv") in said


def test_over_the_worker_as_root_and_as_another_user_the_shims_run_and_the_key_stays_hidden(
    bed: Bed, marker: str
) -> None:
    """The worker and bubblewrap as root and as a uid with no account: a
    shell line finds the shims' Python; the home's key stays unreadable."""
    env, version = pyenv_home(bed.base)  # bed.home: the home the sandbox hides
    (bed.home / ".ssh").mkdir()
    (bed.home / ".ssh" / "id_x").write_text("KEY")
    script = ('python3 -c "import sys; print(\'PREFIX\', sys.prefix)"; '
              'if cat ~/.ssh/id_x; then echo READ; else echo HIDDEN; fi')  # fmt: skip
    shims = env["PATH"].split(":")[0]
    log, status = bed.run(script, marker, network_isolation=False, path=f"{shims}:{SYSTEM_PATH}")
    assert status["state"] == "succeeded", log
    assert f"PREFIX {version}" in log.splitlines(), log
    assert "HIDDEN" in log.splitlines() and "KEY" not in log, log


# Root keeps out of a folder of mode 000 only without these capabilities, as
# a container's root may run: dropped from the bounding set, they are gone
# from what it execs.
NO_DAC_OVERRIDE = ["--inh-caps=-dac_override,-dac_read_search",
                   "--bounding-set=-dac_override,-dac_read_search"]  # fmt: skip


def test_a_folder_on_path_the_user_cannot_enter_is_passed_over_as_plain_doit_passes_it(
    tmp_path: Path,
) -> None:
    """A PATH kept by `su` or `sudo` names the other user's folders
    (/root/.cargo/bin): looking there for the sandbox's toolchains stopped
    the launch with a PermissionError traceback; the run goes on as the
    command would run under plain doit."""
    as_user: list[str] = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("UNENTERABLE PATH FOLDER NOT TESTED: setpriv (util-linux) is not installed")
        as_user = [setpriv, *NO_DAC_OVERRIDE]
    locked = tmp_path / "other-user"
    (locked / "bin").mkdir(parents=True)
    body = """
def task_ran():
    yield from remote_step("ran", command=["sh", "-c", "echo ran > out/ran.txt"], outputs=["out/"])
"""
    root = make_project(tmp_path, body, ["ran"], sandbox="bwrap")
    locked.chmod(0)
    try:
        done = subprocess.run(
            [*as_user, str(DOIT)], cwd=root, capture_output=True, text=True, timeout=90, check=False,
            env=clean_env({"PATH": f"{locked / 'bin'}:{os.environ['PATH']}"}),
        )  # fmt: skip
    finally:
        locked.chmod(0o755)
    assert done.returncode == 0, show(done)
    assert (root / "out" / "ran.txt").read_text() == "ran\n"
    assert "Traceback" not in done.stdout + done.stderr, show(done)
