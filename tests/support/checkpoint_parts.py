"""What the checkpoint tests share (local and ssh): a step that counts to
N, one count every PAUSE seconds, writing its checkpoint by rename as a
training writes `torch.save` to a temporary name then `os.replace`, and
reading it back as it starts; and how to read what its runs did.

Not collected by pytest (the name does not start with test_).
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from disk_full_parts import seen_from_here, small_disk
from dodo_helpers import (
    clean_env,
    doit_ok,
    popen_doit,
    popen_output,
    runs_of,
    show,
    step_skipped,
    stop,
    wait_for,
)

# argv: N, PAUSE, RESULT (the output file), then "fail-fresh" to exit 3 at
# count 3 when it started from nothing (a crash a resume gets past), and
# "hold-at-3" to wait, before that count, for a file `go` in its checkpoints
# folder (a test makes it there once the client is gone), and "hold-after-3"
# to wait for it after that count (its checkpoint written): a test that takes
# the machine away once a snapshot of 3 counts is home finds the command still
# running however late the snapshot comes on a loaded machine.
# Prints "start I" and "count I"; the result holds N and every count made.
COUNT_PY = """\
import json, os, sys, time
n = int(sys.argv[1])
pause = float(sys.argv[2])
result = sys.argv[3]
fail_fresh = "fail-fresh" in sys.argv
hold = "hold-at-3" in sys.argv
hold_after = "hold-after-3" in sys.argv
folder = ([a[len("--ckpt="):] for a in sys.argv if a.startswith("--ckpt=")] or ["ckpt"])[0]
path = os.path.join(folder, "state.json")
state = json.load(open(path)) if os.path.exists(path) else {"n": n, "i": 0, "seen": []}
if state["n"] != n:
    sys.exit("the checkpoint of another step: %r" % state)
start = state["i"]
print("start", start, flush=True)
while state["i"] < n:
    time.sleep(pause)
    while hold and start == 0 and state["i"] == 2 and not os.path.exists(os.path.join(folder, "go")):
        time.sleep(0.05)
    state["i"] += 1
    state["seen"].append(state["i"])
    print("count", state["i"], flush=True)
    with open(path + ".tmp", "w") as f:
        json.dump(state, f)
    os.replace(path + ".tmp", path)
    if fail_fresh and start == 0 and state["i"] == 3:
        sys.exit(3)
    while hold_after and start == 0 and state["i"] == 3 and not os.path.exists("ckpt/go"):
        time.sleep(0.05)
with open(result, "w") as f:
    f.write("%d %s\\n" % (state["i"], ",".join(map(str, state["seen"]))))
"""


def count_step(
    name: str,
    n: int,
    pause: float,
    *extra: str,
    backend: str | None = None,
    checkpoints: str = "ckpt/",
    **more: Any,
) -> str:
    """The dodo lines of one counting step, its result in `<name>.txt`;
    `more`: remote_step's keyword arguments (preemptions=1, timeout=...)."""
    argv = ["python3", "count.py", str(n), str(pause), f"{name}.txt", *extra]
    where = f", backend={backend!r}" if backend else ""
    where += "".join(f", {key}={value!r}" for key, value in more.items())
    return (f"    yield from remote_step({name!r}, command={argv!r}, inputs=['count.py', 'data.txt'], "
            f"outputs=[{name + '.txt'!r}], checkpoints={checkpoints!r}{where})\n")


# Issue 39, item 1: a command naming its checkpoints folder in every way a
# training script is given it: a bare argument, --option=value (the one
# count.py reads), with a trailing "/", and a file in it.
NAMING_ITS_CHECKPOINTS = ["--ckpt", "ckpt/long", "--ckpt=ckpt/long", "ckpt/long/", "ckpt/long/state.json"]
NAMING_STEP = count_step("train", 6, 0.05, *NAMING_ITS_CHECKPOINTS, "hold-at-3", checkpoints="ckpt/long")


