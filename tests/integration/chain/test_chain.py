"""remote_step() through the real `doit`: the chain, its up-to-date check,
reruns, and how it fits ordinary dodo files.

Each test writes a small project in tmp_path and runs `doit` as a process.
The number of run folders in .substrax/runs tells whether a command ran.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from dodo_helpers import (
    DEFAULT_SANDBOX,
    SANDBOXES,
    doit,
    doit_ok,
    handles,
    make_project,
    run_count,
    run_dirs,
    runs_of,
    show,
    step_ran,
    step_skipped,
    tree_files,
    write_dodo,
    write_pyproject,
)

# One step, a folder output and a file output, made from one input.
BASIC = """
def task_step():
    yield from remote_step(
        "step",
        command=["/bin/sh", "-c", COMMAND],
        inputs=["data/in.txt"],
        outputs=["out/", "res.txt"],
        env=ENV,
        timeout=TIMEOUT,
        clean=True,
    )
"""
COMMAND = (
    "mkdir -p out/sub && cp data/in.txt out/a.txt && echo b > out/sub/b.txt"
    " && cat data/in.txt data/in.txt > res.txt"
)


def basic(tmp_path: Path, sandbox: str = DEFAULT_SANDBOX, command: str = COMMAND,
          env: dict[str, str] | None = None, timeout: float | None = None) -> Path:
    body = f"COMMAND = {command!r}\nENV = {env or {}!r}\nTIMEOUT = {timeout!r}\n" + BASIC
    return make_project(tmp_path, body, ["step"], sandbox, files={"data/in.txt": "hello\n"})


def redeclare(root: Path, command: str = COMMAND, env: dict[str, str] | None = None,
              timeout: float | None = None) -> None:
    body = f"COMMAND = {command!r}\nENV = {env or {}!r}\nTIMEOUT = {timeout!r}\n" + BASIC
    write_dodo(root, body, ["step"])


def expected_outputs(text: str = "hello\n") -> dict[str, str]:
    return {"out/a.txt": text, "out/sub/b.txt": "b\n", "res.txt": text * 2}


def outputs_of(root: Path) -> dict[str, str]:
    found = tree_files(root / "out")
    result = {f"out/{k}": v for k, v in found.items()}
    if (root / "res.txt").exists():
        result["res.txt"] = (root / "res.txt").read_text()
    return result


# ------------------------------------------------------------------ no-op


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_first_run_promotes_and_rerun_executes_nothing(tmp_path: Path, sandbox: str) -> None:
    root = basic(tmp_path, sandbox)
    first = doit_ok(root)
    assert step_ran(first, "step"), show(first)
    assert run_count(root) == 1
    assert outputs_of(root) == expected_outputs()
    (run,) = handles(root)
    assert run["state"]["phase"] == "promoted"
    handle_file = run_dirs(root)[0] / "handle.json"
    before = handle_file.stat().st_mtime_ns
    second = doit_ok(root)
    assert step_skipped(second, "step"), show(second)
    assert not step_ran(second, "step")
    assert "new run" not in second.stdout
    assert run_count(root) == 1
    assert handle_file.stat().st_mtime_ns == before  # no phase touched the run
    assert outputs_of(root) == expected_outputs()


def test_noop_rerun_runs_no_task_of_the_chain(tmp_path: Path) -> None:
    """doit's JSON reporter lists every task it ran, hidden phases included."""
    root = basic(tmp_path)
    ran = json.loads(doit_ok(root, "--reporter", "json").stdout)
    names = {t["name"]: t["result"] for t in ran["tasks"]}
    assert names["_step"] == "success"  # the hidden task holding the phases
    assert names["step"] == "success"
    again = json.loads(doit_ok(root, "--reporter", "json").stdout)
    assert [(t["name"], t["result"]) for t in again["tasks"]] == [("step", "up-to-date")]
    assert run_count(root) == 1


# -------------------------------------------------------------- tampering


def _edit_folder_file(root: Path) -> None:
    (root / "out" / "a.txt").write_text("tampered\n")


def _edit_same_size(root: Path) -> None:
    (root / "out" / "a.txt").write_text("HELLO\n")


def _delete_folder_file(root: Path) -> None:
    (root / "out" / "sub" / "b.txt").unlink()


def _add_folder_file(root: Path) -> None:
    (root / "out" / "sub" / "stray.txt").write_text("stray\n")


def _edit_file_output(root: Path) -> None:
    (root / "res.txt").write_text("nope\n")


def _delete_file_output(root: Path) -> None:
    (root / "res.txt").unlink()


