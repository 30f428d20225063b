"""Bad declarations and failed runs: a clear error, exit 1, nothing launched
or promoted; a failed promotion is retried without running the command again;
retries cover the machinery, never a failed command."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from dodo_helpers import (
    BWRAP,
    SANDBOXES,
    compute,
    compute_status,
    doit,
    doit_ok,
    handles,
    make_project,
    needs_bwrap,
    popen_doit,
    popen_output,
    run_count,
    run_dirs,
    show,
    step_ran,
    step_skipped,
    stop,
    tree_files,
    wait_for,
    write_dodo,
)
from progress import wait_exit


def one_step(**kwargs: object) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    return f"""
def task_step():
    yield from remote_step("step", {args})
"""


def assert_refused(root: Path, *needles: str) -> None:
    """doit stops with exit 1 and a message holding every needle, before
    any run is created."""
    done = doit(root)
    assert done.returncode == 1, show(done)
    text = done.stdout + done.stderr
    for needle in needles:
        assert needle in text, show(done)
    assert "Traceback" not in text, show(done)
    assert run_count(root) == 0


# ---------------------------------------------------- declarations refused


@pytest.mark.parametrize(
    ("output", "needle"),
    [
        ("/etc/substrax-test-out.txt", "lies outside the project"),
        ("../elsewhere.txt", "contains '..'"),
        ("out/../../x.txt", "contains '..'"),
        (".", "is the project itself"),
        ("", "is empty"),
    ],
)
def test_bad_output_path_is_refused_before_launch(tmp_path: Path, output: str, needle: str) -> None:
    root = make_project(tmp_path, one_step(shell="true", outputs=[output]), ["step"])
    assert_refused(root, needle, "step 'step'")
    assert not (tmp_path / "elsewhere.txt").exists()


def test_absolute_output_inside_the_project_is_made_relative(tmp_path: Path) -> None:
    root = tmp_path / "proj"
    target = root / "res.txt"
    make_project(tmp_path, one_step(shell="echo r > res.txt", outputs=[str(target)]), ["step"])
    doit_ok(root)
    (run,) = handles(root)
    assert run["spec"]["outputs"] == ["res.txt"]
    assert target.read_text() == "r\n"


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_output_through_a_symlink_leading_outside_is_refused(tmp_path: Path, sandbox: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root = make_project(
        tmp_path, one_step(shell="echo r > link/res.txt", outputs=["link/res.txt"]), ["step"], sandbox
    )
    (root / "link").symlink_to(outside)
    assert_refused(root, "link/res.txt", "a symlink")
    assert list(outside.iterdir()) == [], "a file was written outside the project"


def test_output_that_is_a_symlink_leading_outside_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("keep\n")
    root = make_project(tmp_path, one_step(shell="echo r > res.txt", outputs=["res.txt"]), ["step"], "none")
    (root / "res.txt").symlink_to(outside)
    assert_refused(root, "res.txt", "outside the project")
    assert outside.read_text() == "keep\n"


def test_input_that_does_not_exist_is_refused_at_launch(tmp_path: Path) -> None:
    root = make_project(
        tmp_path, one_step(shell="cat data/nope.txt > o.txt", inputs=["data/nope.txt"], outputs=["o.txt"]),
        ["step"],
    )
    assert_refused(root, "data/nope.txt", "does not exist")
    # Once it exists, the step runs.
    (root / "data").mkdir()
    (root / "data" / "nope.txt").write_text("here\n")
    doit_ok(root)
    assert (root / "o.txt").read_text() == "here\n"


def test_two_steps_with_overlapping_outputs_are_refused(tmp_path: Path) -> None:
    body = """
def task_a():
    yield from remote_step("a", shell="true", outputs=["models/"])

def task_b():
    yield from remote_step("b", shell="true", outputs=["models/b.pt"])
