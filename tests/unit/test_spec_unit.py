"""The unit half of tests/integration/config/test_spec.py: the same subject, the
tests that start no process and open no connection (see its docstring)."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from substrax_tasks.errors import SpecError
from substrax_tasks.step.spec import MAX_STEP_NAME, PathIndex, make_spec, relative_path


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("data/in.csv", "data/in.csv"),
        ("model/", "model/"),
        ("a//b", "a/b"),
        ("./a/./b", "a/b"),
        ("a/.hidden/..x", "a/.hidden/..x"),  # dots inside a name are a name
    ],
)
@pytest.mark.unit
def test_paths_are_made_clean(tmp_path: Path, raw: str, clean: str) -> None:
    assert relative_path(raw, tmp_path, "output") == clean


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ("", "empty"),
        ("a/../b", "'..'"),
        ("..", "'..'"),
        (".", "the project itself"),
        ("/etc/passwd", "outside"),
    ],
)
@pytest.mark.unit
def test_unclean_paths_are_refused(tmp_path: Path, raw: str, needle: str) -> None:
    with pytest.raises(SpecError, match=needle):
        relative_path(raw, tmp_path, "output")


@pytest.mark.unit
def test_an_absolute_path_inside_the_project_becomes_relative(tmp_path: Path) -> None:
    assert relative_path(str(tmp_path / "out") + "/", tmp_path, "output") == "out/"


@pytest.mark.unit
def test_the_index_finds_overlaps_with_outputs_declared_file_by_file() -> None:
    """Files added one by one in one folder (the folder is noted once) still
    make the folder, its parents and the files themselves overlap, each
    named with the step that declared it first."""
    index = PathIndex()
    for j in range(3):
        index.add("a", f"out/s1/f{j}.txt")
    index.add("b", "out/s2/deep/g.txt")
    assert index.overlapping("out/s1/f1.txt") == ("a", "out/s1/f1.txt")
    assert index.overlapping("out/s1/") == ("a", "out/s1/f0.txt")  # holds a's files
    assert index.overlapping("out/") == ("a", "out/s1/f0.txt")
    assert index.overlapping("out/s2") == ("b", "out/s2/deep/g.txt")
    assert index.overlapping("out/s1/f1.txt/x") == ("a", "out/s1/f1.txt")  # lies in a file output
    assert index.overlapping("out/s3/h.txt") is None
    index.remove_step("a")
    assert index.overlapping("out/s1/") is None
    assert index.overlapping("out/") == ("b", "out/s2/deep/g.txt")


@pytest.mark.unit
def test_a_folder_near_another_steps_output_is_told_apart_from_ones_own() -> None:
    """What a failed run of `bad` may remove: a folder only its own outputs
    are in, never one that is, holds or lies in another step's output, even
    where `below` names `bad` (it declared first)."""
    index = PathIndex()
    index.add("bad", "out/bad/")
    index.add("bad", "solo/x/f.txt")
    index.add("w:0", "out/s0.txt")
    index.add("w:1", "runs/lr1/")
    assert index.near_another("out", "bad")  # holds w:0's output, though `below` names bad
    assert not index.near_another("out/bad", "bad")
    assert not index.near_another("solo", "bad") and not index.near_another("solo/x", "bad")
    assert index.near_another("runs/lr1", "bad")  # is w:1's output
    assert index.near_another("runs/lr1/deep", "bad")  # lies in it
    assert index.near_another("runs", "bad")
    assert not index.near_another("elsewhere", "bad")


# ------------------------------------------- arguments of the wrong type

WRONG_TYPES = [
    ({"outputs": "out/result.txt"},
     "outputs must be a list of paths, got the string 'out/result.txt': " 'write outputs=["out/result.txt"]'),
    ({"inputs": "work.py"},
     "inputs must be a list of paths, got the string 'work.py': " 'write inputs=["work.py"]'),
    ({"inputs": Path("work.py")},
     "inputs must be a list of paths, got the path 'work.py': " 'write inputs=["work.py"]'),
    ({"outputs": 3}, "outputs must be a list of paths, got the int 3: write outputs=["),
    ({"outputs": {"out/": 1}}, "outputs must be a list of paths, got a dict"),
    ({"inputs": ["a.csv", 7]},
     "inputs must be a list of paths, but it holds the int 7: give each path as a str"),
    ({"timeout": "60"}, "timeout must be a number of seconds, got the string '60': write timeout=60"),
    ({"timeout": "90.5"}, "got the string '90.5': write timeout=90.5"),
    ({"timeout": "1h"}, "got the string '1h': write timeout=3600 (seconds)"),
    ({"timeout": True}, "timeout must be a number of seconds, got True"),
    ({"timeout": [60]}, "timeout must be a number of seconds, got a list"),
    ({"timeout": float("inf")}, "timeout must be a positive number of seconds, got inf"),
    ({"env": ["A=1", "B=x=y"]},
     """env must be a mapping of variable names to strings, got a list: write env={"A": "1", "B": "x=y"}"""),
    ({"env": "A=1"}, """got the string 'A=1': write env={"A": "1"}"""),
    ({"env": {"N": 4}}, """env['N'] must be a string, got the int 4: write env={"N": "4", ...}"""),
    ({"forward_env": "WANDB_API_KEY"},
     """secrets must be a list of names, got the string 'WANDB_API_KEY': write secrets=["WANDB_API_KEY"]"""),
    ({"resources": "A100:1"}, """got the string 'A100:1': write resources={"accelerators": "A100:1"}"""),
    ({"resources": {"cpus": [2]}}, "resources['cpus'] must be a string or a number, got a list"),
]


@pytest.mark.parametrize(("kwargs", "message"), WRONG_TYPES, ids=[repr(k) for k, _m in WRONG_TYPES])
@pytest.mark.unit
def test_an_argument_of_the_wrong_type_says_what_to_write(tmp_path: Path, kwargs: dict[str, Any],
                                                          message: str) -> None:  # fmt: skip
    with pytest.raises(SpecError) as refused:
        make_spec("train", ["true"], tmp_path, **kwargs)
    assert str(refused.value).startswith("step 'train': ")
    assert message in str(refused.value)


@pytest.mark.parametrize(
    ("command", "message"),
    [
        ("python train.py --lr '0.1 0.2'", 'write command=["python", "train.py", "--lr", "0.1 0.2"], '
                                           "or shell=\"python train.py --lr '0.1 0.2'\""),
        (5, 'got the int 5: write command=["python", "train.py"]'),
        ([], "got an empty list"),
        (["python", None], "command item None is a NoneType"),
    ],
)
@pytest.mark.unit
def test_a_command_of_the_wrong_type_says_what_to_write(tmp_path: Path, command: Any, message: str) -> None:
    with pytest.raises(SpecError, match=r"command must be|command item") as refused:
        make_spec("train", command, tmp_path)
    assert message in str(refused.value)


@pytest.mark.unit
def test_arguments_of_the_documented_types_pass_unchanged(tmp_path: Path) -> None:
    """Tuples, generators and paths are lists of paths too; an int timeout
    stays an int and another number type becomes a plain one, so no
    spec's digest changes."""
    spec = make_spec("train", ("python", Path("train.py"), 3), tmp_path, inputs=(p for p in ["a.csv"]),
                     outputs=(Path("out/m.pt"), "log/"), timeout=60, forward_env=("TOKEN",))  # fmt: skip
    assert spec.command == ["python", "train.py", "3"]
    assert spec.inputs == ["a.csv"]
    assert spec.outputs == ["out/m.pt", "log/"]
    assert spec.timeout == 60 and isinstance(spec.timeout, int)
    numpy_like: dict[str, Any] = {"timeout": Fraction(3, 2)}  # a number, not an int or float
    assert make_spec("t", ["true"], tmp_path, **numpy_like).timeout == 1.5
    assert make_spec("t", ["true"], tmp_path, timeout=2.5).timeout == 2.5


