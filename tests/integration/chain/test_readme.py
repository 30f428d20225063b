"""README's dodo snippets, run as a reader would copy them: the sweep on the
local backend with the real `doit` (serially and three at a time), and the
GPU step loaded (this machine has no GPU to run it on)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from dodo_helpers import REPO, doit_ok, run_count, show, step_ran, step_skipped, write_pyproject

FIT = """\
import argparse, json, os
parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float)
parser.add_argument("out")
args = parser.parse_args()
rows = [line.split(",") for line in open("data/train.csv").read().split()]
loss = sum((float(y) - args.lr * float(x)) ** 2 for x, y in rows)
os.makedirs(args.out, exist_ok=True)
json.dump({"lr": args.lr, "loss": loss}, open(os.path.join(args.out, "metrics.json"), "w"))
print(f"lr {args.lr} loss {loss:.3f}")
"""
SUMMARY = """\
import json, sys
with open("summary.csv", "w") as out:
    for lr in sys.argv[1:]:
        metrics = json.load(open(f"models/lr{lr}/metrics.json"))
        out.write(f"{lr},{metrics['loss']:.3f}\\n")
"""


def readme_example(name: str) -> str:
    """The ```python block after `<!-- example: NAME -->` in README.md."""
    readme = (REPO / "README.md").read_text()
    found = re.search(rf"<!-- example: {name} -->\n```python\n(.*?)```", readme, re.S)
    assert found, f"README.md has no example {name!r}"
    return found.group(1)


def project(tmp_path: Path, dodo: str) -> Path:
    root = tmp_path / "proj"
    (root / "data").mkdir(parents=True)
    write_pyproject(root)
    (root / "dodo.py").write_text(dodo)
    (root / "fit.py").write_text(FIT)
    (root / "summary.py").write_text(SUMMARY)
    (root / "data" / "train.csv").write_text("1,2\n2,4\n3,6\n")
    return root


@pytest.mark.parametrize("threads", [[], ["-n", "3", "-P", "thread"]], ids=["serial", "threads"])
def test_the_readme_sweep_runs_on_the_local_backend(tmp_path: Path, threads: list[str]) -> None:
    root = project(tmp_path, readme_example("sweep"))
    done = doit_ok(root, *threads)
    rates = ["0.01", "0.1", "1.0"]
    assert all(step_ran(done, f"fit:lr{lr}") for lr in rates) and step_ran(done, "summary"), show(done)
    lines = (root / "summary.csv").read_text().splitlines()
    assert [line.split(",")[0] for line in lines] == rates
    assert run_count(root) == 3
    again = doit_ok(root, *threads)
    assert all(step_skipped(again, f"fit:lr{lr}") for lr in rates), show(again)
    one = doit_ok(root, "fit:lr0.1")
    assert step_skipped(one, "fit:lr0.1") and run_count(root) == 3, show(one)


def test_the_readme_gpu_step_loads(tmp_path: Path) -> None:
    gpu = "from substrax_tasks import doit_config, remote_step\n\n" + readme_example("gpu-step")
    root = project(tmp_path, gpu)
    listed = doit_ok(root, "list")
    assert [line.split()[0] for line in listed.stdout.splitlines() if line.strip()] == ["train"], show(listed)
    assert run_count(root) == 0