"""
    root = make_project(tmp_path, body, ["a"])
    assert_refused(root, "'a'", "'b'", "models")
    listed = doit(root, "list")
    assert listed.returncode == 1, show(listed)


def test_overlapping_outputs_of_one_step_are_refused(tmp_path: Path) -> None:
    root = make_project(tmp_path, one_step(shell="true", outputs=["m/", "m/x.txt"]), ["step"])
    assert_refused(root, "overlap")


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"command": "python3 train.py", "outputs": ["o"]}, "non-empty list"),
        ({"command": ["true", 1.5], "outputs": ["o"]}, "float"),
        ({"command": ["true"], "outputs": ["o"], "timeout": 0}, "timeout"),
        ({"command": ["true"], "outputs": ["o"], "env": {"A": 1}}, "env"),
        ({"command": ["true"], "outputs": ["o"], "retries": -1}, "retries"),
        ({"command": ["true"], "outputs": ["o"], "resources": {"gpus": 1}}, "unknown resources"),
        ({"command": ["true"], "outputs": ["o"], "backend": "nope"}, "nope"),
    ],
)
def test_bad_declaration_is_refused(tmp_path: Path, kwargs: dict[str, object], needle: str) -> None:
    root = make_project(tmp_path, one_step(**kwargs), ["step"])
    assert_refused(root, needle)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"command": ["true"], "outputs": "out/result.txt"},
         "outputs must be a list of paths, got the string 'out/result.txt': "
         'write outputs=["out/result.txt"]'),
        ({"command": ["true"], "inputs": "work.py", "outputs": ["o"]},
         '''inputs must be a list of paths, got the string 'work.py': write inputs=["work.py"]'''),
        ({"command": ["true"], "outputs": ["o"], "timeout": "60"},
         "timeout must be a number of seconds, got the string '60': write timeout=60"),
        ({"command": "python3 train.py", "outputs": ["o"]}, 'write command=["python3", "train.py"]'),
        ({"command": ["true"], "outputs": ["o"], "env": ["A=1"]}, 'write env={"A": "1"}'),
        ({"command": ["true"], "outputs": ["o"], "secrets": "TOKEN"}, 'write secrets=["TOKEN"]'),
        ({"command": ["true"], "outputs": ["o"], "retries": "2"}, "retries must be a whole number, got the "
                                                                  "string '2': write retries=2"),
        ({"command": ["true"], "outputs": ["o"], "preemptions": "1"},
         "preemptions must be a whole number, got the string '1': write preemptions=1"),
        ({"command": ["true"], "outputs": ["o"], "preemptions": -1}, "preemptions must be 0 or more, got -1"),
        ({"command": ["true"], "outputs": ["o"], "task_dep": "prep"}, 'write task_dep=["prep"]'),
        ({"command": ["true"], "outputs": ["o"], "file_dep": "cfg.yaml"}, 'write file_dep=["cfg.yaml"]'),
        ({"command": ["true"], "outputs": ["o"], "uptodate": True}, "write uptodate=[True]"),
        ({"command": ["true"], "outputs": ["o"], "backend": 1}, 'got the int 1: write backend="local"'),
        ({"shell": ["echo", "x"], "outputs": ["o"]}, "shell must be one command line (a string), got a list"),
    ],
    ids=["outputs", "inputs", "timeout", "command", "env", "secrets", "retries", "preemptions-str",
         "preemptions-negative", "task_dep", "file_dep",
         "uptodate", "backend", "shell"],
)
def test_argument_of_the_wrong_type_is_refused_with_the_fix(
    tmp_path: Path, kwargs: dict[str, object], message: str
) -> None:
    """Through the real doit: exit 1, one line naming the step, the type
    expected and what to write; no traceback, nothing launched."""
    root = make_project(tmp_path, one_step(**kwargs), ["step"])
    assert_refused(root, "substrax: error: step 'step': ", message)


def test_a_path_naming_a_folder_output_is_refused_before_the_command_runs(tmp_path: Path) -> None:
    """A pathlib.Path drops the trailing "/": before, the command ran and
    only its manifest refused the folder as a file."""
    body = """
def task_step():
    yield from remote_step("step", shell="touch ran.txt; mkdir -p out && echo 1 > out/a.txt",
                           outputs=[Path("out"), Path("ran.txt")])
