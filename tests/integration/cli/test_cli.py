"""`substrax-compute`, run as its own process: exit codes, help, commands."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest
from dodo_helpers import BWRAP
from local_runs import (
    WAIT,
    cli,
    cli_argv,
    describe,
    marked_pids,
    outputs_root,
    run_dir,
    submit,
    wait_final,
    wait_for,
)

from substrax_tasks import __version__
from substrax_tasks.store.project import Project

SUBCOMMANDS = ("status", "logs", "cancel", "fetch", "teardown")


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["bogus"],
        ["logs"],
        ["cancel"],
        ["teardown"],
        ["fetch"],
        ["status", "--bogus"],
        ["status", "a", "b"],
        ["status", "--step"],
        ["status", "a", "--step", "b"],
    ],
    ids=lambda args: " ".join(args) or "no-command",
)
def test_usage_errors_exit_2(project_dir: Path, args: list[str]) -> None:
    done = cli(project_dir, *args)
    assert done.returncode == 2
    assert "usage:" in done.stderr


def test_help_documents_every_subcommand() -> None:
    done = cli(None, "--help")
    assert done.returncode == 0
    for name in SUBCOMMANDS:
        assert name in done.stdout
    assert "--project" in done.stdout
    assert "Exit codes: 0 ok, 1 failure, 2 usage error." in done.stdout
    for name in SUBCOMMANDS:
        sub = cli(None, name, "--help")
        assert sub.returncode == 0
        assert f"usage: substrax-compute {name}" in sub.stdout
    status_help = cli(None, "status", "--help").stdout
    for option in ("--json", "--all", "--step"):
        assert option in status_help
    assert "first match wins" in status_help  # what RUN may be, and in which order
    assert "--follow" in cli(None, "logs", "--help").stdout


def test_version() -> None:
    done = cli(None, "--version")
    assert done.returncode == 0
    assert __version__ in done.stdout


def test_project_defaults_to_the_current_folder(project: Project) -> None:
    handle = submit(project, ["true"])
    wait_final(project, handle)
    done = subprocess.run(
        [*cli_argv(), "status"], cwd=project.root, capture_output=True, text=True, timeout=WAIT, check=False
    )
    assert done.returncode == 0, done.stderr
    assert handle.run_id in done.stdout


def test_status_of_one_run_and_of_an_unknown_run(project: Project) -> None:
    first = submit(project, ["true"], step="first")
    second = submit(project, ["sh", "-c", "exit 4"], step="second")
    assert wait_final(project, first) == "succeeded"
    assert wait_final(project, second) == "failed"
    done = cli(project.root, "status", second.run_id[: len("second-") + 3], "--json")
    assert done.returncode == 0, done.stderr
    runs = json.loads(done.stdout)["runs"]
    assert [(r["run_id"], r["state"], r["exit_code"]) for r in runs] == [(second.run_id, "failed", 4)]
    table = cli(project.root, "status")
    assert table.returncode == 0
    for column in ("run", "step", "backend", "state", "started", "duration"):
        assert column in table.stdout
    assert first.run_id in table.stdout and second.run_id in table.stdout
    unknown = cli(project.root, "status", "no-such-run")
    assert unknown.returncode == 1
    assert "no run, step or group named 'no-such-run'" in unknown.stderr
    assert "steps with runs: first, second" in unknown.stderr  # what there is to name
    assert "Traceback" not in unknown.stderr


def test_status_with_no_runs(project_dir: Path) -> None:
    done = cli(project_dir, "status", "--json")
    assert done.returncode == 0
    assert json.loads(done.stdout) == {"runs": [], "groups": [], "unreadable": [], "leaked": None}
    looked = cli(project_dir, "status", "--machines", "--json")  # the local backend leaves nothing behind
    assert looked.returncode == 0 and json.loads(looked.stdout)["leaked"] == [], looked.stderr


def test_status_asks_hosts_for_leaks_only_with_machines(project_dir: Path) -> None:
    # An ssh host no one answers at: a loopback port just freed.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    (project_dir / "pyproject.toml").write_text(
        f'[tool.substrax.compute.backends.ssh]\nhost = "127.0.0.1"\nport = {port}\n'
    )
    plain = cli(project_dir, "status")
    assert plain.returncode == 0 and "leaks" not in plain.stderr, plain.stderr
    looked = cli(project_dir, "status", "--machines")
    assert looked.returncode == 0, looked.stderr
    assert "could not look for leaks: ssh: " in looked.stderr, looked.stderr


def test_cancel_of_a_finished_run_says_so(project: Project) -> None:
    handle = submit(project, ["sh", "-c", "echo done"])
    assert wait_final(project, handle) == "succeeded"
    done = cli(project.root, "cancel", handle.run_id)
    assert done.returncode == 0
    assert "already finished (succeeded); nothing to cancel" in done.stdout
    assert project.backend_for(handle).poll(handle).state == "succeeded"


def test_logs_prints_the_log(project: Project) -> None:
    handle = submit(project, ["sh", "-c", "echo first line; echo second line >&2"])
    assert wait_final(project, handle) == "succeeded"
    done = cli(project.root, "logs", handle.run_id)
    assert done.returncode == 0
    assert "first line" in done.stdout
    assert "second line" in done.stdout


def test_logs_follow_streams_until_the_run_ends(project: Project, marker: str) -> None:
    go = project.root / "go"
    script = 'echo "line one"; while [ ! -e go ]; do sleep 0.05; done; echo "line two"'
    handle = submit(project, ["sh", "-c", script, marker])
    follower = subprocess.Popen(
        [*cli_argv(), "--project", str(project.root), "logs", "--follow", handle.run_id],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert follower.stdout is not None
        assert follower.stdout.readline() == "line one\n"  # printed while the run goes on
        assert follower.poll() is None
        go.touch()
        out, err = follower.communicate(timeout=WAIT)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.communicate()
    assert follower.returncode == 0, err
    assert out == "line two\n"
    assert project.backend_for(handle).poll(handle).state == "succeeded"


def test_logs_follow_of_a_failed_run_says_how_it_ended(project: Project) -> None:
    handle = submit(project, ["sh", "-c", "echo oops; exit 5"])
    wait_final(project, handle)
    done = cli(project.root, "logs", "--follow", handle.run_id)
    assert done.returncode == 0
    assert "oops" in done.stdout
    assert f"run {handle.run_id} ended: failed" in done.stderr


def test_teardown_removes_work_folder_keeps_handle_and_log(project: Project) -> None:
    handle = submit(project, ["sh", "-c", "echo kept-in-log; echo out > out/file"], outputs=["out/"])
    assert wait_final(project, handle) == "succeeded"
    folder = run_dir(project, handle)
    assert (folder / "work").is_dir()
    done = cli(project.root, "teardown", handle.run_id)
    assert done.returncode == 0, done.stderr
    assert "torn down" in done.stdout
    assert not (folder / "work").exists()
    assert (folder / "handle.json").is_file()
    assert "kept-in-log" in (folder / "run.log").read_text()
    status = cli(project.root, "status", "--json")
    assert status.returncode == 0
    assert json.loads(status.stdout)["runs"][0]["state"] == "succeeded"
    logs = cli(project.root, "logs", handle.run_id)
    assert "kept-in-log" in logs.stdout
    again = cli(project.root, "teardown", handle.run_id)
    assert again.returncode == 0  # idempotent


def test_teardown_of_a_running_run_stops_it_first(project: Project, marker: str) -> None:
    handle = submit(
        project, ["sh", "-c", 'echo go > out/ready; while :; do sleep 1; done', marker], outputs=["out/"]
    )
    ready = outputs_root(project, handle) / "out" / "ready"
    wait_for(ready.exists, "the task to start")
    done = cli(project.root, "teardown", handle.run_id)
    assert done.returncode == 0, done.stderr
    assert project.backend_for(handle).poll(handle).state == "cancelled"
    assert not marked_pids(marker), describe(marked_pids(marker))
    assert not (run_dir(project, handle) / "work").exists()


# --------------------------------------------------------------------- fetch


@pytest.mark.skipif(not BWRAP, reason="FETCH OF STAGED OUTPUTS NOT TESTED: bubblewrap is missing")
def test_fetch_brings_a_runs_outputs_home_verified_into_the_project_or_elsewhere(
    project: Project, tmp_path: Path
) -> None:
    handle = submit(
        project, ["sh", "-c", "mkdir -p out && echo model > out/model.txt && echo m > metrics.json"],
        sandbox="bwrap", outputs=["out/", "metrics.json"],
    )  # fmt: skip
    assert wait_final(project, handle) == "succeeded"
    elsewhere = tmp_path / "elsewhere"
    done = cli(project.root, "fetch", handle.run_id, "--to", str(elsewhere))
    assert done.returncode == 0, done.stderr
    assert (elsewhere / "out" / "model.txt").read_text() == "model\n"
    assert (elsewhere / "metrics.json").read_text() == "m\n"
    assert "verified against its manifest" in done.stdout
    assert not (project.root / "metrics.json").exists()
    (project.root / "metrics.json").write_text("an older result\n")
    done = cli(project.root, "fetch", handle.run_id[:12])
    assert done.returncode == 0, done.stderr
    assert (project.root / "metrics.json").read_text() == "m\n"
    assert (project.root / "out" / "model.txt").read_text() == "model\n"


@pytest.mark.skipif(not BWRAP, reason="FETCH OF STAGED OUTPUTS NOT TESTED: bubblewrap is missing")
def test_fetch_refuses_outputs_that_no_longer_match_and_moves_nothing(project: Project) -> None:
    handle = submit(project, ["sh", "-c", "echo good > result.txt"], sandbox="bwrap", outputs=["result.txt"])
    assert wait_final(project, handle) == "succeeded"
    (outputs_root(project, handle) / "result.txt").write_text("tampered\n")
    (project.root / "result.txt").write_text("kept\n")
    done = cli(project.root, "fetch", handle.run_id)
    assert done.returncode == 1
    assert "do not match its manifest" in done.stderr and "result.txt" in done.stderr
    assert (project.root / "result.txt").read_text() == "kept\n"


def test_fetch_of_a_failed_run_says_there_is_nothing_to_fetch(project: Project) -> None:
    handle = submit(project, ["sh", "-c", "exit 3"], outputs=["never.txt"])
    assert wait_final(project, handle) == "failed"
    done = cli(project.root, "fetch", handle.run_id)
    assert done.returncode == 1
    assert f"run {handle.run_id} is failed: only a succeeded run has outputs to fetch" in done.stderr
