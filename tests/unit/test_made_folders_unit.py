"""The folders a failed run made for its outputs (run/made_folders.py):
which were missing as it launched, and which of them go."""

from __future__ import annotations

from pathlib import Path

import pytest

from substrax_tasks.run.made_folders import absent_folders, remove_made_folders


@pytest.mark.unit
def test_the_folders_missing_at_launch_are_each_level_of_the_outputs_folders(tmp_path: Path) -> None:
    (tmp_path / "kept").mkdir()
    outputs = ["bx/", "deep/er/f.txt", "kept/g.txt", "top.txt", "kept/sub/"]
    assert absent_folders(tmp_path, outputs) == ["bx", "deep", "deep/er", "kept/sub"]


@pytest.mark.unit
def test_only_empty_folders_no_other_step_needs_go_deepest_first(tmp_path: Path) -> None:
    """`shared` is another step's: it stays, and so do the folders above
    one that stayed; a folder holding a file stays; the rest go."""
    for folder in ("a/b/c", "shared/mine", "full/sub"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "full" / "f.txt").write_text("x")
    made = ["a", "a/b", "a/b/c", "shared", "shared/mine", "full", "full/sub", "gone"]
    removed = remove_made_folders(tmp_path, made, lambda folder: folder == "shared")
    assert removed == ["a/b/c", "a/b", "full/sub", "shared/mine", "a"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "shared"]
    assert (tmp_path / "full" / "f.txt").exists()
