"""What a word given to `substrax-compute status|logs|cancel` names: a run
id, a step, a group or a run-id prefix, in that order; and which folder is
the project when no --project is given. Handles written to a real store,
nothing started."""

from __future__ import annotations

from pathlib import Path

import pytest

from substrax_tasks.atomic import write_json_atomic
from substrax_tasks.config.pyproject import find_project
from substrax_tasks.errors import ConfigError, HandleError, NoSuchRun
from substrax_tasks.step.spec import make_spec
from substrax_tasks.store.handle import RunHandle
from substrax_tasks.store.run_store import RunStore
from substrax_tasks.store.selection import group_of, latest_per_step, select

pytestmark = pytest.mark.unit


def add_run(store: RunStore, root: Path, step: str, minute: int) -> RunHandle:
    """A run of `step` created at 12:`minute` (its handle only)."""
    handle = store.new_run(make_spec(step, ["true"], root), "local", {})
    created = f"2025-01-01T12:{minute:02d}:00.000+00:00"
    handle = handle.model_copy(update={"created_at": created})
    write_json_atomic(store.handle_path(handle.run_id), handle.model_dump(mode="json"))
    return handle


@pytest.fixture
def store(tmp_path: Path) -> RunStore:
    return RunStore(tmp_path / ".substrax")


def ids(handles: list[RunHandle] | tuple[RunHandle, ...]) -> list[str]:
    return [h.run_id for h in handles]


def test_group_of_splits_at_the_first_colon() -> None:
    assert group_of("fit:a") == "fit"
    assert group_of("fit:a:b") == "fit"
    assert group_of("fit") is None


@pytest.fixture
def sweep(store: RunStore, tmp_path: Path) -> tuple[RunHandle, RunHandle, RunHandle]:
    """fit:a, then fit:b, then fit:a again."""
    return (
        add_run(store, tmp_path, "fit:a", 1),
        add_run(store, tmp_path, "fit:b", 2),
        add_run(store, tmp_path, "fit:a", 3),
    )


def test_latest_per_step_keeps_the_newest_run_of_each_step_in_creation_order(
    store: RunStore, sweep: tuple[RunHandle, RunHandle, RunHandle]
) -> None:
    old_a, b, new_a = sweep
    assert ids(latest_per_step([new_a, old_a, b])) == [b.run_id, new_a.run_id]
    assert old_a.run_id not in ids(latest_per_step(store.read_all()[0]))


def test_a_step_name_means_its_latest_run_and_a_group_the_latest_of_each_member(
    store: RunStore, sweep: tuple[RunHandle, RunHandle, RunHandle]
) -> None:
    old_a, b, new_a = sweep
    step = select(store, "fit:a")
    assert (step.kind, step.name, ids(step.runs)) == ("step", "fit:a", [old_a.run_id, new_a.run_id])
    assert ids(step.latest()) == [new_a.run_id]
    group = select(store, "fit")
    assert (group.kind, group.steps) == ("group", ["fit:a", "fit:b"])
    assert ids(group.latest()) == [b.run_id, new_a.run_id]


def test_precedence_exact_run_id_then_step_then_group_then_prefix(store: RunStore, tmp_path: Path) -> None:
    old = add_run(store, tmp_path, "fit", 1)  # a plain step, before fit became a sweep
    member = add_run(store, tmp_path, "fit:a", 2)
    newer = add_run(store, tmp_path, "fit", 3)
    # an exact id names that run, even an older one of a step
    assert ids(select(store, old.run_id).runs) == [old.run_id]
    # "fit" is a prefix of both fit runs' ids and a group, but first a step
    chosen = select(store, "fit")
    assert (chosen.kind, ids(chosen.latest())) == ("step", [newer.run_id])
    assert select(store, "fit:a").kind == "step"
    # a unique prefix still names its run
    prefix = select(store, member.run_id[:14])
    assert (prefix.kind, ids(prefix.runs)) == ("run", [member.run_id])


def test_an_ambiguous_prefix_names_the_candidates(store: RunStore, tmp_path: Path) -> None:
    a = add_run(store, tmp_path, "train", 1)
    b = add_run(store, tmp_path, "train", 2)
    with pytest.raises(HandleError, match="matches several runs") as caught:
        select(store, "train-")
    assert a.run_id in str(caught.value) and b.run_id in str(caught.value)


def test_an_unknown_word_names_the_steps_and_groups_there_are(store: RunStore, tmp_path: Path) -> None:
    add_run(store, tmp_path, "fit:a", 1)
    add_run(store, tmp_path, "solo", 2)
    with pytest.raises(NoSuchRun) as caught:
        select(store, "fti")
    assert "no run, step or group named 'fti'" in str(caught.value)
    assert "steps with runs: fit:a, solo; groups: fit" in str(caught.value)
    with pytest.raises(NoSuchRun, match="there are no runs yet"):
        select(RunStore(tmp_path / "empty"), "fit")


def test_steps_only_takes_no_run_ids(store: RunStore, tmp_path: Path) -> None:
    run = add_run(store, tmp_path, "solo", 1)
    assert select(store, "solo", steps_only=True).kind == "step"
    with pytest.raises(HandleError, match=f"no runs of a step or group named '{run.run_id}'"):
        select(store, run.run_id, steps_only=True)


def test_a_word_that_is_a_path_is_no_run_id(store: RunStore, tmp_path: Path) -> None:
    add_run(store, tmp_path, "solo", 1)
    for word in ("..", "../.substrax", "/etc"):
        with pytest.raises(NoSuchRun):
            select(store, word)


# ------------------------------------------------------------ find_project


def test_the_project_is_found_upward_from_a_subfolder(tmp_path: Path) -> None:
    root = tmp_path / "proj"
    deep = root / "src" / "pkg" / "deep"
    deep.mkdir(parents=True)
    (root / "dodo.py").write_text("")
    # a package's own pyproject.toml, with no [tool.substrax], is passed over
    (root / "src" / "pkg" / "pyproject.toml").write_text('[project]\nname = "pkg"\n')
    assert find_project(deep) == root
    assert find_project(root) == root


def test_a_pyproject_with_a_substrax_table_marks_a_project_without_a_dodo(tmp_path: Path) -> None:
    inner = tmp_path / "proj" / "inner"
    (inner / "sub").mkdir(parents=True)
    (tmp_path / "proj" / "dodo.py").write_text("")
    (inner / "pyproject.toml").write_text('[tool.substrax.compute]\ndefault_backend = "local"\n')
    assert find_project(inner / "sub") == inner  # the nearest one wins


def test_with_no_project_above_the_start_folder_is_the_project(tmp_path: Path) -> None:
    lone = tmp_path / "lone" / "sub"
    lone.mkdir(parents=True)
    assert find_project(lone) == lone


def test_a_pyproject_that_is_not_toml_stops_the_search_naming_the_fix(tmp_path: Path) -> None:
    sub = tmp_path / "proj" / "sub"
    sub.mkdir(parents=True)
    (tmp_path / "proj" / "pyproject.toml").write_text("[tool.substrax\n")
    with pytest.raises(ConfigError, match=r"pyproject.toml: not valid TOML .*--project DIR"):
        find_project(sub)
