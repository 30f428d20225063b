"""Which toolchains of the task's PATH the local sandbox shows (issue 33):
each hidden PATH folder with the installation its programs need, never the
home itself nor a folder holding credentials; and what a run that could not
find a program says. The runs themselves are in
tests/integration/local/test_local_program.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from sandbox_beds import job_for

from substrax_tasks._remote import hints
from substrax_tasks.backends.local.program import show_toolchains


def made(base: Path, *files: str) -> None:
    for rel in files:
        (base / rel).parent.mkdir(parents=True, exist_ok=True)
        (base / rel).write_text("x\n")


def shown_for(home: Path, path: list[Path], **environ: str) -> list[str]:
    job = job_for(home.parent / "project", ["out/"], hide=[str(home)])
    show_toolchains(job, {"PATH": ":".join(map(str, [*path, "/usr/bin"])), "HOME": str(home), **environ})
    return job["extra_ro"]


@pytest.mark.unit
def test_each_toolchain_is_shown_with_what_its_programs_need(tmp_path: Path) -> None:
    home = tmp_path / "home"
    made(home, ".pyenv/libexec/pyenv", ".pyenv/versions/3.12.1/bin/python3", ".pyenv/shims/python3",
         "miniforge3/envs/fit/conda-meta/history", "miniforge3/envs/fit/bin/python",
         "venvs/a/pyvenv.cfg", "venvs/a/bin/python", "pythons/3.13/bin/python3.13",
         ".local/bin/black", ".local/lib/python3.12/site-packages/black.py", ".local/share/keyrings/login",
         ".cargo/bin/rustup", ".cargo/credentials.toml", ".rustup/settings.toml")  # fmt: skip
    (home / "venvs/a/pyvenv.cfg").write_text(f"home = {home / 'pythons/3.13/bin'}\n")
    shown = shown_for(home, [home / ".pyenv/shims", home / "miniforge3/envs/fit/bin", home / "venvs/a/bin",
                             home / ".local/bin", home / ".cargo/bin"])  # fmt: skip
    assert shown == [str(home / rel) for rel in (
        ".pyenv", "miniforge3/envs/fit", "venvs/a", "pythons/3.13", ".local/bin", ".local/lib/python3.12",
        ".cargo/bin", ".rustup")]  # fmt: skip


@pytest.mark.unit
def test_the_home_tmp_and_folders_holding_credentials_are_never_shown(tmp_path: Path) -> None:
    home = tmp_path / "home"
    made(home, ".ssh/id_ed25519", ".config/tool/bin/tool", ".aws/bin/aws", "bin/tool")
    shown = shown_for(home, [home, Path("/tmp"), home / ".ssh", home / ".config/tool/bin", home / ".aws/bin",
                             home / "bin"])  # fmt: skip
    assert shown == [str(home / "bin")]


@pytest.mark.unit
def test_a_pyenv_root_brings_the_version_pyenv_reads_here(tmp_path: Path) -> None:
    home = tmp_path / "home"
    made(home, ".pyenv/versions/3.12.1/bin/python3", ".pyenv/shims/python3")
    made(tmp_path, "work/.python-version", "work/project/data.txt")  # `pyenv local` above the project
    job = job_for(tmp_path / "work" / "project", ["out/"], hide=[str(tmp_path)])
    show_toolchains(job, {"PATH": str(home / ".pyenv/shims"), "HOME": str(home), "PYENV_VERSION": "3.12.1"})
    assert job["extra_ro"] == [str(home / ".pyenv"), str(tmp_path / "work" / ".python-version")]
    assert job["env"]["PYENV_VERSION"] == "3.12.1"


@pytest.mark.unit
def test_a_program_not_found_names_the_path_and_what_the_sandbox_hid() -> None:
    job = job_for(Path("/p"), ["out/"], hide=["/home/me"], extra_ro=["/home/me/.pyenv", "/usr/lib/x"])
    path = "/home/me/.pyenv/shims:/usr/bin"
    said = hints.not_found_hint(job, 127, path, True)
    assert said == (
        f"a program the step ran was not found (exit 127): the step's PATH was {path}; "
        "the sandbox hides /home/me, /tmp, /var/tmp (of them it shows, read-only, only /home/me/.pyenv); "
        "install the program in a folder of that PATH outside them, set PATH in the step's env, or name the "
        "program by its path"
    )
    assert hints.not_found_hint(job, 127, "/usr/bin", False) == (
        "a program the step ran was not found (exit 127): the step's PATH was /usr/bin; install the "
        "program in a folder of that PATH, or name it by its path")  # fmt: skip
    assert hints.not_found_hint(job, 1, "/usr/bin", True) is None  # a missing data file is no program
