"""The sandbox's home (issue 17): a writable, empty home for each run that
leaves nothing in the real one and is gone when the run ends; `cache_dirs`
kept across runs of a project; and a write the sandbox refused named in the
run's failure with the fix.

First what needs no bubblewrap (the argv, the log scan, the settings), then
runs of the real worker under real bubblewrap, through `doit` on the local
backend, as an unprivileged user, and once over ssh.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import needs_bwrap, run_dir, submit, wait_final
from dodo_helpers import (
    doit,
    doit_ok,
    make_project,
    show,
    step_ran,
    step_skipped,
    tree_files,
    wait_for,
    write_pyproject,
)
from ssh_helpers import make_ssh_project, needs_root, needs_sshd
from test_sandbox import job_for
from test_sandbox_escape import Bed, bed  # noqa: F401 - bed: a fixture
from testbeds.sshd_host import SshHost

from substrax_tasks._remote import hints, sandbox
from substrax_tasks.backends.job import WorkerPaths, build_job
from substrax_tasks.config.settings import validate
from substrax_tasks.errors import ConfigError
from substrax_tasks.step.spec import canonical_digest, make_spec, settings_in_key
from substrax_tasks.store.project import Project

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

HOME_WRITES = r"""
set -e
mkdir -p "$MPLCONFIGDIR" ~/.cache/x
echo config > ~/.config/matplotlib/matplotlibrc
echo cached > ~/.cache/x/blob
sleep "${1:-0}"
env | grep -E '^(HOME|XDG_[A-Z]+_HOME|MPLCONFIGDIR)=' | sort > out/env.txt
ls -A ~ > out/home.txt
"""


@needs_bwrap
@pytest.mark.parametrize("end", ["timed_out", "cancelled"])
def test_the_runs_home_is_removed_when_the_run_is_stopped(
    project: Project, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, end: str
) -> None:
    real_home = tmp_path / "home"
    real_home.mkdir()
    monkeypatch.setenv("HOME", str(real_home))  # the worker's, and the task's in the sandbox
    handle = submit(project, ["sh", "-c", HOME_WRITES, "sh", "120"], sandbox="bwrap", outputs=["out/"],
                    timeout=1 if end == "timed_out" else None)  # fmt: skip
    home = run_dir(project, handle) / "work" / "home"
    if end == "cancelled":
        wait_for((home / ".cache" / "x" / "blob").exists, "the task to write its home")
        assert project.backend_for(handle).cancel(handle)
    assert wait_final(project, handle, timeout=60) == end
    assert not home.exists()
    assert os.listdir(real_home) == []


@needs_bwrap
def test_matplotlib_style_writes_to_the_home_succeed_and_leave_nothing_in_the_real_home(
    tmp_path: Path,
) -> None:
    real_home = tmp_path / "home"
    real_home.mkdir()
    (real_home / ".config").mkdir()
    (real_home / ".config" / "mine.txt").write_text("the user's own\n")
    root = make_project(tmp_path, f"""
def task_plot():
    yield from remote_step("plot", shell={HOME_WRITES!r}, outputs=["out/"])
""", default_tasks=["plot"], sandbox="bwrap")  # fmt: skip
    done = doit_ok(root, env={"HOME": str(real_home)})
    assert step_ran(done, "plot"), show(done)
    assert "Read-only file system" not in done.stdout + done.stderr
    home = str(real_home)  # the run's home is at the real home's path
    assert (root / "out" / "env.txt").read_text().splitlines() == [
        f"HOME={home}", f"MPLCONFIGDIR={home}/.config/matplotlib", f"XDG_CACHE_HOME={home}/.cache",
        f"XDG_CONFIG_HOME={home}/.config", f"XDG_DATA_HOME={home}/.local/share",
        f"XDG_STATE_HOME={home}/.local/state",
    ]  # fmt: skip
    assert (root / "out" / "home.txt").read_text().split() == [".cache", ".config"]  # empty at the start
    assert tree_files(real_home) == {".config/mine.txt": "the user's own\n"}  # nothing left there
    assert tree_files(root / "out").keys() == {"env.txt", "home.txt"}  # the home is not an output
    (run,) = (root / ".substrax" / "runs").iterdir()
    assert not (run / "work").exists()


CACHED_STEPS = r"""
FETCH = '''
set -e
if [ -f ~/.cache/kept/model.bin ]; then echo "cached $1" > a/out.txt
else mkdir -p ~/.cache/kept && echo weights > ~/.cache/kept/model.bin && echo "downloaded $1" > a/out.txt; fi
echo scratch > ~/not-kept.txt
'''
USE = '''
set -e
{ cat ~/.cache/kept/model.bin 2>/dev/null || echo none; cat a/out.txt; } > b/out.txt
if [ -e ~/not-kept.txt ]; then echo leaked >> b/out.txt; fi
'''


def task_a():
    yield from remote_step("a", shell=FETCH.replace("$1", get_var("run", "1")), outputs=["a/"])


def task_b():
    yield from remote_step("b", shell=USE, inputs=["a/out.txt"], outputs=["b/"])
