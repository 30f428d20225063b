"""One environment and one project view on every backend (issue 17).

The local backend builds the locked environment as ssh does (remote/env.py,
offline from a wheel folder made here), and its sandbox shows the project
as ssh uploads it: the declared inputs and the lock file, nothing else.
An undeclared helper the command imports fails alike on both, naming the
file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
from dodo_helpers import (
    BIN,
    doit,
    doit_ok,
    make_project,
    needs_bwrap,
    run_count,
    show,
    step_ran,
    write_dodo,
    write_pyproject,
)
from ssh_helpers import build_wheel, make_ssh_project, needs_root, needs_sshd, one_step, write_ssh_dodo
from testbeds.sshd_host import SshHost

WHEELS = 'pip_args = ["--no-index", "--find-links", "wheels"]\n'
WRITE_V = "import sys, sxtiny; open('out/v.txt', 'w').write(sxtiny.VALUE + ' ' + sys.prefix)"
USES_SXTINY = one_step(
    command=["python3", "-c", WRITE_V],
    inputs=["data/in.txt"],
    outputs=["out/"],
)


def git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, timeout=60)


@needs_bwrap
def test_local_builds_the_requirements_env_offline_from_a_wheel_folder_and_reuses_it(tmp_path: Path) -> None:
    root = make_project(tmp_path, USES_SXTINY, ["step"], sandbox="bwrap",
                        files={"data/in.txt": "1\n", "requirements.txt": "sxtiny==0.1\n"})  # fmt: skip
    write_pyproject(root, "bwrap", WHEELS)
    build_wheel(root / "wheels", "sxtiny", "0.1", 'VALUE = "from-the-wheel"\n')
    first = doit_ok(root)
    assert "step: built the environment from requirements.txt" in first.stdout, show(first)
    value, prefix = (root / "out" / "v.txt").read_text().split()
    assert value == "from-the-wheel"
    assert Path(prefix).parent == root / ".substrax" / "envs"

    (root / "data" / "in.txt").write_text("2\n")  # a new run of the same step: the env is reused
    second = doit_ok(root)
    assert step_ran(second, "step") and run_count(root) == 2, show(second)
    assert "step: reusing the environment for requirements.txt" in second.stdout, show(second)
    assert (root / "out" / "v.txt").read_text().split() == ["from-the-wheel", prefix]
    assert [p.name for p in (root / ".substrax" / "envs").iterdir() if p.is_dir()] == [Path(prefix).name]

    # two steps at once under threads: one builds, the other waits for it
    (root / "requirements.txt").write_text("sxtiny==0.1\n# two steps\n")
    writes_other = WRITE_V.replace("out/", "other/")
    other = one_step("other", command=["python3", "-c", writes_other], outputs=["other/"])
    (root / "dodo.py").write_text((root / "dodo.py").read_text() + other)
    both = doit_ok(root, "-n", "2", "-P", "thread", "step", "other")
    said = both.stdout
    assert said.count("built the environment from requirements.txt") == 1, show(both)
    assert said.count("reusing the environment for requirements.txt") == 1, show(both)
    assert (root / "other" / "v.txt").read_text().split()[0] == "from-the-wheel"
    prefixes = {(root / out / "v.txt").read_text().split()[1] for out in ("out", "other")}
    assert len(prefixes) == 1, prefixes  # one environment for both

    # a lock that cannot be met: the step fails before running, saying why
    (root / "requirements.txt").write_text("sxtiny==9.9\n")
    missing = doit(root)
    assert missing.returncode == 1 and run_count(root) == 5, show(missing)  # a failure, not an error
    said = missing.stdout + missing.stderr
    assert "building the environment" in said and "sxtiny==9.9" in said, show(missing)


@needs_bwrap
@pytest.mark.skipif(shutil.which("uv", path=str(BIN)) is None, reason="UV.LOCK NOT TESTED: no uv")
def test_local_builds_the_uv_lock_env_offline(tmp_path: Path) -> None:
    root = make_project(tmp_path, USES_SXTINY, ["step"], sandbox="bwrap", files={"data/in.txt": "1\n"})
    (root / "pyproject.toml").write_text(textwrap.dedent("""\
        [project]
        name = "uses-sxtiny"
        version = "0"
        requires-python = ">=3.8"
        dependencies = ["sxtiny"]

        [tool.uv]
        no-index = true
        find-links = ["wheels"]

        """) + (root / "pyproject.toml").read_text())  # fmt: skip
    build_wheel(root / "wheels", "sxtiny", "0.1", 'VALUE = "uv-locked"\n')
    path = f"{BIN}{os.pathsep}{os.environ['PATH']}"
    env = {"PATH": path, "UV_OFFLINE": "1", "UV_CACHE_DIR": str(tmp_path / "uv")}
    subprocess.run([str(BIN / "uv"), "lock"], cwd=root, env={**os.environ, **env}, check=True, timeout=120)
    first = doit_ok(root, env=env)
    assert "step: built the environment from uv.lock" in first.stdout, show(first)
    value, prefix = (root / "out" / "v.txt").read_text().split()
    assert value == "uv-locked" and Path(prefix).parent == root / ".substrax" / "envs", show(first)
    (root / "data" / "in.txt").write_text("2\n")
    second = doit_ok(root, env=env)
    assert "step: reusing the environment for uv.lock" in second.stdout, show(second)


# ------------------------------------------------------------------ parity

IMPORTS_HELPER = one_step(command=["python3", "main.py"], inputs=["main.py"], outputs=["out/"])
DECLARES_HELPER = one_step(command=["python3", "main.py"], inputs=["main.py", "helper.py"], outputs=["out/"])
PARITY_FILES = {
    "main.py": "import helper\nopen('out/r.txt', 'w').write(helper.X)\n",
    "helper.py": "X = 'helped'\n",
    ".gitignore": ".substrax/\n",
}
# What the run sees of the project, less its outputs' folder: the same on every backend.
LIST_VIEW = (
    "import os\n"
    "seen = sorted(os.path.join(d, f)[2:] for d, _, fs in os.walk('.')\n"
    "              if not d.startswith('./out') for f in fs)\n"
    "open('out/seen.txt', 'w').write(' '.join(seen))\n"
)
LISTS_VIEW = one_step(command=["python3", "-c", LIST_VIEW], inputs=["data/", "src/main.py"], outputs=["out/"])
VIEW_FILES = {
    "data/in.txt": "1\n", "data/more/deep.txt": "2\n", "src/main.py": "", "src/scratch.py": "",
    "README.md": "tracked, not declared\n", "notes.txt": "", "helper.py": "", ".gitignore": ".substrax/\n",
}  # fmt: skip
VIEW = "data/in.txt data/more/deep.txt src/main.py"


def tracked_helper(root: Path) -> None:
    """Every file tracked by git: tracking no longer puts a file in the view."""
    git(root, "init", "-q")
    git(root, "add", "-A")


def assert_fails_naming_the_helper(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 1, show(done)
    said = done.stdout + done.stderr
    assert "ModuleNotFoundError: No module named 'helper'" in said, show(done)
    assert (
        "the run sees the step's declared inputs only, and helper.py is not declared; "
        "declare it in inputs=[...] (in outputs=[...] if the command writes it)" in said
    ), show(done)


@needs_bwrap
def test_local_sees_the_declared_inputs_only_as_ssh_does(tmp_path: Path) -> None:
    root = make_project(tmp_path, IMPORTS_HELPER, ["step"], sandbox="bwrap", files=PARITY_FILES)
    tracked_helper(root)
    assert_fails_naming_the_helper(doit(root))
    assert not (root / "out" / "r.txt").exists()
    write_dodo(root, DECLARES_HELPER, ["step"])
    doit_ok(root)
    assert (root / "out" / "r.txt").read_text() == "helped"


@needs_bwrap
def test_an_input_is_seen_and_the_rest_of_its_folder_is_not(tmp_path: Path) -> None:
    listing = "import os; open('out/ls.txt', 'w').write(' '.join(sorted(os.listdir('data'))))"
    body = one_step(command=["python3", "-c", listing], inputs=["data/keep.csv"], outputs=["out/"])
    files = {"data/keep.csv": "1\n", "data/other.csv": "2\n", "data/tracked.txt": "t\n",
             ".gitignore": "data/*.csv\n"}  # fmt: skip
    root = make_project(tmp_path, body, ["step"], sandbox="bwrap", files=files)
    git(root, "init", "-q")
    git(root, "add", "dodo.py", "pyproject.toml", ".gitignore", "data/tracked.txt")
    doit_ok(root)
    assert (root / "out" / "ls.txt").read_text() == "keep.csv"


@needs_bwrap
def test_with_an_output_at_the_top_the_view_still_hides_what_is_not_declared(tmp_path: Path) -> None:
    """An output at the project's top makes the top a writable folder (bound
    from staging, its entries bound back): undeclared entries there, and in
    folders below, stay hidden all the same."""
    listing = (
        "import os; seen = sorted(os.listdir('.') + os.listdir('src')); "
        "open('report.txt', 'w').write(' '.join(seen))"
    )
    body = one_step(command=["python3", "-c", listing], inputs=["src/main.py"], outputs=["report.txt"])
    files = {"src/main.py": "", "src/scratch.py": "", "notes.txt": "", ".gitignore": ".substrax/\n"}
    root = make_project(tmp_path, body, ["step"], sandbox="bwrap", files=files)
    git(root, "init", "-q")
    git(root, "add", "-A")
    doit_ok(root)
    seen = (root / "report.txt").read_text().split()
    assert seen == ["main.py", "src"]  # no .git, .gitignore, dodo.py, pyproject.toml, notes, scratch


@needs_bwrap
def test_the_program_doit_would_run_from_a_hidden_project_venv_is_shown(tmp_path: Path) -> None:
    """An activated .venv of the project (not declared, so hidden): the
    program found on doit's PATH there is bound back, as from the home."""
    body = one_step(command=["sxtool"], outputs=["out/"])
    tool = "#!/bin/sh\necho from-the-venv > out/t.txt\n"
    files = {".gitignore": ".venv/\n.substrax/\n", ".venv/bin/sxtool": tool}
    root = make_project(tmp_path, body, ["step"], sandbox="bwrap", files=files)
    (root / ".venv" / "bin" / "sxtool").chmod(0o755)
    git(root, "init", "-q")
    git(root, "add", "dodo.py", "pyproject.toml", ".gitignore")
    doit_ok(root, env={"PATH": f"{root / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}"})
    assert (root / "out" / "t.txt").read_text() == "from-the-venv\n"