"""
    root = make_project(tmp_path, body, ["step"], files={"out/old.txt": "old\n"})
    assert_refused(root, "output out is a folder, but it is given as a pathlib.Path", 'write "out/"')
    assert not (root / "ran.txt").exists()


def test_a_path_output_naming_nothing_yet_without_a_suffix_is_refused_before_the_command_runs(
    tmp_path: Path,
) -> None:
    """Issue 39, item 6: the folder the command is to make is not there yet,
    so only its manifest refused it as a file, after the whole run. A Path
    cannot say "folder", and nothing there says which: refused at load."""
    body = """
def task_step():
    yield from remote_step("step", shell="touch ran.txt; mkdir -p out && echo 1 > out/a.txt",
                           outputs=[Path("out"), Path("ran.txt")])
"""
    root = make_project(tmp_path, body, ["step"])
    assert_refused(
        root, "substrax: error: step 'step': output out is given as a pathlib.Path, which drops the trailing",
        'nothing is there yet to tell a folder from a file: write "out/" for a folder (or str(path) + "/"), '
        '"out" for a file',
    )  # fmt: skip
    assert not (root / "ran.txt").exists() and not (root / "out").exists()
    write_dodo(root, body.replace('Path("out")', '"out/"'), ["step"])  # the fix it names
    doit_ok(root)
    assert (root / "out" / "a.txt").read_text() == "1\n" and (root / "ran.txt").is_file()


# --------------------------------------------------------- failed runs


def test_missing_declared_output_fails_the_run_and_promotes_nothing(tmp_path: Path) -> None:
    body = """
C = get_var("c", "mkdir -p out && echo 1 > out/a.txt && echo 1 > res.txt")

def task_step():
    yield from remote_step("step", shell=C, outputs=["out/", "res.txt"])
