"""Staged outputs are verified once, as they are fetched, and promoted by the
one implementation `doit` and `substrax-compute fetch` share
(run/promote.py: `verify_staged`, `promote_verified`; issue 30).

The promotion does not verify them again: that is safe only because
nothing but this client writes the staging folder between the two. The
tests below hold what that relies on: one client stages a run at a time (a
CLI fetch while `doit` drives the step is refused), and no process of a run
outlives it to write its outputs after they were verified. Real doit, real
bubblewrap, the real CLI; the reads are counted by strace.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from dodo_helpers import (
    BWRAP,
    DOIT,
    WAIT,
    clean_env,
    compute,
    doit,
    doit_ok,
    make_project,
    popen_doit,
    popen_output,
    runs_of,
    show,
    stop,
    wait_for,
)
from local_runs import describe, marked_pids, submit, wait_final

from substrax_tasks.store.project import Project

pytestmark = pytest.mark.skipif(
    not BWRAP, reason="STAGED FETCH NOT TESTED: bubblewrap is missing or unusable (outputs are staged in it)"
)
needs_strace = pytest.mark.skipif(
    shutil.which("strace") is None,
    reason="READS OF A FETCH NOT COUNTED: strace is missing (`make test` installs it as root)",
)

BIG = """
def task_big():
    yield from remote_step("big", shell="head -c 8000000 /dev/zero > big.bin", outputs=["big.bin"])
"""


@needs_strace
def test_a_fresh_output_is_read_once_between_its_fetch_and_its_promotion(tmp_path: Path) -> None:
    """Before: the fetch hashed the staged file, and the promotion hashed it
    again (a file changed within the hash cache's racy window is never taken
    from the cache, and a fresh output always is in it: 1 s more per GiB)."""
    root = make_project(tmp_path, BIG, default_tasks=["big"])
    trace = tmp_path / "trace"
    # Only doit's main thread, where the phases run (no -f: not the worker,
    # nor the command); every file counts as freshly written.
    done = subprocess.run(
        ["strace", "-o", str(trace), "-e", "trace=openat", str(DOIT)],
        cwd=root, env=clean_env({"SUBSTRAX_RACY_SECONDS": "3600"}),
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, show(done)
    reads = [
        line for line in trace.read_text().splitlines()
        if re.search(r'/big\.bin", O_RDONLY', line) and "O_PATH" not in line
    ]  # fmt: skip
    assert len(reads) == 1, "\n".join(reads)
    assert "/fetched/big.bin" in reads[0]  # the staged copy, as it was fetched
    assert (root / "big.bin").read_bytes() == b"\0" * 8_000_000
    (run,) = runs_of(root, "big")
    manifest = json.loads((root / ".substrax" / "runs" / run["run_id"] / "manifest.json").read_text())
    assert manifest["entries"][0]["sha256"] == hashlib.sha256(b"\0" * 8_000_000).hexdigest()
    again = doit_ok(root)
    assert "-- big" in again.stdout, show(again)  # up to date: the record says what was promoted


ESCAPE = """
def task_escape():
    yield from remote_step("escape", shell="mkdir -p out && ln -s /etc/passwd out/link", outputs=["out/"])
"""


def test_the_cli_and_doit_refuse_outputs_no_manifest_accepts_alike(tmp_path: Path) -> None:
    """A succeeded run whose outputs hold a symlink out of them: its worker
    could take no manifest, and the fetch's own is refused. Before, doit
    said so and the CLI's copy of the fetch ended in a traceback."""
    root = make_project(tmp_path, ESCAPE, default_tasks=["escape"])
    chain = doit(root)
    said = chain.stdout + chain.stderr
    assert chain.returncode == 1, show(chain)
    refusal = "symlink out/link -> /etc/passwd"
    assert refusal in said and "refused, never followed" in said, show(chain)
    assert "nothing was promoted" in said and "Traceback" not in said, show(chain)

    project = Project.open(root)
    handle = submit(project, ["sh", "-c", "mkdir -p out && ln -s /etc/passwd out/link"], step="escape",
                    sandbox="bwrap", outputs=["out/"])  # fmt: skip
    assert wait_final(project, handle) == "succeeded"
    fetched = compute(root, "fetch", handle.run_id)
    assert fetched.returncode == 1, show(fetched)
    assert "Traceback" not in fetched.stderr, show(fetched)
    assert f"error: run {handle.run_id}: {refusal}" in fetched.stderr, show(fetched)
    assert "refused, never followed" in fetched.stderr and "nothing was promoted" in fetched.stderr
    assert not list(root.glob("out/*")), "nothing that did not verify is promoted"


