"""Checkpoints on the local backend (`remote_step(..., checkpoints="ckpt/")`),
as a user drives them with `doit`: the folder lives in the store, bound
writable into the sandbox, so a run interrupted by Ctrl-C or failed is
resumed by the next `doit` from what it had written; a changed input
starts afresh; once the outputs are promoted the checkpoints go; two steps
running beside each other keep theirs apart."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from checkpoint_parts import (
    COUNT_PY,
    NAMING_STEP,
    count_step,
    counts,
    kept_state,
    rerun_and_reattach_naming_the_checkpoints,
    result_of,
    run_logs,
    starts,
)
from dodo_helpers import (
    DEFAULT_SANDBOX,
    SANDBOXES,
    compute,
    doit,
    doit_ok,
    make_project,
    popen_doit,
    popen_output,
    show,
    stop,
    unsafe_modes,
    wait_for,
    write_pyproject,
)
from progress import wait_exit

PAUSE = 0.3  # between counts: long enough for a Ctrl-C to land mid-run


def counting_project(tmp_path: Path, body: str, sandbox: str = DEFAULT_SANDBOX) -> Path:
    return make_project(tmp_path, "def task_all():\n" + body, sandbox=sandbox,
                        files={"count.py": COUNT_PY, "data.txt": "one\n"})  # fmt: skip


def test_ctrl_c_then_doit_resumes_from_the_checkpoint(tmp_path: Path) -> None:
    root = counting_project(tmp_path, count_step("count", 12, PAUSE))
    proc = popen_doit(root, "count")
    try:
        wait_for(lambda: (kept_state(root, "count") or {}).get("i", 0) >= 4, "four counts checkpointed")
        proc.send_signal(signal.SIGINT)
        code = wait_exit(proc, "the doit to end", 60)
    finally:
        stop(proc)
    assert code != 0, popen_output(root)
    first = run_logs(root, "count")[0]
    interrupted_at = max(counts(first))
    assert interrupted_at < 12, first
    kept = kept_state(root, "count")
    assert kept is not None and kept["i"] >= 4, kept

    done = doit_ok(root, "count")
    second = run_logs(root, "count")[-1]
    assert starts(second) == [kept["i"]], show(done)
    # A count is redone only if the Ctrl-C landed between its print and its checkpoint.
    assert interrupted_at - kept["i"] <= 1, (first, second)
    reached, seen = result_of(root, "count")
    assert reached == 12
    assert seen == list(range(1, 13))  # each count once in the state that was carried over
    # The outputs are home: the checkpoints have done their work.
    assert not (root / ".substrax" / "checkpoints" / "count").exists()
    assert kept_state(root, "count") is None


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_a_failed_command_leaves_its_checkpoint_for_the_next_doit(tmp_path: Path, sandbox: str) -> None:
    """Without a sandbox the command writes in the project, and the worker
    keeps what it left as it ends."""
    root = counting_project(tmp_path, count_step("count", 6, 0.01, "fail-fresh"), sandbox)
    failed = doit(root, "count")
    assert failed.returncode != 0, show(failed)
    assert "failed (exit code 3)" in failed.stdout + failed.stderr, show(failed)
    assert kept_state(root, "count") == {"n": 6, "i": 3, "seen": [1, 2, 3]}

    done = doit_ok(root, "count")
    assert starts(run_logs(root, "count")[-1]) == [3], show(done)
    assert "count: checkpoints of an earlier run in place (1 file(s))" in done.stdout + done.stderr
    assert result_of(root, "count") == (6, [1, 2, 3, 4, 5, 6])


def test_a_changed_input_starts_afresh(tmp_path: Path) -> None:
    root = counting_project(tmp_path, count_step("count", 6, 0.01, "fail-fresh"))
    assert doit(root, "count").returncode != 0
    assert kept_state(root, "count") == {"n": 6, "i": 3, "seen": [1, 2, 3]}
    (root / "data.txt").write_text("two\n")  # another key: the snapshot of the old one is not restored
    again = doit(root, "count")
    assert again.returncode != 0, show(again)  # started from nothing, so it failed at 3 again
    assert starts(run_logs(root, "count")[-1]) == [0], show(again)


def test_keep_checkpoints_keeps_them_after_promotion(tmp_path: Path) -> None:
    root = counting_project(tmp_path, count_step("count", 3, 0.01))
    write_pyproject(root, extra="keep_checkpoints = true\n")
    doit_ok(root, "count")
    assert kept_state(root, "count") == {"n": 3, "i": 3, "seen": [1, 2, 3]}


def test_two_steps_under_threads_keep_their_checkpoints_apart(tmp_path: Path) -> None:
    root = counting_project(
        tmp_path, count_step("a", 5, 0.05, "fail-fresh") + count_step("b", 8, 0.05, "fail-fresh")
    )
    failed = doit(root, "-n", "2", "-P", "thread", "a", "b")
    assert failed.returncode != 0, show(failed)
    assert kept_state(root, "a") == {"n": 5, "i": 3, "seen": [1, 2, 3]}
    assert kept_state(root, "b") == {"n": 8, "i": 3, "seen": [1, 2, 3]}
    done = doit_ok(root, "-n", "2", "-P", "thread", "a", "b")
    assert starts(run_logs(root, "a")[-1]) == [3], show(done)
    assert starts(run_logs(root, "b")[-1]) == [3], show(done)
    assert result_of(root, "a") == (5, [1, 2, 3, 4, 5])
    assert result_of(root, "b") == (8, list(range(1, 9)))


def test_gc_removes_the_checkpoints_of_keys_no_step_has_any_more(tmp_path: Path) -> None:
    step_b = count_step("b", 6, 0.05, "fail-fresh")
    root = counting_project(tmp_path, count_step("a", 6, 0.05, "fail-fresh") + step_b)
    for step in ("a", "b"):
        assert doit(root, step).returncode != 0  # fails at count 3, its checkpoint kept
    (root / "data.txt").write_text("two\n")  # a's key changes: its next run starts afresh
    assert doit(root, "a").returncode != 0
    (root / "dodo.py").write_text((root / "dodo.py").read_text().replace(step_b, ""))  # b is gone
    folders = root / ".substrax" / "checkpoints"
    old_a, new_a = sorted((folders / "a").iterdir(), key=lambda p: p.stat().st_mtime)
    (old_b,) = (folders / "b").iterdir()

    listed = compute(root, "gc", "--dry-run")
    assert listed.returncode == 0, show(listed)
    assert f"would remove checkpoints {old_a} (step a: no step of the dodo file has that key any more)" in (
        listed.stdout), show(listed)  # fmt: skip
    assert f"would remove checkpoints {old_b}" in listed.stdout, show(listed)
    assert str(new_a) not in listed.stdout
    assert old_a.exists() and old_b.exists()

    done = compute(root, "gc")
    assert done.returncode == 0, show(done)
    assert f"removed checkpoints {old_a}" in done.stdout and f"removed checkpoints {old_b}" in done.stdout
    assert not old_a.exists() and not (folders / "b").exists()
    assert new_a.is_dir()  # today's key: the next doit resumes from it
    resumed = doit_ok(root, "a")
    assert starts(run_logs(root, "a")[-1]) == [3], show(resumed)
    assert result_of(root, "a") == (6, list(range(1, 7)))


def test_gc_keeps_the_checkpoints_of_a_run_still_going_under_an_old_key(tmp_path: Path) -> None:
    root = counting_project(tmp_path, count_step("count", 40, PAUSE))
    proc = popen_doit(root, "count")
    try:
        wait_for(lambda: (kept_state(root, "count") or {}).get("i", 0) >= 1, "a count checkpointed")
        (root / "data.txt").write_text("two\n")  # the dodo's key is another now; the run goes on
        done = compute(root, "gc")
        assert done.returncode == 0, show(done)
        assert "checkpoints" not in done.stdout, show(done)
        assert kept_state(root, "count") is not None
        proc.send_signal(signal.SIGINT)  # cancels the local run
        wait_exit(proc, "the doit to end", 60)
    finally:
        stop(proc)


@pytest.mark.parametrize("checkpoints_first", [True, False], ids=["checkpoints-first", "output-first"])
def test_a_checkpoints_folder_overlapping_another_steps_output_is_refused_at_load(
    tmp_path: Path, checkpoints_first: bool
) -> None:
    kept = count_step("count", 3, 0.01)
    other = "    yield from remote_step('other', command=['true'], outputs=['ckpt/x.txt'])\n"
    root = counting_project(tmp_path, kept + other if checkpoints_first else other + kept)
    refused = doit(root, "list")
    assert refused.returncode == 1, show(refused)
    said = refused.stdout + refused.stderr
    if checkpoints_first:
        assert "step 'other': ckpt/x.txt overlaps the checkpoints folder ckpt/ of step 'count'" in said, said
    else:
        assert "step 'count': ckpt/ overlaps the output ckpt/x.txt of step 'other'" in said, said
    assert "a checkpoints folder belongs to its step alone" in said and "Traceback" not in said


# The command makes a setuid file, a world-writable setuid one and a sticky,
# world-writable folder in its checkpoints, then fails; run again, it says
# the modes it finds there and succeeds.
PRIVILEGED = """\
def task_all():
    yield from remote_step("priv", command=["sh", "-c", MAKE], inputs=["data.txt"], outputs=["out.txt"],
                           checkpoints="ckpt/")