"""
    root = make_project(tmp_path, body, ["step"])
    doit_ok(root)
    done = doit(root, "step", "c=mkdir -p out && echo 2 > out/a.txt")  # no res.txt
    assert done.returncode == 1, show(done)
    assert "res.txt" in done.stdout + done.stderr
    assert "nothing was promoted" in done.stdout + done.stderr
    states = [r["state"] for r in compute_status(root)]
    assert states == ["succeeded", "failed"], states
    if BWRAP:
        # The outputs it did make are not promoted: the old ones stand.
        assert (root / "out" / "a.txt").read_text() == "1\n"
        assert (root / "res.txt").read_text() == "1\n"
    # Not reused: the next try runs the command again.
    again = doit(root, "step", "c=mkdir -p out && echo 2 > out/a.txt")
    assert again.returncode == 1
    assert run_count(root) == 3


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_a_missing_output_names_what_the_run_wrote_instead(tmp_path: Path, sandbox: str) -> None:
    """A typo in the command (reslt for result): the failure names the file
    written under a near name, so the user sees the typo, not only the
    absence. A name far from it is not offered."""
    shell = "mkdir -p out && echo 1 > out/reslt.txt && echo 1 > out/other.log"
    body = one_step(shell=shell, outputs=["out/result.txt"])
    root = make_project(tmp_path, body, ["step"], sandbox=sandbox)
    done = doit(root)
    said = done.stdout + done.stderr
    assert done.returncode == 1, show(done)
    assert "did not produce declared output(s) out/result.txt (it wrote out/reslt.txt instead of " \
        "out/result.txt" in said, show(done)
    assert "other.log" not in said, show(done)
    assert "Traceback" not in said, show(done)


def test_failed_command_fails_the_step_with_its_log(tmp_path: Path) -> None:
    root = make_project(
        tmp_path, one_step(shell="echo boom-on-stderr >&2; exit 3", outputs=["o.txt"], retries=2), ["step"]
    )
    done = doit(root)
    assert done.returncode == 1, show(done)
    assert "failed (exit code 3)" in done.stdout + done.stderr
    assert "boom-on-stderr" in done.stdout + done.stderr
    assert "retry" not in done.stdout + done.stderr  # a failed command is not retried
    assert run_count(root) == 1
    assert [r["state"] for r in compute_status(root)] == ["failed"]
    assert not (root / "o.txt").exists()
    doit(root)
    assert run_count(root) == 2  # a failed run is never taken as done


def test_timeout_stops_the_run(tmp_path: Path) -> None:
    root = make_project(
        tmp_path, one_step(shell="echo partial > o.txt; sleep 30", outputs=["o.txt"], timeout=0.5), ["step"]
    )
    done = doit(root)
    assert done.returncode == 1, show(done)
    assert "timed_out" in done.stdout + done.stderr
    assert [r["state"] for r in compute_status(root)] == ["timed_out"]
    if BWRAP:
        assert not (root / "o.txt").exists()  # partial output not promoted


@pytest.mark.parametrize(
    "link",
    ["/etc/passwd", "../../secret.txt", "../secret.txt"],
    ids=["absolute", "up-out-of-project", "up-out-of-output"],
)
def test_symlink_escaping_an_output_is_refused_never_followed(tmp_path: Path, link: str) -> None:
    shell = f"mkdir -p out/d && echo fine > out/d/ok.txt && ln -s {link} out/d/evil"
    root = make_project(tmp_path, one_step(shell=shell, outputs=["out/d/"]), ["step"])
    (root / "secret.txt").write_text("top secret\n")
    (root / "out").mkdir()
    (root / "out" / "secret.txt").write_text("top secret\n")
    done = doit(root)
    assert done.returncode == 1, show(done)
    text = done.stdout + done.stderr
    assert "evil" in text, show(done)
    assert "nothing was promoted" in text, show(done)
    assert not (root / "out" / "d" / "evil").is_symlink()
    states = [r["state"] for r in compute_status(root)]
    assert states == ["failed"], states
    # The record of the run says why.
    status = compute(root, "status", "--json")
    assert "evil" in status.stdout


def test_file_output_that_is_a_symlink_out_of_the_project_is_refused(tmp_path: Path) -> None:
    body = one_step(shell="ln -s /etc/hostname res.txt", outputs=["res.txt"])
    root = make_project(tmp_path, body, ["step"])
    done = doit(root)
    assert done.returncode == 1, show(done)
    assert "res.txt" in done.stdout + done.stderr
    assert not (root / "res.txt").is_symlink()


# ------------------------------------------- promotion failure, then retried


GATED = """
def task_step():
    yield from remote_step(
        "step",
        shell="mkdir -p out && echo result > out/res.txt && while [ ! -e gate/go ]; do sleep 0.05; done",
        inputs=["gate/"],
        outputs=["out/"],
    )
"""


@needs_bwrap
def test_failed_promotion_is_retried_without_running_again(tmp_path: Path) -> None:
    root = make_project(tmp_path, GATED, ["step"], sandbox="bwrap")
    (root / "gate").mkdir()
    proc = popen_doit(root)
    try:
        # Wait until the command has written its output (in the run's staging).
        wait_for(lambda: any(run_dirs(root)) and any((run_dirs(root)[0] / "work").rglob("res.txt")),
                 "the output in staging")
        shutil.rmtree(root / "out")
        (root / "out").write_text("a plain file where the output folder goes\n")
        (root / "gate" / "go").write_text("")
        code = wait_exit(proc, "the doit to end", 60)
    finally:
        stop(proc)
    text = popen_output(root)
    assert code == 1, text
    assert "could not move the outputs" in text
    assert "without running the command again" in text
    assert (root / "out").is_file()
    assert run_count(root) == 1
    (root / "out").unlink()
    (root / "gate" / "go").unlink()  # the gate, an input, as at launch: the run's key holds
    again = doit_ok(root)
    assert step_ran(again, "step"), show(again)
    assert run_count(root) == 1  # promoted from the same run
    assert (root / "out" / "res.txt").read_text() == "result\n"
    assert step_skipped(doit_ok(root), "step")
    (run,) = handles(root)
    assert run["state"]["phase"] == "promoted"
    # Torn down once its outputs were home.
    assert not (run_dirs(root)[0] / "work").exists()


# ----------------------------------------------------------------- retries


def path_without_bwrap(tmp_path: Path) -> Path:
    """A PATH folder with what the worker needs, but no bubblewrap."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("true", "sh"):
        found = shutil.which(tool)
        assert found is not None
        (bin_dir / tool).symlink_to(found)
    return bin_dir