@needs_bwrap
def test_a_project_that_is_not_a_git_work_tree_has_the_same_view(tmp_path: Path) -> None:
    root = make_project(tmp_path, IMPORTS_HELPER, ["step"], sandbox="bwrap", files=PARITY_FILES)
    assert_fails_naming_the_helper(doit(root))
    write_dodo(root, DECLARES_HELPER, ["step"])
    doit_ok(root)
    assert (root / "out" / "r.txt").read_text() == "helped"


@needs_sshd
@needs_root
def test_over_ssh_the_undeclared_helper_fails_the_same_way(tmp_path: Path, host: SshHost) -> None:
    root = make_ssh_project(tmp_path, host, IMPORTS_HELPER, files=PARITY_FILES)
    tracked_helper(root)
    assert_fails_naming_the_helper(doit(root))
    write_ssh_dodo(root, DECLARES_HELPER, ["step"])
    doit_ok(root)
    assert (root / "out" / "r.txt").read_text() == "helped"


@needs_bwrap
@needs_sshd
@needs_root
def test_the_view_is_the_same_on_local_and_over_ssh(tmp_path: Path, host: SshHost) -> None:
    """Tracked files the step does not declare (README.md, the dodo.py)
    are in neither view; the declared inputs are in both."""
    (tmp_path / "local").mkdir()
    local = make_project(tmp_path / "local", LISTS_VIEW, ["step"], sandbox="bwrap", files=VIEW_FILES)
    tracked_helper(local)
    doit_ok(local)
    assert (local / "out" / "seen.txt").read_text() == VIEW
    remote = make_ssh_project(tmp_path / "ssh", host, LISTS_VIEW, files=VIEW_FILES)
    tracked_helper(remote)
    doit_ok(remote)
    assert (remote / "out" / "seen.txt").read_text() == VIEW