def _delete_folder_output(root: Path) -> None:
    for path in sorted((root / "out").rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    (root / "out").rmdir()


def _chmod_output(root: Path) -> None:
    (root / "out" / "a.txt").chmod(0o755)


TAMPERING = {
    "edit-in-folder": _edit_folder_file,
    "edit-same-size": _edit_same_size,
    "delete-in-folder": _delete_folder_file,
    "add-to-folder": _add_folder_file,
    "edit-file-output": _edit_file_output,
    "delete-file-output": _delete_file_output,
    "delete-folder-output": _delete_folder_output,
    "chmod": _chmod_output,
}


# Every kind in the sandbox; without it (outputs written in place), a few.
TAMPER_CASES = [pytest.param(how, DEFAULT_SANDBOX, id=f"{how}-{DEFAULT_SANDBOX}") for how in TAMPERING]
if DEFAULT_SANDBOX != "none":
    TAMPER_CASES += [
        pytest.param(how, "none", id=f"{how}-none")
        for how in ("edit-in-folder", "add-to-folder", "delete-file-output")
    ]


@pytest.mark.parametrize(("how", "sandbox"), TAMPER_CASES)
def test_tampered_output_reruns_the_step(tmp_path: Path, how: str, sandbox: str) -> None:
    root = basic(tmp_path, sandbox)
    doit_ok(root)
    assert run_count(root) == 1
    TAMPERING[how](root)
    again = doit_ok(root)
    assert step_ran(again, "step"), show(again)
    # The local backend drops a run's outputs once promoted: it runs again.
    assert run_count(root) == 2
    # Without a sandbox the outputs are removed before the command writes
    # them in place, so a stray file is gone in both modes.
    assert outputs_of(root) == expected_outputs()
    if how == "chmod":
        assert not os.access(root / "out" / "a.txt", os.X_OK) or sandbox == "none"
    third = doit_ok(root)
    assert step_skipped(third, "step"), show(third)
    assert run_count(root) == 2


# ----------------------------------------------------- changes that rerun


def test_input_change_reruns(tmp_path: Path) -> None:
    root = basic(tmp_path)
    doit_ok(root)
    (root / "data" / "in.txt").write_text("changed\n")
    again = doit_ok(root)
    assert step_ran(again, "step"), show(again)
    assert run_count(root) == 2
    assert outputs_of(root) == expected_outputs("changed\n")
    # Same content again, new mtime: hashed, not re-run.
    (root / "data" / "in.txt").write_text("changed\n")
    assert step_skipped(doit_ok(root), "step")
    assert run_count(root) == 2


def test_environment_lock_change_reruns(tmp_path: Path) -> None:
    """The lock file the environment is built from is part of the key."""
    root = basic(tmp_path)
    (root / "requirements.txt").write_text("# numpy==2.0.0\n")  # offline: an env with nothing in it
    doit_ok(root)
    assert step_skipped(doit_ok(root), "step")
    (root / "requirements.txt").write_text("# numpy==2.1.0\n")
    again = doit_ok(root)
    assert step_ran(again, "step"), show(again)
    assert run_count(root) == 2
    assert step_skipped(doit_ok(root), "step")


@pytest.mark.parametrize("folder", ["data/", "data"])  # a folder may be declared without its "/"
def test_input_folder_change_reruns(tmp_path: Path, folder: str) -> None:
    body = f"""
    def task_step():
        yield from remote_step("step", command=["/bin/sh", "-c", "ls data > listing.txt"],
                               inputs=["{folder}"], outputs=["listing.txt"])
    """
    root = make_project(tmp_path, body, ["step"], files={"data/a": "a"})
    doit_ok(root)
    assert (root / "listing.txt").read_text() == "a\n"
    (root / "data" / "b").write_text("b")
    assert step_ran(doit_ok(root), "step")
    assert (root / "listing.txt").read_text() == "a\nb\n"
    assert run_count(root) == 2
    assert step_skipped(doit_ok(root), "step")


def test_command_change_reruns(tmp_path: Path) -> None:
    root = basic(tmp_path)
    doit_ok(root)
    redeclare(root, command=COMMAND + " && echo more >> res.txt")
    again = doit_ok(root)
    assert step_ran(again, "step"), show(again)
    assert run_count(root) == 2
    assert (root / "res.txt").read_text() == "hello\nhello\nmore\n"
    assert step_skipped(doit_ok(root), "step")


def test_env_change_reruns(tmp_path: Path) -> None:
    command = COMMAND + ' && echo "$GREETING" > out/greeting.txt'
    root = basic(tmp_path, command=command, env={"GREETING": "one"})
    doit_ok(root)
    assert (root / "out" / "greeting.txt").read_text() == "one\n"
    redeclare(root, command=command, env={"GREETING": "two"})
    assert step_ran(doit_ok(root), "step")
    assert (root / "out" / "greeting.txt").read_text() == "two\n"
    assert run_count(root) == 2
    assert step_skipped(doit_ok(root), "step")


def test_timeout_change_reruns(tmp_path: Path) -> None:
    root = basic(tmp_path, timeout=100)
    doit_ok(root)
    redeclare(root, timeout=200)
    assert step_ran(doit_ok(root), "step")
    assert run_count(root) == 2
    (second,) = [h for h in handles(root) if h["spec"]["timeout"] == 200]
    assert second["state"]["phase"] == "promoted"
    assert step_skipped(doit_ok(root), "step")


def test_backend_settings_change_reruns(tmp_path: Path) -> None:
    root = basic(tmp_path)
    doit_ok(root)
    write_pyproject(root, DEFAULT_SANDBOX, extra="network_isolation = false\n")
    assert step_skipped(doit_ok(root), "step")  # the same validated settings
    write_pyproject(root, DEFAULT_SANDBOX)
    (root / "pyproject.toml").write_text(
        (root / "pyproject.toml").read_text().replace("grace_seconds = 0.5", "grace_seconds = 0.7")
    )
    assert step_ran(doit_ok(root), "step")
    assert run_count(root) == 2


# ------------------------------------------------------- doit's own verbs


def test_forget_reruns(tmp_path: Path) -> None:
    root = basic(tmp_path)
    doit_ok(root)
    forgot = doit_ok(root, "forget", "step")
    assert "forgetting step" in forgot.stdout
    again = doit_ok(root)
    assert step_ran(again, "step"), show(again)
    assert run_count(root) == 2
    assert outputs_of(root) == expected_outputs()
    assert step_skipped(doit_ok(root), "step")


def test_clean_removes_outputs_then_reruns(tmp_path: Path) -> None:
    root = basic(tmp_path)
    doit_ok(root)
    cleaned = doit_ok(root, "clean", "step")
    assert not (root / "res.txt").exists(), show(cleaned)
    assert not (root / "out").exists(), show(cleaned)
    assert (root / "data" / "in.txt").exists()  # inputs are not outputs
    again = doit_ok(root)
    assert step_ran(again, "step")
    assert run_count(root) == 2
    assert outputs_of(root) == expected_outputs()


def test_clean_dry_run_removes_nothing(tmp_path: Path) -> None:
    root = basic(tmp_path)
    doit_ok(root)
    done = doit_ok(root, "clean", "--dry-run", "step")
    assert outputs_of(root) == expected_outputs(), show(done)
    # the action named by what it does, not by its Python object
    assert "step - executing 'Python: remove the outputs of step step: " in done.stdout, show(done)
    assert "would remove out/" in done.stdout and "functools" not in done.stdout, show(done)


def test_clean_dry_run_of_a_step_of_many_outputs_prints_a_short_label(tmp_path: Path) -> None:
    """Before, doit's label listed every output: 1,400 characters for a
    step of 100. The label is one short line; each output has its own."""
    body = """
def task_subjects():
    yield from remote_step("subjects", shell="for i in $(seq -w 1 100); do echo $i > sub-$i.csv; done",
                           outputs=[f"sub-{i:03d}.csv" for i in range(1, 101)], clean=True)
"""
    root = make_project(tmp_path, body, ["subjects"])
    doit_ok(root)
    done = doit_ok(root, "clean", "--dry-run", "subjects")
    (label,) = [line for line in done.stdout.splitlines() if "executing" in line]
    assert label == (
        "subjects - executing 'Python: remove the outputs of step subjects: "
        "sub-001.csv, sub-002.csv, ... (100 in all)'"
    ), show(done)
    assert done.stdout.count("would remove sub-") == 100, show(done)
    assert (root / "sub-100.csv").exists()


def test_list_shows_public_tasks_and_info_works(tmp_path: Path) -> None:
    body = BASIC + """
def task_plain():
    return {"actions": ["true"], "doc": "a plain task"}
"""
    body = f"COMMAND = {COMMAND!r}\nENV = {{}}\nTIMEOUT = None\n" + body
    root = make_project(tmp_path, body, ["step"], files={"data/in.txt": "hello\n"})
    listed = doit_ok(root, "list")
    names = [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]
    assert sorted(names) == ["plain", "step"], show(listed)
    private = doit_ok(root, "list", "--private")
    assert "_step " in private.stdout or "_step\n" in private.stdout
    info = doit(root, "info", "step")
    assert info.returncode == 1, show(info)  # doit info: 1 when the task would run
    assert "data/in.txt" in info.stdout
    assert "res.txt" in info.stdout
    assert "status     : run" in info.stdout
    # The reason names the step's own check in words, not as an object address.
    assert "the verified outputs of step 'step'" in info.stdout
    assert "object at 0x" not in info.stdout
    assert run_count(root) == 0  # listing and info launch nothing
    doit_ok(root)
    info = doit_ok(root, "info", "step")
    assert "up-to-date" in info.stdout, show(info)


def test_info_shows_a_folder_input(tmp_path: Path) -> None:
    """doit's file_dep takes files only: before, `doit info` did not name
    a folder input at all."""
    body = """
def task_step():
    yield from remote_step("step", shell="cat data/d/x data/f.txt > res.txt",
                           inputs=["data/d/", "data/f.txt"], outputs=["res.txt"])
"""
    root = make_project(tmp_path, body, ["step"], files={"data/d/x": "x\n", "data/f.txt": "f\n"})
    info = doit(root, "info", "step")
    assert info.returncode == 1, show(info)
    meta = next(line for line in info.stdout.splitlines() if line.startswith("meta "))
    assert "'inputs': ['data/d/', 'data/f.txt']" in meta, show(info)


@pytest.mark.parametrize("threads", [[], ["-n", "2", "-P", "thread"]], ids=["serial", "threads"])
def test_a_step_run_again_after_an_edited_output_is_not_called_up_to_date(
    tmp_path: Path, threads: list[str]
) -> None:
    """Plain `doit` with no default_tasks selects the hidden task of the
    phases too, before the public one: before, the public task was then
    checked after the new run and printed `-- square` (up to date) right
    after `new run ...`, and the closing line said nothing ran."""
    body = """
DOIT_CONFIG = doit_config()  # no default_tasks: plain `doit` selects every task

def task_square():
    yield from remote_step("square", shell="echo 4 > sq.txt", outputs=["sq.txt"])
"""
    root = make_project(tmp_path, body)
    assert step_ran(doit_ok(root, *threads), "square")
    (root / "sq.txt").write_text("5\n")
    again = doit_ok(root, *threads)
    # serially `square: new run`, under threads `square | new run` (each line names its step)
    assert re.search(r"^square(:| \|) new run square-", again.stdout, re.M), show(again)
    assert step_ran(again, "square") and not step_skipped(again, "square"), show(again)
    assert "ran 1 of 1 tasks" in again.stdout, show(again)
    assert (root / "sq.txt").read_text() == "4\n"
    assert run_count(root) == 2
    assert step_skipped(doit_ok(root, *threads), "square")


# -------------------------------------------------- fits ordinary dodo files

NAMES = ["fit:lr0.1", "a,b", "with space", "sub/ject 01"]


def test_step_names_with_special_characters(tmp_path: Path) -> None:
    body = f"""
NAMES = {NAMES!r}

def task_steps():
    for i, name in enumerate(NAMES):
        yield from remote_step(
            name, command=["/bin/sh", "-c", 'echo "$0" > out/n' + str(i) + '.txt', name],
            outputs=[f"out/n{{i}}.txt"],
        )
    yield {{"basename": "plain", "actions": ["echo plain > plain.txt"], "targets": ["plain.txt"]}}

def task_after():
    return {{
        "actions": ["cat out/n0.txt out/n1.txt out/n2.txt out/n3.txt > after.txt"],
        "task_dep": NAMES,
        "targets": ["after.txt"],
    }}
"""
    root = make_project(tmp_path, body, ["after"])
    first = doit_ok(root)
    assert (root / "after.txt").read_text() == "".join(f"{n}\n" for n in NAMES), show(first)
    assert run_count(root) == 4
    # Folder and file names made from them are safe.
    for path in run_dirs(root) + list((root / ".substrax").rglob("*")):
        assert not any(c in path.name for c in ":, ")
    listed = doit_ok(root, "list", "--all")  # fit:lr0.1 is the member lr0.1 of the group fit
    for name in NAMES:
        assert name in listed.stdout
    for name in NAMES:
        again = doit_ok(root, name)
        assert step_skipped(again, name), show(again)
    (root / "out" / "n3.txt").write_text("x\n")
    again = doit_ok(root, "sub/ject 01")
    assert step_ran(again, "sub/ject 01"), show(again)
    assert run_count(root) == 5
    assert (root / "out" / "n3.txt").read_text() == "sub/ject 01\n"


def test_argv_items_str_path_int(tmp_path: Path) -> None:
    body = """
def task_step():
    yield from remote_step(
        "step",
        command=["python3", Path("scripts") / "write.py", 7, "out/n.txt"],
        inputs=["scripts/write.py"],
        outputs=["out/n.txt"],
    )
"""
    script = "import sys\nopen(sys.argv[2], 'w').write(str(int(sys.argv[1]) * 6))\n"
    root = make_project(tmp_path, body, ["step"], files={"scripts/write.py": script})
    doit_ok(root)
    assert (root / "out" / "n.txt").read_text() == "42"
    (run,) = handles(root)
    assert run["spec"]["command"] == ["python3", "scripts/write.py", "7", "out/n.txt"]


def test_shell_form_with_pipe_and_redirect(tmp_path: Path) -> None:
    body = """
def task_step():
    yield from remote_step(
        "step",
        shell="sort -r data/words.txt | head -n 2 > top.txt && date +%s >/dev/null",
        inputs=["data/words.txt"],
        outputs=["top.txt"],
    )
"""
    root = make_project(tmp_path, body, ["step"], files={"data/words.txt": "a\nc\nb\n"})
    done = doit_ok(root)
    assert (root / "top.txt").read_text() == "c\nb\n", show(done)
    assert step_skipped(doit_ok(root), "step")


def test_command_and_shell_together_is_refused(tmp_path: Path) -> None:
    body = """
def task_step():
    yield from remote_step("step", command=["true"], shell="true", outputs=["x"])
"""
    root = make_project(tmp_path, body, ["step"])
    done = doit(root)
    assert done.returncode == 1, show(done)
    assert "either command" in done.stderr
    assert run_count(root) == 0


def test_several_outputs_files_and_folders(tmp_path: Path) -> None:
    body = """
def task_step():
    yield from remote_step(
        "step",
        shell=(
            "mkdir -p m/weights r/logs && echo w > m/weights/w.bin && echo l > r/logs/l.txt"
            " && echo s > summary.txt && echo d > r/done.txt && ln -s weights/w.bin m/latest"
        ),
        outputs=["m/", "r/logs/", "summary.txt", "r/done.txt"],
    )

def task_use():
    return {
        "actions": ["cat m/latest r/done.txt > use.txt"],
        "file_dep": ["summary.txt", "r/done.txt"],
        "targets": ["use.txt"],
    }
"""
    root = make_project(tmp_path, body, ["use"])
    done = doit_ok(root)
    assert (root / "use.txt").read_text() == "w\nd\n", show(done)
    assert (root / "m" / "latest").is_symlink()
    assert os.readlink(root / "m" / "latest") == "weights/w.bin"
    assert (root / "r" / "logs" / "l.txt").read_text() == "l\n"
    again = doit_ok(root)
    assert step_skipped(again, "step") and step_skipped(again, "use"), show(again)
    (root / "m" / "latest").unlink()
    (root / "m" / "latest").symlink_to("elsewhere")
    assert step_ran(doit_ok(root), "step")
    assert os.readlink(root / "m" / "latest") == "weights/w.bin"
    assert run_count(root) == 2


def test_extra_file_dep_is_tracked_but_not_an_input(tmp_path: Path) -> None:
    body = """
def task_step():
    yield from remote_step(
        "step", command=["/bin/sh", "-c", "echo ran > out.txt"],
        outputs=["out.txt"], file_dep=["notes.txt"],
    )
"""
    root = make_project(tmp_path, body, ["step"], files={"notes.txt": "v1"})
    doit_ok(root)
    (run,) = handles(root)
    assert run["spec"]["inputs"] == []
    assert step_skipped(doit_ok(root), "step")
    (root / "notes.txt").write_text("v2")
    assert step_ran(doit_ok(root), "step")
    assert run_count(root) == 2
    assert step_skipped(doit_ok(root), "step")
    info = doit_ok(root, "info", "step")
    assert "notes.txt" in info.stdout


def test_user_uptodate_is_combined_with_and(tmp_path: Path) -> None:
    body = """
def flag(task, values):
    return Path("fresh.flag").exists()

def task_step():
    yield from remote_step(
        "step", command=["/bin/sh", "-c", "echo ran > out.txt"], outputs=["out.txt"],
        uptodate=[flag, True],
    )
"""
    root = make_project(tmp_path, body, ["step"], files={"fresh.flag": ""})
    doit_ok(root)
    assert step_skipped(doit_ok(root), "step")
    (root / "fresh.flag").unlink()  # the user's check says: not up to date
    assert step_ran(doit_ok(root), "step")
    assert run_count(root) == 2
    (root / "fresh.flag").write_text("")
    assert step_skipped(doit_ok(root), "step")
    # The user's True does not override the library's check.
    (root / "out.txt").write_text("tampered\n")
    assert step_ran(doit_ok(root), "step")
    assert (root / "out.txt").read_text() == "ran\n"
    assert run_count(root) == 3


def test_user_uptodate_false_forces_a_run_every_time(tmp_path: Path) -> None:
    body = """
def task_step():
    yield from remote_step(
        "step", command=["/bin/sh", "-c", "echo ran > out.txt"], outputs=["out.txt"],
        uptodate=[False],
    )
"""
    root = make_project(tmp_path, body, ["step"])
    doit_ok(root)
    assert step_ran(doit_ok(root), "step")
    assert run_count(root) == 2


def test_user_uptodate_in_doit_forms_config_changed_and_tuple(tmp_path: Path) -> None:
    body = """
from doit.tools import config_changed

LR = get_var("lr", "0.1")

def flag_is(path, wanted):
    return Path(path).read_text().strip() == wanted

def task_step():
    yield from remote_step(
        "step", command=["/bin/sh", "-c", "echo ran > out.txt"], outputs=["out.txt"],
        uptodate=[
            config_changed({"lr": LR}), (flag_is, ["flag.txt"], {"wanted": "fresh"}), "test -e flag.txt"
        ],
    )
"""
    root = make_project(tmp_path, body, ["step"], files={"flag.txt": "fresh"})
    doit_ok(root)
    assert step_skipped(doit_ok(root), "step")
    assert step_ran(doit_ok(root, "step", "lr=0.2"), "step")  # config_changed says: changed
    assert run_count(root) == 2
    assert step_skipped(doit_ok(root, "step", "lr=0.2"), "step")
    (root / "flag.txt").write_text("stale")  # the tuple form says: not up to date
    assert step_ran(doit_ok(root, "step", "lr=0.2"), "step")
    assert run_count(root) == 3
    info = doit(root, "info", "step", "lr=0.2")
    assert "flag_is" in info.stdout, show(info)  # doit names the user's item that is false


def test_bad_uptodate_item_is_refused(tmp_path: Path) -> None:
    body = """
def task_step():
    yield from remote_step("step", shell="true", outputs=["o"], uptodate=[42])
"""
    root = make_project(tmp_path, body, ["step"])
    done = doit(root)
    assert done.returncode == 3, show(done)  # doit's own refusal of a bad task, at load
    assert "invalid 'uptodate' item '42'" in done.stderr
    assert run_count(root) == 0


def test_always_execute_runs_the_step_again(tmp_path: Path) -> None:
    root = basic(tmp_path)
    doit_ok(root)
    assert step_skipped(doit_ok(root), "step")
    forced = doit_ok(root, "-a", "step")
    assert step_ran(forced, "step"), show(forced)
    assert run_count(root) == 2  # `doit -a` means: run it again
    assert step_skipped(doit_ok(root), "step")


def test_plain_doit_without_default_tasks_skips_an_up_to_date_step(tmp_path: Path) -> None:
    """Without default_tasks doit selects every task, the hidden task of the
    phases too: it carries the step's check, so an up-to-date step runs
    nothing; `doit -a` runs the step once."""
    body = f"COMMAND = {COMMAND!r}\nENV = {{}}\nTIMEOUT = None\n" + BASIC
    root = make_project(tmp_path, body, (), files={"data/in.txt": "hello\n"})
    dodo = root / "dodo.py"
    dodo.write_text(dodo.read_text().replace("doit_config(default_tasks=[])", "doit_config()"))
    assert step_ran(doit_ok(root), "step")

    def results(*args: str) -> dict[str, str]:
        done = json.loads(doit_ok(root, "--reporter", "json", *args).stdout)
        return {t["name"]: t["result"] for t in done["tasks"]}

    assert results() == {"_step": "up-to-date", "step": "up-to-date"}
    assert run_count(root) == 1
    assert results("-a") == {"_step": "success", "step": "success"}
    assert run_count(root) == 2
    assert outputs_of(root) == expected_outputs()
    assert step_skipped(doit_ok(root), "step")


def test_passthrough_keys_and_task_dep(tmp_path: Path) -> None:
    body = """
def task_first():
    return {"actions": ["echo first > first.txt"], "targets": ["first.txt"]}

def task_step():
    yield from remote_step(
        "step", command=["/bin/sh", "-c", "cat first.txt > out.txt"], inputs=["first.txt"],
        outputs=["out.txt"], task_dep=["first"], doc="my own doc",
        title=lambda task: "custom title " + task.name,
    )
"""
    root = make_project(tmp_path, body, ["step"])
    done = doit_ok(root)
    assert "custom title step" in done.stdout, show(done)
    assert (root / "out.txt").read_text() == "first\n"
    assert "my own doc" in doit_ok(root, "list").stdout


def test_unknown_keyword_is_refused(tmp_path: Path) -> None:
    body = """
def task_step():
    yield from remote_step("step", command=["true"], outputs=["x"], targets=["y"])
"""
    root = make_project(tmp_path, body, ["step"])
    done = doit(root)
    assert done.returncode == 1, show(done)
    assert "unknown argument(s) targets" in done.stderr


def test_many_steps_in_one_generator_beside_plain_tasks(tmp_path: Path) -> None:
    body = """
def task_sweep():
    for lr in (1, 2, 3):
        yield from remote_step(
            f"sweep:lr{lr}", command=["/bin/sh", "-c", f"echo {lr} > res/lr{lr}.txt"],
            outputs=[f"res/lr{lr}.txt"],
        )
    yield {"basename": "summary", "actions": ["cat res/lr1.txt res/lr2.txt res/lr3.txt > sum.txt"],
           "file_dep": ["res/lr1.txt", "res/lr2.txt", "res/lr3.txt"], "targets": ["sum.txt"]}
"""
    root = make_project(tmp_path, body, ["summary"])
    done = doit_ok(root)
    assert (root / "sum.txt").read_text() == "1\n2\n3\n", show(done)
    assert run_count(root) == 3
    again = doit_ok(root)
    assert step_skipped(again, "summary")
    assert run_count(root) == 3


def test_get_var_in_argv_is_part_of_the_digest(tmp_path: Path) -> None:
    body = """
X = get_var("x", "0")

def task_step():
    yield from remote_step(
        "step", command=["/bin/sh", "-c", 'echo "$0" > out.txt', X], outputs=["out.txt"],
    )
"""
    root = make_project(tmp_path, body, ["step"])
    doit_ok(root, "step", "x=1")
    assert (root / "out.txt").read_text() == "1\n"
    assert step_skipped(doit_ok(root, "step", "x=1"), "step")
    again = doit_ok(root, "step", "x=2")
    assert step_ran(again, "step"), show(again)
    assert (root / "out.txt").read_text() == "2\n"
    assert run_count(root) == 2
    assert step_ran(doit_ok(root, "step", "x=1"), "step")
    assert run_count(root) == 3


def test_secret_reaches_the_command_but_is_never_stored(tmp_path: Path) -> None:
    value = "s3cr3t-VALUE-4f1c9a"
    body = """
def task_step():
    yield from remote_step(
        "step",
        shell='echo "set=${API_TOKEN:+yes} len=${#API_TOKEN}" > seen.txt; echo "a log line"',
        outputs=["seen.txt"],
        secrets=["API_TOKEN"],
    )
"""
    root = make_project(tmp_path, body, ["step"])
    env = {"API_TOKEN": value}
    done = doit_ok(root, env=env)
    assert (root / "seen.txt").read_text() == f"set=yes len={len(value)}\n", show(done)
    assert value not in done.stdout + done.stderr
    # Never in the store (handles, job file, log, records, caches) nor doit's DB.
    stored = [p for p in (root / ".substrax").rglob("*") if p.is_file()]
    stored += [p for p in root.iterdir() if p.name.startswith(".doit.db")]
    assert any(p.name == "run.log" for p in stored)
    for path in stored:
        assert value.encode() not in path.read_bytes(), path
    # A new value is not a new step: the digest holds the name only.
    assert step_skipped(doit_ok(root, env={"API_TOKEN": "other"}), "step")
    (run,) = handles(root)
    assert run["spec"]["forward_env"] == ["API_TOKEN"]


def test_secret_that_is_not_set_is_an_error(tmp_path: Path) -> None:
    body = """
def task_step():
    yield from remote_step("step", shell="echo x > o.txt", outputs=["o.txt"], secrets=["NOT_SET_HERE"])
"""
    root = make_project(tmp_path, body, ["step"])
    done = doit(root)
    assert done.returncode != 0, show(done)
    assert "NOT_SET_HERE" in done.stdout + done.stderr
    assert "not set" in done.stdout + done.stderr
    assert not (root / "o.txt").exists()
    assert run_count(root) == 0


def test_resources_are_pinned_and_part_of_the_digest(tmp_path: Path) -> None:
    body = """
CPUS = int(get_var("cpus", "1"))

def task_step():
    yield from remote_step("step", shell="echo x > o.txt", outputs=["o.txt"], resources={"cpus": CPUS})
"""
    root = make_project(tmp_path, body, ["step"])
    doit_ok(root)
    (run,) = handles(root)
    assert run["spec"]["resources"] == {"cpus": 1}
    assert step_skipped(doit_ok(root), "step")
    assert step_ran(doit_ok(root, "step", "cpus=2"), "step")
    assert runs_of(root, "step")[-1]["spec"]["resources"] == {"cpus": 2}


def test_dependent_plain_task_uses_file_dep_on_outputs(tmp_path: Path) -> None:
    body = """
def task_step():
    yield from remote_step("step", shell="cp data/in.txt model.txt", inputs=["data/in.txt"],
                           outputs=["model.txt"])

def task_report():
    return {"actions": ["cat model.txt model.txt > report.txt"], "file_dep": ["model.txt"],
            "targets": ["report.txt"]}
"""
    root = make_project(tmp_path, body, ["report"], files={"data/in.txt": "m\n"})
    doit_ok(root)
    assert (root / "report.txt").read_text() == "m\nm\n"
    again = doit_ok(root)
    assert step_skipped(again, "step") and step_skipped(again, "report"), show(again)
    (root / "data" / "in.txt").write_text("n\n")
    third = doit_ok(root)
    assert step_ran(third, "step") and step_ran(third, "report"), show(third)
    assert (root / "report.txt").read_text() == "n\nn\n"


def test_step_consuming_another_steps_output_runs_after_it(tmp_path: Path) -> None:
    body = """
def task_pipeline():
    yield from remote_step("second", shell="cat mid/a.txt mid/a.txt > final.txt",
                           inputs=["mid/a.txt"], outputs=["final.txt"])
    yield from remote_step("first", shell="echo a > mid/a.txt", outputs=["mid/a.txt"])
"""
    root = make_project(tmp_path, body, ["second"])
    done = doit_ok(root)
    assert (root / "final.txt").read_text() == "a\na\n", show(done)
    assert run_count(root) == 2


def test_equal_sign_in_a_step_name_is_refused_by_doit(tmp_path: Path) -> None:
    body = """
def task_step():
    yield from remote_step("fit:lr=0.1", shell="echo x > o.txt", outputs=["o.txt"])
"""
    root = make_project(tmp_path, body, ["fit:lr=0.1"])
    done = doit(root)
    assert done.returncode != 0, show(done)
    assert "equal sign" in done.stderr
    assert run_count(root) == 0


def test_no_sandbox_run_that_skips_an_output_is_not_fed_the_old_one(tmp_path: Path) -> None:
    body = """
COMMAND = get_var("c", "echo x > res.txt")

def task_step():
    yield from remote_step("step", shell=COMMAND, outputs=["res.txt"])
"""
    root = make_project(tmp_path, body, ["step"], sandbox="none")
    doit_ok(root)
    done = doit(root, "step", "c=true")  # succeeds without writing res.txt
    assert done.returncode != 0, show(done)
    assert "res.txt" in done.stdout + done.stderr


@pytest.mark.parametrize("sandbox", ["none", "bwrap"])
def test_no_process_the_command_can_read_holds_an_undeclared_variable(tmp_path: Path, sandbox: str) -> None:
    """Without a sandbox the command can read the environ of its worker (its
    parent, the same user): the worker was forked by a spawner started with
    the filtered environment, and its secrets reach it in memory, so neither
    is there; the command itself has its declared secret."""
    if sandbox == "bwrap" and shutil.which("bwrap") is None:
        pytest.skip("BUBBLEWRAP NOT INSTALLED: the sandboxed half of this test did not run")
    body = """
def task_step():
    yield from remote_step(
        "step",
        shell=(
            'e=$(tr "\\\\0" "\\\\n" < /proc/$PPID/environ); echo "$e" | grep -c UNDECLARED_VALUE > seen.txt; '
            'echo "$e" | grep -c DECLARED_VALUE_9 >> seen.txt; '
            'echo "$API_TOKEN" | grep -c DECLARED_VALUE_9 >> seen.txt; true'
        ),
        outputs=["seen.txt"],
        secrets=["API_TOKEN"],
    )
"""
    root = make_project(tmp_path, body, ["step"], sandbox=sandbox)
    done = doit_ok(root, env={"API_TOKEN": "DECLARED_VALUE_9", "AWS_SECRET_ACCESS_KEY": "UNDECLARED_VALUE"})
    # Under bubblewrap the parent is bubblewrap's, started by the worker with
    # the task's environment: the declared secret is there, the other not.
    in_parent = "1" if sandbox == "bwrap" else "0"
    assert (root / "seen.txt").read_text() == f"0\n{in_parent}\n1\n", show(done)
