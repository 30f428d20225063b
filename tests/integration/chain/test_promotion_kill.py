"""A kill at each rename (and copy) of a promotion (issue 18, item 8): the
next doit finishes it before anything reads the outputs, leaves nothing
moved aside or copied half in the project, and the outputs are all new.
Same file system, and a store on a tmpfs (/dev/shm) apart from the project.

Real doit, SIGKILLed by an audit hook at its Nth rename or copy into the
project (the interpreter's own `os.rename` / `shutil.copyfile` events).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from dodo_helpers import DOIT, clean_env, doit, doit_ok, make_project, show, tree_files

BODY = """
def task_step():
    yield from remote_step(
        "step", inputs=["in.txt"], outputs=["d/", "f.txt"],
        command=["sh", "-c", "mkdir -p d && cp in.txt d/a && cp in.txt d/b && cp in.txt f.txt"],
    )
"""
# doit, killed (-9) at the Nth rename or copy that touches the project
# outside its store; exits 0 untouched when there are fewer than N.
KILLED_AT = """
import os, signal, sys
project, store, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
seen = 0
def inside(path):
    path = os.fsdecode(path) if isinstance(path, (str, bytes)) else ""
    return path.startswith(project + "/") and not path.startswith(store)
def hook(event, args):
    global seen
    if event in ("os.rename", "shutil.copyfile") and inside(args[1]):
        seen += 1
        if seen == n:
            os.kill(os.getpid(), signal.SIGKILL)
sys.addaudithook(hook)
sys.argv = [sys.argv[4]]
from doit.__main__ import main
sys.exit(main())
"""


@pytest.fixture
def shm_store() -> Iterator[Path]:
    store = Path("/dev/shm") / f"substrax-test-{uuid.uuid4().hex}"
    yield store
    shutil.rmtree(store, ignore_errors=True)


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob(".*substrax-*") if ".substrax" not in p.relative_to(root).parts)


@pytest.mark.parametrize("where", ["same file system", "store on a tmpfs"])
def test_a_kill_at_each_rename_of_a_promotion_is_finished_by_the_next_doit(
    tmp_path: Path, shm_store: Path, where: str
) -> None:
    if where == "store on a tmpfs" and not Path("/dev/shm").is_dir():
        pytest.skip("CROSS FILE SYSTEM PROMOTION NOT TESTED: no /dev/shm")
    n = 0
    while True:
        n += 1
        (tmp_path / f"kill-{n}").mkdir()
        root = make_project(tmp_path / f"kill-{n}", BODY, default_tasks=["step"], files={"in.txt": "v1\n"})
        store = root / ".substrax"
        if where == "store on a tmpfs":
            store = shm_store / str(n)
            text = (root / "pyproject.toml").read_text()
            (root / "pyproject.toml").write_text(f'[tool.substrax.compute]\nstate_dir = "{store}"\n\n{text}')
        doit_ok(root)
        (root / "in.txt").write_text("v2\n")
        killed = subprocess.run(
            [sys.executable, "-c", KILLED_AT, str(root), str(store), str(n), str(DOIT)],
            cwd=root, env=clean_env(), capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        if killed.returncode == 0:  # fewer than n: each one was tried
            break
        assert killed.returncode == -signal.SIGKILL, show(killed)
        again = doit(root)
        assert again.returncode == 0, show(again)
        assert tree_files(root / "d") == {"a": "v2\n", "b": "v2\n"}, (n, show(again))
        assert (root / "f.txt").read_text() == "v2\n"
        assert leftovers(root) == [], (n, leftovers(root))
    assert n > 3, f"only {n - 1} renames or copies seen: the hook missed the promotion"