@needs_bwrap
def test_retries_cover_a_failure_of_the_machinery(tmp_path: Path) -> None:
    """A real machinery failure: bubblewrap is not on PATH when the run is
    launched (sandbox = "bwrap" refuses to run without it). It appears after
    the first failure; the retry then succeeds."""
    bwrap = shutil.which("bwrap")
    assert bwrap is not None
    bin_dir = path_without_bwrap(tmp_path)
    root = make_project(
        tmp_path, one_step(command=["/bin/sh", "-c", "echo ok > o.txt"], outputs=["o.txt"], retries=1),
        ["step"], sandbox="bwrap",
    )
    proc = popen_doit(root, env={"PATH": str(bin_dir)})
    try:
        wait_for(lambda: "retry 1 of 1" in popen_output(root), "the first launch to fail")
        (bin_dir / "bwrap").symlink_to(bwrap)
        code = wait_exit(proc, "the doit to end", 60)
    finally:
        stop(proc)
    text = popen_output(root)
    assert code == 0, text
    assert "launch failed" in text and "bubblewrap is not installed" in text
    assert (root / "o.txt").read_text() == "ok\n"
    assert run_count(root) == 1


@needs_bwrap
def test_machinery_failure_without_retries_fails_clearly(tmp_path: Path) -> None:
    bin_dir = path_without_bwrap(tmp_path)
    root = make_project(
        tmp_path, one_step(command=["/bin/sh", "-c", "echo ok > o.txt"], outputs=["o.txt"]),
        ["step"], sandbox="bwrap",
    )
    done = doit(root, env={"PATH": str(bin_dir)})
    assert done.returncode != 0, show(done)
    assert "bubblewrap is not installed" in done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert not (root / "o.txt").exists()
    # The next try with bubblewrap back reuses the run that never started.
    doit_ok(root)
    assert (root / "o.txt").read_text() == "ok\n"
    assert run_count(root) == 1


def test_steps_of_another_project_folder_do_not_clash(tmp_path: Path) -> None:
    """Two projects declaring the same step name and outputs are separate."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = make_project(tmp_path / "a", one_step(shell="echo a > o.txt", outputs=["o.txt"]), ["step"])
    second = make_project(tmp_path / "b", one_step(shell="echo b > o.txt", outputs=["o.txt"]), ["step"])
    doit_ok(first)
    doit_ok(second)
    assert (first / "o.txt").read_text() == "a\n"
    assert (second / "o.txt").read_text() == "b\n"


def test_redeclared_dodo_keeps_working_after_a_step_is_renamed(tmp_path: Path) -> None:
    root = make_project(tmp_path, one_step(shell="echo a > o.txt", outputs=["o.txt"]), ["step"])
    doit_ok(root)
    write_dodo(root, """
def task_step():
    yield from remote_step("renamed", shell="echo a > o.txt", outputs=["o.txt"])
""", ["renamed"])
    done = doit_ok(root)
    assert step_ran(done, "renamed")
    assert run_count(root) == 2
    assert os.path.exists(root / "o.txt")


# ------------------------------------- the state folder and .git: never a step's

GOOD_STEP = """
def task_good():
    yield from remote_step("good", command=["sh", "-c", "echo ok > good.txt"], outputs=["good.txt"])
"""
HOSTILE_STEP = """
def task_bad():
    yield from remote_step("bad", command=["sh", "-c", "echo 0 > out.txt"], {paths})
