"""Declarations checked at load: paths made clean, overlaps found (in-process;
the same refusals through `doit` are in test_chain_errors.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from substrax_tasks.errors import SpecError
from substrax_tasks.spec import PathIndex, relative_path


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