@pytest.mark.unit
def test_a_step_name_is_refused_one_character_over_the_limit(tmp_path: Path) -> None:
    assert MAX_STEP_NAME == 228
    make_spec("a" * MAX_STEP_NAME, ["true"], tmp_path)
    make_spec("a b" * 200, ["true"], tmp_path)  # not safe as it is: shortened with a hash, fits
    with pytest.raises(SpecError) as caught:
        make_spec("a" * (MAX_STEP_NAME + 1), ["true"], tmp_path)
    assert str(caught.value) == (
        f"step '{'a' * 40}...': the name is 229 characters; at most 228 fit in the file names "
        "made from it (255 bytes a name); give the step a shorter name"
    )




@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"checkpoints": 5}, 'got the int 5: write checkpoints="ckpt/"'),
        ({"checkpoints": "../ckpt/"}, "contains '..'"),
        ({"checkpoints": "data/ckpt/", "inputs": ["data/"]},
         "checkpoints folder data/ckpt/ overlaps the input data"),
        ({"checkpoints": "model/", "outputs": ["model/best.pt"]}, "overlaps the output model/best.pt"),
        ({"checkpoints": "ckpt", "outputs": ["ckpt"]},
         "checkpoints folder ckpt/ overlaps the output ckpt"),
    ],
)
@pytest.mark.unit
def test_a_checkpoints_folder_is_a_folder_of_its_own_in_the_project(
    tmp_path: Path, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(SpecError) as refused:
        make_spec("train", ["true"], tmp_path, **kwargs)
    assert str(refused.value).startswith("step 'train': ")
    assert message in str(refused.value)


@pytest.mark.unit
def test_checkpoints_are_a_folder_and_in_the_digest_only_when_declared(tmp_path: Path) -> None:
    """A step without checkpoints dumps as it did before they existed, so
    an upgrade changes no run's digest; one with them is another step."""
    plain = make_spec("train", ["true"], tmp_path, outputs=["m.pt"])
    assert "checkpoints" not in plain.model_dump()
    kept = make_spec("train", ["true"], tmp_path, outputs=["m.pt"], checkpoints=Path("ckpt"))
    assert kept.checkpoints == "ckpt/"
    assert kept.model_dump()["checkpoints"] == "ckpt/"
    assert make_spec("train", ["true"], tmp_path, checkpoints=str(tmp_path / "ckpt")).checkpoints == "ckpt/"