"""
STATE_MOVED = '[tool.substrax.compute]\nstate_dir = "var/state"\n'


@pytest.mark.parametrize(
    ("moved_by", "paths", "said"),
    [
        pytest.param(None, 'outputs=["out.txt"], checkpoints=".substrax/"',
                     "checkpoints folder .substrax/ is the state folder .substrax/", id="checkpoints-is-it"),
        pytest.param(None, 'outputs=["out.txt"], checkpoints=".substrax/runs"',
                     "checkpoints folder .substrax/runs/ lies in the state folder .substrax/", id="ckpt-in"),
        pytest.param(None, 'outputs=["out.txt", ".substrax/client-id"]',
                     "output .substrax/client-id lies in the state folder .substrax/", id="output-in"),
        pytest.param(None, 'inputs=[".substrax/"], outputs=["out.txt"]',
                     "input .substrax/ is the state folder .substrax/", id="input-is-it"),
        pytest.param("pyproject", 'outputs=["out.txt", "var/"]',
                     "output var/ holds the state folder var/state/", id="output-holds-moved"),
        pytest.param("env", 'outputs=["out.txt"], checkpoints="var/state/"',
                     "checkpoints folder var/state/ is the state folder var/state/", id="moved-by-overlay"),
        pytest.param(None, 'outputs=["out.txt", ".git/hooks/"]',
                     "output .git/hooks/ lies in .git, git's own folder", id="git-hooks"),
        pytest.param(None, 'outputs=["out.txt"], checkpoints=".git"',
                     "checkpoints folder .git/ lies in .git, git's own folder", id="git-checkpoints"),
    ],
)  # fmt: skip
def test_a_step_path_on_the_state_folder_or_in_git_is_refused_at_load(
    tmp_path: Path, moved_by: str | None, paths: str, said: str
) -> None:
    """Issue 39, item 4: with `sandbox = "none"` a checkpoints folder put in
    place over the state folder wiped the store, outputs under it were
    promoted into it (the client id overwritten), and `.git/hooks/` was an
    output. Each is refused as the dodo loads, wherever the state folder is
    (state_dir in pyproject.toml or the SUBSTRAX_CONFIG overlay): nothing
    runs, the store, .git and the other step's output stay as they were."""
    root = make_project(tmp_path, GOOD_STEP, sandbox="none", files={".git/hooks/pre-commit": "#!/bin/sh\n"})
    env: dict[str, str] = {}
    if moved_by == "pyproject":
        (root / "pyproject.toml").write_text(STATE_MOVED + (root / "pyproject.toml").read_text())
    elif moved_by == "env":
        (tmp_path / "overlay.toml").write_text(STATE_MOVED)
        env["SUBSTRAX_CONFIG"] = str(tmp_path / "overlay.toml")
    store = root / ("var/state" if moved_by else ".substrax")
    doit_ok(root, "good", env=env)
    assert len(list((store / "runs").iterdir())) == 1 and (root / "good.txt").read_text() == "ok\n"
    before = {base: tree_files(root / base) for base in (store.relative_to(root).as_posix(), ".git")}

    write_dodo(root, GOOD_STEP + HOSTILE_STEP.format(paths=paths))
    refused = doit(root, env=env)
    assert refused.returncode == 1, show(refused)
    text = refused.stdout + refused.stderr
    assert said in text and "Traceback" not in text, show(refused)
    assert {base: tree_files(root / base) for base in before} == before  # nothing ran, nothing was moved
    assert not (root / "out.txt").exists() and (root / "good.txt").read_text() == "ok\n"


def test_an_input_in_git_is_read_as_any_input(tmp_path: Path) -> None:
    """Reading .git is harmless (`.git/HEAD` to stamp a version): only
    writing there is refused."""
    step = one_step(command=["cp", ".git/HEAD", "out.txt"], inputs=[".git/HEAD"], outputs=["out.txt"])
    root = make_project(tmp_path, step, default_tasks=["step"], files={".git/HEAD": "ref: refs/heads/main\n"})
    doit_ok(root)
    assert (root / "out.txt").read_text() == "ref: refs/heads/main\n"
