"""The wheel carries remote/ as substrax_tasks/_remote, and SkyPilot's SDK
helper in the SkyPilot backend's package: an installed, non-editable package
runs its worker and its helper without the source checkout, and imports the
scripts by that namespaced name only (nothing named plain `remote` is
installed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from fakesky_cleanup import cleanup, fakesky_env
from local_runs import REPO

from substrax_tasks.backends.scripts import REMOTE_SCRIPTS

BUILD_SECONDS = 300  # building and installing fetch packages through pip

# Runs in the installed venv, from a folder outside the checkout.
SUBMIT_SCRIPT = """
import importlib.util, json, sys, time
from pathlib import Path
import substrax_tasks
from substrax_tasks._remote import control
from substrax_tasks.backends.scripts import remote_script
from substrax_tasks.backends.skypilot.client import SKY_SDK_SCRIPT
from substrax_tasks.store.project import Project
from substrax_tasks.step.spec import make_spec

project = Project.open(sys.argv[1])
spec = make_spec("packaged", ["sh", "-c", "echo from-the-installed-worker"], project.root)
handle = project.submit(spec, settings={"sandbox": "none", "grace_seconds": 0.5})
status = project.backend_for(handle).wait(handle)
print(json.dumps({
    "package": substrax_tasks.__file__,
    "worker": str(remote_script("worker.py")),
    "control": control.__file__,
    "plain_remote": importlib.util.find_spec("remote") is not None,
    "sky_helper": str(SKY_SDK_SCRIPT),
    "state": status.state,
    "log": project.backend_for(handle).read_log(handle, 0).decode(),
}))
"""


def run(
    argv: list[str], cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=BUILD_SECONDS, check=False
    )
    assert done.returncode == 0, f"{' '.join(argv)} failed:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.mark.timeout(BUILD_SECONDS * 2)
def test_installed_wheel_runs_its_worker(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    run([sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(REPO)])
    (wheel,) = dist.glob("substrax_tasks-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert {f"substrax_tasks/_remote/{name}" for name in REMOTE_SCRIPTS} <= names
    assert not any(name.startswith("remote/") for name in names)
    # the SkyPilot helper imports sky: in the SkyPilot backend's package, never
    # shipped to hosts with remote/, and alone in its folder (a script's folder
    # comes first on its sys.path: no module there may shadow one of SkyPilot's)
    helper = "substrax_tasks/backends/skypilot/helper/"
    assert {name for name in names if name.startswith(helper) and name.endswith(".py")} == {
        f"{helper}sky_sdk.py"
    }
    assert not any(name.startswith("substrax_tasks/_sky_helper/") for name in names)
    assert "substrax_tasks/_remote/sky_sdk.py" not in names
    # nothing that runs at the start of every interpreter of the environment
    assert not any(name.endswith(".pth") for name in names), sorted(names)

    # A venv of its own holding the wheel, not the checkout. Its dependencies
    # come from this venv's site-packages, through a .pth line: the lines of
    # that folder's own .pth files (the editable install's) are not read.
    # (Installing them again from the index would check nothing more.)
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", str(wheel)])
    own_site = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    (own_site / "substrax-test-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")

    project = tmp_path / "project"
    project.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = run([str(python), "-c", SUBMIT_SCRIPT, str(project)], cwd=tmp_path, env=env)
    report = json.loads(done.stdout)
    site = venv / "lib"
    assert Path(report["package"]).is_relative_to(site), report["package"]  # not the checkout
    assert Path(report["worker"]).is_relative_to(site), report["worker"]
    assert Path(report["worker"]).parent.name == "_remote"
    assert Path(report["control"]) == Path(report["worker"]).with_name("control.py")
    assert not report["plain_remote"]
    assert not (own_site / "remote").exists()
    assert Path(report["sky_helper"]).is_relative_to(site), report["sky_helper"]
    # the installed helper answers, with the fake SkyPilot as its `sky`
    home = tmp_path / "home"
    try:
        answer = subprocess.run(
            [str(python), report["sky_helper"], "validate"], input=json.dumps({"task": {"run": "echo hi"}}),
            env=fakesky_env(home), cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    finally:
        cleanup(home)
    assert answer.returncode == 0, answer.stderr
    assert json.loads(answer.stdout) == {"ok": True, "result": {"valid": True}}
    assert report["state"] == "succeeded"
    assert "from-the-installed-worker" in report["log"]

    cli_help = run([str(venv / "bin" / "substrax-compute"), "--help"], cwd=tmp_path, env=env)
    assert "status" in cli_help.stdout


def test_importing_every_module_registers_no_exit_hook_and_no_signal_handler() -> None:
    """A plain import (a dodo file that imports substrax_tasks, `why`
    loading it) changes nothing in the process: hooks and handlers are
    installed only once something runs."""
    code = """
import atexit, importlib, pkgutil, signal
import doit, paramiko, pydantic, rich  # their own hooks (paramiko has two) are not ours
import substrax_tasks
hooks = atexit._ncallbacks()
before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
names = [m.name for m in pkgutil.walk_packages(substrax_tasks.__path__, "substrax_tasks.")]
for name in names:
    importlib.import_module(name)
after = {s: signal.getsignal(s) for s in before}
print(len(names), atexit._ncallbacks() - hooks, before == after)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    modules, hooks, same_handlers = done.stdout.split()
    assert int(modules) > 20
    assert (hooks, same_handlers) == ("0", "True"), done.stdout