NOT_MADE = """
def task_half():
    yield from remote_step("half", shell="echo made > made.txt", outputs=["made.txt", "never.txt"])
"""


def test_the_cli_and_doit_name_an_output_the_run_did_not_make_alike(tmp_path: Path) -> None:
    """Before, the CLI called it a copy that does not match the manifest."""
    root = make_project(tmp_path, NOT_MADE, default_tasks=["half"])
    chain = doit(root)
    said = "the run did not produce declared output(s) never.txt; nothing was promoted"
    assert chain.returncode == 1 and said in chain.stdout + chain.stderr, show(chain)
    project = Project.open(root)
    handle = submit(project, ["sh", "-c", "echo made > made.txt"], step="half", sandbox="bwrap",
                    outputs=["made.txt", "never.txt"])  # fmt: skip
    assert wait_final(project, handle) == "succeeded"
    fetched = compute(root, "fetch", handle.run_id)
    assert fetched.returncode == 1, show(fetched)
    assert f"error: run {handle.run_id}: {said}" in fetched.stderr, show(fetched)
    assert not (root / "made.txt").exists(), "nothing of a run that did not make its outputs is promoted"


# Unsandboxed, so that the command sees the gate the test makes in the project.
GATED = """
def task_step():
    yield from remote_step(
        "step",
        command=["sh", "-c", "while [ ! -e gate ]; do sleep 0.05; done; echo new > out.txt", "{marker}"],
        outputs=["out.txt"],
    )
"""


def test_a_cli_fetch_while_doit_drives_the_step_is_refused_and_stages_nothing(
    tmp_path: Path, marker: str
) -> None:
    """One client stages a run at a time, which is what lets the promotion
    trust the fetch's verification: the CLI takes the step's lock, which
    doit holds from launch to the chain's end. Before, the CLI fetched (and
    promoted into the declared paths) while doit drove the same step."""
    root = make_project(tmp_path, GATED.format(marker=marker), default_tasks=["step"], sandbox="none")
    project = Project.open(root)
    earlier = submit(project, ["sh", "-c", "echo earlier > out.txt"], sandbox="bwrap", outputs=["out.txt"])
    assert wait_final(project, earlier) == "succeeded"
    staging = project.store.run_dir(earlier.run_id) / "fetched"
    proc = popen_doit(root)
    try:
        wait_for(lambda: "new run" in popen_output(root), "doit to launch its run")
        refused = compute(root, "fetch", earlier.run_id)
        assert refused.returncode == 1, show(refused)
        assert "step 'step' is being run by another process" in refused.stderr, show(refused)
        assert "Traceback" not in refused.stderr, show(refused)
        assert not staging.exists() and not (root / "out.txt").exists()
        (root / "gate").touch()
        assert proc.wait(timeout=WAIT) == 0, popen_output(root)
    finally:
        stop(proc)
    assert (root / "out.txt").read_text() == "new\n"
    elsewhere = tmp_path / "elsewhere"
    fetched = compute(root, "fetch", earlier.run_id, "--to", str(elsewhere))  # the step is free again
    assert fetched.returncode == 0, show(fetched)
    assert (elsewhere / "out.txt").read_text() == "earlier\n"


LEAVES_A_WRITER = """
def task_step():
    yield from remote_step(
        "step",
        command=["sh", "-c", "(setsid sh -c 'while :; do echo more >> out.txt; sleep 0.01; done' $0 &); "
                 "echo made > out.txt; sleep 0.2", "{marker}"],
        outputs=["out.txt"],
    )
"""


def test_no_process_of_a_run_outlives_it_to_change_what_was_verified(tmp_path: Path, marker: str) -> None:
    """The local backend stages hard links to the sandbox's own outputs: only
    because every process of a run is gone once it is final (the sandbox's
    pid namespace) can nothing change them between the fetch's verification
    and their promotion. A command leaves a daemon appending to its output."""
    root = make_project(tmp_path, LEAVES_A_WRITER.format(marker=marker), default_tasks=["step"])
    doit_ok(root)
    assert not marked_pids(marker), describe(marked_pids(marker))
    (run,) = runs_of(root, "step")
    manifest = json.loads((root / ".substrax" / "runs" / run["run_id"] / "manifest.json").read_text())
    (entry,) = manifest["entries"]
    assert hashlib.sha256((root / "out.txt").read_bytes()).hexdigest() == entry["sha256"]
