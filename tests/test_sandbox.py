"""The bubblewrap sandbox of local runs, with real bubblewrap.

The task tries each thing and prints ALLOWED/DENIED per attempt; the test
reads that from the log and checks the host's files as well.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import log_text, needs_bwrap, outputs_root, run_dir, submit, wait_final

from substrax_tasks.runs import Project

pytestmark = needs_bwrap

# attempt NAME SHELL-CODE: runs the code, prints "ALLOWED NAME" or "DENIED NAME"
ATTEMPT = 'attempt() { if sh -c "$2" >/dev/null 2>&1; then echo "ALLOWED $1"; else echo "DENIED $1"; fi; }\n'


def verdicts(log: str) -> dict[str, str]:
    return {m.group(2): m.group(1) for m in re.finditer(r"^(ALLOWED|DENIED) (\S+)$", log, re.MULTILINE)}


@pytest.fixture
def fake_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """$HOME for this test (and the runs it starts): a folder with a secret."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "secret.txt").write_text("credentials\n")
    monkeypatch.setenv("HOME", str(home))
    assert Path.home() == home
    return home


def test_sandbox_allows_writes_only_to_declared_outputs(
    project: Project, fake_home: Path, marker: str
) -> None:
    root = project.root
    (root / "code.txt").write_text("original\n")
    (root / "data").mkdir()
    (root / "data" / "in.txt").write_text("input\n")
    (root / "results").mkdir()
    (root / "results" / "old.txt").write_text("kept\n")  # beside a declared file output
    (root / "results" / "metrics.json").write_text("earlier version\n")
    (root / "out").mkdir()
    (root / "out" / "stale.txt").write_text("earlier version\n")
    scratch = f"/tmp/{marker}"
    script = ATTEMPT + f"""
attempt read-project 'cat code.txt'
attempt read-input 'cat data/in.txt'
attempt read-beside-output 'cat results/old.txt'
attempt write-project 'echo x > code.txt'
attempt new-file-in-project 'echo x > new.txt'
attempt write-input 'echo x > data/in.txt'
attempt write-beside-output 'echo x > results/old.txt'
attempt write-home 'echo x > "$HOME/planted"'
attempt read-home 'cat "$HOME/secret.txt"'
attempt see-earlier-file-output 'cat results/metrics.json'
attempt see-earlier-folder-output 'test -e out/stale.txt'
attempt write-folder-output 'echo result > out/result.txt'
attempt write-file-output 'echo "{{}}" > results/metrics.json'
attempt write-private-tmp 'echo x > {scratch}'
"""
    handle = submit(
        project,
        ["sh", "-c", script],
        sandbox="bwrap",
        inputs=["data/in.txt"],
        outputs=["out/", "results/metrics.json"],
    )
    assert wait_final(project, handle) == "succeeded"
    assert verdicts(log_text(project, handle)) == {
        "read-project": "ALLOWED",
        "read-input": "ALLOWED",
        "read-beside-output": "ALLOWED",
        "write-project": "DENIED",
        "new-file-in-project": "DENIED",
        "write-input": "DENIED",
        "write-beside-output": "DENIED",
        "write-home": "DENIED",
        "read-home": "DENIED",
        "see-earlier-file-output": "DENIED",
        "see-earlier-folder-output": "DENIED",
        "write-folder-output": "ALLOWED",
        "write-file-output": "ALLOWED",
        "write-private-tmp": "ALLOWED",
    }
    # Nothing outside the outputs changed on the host.
    assert (root / "code.txt").read_text() == "original\n"
    assert not (root / "new.txt").exists()
    assert (root / "data" / "in.txt").read_text() == "input\n"
    assert (root / "results" / "old.txt").read_text() == "kept\n"
    assert not (fake_home / "planted").exists()
    assert not Path(scratch).exists()
    # The outputs landed at their relative paths in the run's staging folder.
    staging = outputs_root(project, handle)
    assert staging == run_dir(project, handle) / "work" / "outputs"
    assert (staging / "out" / "result.txt").read_text() == "result\n"
    assert (staging / "results" / "metrics.json").read_text() == "{}\n"
    assert (root / "results" / "metrics.json").read_text() == "earlier version\n"
    assert not (root / "out" / "result.txt").exists()


def test_sandbox_project_inside_home_stays_visible_read_only(
    tmp_path: Path, fake_home: Path
) -> None:
    root = fake_home / "work" / "project"
    root.mkdir(parents=True)
    (root / "code.txt").write_text("original\n")
    project = Project.open(root)
    script = ATTEMPT + """
attempt read-project 'cat code.txt'
attempt write-project 'echo x > code.txt'
attempt read-home 'cat "$HOME/secret.txt"'
attempt write-home 'echo x > "$HOME/planted"'
attempt write-output 'echo result > out/result.txt'
echo "HOME HOLDS: $(ls -A "$HOME" | tr '\\n' ' ')"
"""
    handle = submit(project, ["sh", "-c", script], sandbox="bwrap", outputs=["out/"])
    assert wait_final(project, handle) == "succeeded"
    log = log_text(project, handle)
    assert verdicts(log) == {
        "read-project": "ALLOWED",
        "write-project": "DENIED",
        "read-home": "DENIED",
        "write-home": "DENIED",
        "write-output": "ALLOWED",
    }
    assert "HOME HOLDS: work \n" in log  # only the way to the project
    assert (root / "code.txt").read_text() == "original\n"
    assert not (fake_home / "planted").exists()
    assert (outputs_root(project, handle) / "out" / "result.txt").read_text() == "result\n"


@pytest.fixture
def tcp_server() -> Iterator[socket.socket]:
    """A listening TCP socket on the host's 127.0.0.1."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield server
    server.close()


def connections_made(server: socket.socket) -> int:
    server.setblocking(False)
    count = 0
    while True:
        try:
            conn, _ = server.accept()
        except BlockingIOError:
            return count
        conn.close()
        count += 1


@pytest.mark.parametrize("isolated", [True, False], ids=["network_isolation", "network"])
def test_network_isolation_removes_the_network(
    project: Project, tcp_server: socket.socket, isolated: bool
) -> None:
    port = tcp_server.getsockname()[1]
    connect = f"bash -c 'exec 3<>/dev/tcp/127.0.0.1/{port}'"
    script = f"if {connect}; then echo CONNECTED; else echo NO-CONNECTION; fi"
    handle = submit(project, ["sh", "-c", script], sandbox="bwrap", network_isolation=isolated)
    assert wait_final(project, handle) == "succeeded"
    log = log_text(project, handle)
    if isolated:
        assert "NO-CONNECTION" in log
        assert connections_made(tcp_server) == 0
    else:
        assert "CONNECTED" in log
        assert "NO-CONNECTION" not in log
        assert connections_made(tcp_server) == 1
