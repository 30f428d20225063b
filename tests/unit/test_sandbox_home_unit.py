"""The unit half of tests/integration/local/test_sandbox_home.py: the same subject, the
tests that start no process and open no connection (see its docstring)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sandbox_beds import job_for

from substrax_tasks._remote import hints, sandbox
from substrax_tasks.backends.job import WorkerPaths, build_job
from substrax_tasks.config.settings import validate
from substrax_tasks.errors import ConfigError
from substrax_tasks.step.spec import canonical_digest, make_spec, settings_in_key

# ------------------------------------------------- without bubblewrap


@pytest.mark.unit
def test_bwrap_argv_binds_the_runs_home_over_the_real_one_then_the_kept_folders(tmp_path: Path) -> None:
    home = tmp_path / "home"
    project = home / "work" / "project"
    project.mkdir(parents=True)
    spec = make_spec("step", ["true"], project)
    paths = WorkerPaths(project=str(project), run_dir=str(project / ".substrax" / "runs" / "r1"))
    job = build_job(spec, paths, sandbox="bwrap", network_isolation=False, grace_seconds=1.0,
                    hide=[str(home)], cache_dirs=["~/.cache/huggingface", "~/.torch/"],
                    cache_root="/kept")  # fmt: skip
    argv = sandbox.bwrap_argv("bwrap", job, "/staging", home=str(home))
    binds = [(argv[i + 1], argv[i + 2]) for i, arg in enumerate(argv) if arg == "--bind"]
    assert binds[:3] == [
        (paths.home, str(home)),  # the run's own home, on disk, at the real home's path
        ("/kept/.cache/huggingface", str(home / ".cache" / "huggingface")),
        ("/kept/.torch", str(home / ".torch")),
    ]
    assert paths.home == f"{paths.run_dir}/work/home"
    # the real home is replaced, not also hidden under a read-only tmpfs
    assert str(home) not in [argv[i + 1] for i, arg in enumerate(argv) if arg in ("--tmpfs", "--remount-ro")]
    # the project inside the home is bound back after the home (read-only)
    assert argv.index(str(project)) > argv.index(paths.home)


@pytest.mark.unit
def test_home_settings_point_the_tools_into_the_runs_home(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    job = job_for(tmp_path, [], hide=[str(home)])
    assert sandbox.home_settings(job, {"HOME": str(home)}) == {
        "HOME": str(home),
        "XDG_CACHE_HOME": f"{home}/.cache",
        "XDG_CONFIG_HOME": f"{home}/.config",
        "XDG_DATA_HOME": f"{home}/.local/share",
        "XDG_STATE_HOME": f"{home}/.local/state",
        "MPLCONFIGDIR": f"{home}/.config/matplotlib",
    }
    # no hidden home to mount on: the run's home folder is the home, at its own path
    for environ in ({}, {"HOME": "/"}, {"HOME": "relative"}, {"HOME": str(tmp_path)}):
        assert sandbox.task_home(job, environ) == job["home_dir"]


PROJECT = "/work/proj"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("line", "paths"),
    [
        ("OSError: [Errno 30] Read-only file system: 'reports/sub01-report.h5'", ["reports/sub01-report.h5"]),
        ("OSError: Unable to create file (unable to open file: name = 'reports/a.h5', errno = 30, "
         "error message = 'Read-only file system', flags = 13, o_flags = 242)", ["reports/a.h5"]),
        ("touch: cannot touch 'new.txt': Read-only file system", ["new.txt"]),
        ("mkdir: cannot create directory \u2018reports\u2019: Read-only file system", ["reports"]),
        ("sh: 1: cannot create /work/proj/x/y.csv: Read-only file system", ["x/y.csv"]),
        ("bash: line 1: out.txt: Read-only file system", ["out.txt"]),
        ("Error: Read-only file system (os error 30)", []),  # no path: the fix alone
        ("mkdir -p failed for path /usr/share/x: [Errno 30] Read-only file system: '/usr/share/x'",
         ["/usr/share/x"]),
    ],
)  # fmt: skip
def test_refused_writes_reads_the_path_of_common_erofs_messages(line: str, paths: list[str]) -> None:
    found = hints.refused_writes("a line before\n" + line + "\n", PROJECT)
    assert found is not None
    assert [p[len(PROJECT) + 1 :] if p.startswith(PROJECT + "/") else p for p in found] == paths
    assert hints.refused_writes("no such error here\n", PROJECT) is None


@pytest.mark.unit
def test_erofs_hint_names_project_paths_as_the_dodo_does_and_the_fix(tmp_path: Path) -> None:
    job = job_for(tmp_path, ["out/"])
    log = Path(job["log_file"])
    log.parent.mkdir(parents=True)
    log.write_text("Traceback ...\nOSError: [Errno 30] Read-only file system: 'reports/r.h5'\n")
    assert hints.erofs_hint(job) == (
        "the sandbox refused a write to reports/r.h5 (Read-only file system): only the declared "
        "outputs, $HOME and $TMPDIR are writable there; declare it as an output, or write under $TMPDIR"
    )
    log.write_text("touch: cannot touch '/usr/lib/x': Read-only file system\n")
    assert str(hints.erofs_hint(job)).endswith("/usr/lib/x (Read-only file system): only the declared "
                                                 "outputs, $HOME and $TMPDIR are writable there; "
                                                 "write under $TMPDIR")  # fmt: skip
    log.write_text("exit 1\n")
    assert hints.erofs_hint(job) is None


@pytest.mark.unit
@pytest.mark.parametrize(
    ("folders", "error"),
    [
        (["/root/.cache/huggingface"], "'/root/.cache/huggingface' is not under ~: give it as \"~/\""),
        ([".cache/x"], "'.cache/x' is not under ~"),
        (["~user/.cache"], "'~user/.cache' is not under ~"),
        (["~"], "'~' is the whole home, which each run starts empty"),
        (["~/a/../b"], "'~/a/../b': write the path without \"\", \".\" or \"..\" parts"),
        (["~//a"], "'~//a': write the path without"),
        (["~/.cache", "~/.cache/huggingface"], "'~/.cache/huggingface' overlaps '~/.cache'"),
        ("~/.cache", "cache_dirs = '~/.cache': Input should be a valid list"),
    ],
)  # fmt: skip
def test_cache_dirs_refused_at_load_with_the_fix(folders: object, error: str) -> None:
    for backend in ("local", "ssh"):
        table: dict[str, object] = {"cache_dirs": folders}
        if backend == "ssh":
            table["host"] = "gpu-box"
        with pytest.raises(ConfigError) as raised:
            validate({"backends": {backend: table}}, Path("/p"), None)
        assert f"tool.substrax.compute.backends.{backend}.cache_dirs" in str(raised.value)
        assert error in str(raised.value)
    good = validate({"backends": {"local": {"cache_dirs": ["~/.cache/huggingface/"]}}}, Path("/p"), None)
    assert good.backend_settings("local", Path("/p")).cache_dirs == ["~/.cache/huggingface"]


@pytest.mark.unit
def test_cache_dirs_are_not_part_of_the_key() -> None:
    pinned = validate({}, Path("/p"), None).pinned("local", Path("/p"))
    kept = {**pinned, "cache_dirs": ["~/.cache/huggingface"]}
    assert canonical_digest(settings_in_key(kept)) == canonical_digest(settings_in_key(pinned))
    assert "cache_dirs" not in settings_in_key(kept)


# ------------------------------------------------- the real worker and bubblewrap


# ------------------------------------------------- as root and as another user


# ------------------------------------------------- over ssh