MAKE = (
    "if [ -e ckpt/s ]; then stat -c 'mode %a %n' ckpt/s ckpt/o ckpt/d; echo done > out.txt; exit 0; fi; "
    "mkdir -p ckpt/d && echo s > ckpt/s && echo o > ckpt/o && "
    "chmod 6755 ckpt/s && chmod 4777 ckpt/o && chmod 1777 ckpt/d && exit 3"
)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="SETUID CHECKPOINTS NOT TESTED: root makes them, as CI runs")
@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_a_root_commands_setuid_checkpoints_keep_no_privilege_in_the_store(
    tmp_path: Path, sandbox: str
) -> None:
    """Issue 28, item 2: the checkpoints folder is the store's (bound into the
    sandbox, or kept back from the project): a root command's setuid or
    world-writable files there lose those bits as the command ends, before
    the next doit (or attempt) finds them."""
    root = make_project(tmp_path, PRIVILEGED, sandbox=sandbox, files={"data.txt": "one\n"})
    failed = doit(root, "priv")
    assert failed.returncode != 0 and "failed (exit code 3)" in failed.stdout + failed.stderr, show(failed)
    store = root / ".substrax" / "checkpoints" / "priv"
    (live,) = store.glob("*/live")
    assert sorted(p.name for p in live.iterdir()) == ["d", "o", "s"]
    assert unsafe_modes(store, ["."]) == {}, show(failed)
    # Without a sandbox the command wrote them in the project: those too.
    assert unsafe_modes(root, ["ckpt"]) == {}, show(failed)

    done = doit_ok(root, "priv")
    said = run_logs(root, "priv")[-1]
    assert {"mode 755 ckpt/s", "mode 775 ckpt/o", "mode 775 ckpt/d"} <= set(said.splitlines()), show(done)


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_a_command_naming_its_checkpoints_folder_runs_again_after_an_edit_and_reattaches(
    tmp_path: Path, sandbox: str
) -> None:
    """Issue 39, item 1: the first run leaves ckpt/long in the project (the
    sandbox's mount point; without one, the checkpoints themselves), and
    every later launch was refused as naming "a project file the run would
    not see"."""
    root = counting_project(tmp_path, NAMING_STEP, sandbox)

    def written_in() -> Path | None:  # the kept folder, bound at ckpt/long; or ckpt/long itself
        if sandbox == "none":
            return root / "ckpt" / "long"
        return next((root / ".substrax" / "checkpoints" / "train").glob("*/live"), None)

    rerun_and_reattach_naming_the_checkpoints(root, written_in)
    assert (root / "ckpt" / "long").is_dir()  # what made every later launch refused
