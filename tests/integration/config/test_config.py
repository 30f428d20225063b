"""`[tool.substrax.compute]`: defaults, and one clear message per mistake."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from dodo_helpers import doit, make_project, show
from local_runs import cli, wait_final

from substrax_tasks.config.pyproject import load_config
from substrax_tasks.errors import ConfigError
from substrax_tasks.step.spec import make_spec
from substrax_tasks.store.project import Project

STEP = """
def task_step():
    yield from remote_step("step", command=["sh", "-c", "echo ok > out.txt"], outputs=["out.txt"])
"""
# (id, pyproject.toml text, fragments the message must hold: key path, value, valid choices)
BAD_CONFIGS = [
    (
        "unknown-key",
        "[tool.substrax.compute]\nbogus = 1\n",
        [
            "unknown key 'bogus' in [tool.substrax.compute]",
            "valid keys: backends, cache, default_backend, state_dir",
        ],
    ),
    (
        "unknown-cache-key",
        '[tool.substrax.compute.cache]\nshare = "s3://b/p"\n',
        ["unknown key 'share' in [tool.substrax.compute.cache]", "allowed_signers", "shared"],
    ),
    (
        "cache-size",
        '[tool.substrax.compute.cache]\nmax_size = "lots"\n',
        ["tool.substrax.compute.cache.max_size = 'lots'", '"500MiB"'],
    ),
    (
        "cache-mode",
        '[tool.substrax.compute.cache]\nmode = "write"\n',
        ["tool.substrax.compute.cache.mode = 'write'", "'read' or 'readwrite'"],
    ),
    (
        "cache-url",
        '[tool.substrax.compute.cache]\nshared = "team-bucket"\n',
        ["tool.substrax.compute.cache.shared = 'team-bucket'", "s3://bucket/prefix"],
    ),
    (
        "unknown-backend-key",
        '[tool.substrax.compute.backends.local]\nsandbx = "none"\n',
        [
            "unknown key 'sandbx' in [tool.substrax.compute.backends.local]",
            "valid keys: cache_dirs, grace_seconds, hide_gpus_when_unasked, hourly_cost, keep_checkpoints, "
            "max_cost, max_parallel, network_isolation, pip_args, sandbox",
        ],
    ),
    (
        "wrong-type",
        '[tool.substrax.compute.backends.local]\nnetwork_isolation = "maybe"\n',
        ["tool.substrax.compute.backends.local.network_isolation = 'maybe'", "valid boolean"],
    ),
    (
        "wrong-type-top-level",
        "[tool.substrax.compute]\nstate_dir = 5\n",
        ["tool.substrax.compute.state_dir = 5", "valid string"],
    ),
    (
        "bad-sandbox",
        '[tool.substrax.compute.backends.local]\nsandbox = "docker"\n',
        ["tool.substrax.compute.backends.local.sandbox = 'docker'", "'auto', 'bwrap' or 'none'"],
    ),
    (
        "bad-grace",
        "[tool.substrax.compute.backends.local]\ngrace_seconds = -1\n",
        ["tool.substrax.compute.backends.local.grace_seconds = -1", "greater than 0"],
    ),
    (
        "bad-checkpoint-seconds",
        '[tool.substrax.compute.backends.ssh]\nhost = "box"\ncheckpoint_seconds = 0\n',
        ["tool.substrax.compute.backends.ssh.checkpoint_seconds = 0", "greater than 0"],
    ),
    (
        "isolation-without-sandbox",
        '[tool.substrax.compute.backends.local]\nsandbox = "none"\nnetwork_isolation = true\n',
        [
            "[tool.substrax.compute.backends.local]",
            'network_isolation = true needs the sandbox, but sandbox = "none"',
        ],
    ),
    (
        "ssh-isolation-without-sandbox",
        '[tool.substrax.compute.backends.ssh]\nhost = "box"\nsandbox = "none"\n'
        "[tool.substrax.compute.backends.ssh.copy]\nnetwork_isolation = true\n",
        [
            "[tool.substrax.compute.backends.ssh]",
            'network_isolation = true needs the sandbox, but sandbox = "none"',
        ],
    ),
    (
        "bad-default-backend",
        '[tool.substrax.compute]\ndefault_backend = "aws"\n',
        [
            "tool.substrax.compute.default_backend = 'aws' is not a backend",
            "valid choices: local, ssh, skypilot",
        ],
    ),
    (
        "unknown-backend-table",
        "[tool.substrax.compute.backends.aws]\nregion = 1\n",
        [
            "unknown backend table [tool.substrax.compute.backends.aws]",
            "valid backends: local, ssh, skypilot",
        ],
    ),
    (
        "misspelled-table",
        '[tool.substrax.compte]\ndefault_backend = "local"\n',
        [
            "[tool.substrax.compte] is not a table substrax reads",
            "did you mean [tool.substrax.compute]?",
        ],
    ),
    (
        "key-under-substrax",
        '[tool.substrax]\nstate_dir = "runs"\n',
        [
            "state_dir directly under [tool.substrax] is not read",
            "did you mean state_dir under [tool.substrax.compute]?",
        ],
    ),
    (
        "misspelled-tool-table",
        '[tool.substrx.compute]\ndefault_backend = "local"\n',
        ["[tool.substrx] is not a table substrax reads; did you mean [tool.substrax]?"],
    ),
    (
        "invalid-toml",
        "[tool.substrax.compute\ndefault_backend = 'local'\n",
        ["pyproject.toml: not valid TOML", "line 1", "fix the file"],
    ),
]


@pytest.mark.parametrize(("text", "fragments"), [pytest.param(t, f, id=i) for i, t, f in BAD_CONFIGS])
def test_bad_config_is_refused_with_its_message(project_dir: Path, text: str, fragments: list[str]) -> None:
    (project_dir / "pyproject.toml").write_text(text)
    with pytest.raises(ConfigError) as caught:
        Project.open(project_dir)
    for fragment in fragments:
        assert fragment in str(caught.value)
    assert not (project_dir / ".substrax").exists()  # refused before anything ran

    done = cli(project_dir, "status")
    assert done.returncode == 1
    for fragment in fragments:
        assert fragment in done.stderr
    assert "Traceback" not in done.stderr


def test_bad_backend_from_the_environment(project_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUBSTRAX_BACKEND", "gcp")
    with pytest.raises(ConfigError, match="SUBSTRAX_BACKEND = 'gcp' is not a backend; valid choices: local"):
        load_config(project_dir)
    done = cli(project_dir, "status")
    assert done.returncode == 1
    assert "SUBSTRAX_BACKEND = 'gcp'" in done.stderr


def test_configured_values_are_used(project_dir: Path) -> None:
    (project_dir / "pyproject.toml").write_text(
        '[tool.substrax.compute]\ndefault_backend = "local"\nstate_dir = "var/runs-state"\n\n'
        '[tool.substrax.compute.backends.local]\nsandbox = "none"\ngrace_seconds = 0.5\n'
        'cache_dirs = ["~/.cache/huggingface"]\n'
    )
    project = Project.open(project_dir)
    configured = {"sandbox": "none", "network_isolation": False, "grace_seconds": 0.5,
                  "cache_dirs": ["~/.cache/huggingface"], "max_parallel": None,
                  "hide_gpus_when_unasked": False, "pip_args": [], "keep_checkpoints": False,
                  "hourly_cost": None, "max_cost": None}  # fmt: skip
    assert project.settings_for() == ("local", configured)
    handle = project.submit(make_spec("configured", ["true"], project_dir))
    assert handle.settings == configured
    assert wait_final(project, handle) == "succeeded"
    assert (project_dir / "var" / "runs-state" / "runs" / handle.run_id / "handle.json").is_file()
    done = cli(project_dir, "status")
    assert done.returncode == 0, done.stderr
    assert handle.run_id in done.stdout


def test_worker_refuses_isolation_without_sandbox(project: Project) -> None:
    """The worker holds the same line for any backend that hands it a job."""
    spec = make_spec("isolated", ["true"], project.root)
    handle = project.new_run(spec, settings={"sandbox": "auto"})
    backend = project.backend_for(handle)
    handle = backend.launch(handle)
    job_file = project.store.run_dir(handle.run_id) / "job.json"
    job = json.loads(job_file.read_text())
    job.update(sandbox="none", network_isolation=True)
    job_file.write_text(json.dumps(job))
    backend.start(handle)
    assert wait_final(project, handle) == "failed"
    assert "network_isolation = true needs the sandbox" in (backend.poll(handle).message or "")


MODULES = ["config.pyproject", "config.settings", "store.run_store", "store.project", "store.handle",
           "run.steplock", "cli.main", "uptodate.check", "run.step_driver", "step.tasks", "backends",
           "backends.local.backend", "backends.ssh.backend", "backends.skypilot.backend",
           "backends.skypilot.settings"]


@pytest.mark.parametrize("module", MODULES)
def test_each_module_can_be_imported_first(module: str) -> None:
    """No import cycle: each module loads in a fresh interpreter on its own."""
    done = subprocess.run(
        [sys.executable, "-c", f"import substrax_tasks.{module}"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr


RESOLVE = """
import sys
from pathlib import Path
from substrax_tasks.store.project import Project
print(Project.open(Path(sys.argv[1])).settings_for()[1]["grace_seconds"], "pydantic" in sys.modules)
"""


def test_an_unchanged_configuration_is_resolved_without_pydantic(project_dir: Path) -> None:
    """A no-op doit reads the validated settings from the cache; an edit of
    pyproject.toml makes it validate again."""
    pyproject = project_dir / "pyproject.toml"

    def resolved() -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-c", RESOLVE, str(project_dir)]
        return subprocess.run(argv, capture_output=True, text=True, check=False)

    pyproject.write_text("[tool.substrax.compute.backends.local]\ngrace_seconds = 2.0\n")
    assert resolved().stdout == "2.0 True\n"  # first: validated
    assert resolved().stdout == "2.0 False\n"  # then from the cache
    pyproject.write_text("[tool.substrax.compute.backends.local]\ngrace_seconds = 3.5\n")
    assert resolved().stdout == "3.5 True\n"
    assert resolved().stdout == "3.5 False\n"
    pyproject.write_text("[tool.substrax.compute.backends.local]\ngrace_seconds = -1\n")
    refused = resolved()
    assert refused.returncode != 0
    assert "tool.substrax.compute.backends.local.grace_seconds = -1" in refused.stderr


DOIT_MISTAKES = [
    pytest.param(
        '[tool.substrax.compte]\ndefault_backend = "local"\n',
        "[tool.substrax.compte] is not a table substrax reads; did you mean [tool.substrax.compute]?",
        id="misspelled-table",
    ),
    pytest.param(
        '[tool.substrax]\ndefault_backend = "local"\n',
        "default_backend directly under [tool.substrax] is not read; "
        "did you mean default_backend under [tool.substrax.compute]?",
        id="key-under-substrax",
    ),
]


@pytest.mark.parametrize(("text", "message"), DOIT_MISTAKES)
def test_doit_names_a_config_mistake_in_one_line(tmp_path: Path, text: str, message: str) -> None:
    root = make_project(tmp_path, STEP, default_tasks=["step"])
    (root / "pyproject.toml").write_text(text)
    done = doit(root)
    assert done.returncode == 1, show(done)
    assert done.stderr.startswith(f"substrax: error: {root / 'pyproject.toml'}: "), show(done)
    assert message in done.stderr and "Traceback" not in done.stderr, show(done)
    assert not (root / ".substrax").exists()
    (root / "pyproject.toml").write_text("[tool.substrax.compute]\n")  # fixed: it runs
    assert doit(root).returncode == 0


def test_a_pyproject_that_is_not_toml_is_told_in_one_line_where_substrax_reads_it(tmp_path: Path) -> None:
    """doit reads pyproject.toml (for [tool.doit]) in the folder it starts
    in, before it loads the dodo file: there a file that is not TOML is
    doit's own error, and no code of the package has run (nothing hooks the
    interpreter to reword it). Wherever substrax reads the file itself it
    says so in one line naming the file: the dodo file loaded from another
    folder (`doit -f project/dodo.py`: doit reads no pyproject.toml there),
    and the CLI."""
    root = make_project(tmp_path, STEP, default_tasks=["step"])
    (root / "pyproject.toml").write_text("[tool.substrax.compute\ndefault_backend = 'local'\n")
    message = (
        f"{root / 'pyproject.toml'}: not valid TOML (Expected ']' at the end of a table declaration "
        "(at line 1, column 23)); fix the file and run again\n"
    )
    in_the_project = doit(root)
    assert in_the_project.returncode == 1, show(in_the_project)
    assert "TOMLDecodeError" in in_the_project.stderr, show(in_the_project)  # doit's, as doit says it
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    from_elsewhere = doit(outside, "-f", str(root / "dodo.py"))
    assert from_elsewhere.returncode == 1, show(from_elsewhere)
    assert from_elsewhere.stderr == f"substrax: error: {message}", show(from_elsewhere)
    status = cli(root, "status")
    assert status.returncode == 1
    assert status.stderr.endswith(message) and "Traceback" not in status.stderr, status.stderr
    assert not (root / ".substrax").exists()
    (root / "pyproject.toml").write_text("[tool.substrax.compute]\n")  # fixed: it runs
    assert doit(outside, "-f", str(root / "dodo.py")).returncode == 0
    assert (root / "out.txt").read_text() == "ok\n"
