"""The unit half of tests/integration/chain/test_view.py: the same subject, the
tests that start no process and open no connection (see its docstring)."""

from __future__ import annotations

from pathlib import Path

import pytest

from substrax_tasks._remote import hints
from substrax_tasks.errors import SpecError
from substrax_tasks.step.spec import make_spec
from substrax_tasks.step.view import check_command_in_view, project_view, written_paths

# ------------------------------------------------------------ the pieces


@pytest.mark.unit
def test_the_view_is_the_inputs_and_the_lock_and_hides_the_rest_at_the_coarsest_level(tmp_path: Path) -> None:
    made = ["src/main.py", "src/lib/util.py", "src/lib/other.py", "src/scratch.py", "README.md",
            "requirements.txt", "out/old.txt", ".substrax/runs/x", ".git/HEAD", "data/a.csv"]  # fmt: skip
    for rel in made:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    view = project_view(tmp_path, tmp_path / ".substrax", ["src/main.py", "src/lib/"], ["out/"])
    assert view.files == ["src/main.py", "src/lib", "requirements.txt"]
    assert view.hidden == [".git", ".substrax", "README.md", "data", "out", "src/scratch.py"]
    assert view.left_out == ["README.md", "data", "src/scratch.py"]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["python3", "work.py"], "work.py"),
        (["python3", "{root}/work.py"], "work.py"),  # absolute, inside the project
        (["python3", "src/run.py", "--config=conf/a.yaml"], "conf/a.yaml"),
        (["sh", "tools"], "tools"),  # a folder
        (["python3", "src/run.py", "data"], None),  # a folder holding an input
        (["python3", "src/run.py", "out/x.txt", "requirements.txt", "missing.py", "-c", "1", "."], None),
        (["python3", "/usr/bin/env"], None),  # outside the project
    ],
)
def test_the_command_check_names_an_undeclared_project_path(
    tmp_path: Path, argv: list[str], named: str | None
) -> None:
    made = ["work.py", "src/run.py", "conf/a.yaml", "tools/t.sh", "data/in.csv", "requirements.txt",
            "out/x.txt"]  # fmt: skip
    for rel in made:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    command = [a.format(root=tmp_path) for a in argv]
    spec = make_spec("work", command, tmp_path, inputs=["src/run.py", "data/in.csv"], outputs=["out/"])
    if named is None:
        check_command_in_view(spec, tmp_path)
        return
    with pytest.raises(SpecError, match=f"its command names {named}, a project file the run would not see"):
        check_command_in_view(spec, tmp_path)


@pytest.mark.unit
@pytest.mark.parametrize(
    "named", ["ckpt/long", "--ckpt=ckpt/long", "ckpt/long/", "ckpt/long/x.pt", "-r=ckpt/long/x.pt", "ckpt"]
)
def test_the_checkpoints_folder_named_by_the_command_is_the_runs_own(tmp_path: Path, named: str) -> None:
    """Issue 39, item 1: as a run leaves it in the project (its mount point,
    or without a sandbox its checkpoints), never refused nor named left out."""
    (tmp_path / "ckpt" / "long").mkdir(parents=True)
    (tmp_path / "ckpt" / "long" / "x.pt").write_text("")
    (tmp_path / "train.py").write_text("")
    command = ["python3", "train.py", named]
    spec = make_spec("train", command, tmp_path, inputs=["train.py"], outputs=["o/"], checkpoints="ckpt/long")
    check_command_in_view(spec, tmp_path)
    view = project_view(tmp_path, tmp_path / ".substrax", spec.inputs, written_paths(spec))
    assert view.hidden == ["ckpt"]  # bound over in the sandbox, put in place without one
    assert view.left_out == []


@pytest.mark.unit
def test_a_failure_hint_names_a_module_a_package_folder_and_a_script_left_out() -> None:
    job = {"left_out": ["helper.py", "mypkg", "tools/x.py", "notes.txt"]}
    assert hints.left_out_hint(job, "ModuleNotFoundError: No module named 'mypkg'\n") == (
        "the run sees the step's declared inputs only, and mypkg is not declared; declare it in inputs=[...] "
        "(in outputs=[...] if the command writes it)"
    )
    tail = "python3: can't open file '/work/proj/tools/x.py': [Errno 2] No such file or directory\n"
    assert "and tools/x.py is not declared" in str(hints.left_out_hint(job, tail))
    both = "No module named 'helper'\nNo module named 'mypkg'\n"
    assert hints.left_out_hint(job, both) == (
        "the run sees the step's declared inputs only, and helper.py, mypkg are not declared; "
        "declare them in inputs=[...] (in outputs=[...] if the command writes them)"
    )


@pytest.mark.unit
def test_with_a_uv_lock_the_view_and_the_key_hold_the_pyproject_uv_reads_it_with(tmp_path: Path) -> None:
    from substrax_tasks.uptodate.check import environment_lock

    for rel in ["uv.lock", "pyproject.toml", "README.md"]:
        (tmp_path / rel).write_text(rel)
    assert project_view(tmp_path, tmp_path / ".substrax", []).files == ["uv.lock", "pyproject.toml"]
    before = environment_lock(tmp_path)
    assert set(before) == {"uv.lock", "pyproject.toml"}
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'changed'\n")
    assert environment_lock(tmp_path)["pyproject.toml"] != before["pyproject.toml"]
    (tmp_path / "uv.lock").unlink()
    assert project_view(tmp_path, tmp_path / ".substrax", []).files == []