"""


@needs_bwrap
def test_cache_dirs_kept_for_the_next_step_and_the_next_run_never_in_the_outputs_nor_the_key(
    tmp_path: Path,
) -> None:
    real_home = tmp_path / "home"
    real_home.mkdir()
    env = {"HOME": str(real_home)}
    root = make_project(tmp_path, CACHED_STEPS, default_tasks=["a", "b"], sandbox="bwrap")
    doit_ok(root, env=env)
    assert (root / "a" / "out.txt").read_text() == "downloaded 1\n"
    assert (root / "b" / "out.txt").read_text() == "none\ndownloaded 1\n"  # no folder kept yet
    # adding cache_dirs changes nothing a step makes: nothing reruns
    write_pyproject(root, "bwrap", extra='cache_dirs = ["~/.cache/kept"]\n')
    again = doit_ok(root, env=env)
    assert step_skipped(again, "a") and step_skipped(again, "b"), show(again)

    changed = doit_ok(root, "run=2", env=env)  # a changed command: both rerun
    assert step_ran(changed, "a") and step_ran(changed, "b"), show(changed)
    assert (root / "a" / "out.txt").read_text() == "downloaded 2\n"  # the first run with the folder kept
    assert (root / "b" / "out.txt").read_text() == "weights\ndownloaded 2\n"  # the next step found it
    kept = root / ".substrax" / "cache" / "home" / ".cache" / "kept"
    assert (kept / "model.bin").read_text() == "weights\n"

    rerun = doit_ok(root, "run=3", env=env)
    assert step_ran(rerun, "a"), show(rerun)
    assert (root / "a" / "out.txt").read_text() == "cached 3\n"  # the next run found it
    assert (root / "b" / "out.txt").read_text() == "weights\ncached 3\n"  # and the rest of the home is new
    assert tree_files(root / "a").keys() == {"out.txt"} and tree_files(root / "b").keys() == {"out.txt"}
    assert os.listdir(real_home) == []


@needs_bwrap
def test_an_undeclared_write_fails_naming_the_path_and_the_fix(tmp_path: Path) -> None:
    write = "import pathlib; pathlib.Path('reports/sub01-report.h5').write_bytes(b'x')"
    root = make_project(tmp_path, f"""
def task_report():
    yield from remote_step("report", command=["python3", "-c", {write!r}], inputs=["reports/README"],
                           outputs=["out/"])
""", default_tasks=["report"], sandbox="bwrap", files={"reports/README": "declared elsewhere\n"})  # fmt: skip
    done = doit(root)
    assert done.returncode != 0, show(done)
    said = done.stdout + done.stderr
    assert (
        "run" in said
        and "failed (exit code 1): the sandbox refused a write to reports/sub01-report.h5 "
        "(Read-only file system): only the declared outputs, $HOME and $TMPDIR are writable there; "
        "declare it as an output, or write under $TMPDIR"
        in said
    ), show(done)
    assert not (root / "reports" / "sub01-report.h5").exists()


# ------------------------------------------------- as root and as another user


@needs_bwrap
def test_the_home_is_removed_whatever_the_task_did_to_it(bed: Bed, marker: str) -> None:  # noqa: F811
    script = r"""
set -e
echo x > ~/planted
mkdir -p ~/closed/deep && echo x > ~/closed/deep/file && chmod 500 ~/closed/deep ~/closed
ln -s "$PWD" ~/project-link
ln -s "$PWD/code.txt" ~/code-link
echo result > out/result.txt
"""
    log, status = bed.run(script, marker, network_isolation=False)
    assert status["state"] == "succeeded", log
    assert (bed.base / "runs" / marker[-8:] / "work" / "home").exists() is False
    assert sorted(os.listdir(bed.home)) == ["secret.txt"]  # the real home: as it was
    assert (bed.project / "code.txt").read_text() == "original\n"  # links were not followed


# ------------------------------------------------- over ssh


@needs_sshd
@needs_root
@needs_bwrap
def test_over_ssh_the_home_is_writable_and_fresh_and_cache_dirs_are_kept_on_the_host(
    tmp_path: Path, host: SshHost
) -> None:
    before = set(os.listdir(host.remote_home))
    caches = host.remote_home / ".substrax-remote" / "cache"
    cached_before = set(caches.iterdir()) if caches.is_dir() else set()  # other tests' projects
    root = make_ssh_project(tmp_path, host, CACHED_STEPS, ("a", "b"), sandbox="bwrap",
                            cache_dirs=["~/.cache/kept"])  # fmt: skip
    done = doit_ok(root)
    assert (root / "a" / "out.txt").read_text() == "downloaded 1\n", show(done)
    assert (root / "b" / "out.txt").read_text() == "weights\ndownloaded 1\n"  # kept; ~/not-kept.txt not
    rerun = doit_ok(root, "run=2")
    assert step_ran(rerun, "a"), show(rerun)
    assert (root / "a" / "out.txt").read_text() == "cached 2\n"
    # on the host: the kept folder under remote_root, keyed by the project; nothing else in the home
    (kept,) = set(caches.iterdir()) - cached_before
    assert kept.name.startswith("proj-")
    assert (kept / ".cache" / "kept" / "model.bin").read_text() == "weights\n"
    assert set(os.listdir(host.remote_home)) - before <= {".substrax-remote"}
