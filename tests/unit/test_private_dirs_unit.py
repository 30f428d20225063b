"""The unit half of tests/integration/config/test_private_dirs.py: the same subject, the
tests that start no process and open no connection (see its docstring)."""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path

import pytest
from private_dirs_parts import OTHER_UID, PLANTED, UID, needs_root_to_chown, plant

from substrax_tasks import private as _private
from substrax_tasks.config.pyproject import cache_file, config_stamp
from substrax_tasks.private import UnsafeFolder, private_dir
from substrax_tasks.store.project import Project


@pytest.fixture
def temp_base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The temp folder of this process, for the unit tests: a folder of the test's."""
    base = tmp_path / "tmp"
    base.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    return base


# ---------------------------------------------------------------- the helper


@pytest.mark.unit
def test_a_new_private_folder_is_ours_and_closed(temp_base: Path) -> None:
    folder = private_dir("substrax")
    assert folder == temp_base / f"substrax-{UID}"
    st = folder.lstat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (UID, 0o700)
    assert private_dir("substrax") == folder  # found again and accepted


@pytest.mark.unit
@pytest.mark.parametrize(("how", "fragment"), PLANTED)
def test_a_planted_folder_is_refused_with_the_fix(temp_base: Path, how: str, fragment: str) -> None:
    planted = plant(temp_base, f"substrax-ssh-{UID}", how)
    with pytest.raises(UnsafeFolder) as caught:
        private_dir("substrax-ssh")
    message = str(caught.value)
    assert str(planted) in message and fragment in message
    assert "set XDG_RUNTIME_DIR or TMPDIR to a folder only you can write" in message
    if how == "symlink":
        assert not list((temp_base / "elsewhere").iterdir())  # nothing was put where it leads


@pytest.mark.unit
def test_our_own_folder_that_others_may_only_read_is_closed(temp_base: Path) -> None:
    """Others could not have put anything in it: its mode is fixed, not refused."""
    folder = temp_base / f"substrax-{UID}"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    assert private_dir("substrax") == folder
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700


@pytest.mark.unit
def test_a_private_runtime_dir_is_preferred_and_a_loose_one_passed_over(
    temp_base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = tmp_path / "run-user"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert private_dir("substrax") == runtime / "substrax"
    runtime.chmod(0o755)  # not private: the temp folder is used instead
    assert private_dir("substrax") == temp_base / f"substrax-{UID}"
    monkeypatch.setenv("XDG_RUNTIME_DIR", "relative/path")
    assert private_dir("substrax") == temp_base / f"substrax-{UID}"


@pytest.mark.unit
def test_the_control_folder_falls_back_to_tmp_when_the_temp_folder_is_long(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from substrax_tasks.transports.openssh import CONTROL_DIR_MAX

    long_base = tmp_path / ("x" * 80)
    monkeypatch.setattr(tempfile, "tempdir", str(long_base))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert _private.private_path("substrax-ssh", CONTROL_DIR_MAX) == Path(f"/tmp/substrax-ssh-{UID}")


# --------------------------------------------------- the cached configuration


@pytest.mark.unit
@pytest.mark.parametrize("how", ["group-writable", pytest.param("foreign", marks=needs_root_to_chown)])
def test_a_cached_configuration_not_ours_alone_is_not_trusted(
    temp_base: Path, tmp_path: Path, how: str
) -> None:
    """A cache with the right stamp naming another state_dir, as someone
    could leave it: validated again, the configured state_dir stands."""
    root = tmp_path / "proj"
    root.mkdir()
    (root / "pyproject.toml").write_text('[tool.substrax.compute]\nstate_dir = "mine"\n')
    assert Project.open(root).store.root == root / "mine"  # made the cache
    path = cache_file(root)
    data = json.loads(path.read_text())
    assert data["stamp"] == config_stamp(root)
    path.write_text(json.dumps({**data, "state_dir": str(tmp_path / "theirs")}))
    if how == "foreign":
        os.chown(path, OTHER_UID, OTHER_UID)
    else:
        path.chmod(0o620)
    assert Project.open(root).store.root == root / "mine"
    st = path.stat()  # and replaced by one of ours
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (UID, 0o600)
    assert json.loads(path.read_text())["state_dir"] == str(root / "mine")


@pytest.mark.unit
def test_a_configuration_cached_by_another_tree_of_the_same_version_is_not_used(
    temp_base: Path, tmp_path: Path
) -> None:
    """Two working trees of the project (an A/B of two commits) share a
    version string: what one's code validated is not the other's."""
    root = tmp_path / "proj"
    root.mkdir()
    (root / "pyproject.toml").write_text('[tool.substrax.compute]\nstate_dir = "mine"\n')
    assert Project.open(root).store.root == root / "mine"  # made the cache
    path = cache_file(root)
    data = json.loads(path.read_text())
    version, folder = data["stamp"][0]
    assert Path(folder) == Path(_private.__file__).resolve().parent
    other_tree = {**data, "stamp": [[version, "/elsewhere/substrax-tasks"], *data["stamp"][1:]],
                  "state_dir": str(tmp_path / "theirs")}  # fmt: skip
    path.write_text(json.dumps(other_tree))
    assert Project.open(root).store.root == root / "mine"


# ------------------------------------------------------------ as a user sees it