def rerun_and_reattach_naming_the_checkpoints(
    root: Path, written_in: Callable[[], Path | None], env: Mapping[str, str] | None = None, wait: float = 30
) -> None:
    """Drive NAMING_STEP (in `root`'s dodo) as a user does: a first run, a
    no-op doit, a rerun after an input edit, and a doit SIGKILLed while its
    run goes on, then a doit that reattaches to it. Each run holds before
    its third count until the test makes `go` in `written_in()`, the folder
    the newest run's command writes its checkpoints in (None: not yet).
    Before issue 39's fix every launch after the first was refused."""

    def held_at_two(proc: subprocess.Popen[str]) -> Path:
        def holding() -> bool:
            folder = written_in()
            with contextlib.suppress(OSError, ValueError):  # not made yet (or the old run's, replaced)
                return folder is not None and json.loads((folder / "state.json").read_text())["i"] == 2
            return False

        wait_for(lambda: proc.poll() is not None or holding(), "the run holding at count 2", timeout=wait)
        assert proc.poll() is None, popen_output(root)
        folder = written_in()
        assert folder is not None
        return folder

    def run_to_its_end() -> None:
        proc = popen_doit(root, "train", env=env)
        try:
            (held_at_two(proc) / "go").write_text("")
            assert proc.wait(timeout=wait * 4) == 0, popen_output(root)
        finally:
            stop(proc)
        assert result_of(root, "train") == (6, list(range(1, 7)))

    run_to_its_end()
    assert step_skipped(doit_ok(root, "train", env=env), "train")
    (root / "data.txt").write_text("two\n")
    run_to_its_end()
    assert len(runs_of(root, "train")) == 2, popen_output(root)

    (root / "data.txt").write_text("three\n")
    killed = popen_doit(root, "train", env=env)
    try:
        holding_in = held_at_two(killed)
        killed.send_signal(signal.SIGKILL)  # the client only: its run goes on, held before count 3
        killed.wait(timeout=30)
    finally:
        stop(killed)
    launched = [h["run_id"] for h in runs_of(root, "train")]
    assert len(launched) == 3, popen_output(root)
    (holding_in / "go").write_text("")
    reattached = doit_ok(root, "train", env=env)
    assert [h["run_id"] for h in runs_of(root, "train")] == launched, show(reattached)  # not launched again
    assert starts(run_logs(root, "train")[-1]) == [0], show(reattached)  # one run, never restarted
    assert result_of(root, "train") == (6, list(range(1, 7)))


def starts(log: str) -> list[int]:
    return [int(m) for m in re.findall(r"^start (\d+)$", log, re.M)]


def counts(log: str) -> list[int]:
    return [int(m) for m in re.findall(r"^count (\d+)$", log, re.M)]


def run_logs(root: Path, step: str) -> list[str]:
    """The log of each run of `step`, oldest first."""
    runs = root / ".substrax" / "runs"
    found = []
    for folder in runs.iterdir():
        handle = json.loads((folder / "handle.json").read_text())
        if handle["step"] == step:
            log = folder / "run.log"
            found.append((handle["created_at"], log.read_text() if log.exists() else ""))
    return [text for _at, text in sorted(found)]


def kept_state(root: Path, step: str) -> dict[str, Any] | None:
    """The checkpoint kept in the store for `step` (any key): the local
    backend's live folder, or the latest snapshot pulled from a host."""
    folder = root / ".substrax" / "checkpoints" / step
    for path in [*folder.glob("*/live/state.json"), *folder.glob("*/latest/files/state.json")]:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    return None


def result_of(root: Path, step: str) -> tuple[int, list[int]]:
    """The step's result: the count reached and every count made, in order."""
    reached, seen = (root / f"{step}.txt").read_text().split()
    return int(reached), [int(c) for c in seen.split(",")]


@contextlib.contextmanager
def on_small_disk(source: Path, size_mb: int) -> Iterator[tuple[Path, Path, int]]:
    """The project `source` copied onto a tmpfs of `size_mb` (disk_full_parts.small_disk),
    mounted over an empty folder in a private mount namespace (as root): (its path
    there, the same folder as this process sees it through the namespace's
    holder, the holder's pid, for `inside`). The tmpfs goes with the holder."""
    root = source.parent / "small-disk"
    with small_disk(source, root, size_mb) as pid:
        yield root, seen_from_here(pid, root), pid


def inside(pid: int, root: Path, *argv: str, out: IO[str]) -> subprocess.Popen[str]:
    """argv started in the mount namespace of `pid`, in `root`, its stdout and stderr to `out`."""
    return subprocess.Popen(["nsenter", "-t", str(pid), "-m", f"--wd={root}", "--", *argv],
                            env=clean_env(), stdout=out, stderr=subprocess.STDOUT, text=True)  # fmt: skip
