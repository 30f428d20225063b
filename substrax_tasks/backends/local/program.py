"""The program a local step runs: the one plain doit would run.

doit execs the argv's program found on its own PATH. The sandbox hides the
home and /tmp, where pyenv shims, venvs and user installs often live, so
the same name looked up in there finds another program (`python3` becomes
/usr/bin/python3, without the user's packages) or none. So the program is
found here, on this process's PATH, and the job names it by its path, with
what it needs shown read-only; a program that cannot be shown whole fails
the launch, naming both paths. Local backend only: over ssh and SkyPilot
the argv runs on a machine whose PATH this process does not know.

A `shell=` step, or a script the step runs, finds its programs on the
task's PATH inside the sandbox: so the toolchains on that PATH that the
sandbox hides (pyenv's shims, a conda env, ~/.local/bin, ~/.cargo/bin) are
shown too, read-only, with the installation each needs (show_toolchains);
never a folder holding credentials, nor the home itself.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from pathlib import Path

from substrax_tasks._remote import runfiles
from substrax_tasks.errors import SubstraxError

PYTHON = re.compile(r"python[0-9.]*")
# The interpreter a Python program names, and what it reads at start-up.
ASK_PYTHON = "import sys; print(sys.executable); print(sys.prefix); print(sys.base_prefix)"
ASK_SECONDS = 60
ALWAYS_HIDDEN = ("/tmp", "/var/tmp")  # noqa: S108 - emptied in the sandbox, as the hidden home
# What of a hidden folder stays hidden whatever the PATH names: where tools
# keep credentials. A PATH entry in one of these, or holding one (the home
# itself on PATH), is not shown.
CREDENTIALS = (
    ".ssh", ".aws", ".config", ".gnupg", ".docker", ".kube", ".azure", ".netrc", ".git-credentials",
    ".pypirc", ".cargo/credentials", ".cargo/credentials.toml", ".local/share/keyrings",
)  # fmt: skip


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _shown(path: str, job: runfiles.Job) -> bool:
    """Whether the sandbox shows `path` as it is here (remote/sandbox.py:
    the hidden folders and /tmp go, the project's view and extra_ro come
    back)."""
    if any(_inside(path, f) for f in job.get("extra_ro", [])):
        return True
    if _inside(path, job["project"]):  # less what the project's view hides (project_view.py)
        rel = os.path.relpath(path, job["project"])
        return not any(_inside(rel, h) for h in job.get("project_hidden", []))
    return not any(_inside(path, f) for f in [*job.get("hide", []), *ALWAYS_HIDDEN] if f)


def _shebang(path: str) -> str | None:
    """The interpreter a script names (through /usr/bin/env too); None for a binary."""
    try:
        with Path(path).open("rb") as f:
            line = f.readline(512)
    except OSError:
        return None
    if not line.startswith(b"#!"):
        return None
    words = line[2:].decode(errors="replace").split()
    if words[:1] == ["/usr/bin/env"] and len(words) > 1:
        return shutil.which(words[1]) or words[1]
    return words[0] if words else None


def _ask_python(program: str, job: runfiles.Job, environ: dict[str, str]) -> list[str]:
    """[executable, prefix, base prefix] of the interpreter `program` runs,
    run as the step would be here (a pyenv shim reads its version from the
    environment and the project's .python-version)."""
    said, lines = _asked(program, job["cwd"], tuple(sorted(environ.items())))
    if len(lines) != 3:
        raise SubstraxError(
            f"the step's program {job['argv'][0]!r} is {program} here, under a folder the sandbox "
            f"hides, and asking it which Python it runs failed ({said}); name the interpreter by "
            "its path in the argv"
        )
    return list(lines)


# Asked once per process for each program, folder and environment: a pyenv
# shim takes 0.4 s to answer (bench/README.md, bench_steps.py --python), and
# a sweep's steps all ask the same.
@functools.lru_cache(maxsize=64)
def _asked(program: str, cwd: str, environ: tuple[tuple[str, str], ...]) -> tuple[str, tuple[str, ...]]:
    try:
        done = subprocess.run(
            [program, "-c", ASK_PYTHON], cwd=cwd, env=dict(environ), stdin=subprocess.DEVNULL,
            capture_output=True, text=True, timeout=ASK_SECONDS, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc), ()
    return done.stderr.strip()[-500:], tuple(done.stdout.splitlines()) if done.returncode == 0 else ()


def resolve_program(job: runfiles.Job, environ: dict[str, str]) -> None:
    """Name the job's program by the path it has on `environ`'s PATH (after
    the job's path_prepend), and add to `extra_ro` what the sandbox must
    show of it: a Python's installation (a shim is replaced by the
    interpreter it runs here), or a program's folder."""
    name = str(job["argv"][0])
    if "/" in name:  # a path: run as given, from the project folder
        return
    path = os.pathsep.join([*job.get("path_prepend", []), environ.get("PATH", os.defpath)])
    found = shutil.which(name, path=path)
    if found is None:
        raise SubstraxError(
            f"the step's program {name!r} is not on PATH here ({path}); install it, or name it by its path"
        )
    found = str(Path(found).absolute())  # not resolved: a venv's python is a link to its base's
    real = Path(found).resolve()
    job["argv"][0] = found
    if _shown(found, job) and _shown(str(real), job):
        return
    if PYTHON.fullmatch(real.name) or PYTHON.fullmatch(Path(found).name):
        executable, *prefixes = _ask_python(found, job, environ)
        job["argv"][0] = executable
        shown = [*prefixes, str(Path(executable).resolve().parent.parent)]
    else:
        runner = _shebang(found)
        if runner is not None and not _shown(runner, job):
            raise SubstraxError(
                f"the step's program {name!r} is {found} here, a script run by {runner}; the sandbox "
                "hides both, and shows the script's folder only: name the interpreter by its path in "
                "the argv, or install the program outside the hidden folders "
                f"({', '.join(job.get('hide', []))}, /tmp)"
            )
        shown = [str(Path(found).parent), str(real.parent)]
    job["extra_ro"] = [*job.get("extra_ro", []), *dict.fromkeys(p for p in shown if not _shown(p, job))]


def _installation(entry: Path, environ: dict[str, str]) -> list[Path]:
    """What the programs of PATH folder `entry` need besides the folder:
    a pyenv-like root (its shims run libexec/pyenv and versions/; the
    libexec of Homebrew's pyenv lives elsewhere, as rbenv's and nodenv's
    roots have the same shape), a Python prefix (a conda or mamba env or
    install, a venv and its base), pip --user's lib/python* beside a bin
    folder, rustup's home for cargo's proxies."""
    parent = entry.parent
    needs: list[Path] = []
    pyenv_root = (parent / "libexec" / "pyenv").is_file() or (
        entry.name == "shims" and (parent / "versions").is_dir()
    )
    if pyenv_root or (parent / "conda-meta").is_dir():
        needs.append(parent)
    elif (parent / "pyvenv.cfg").is_file():
        needs.append(parent)
        base = _venv_home(parent / "pyvenv.cfg")
        if base is not None:
            needs.append(base.parent)
    elif entry.name == "bin":
        needs += sorted(parent.glob("lib/python*"))
    if (entry / "rustup").is_file():
        home = Path(environ.get("HOME") or Path.home())
        needs.append(Path(environ.get("RUSTUP_HOME") or home / ".rustup"))
    return needs


def _venv_home(cfg: Path) -> Path | None:
    """The bin folder of a venv's base interpreter (pyvenv.cfg's `home`)."""
    try:
        lines = cfg.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, value = line.partition("=")
        if key.strip() == "home" and value.strip():
            return Path(os.path.normpath(value.strip()))
    return None


def _holds_credentials(path: str, job: runfiles.Job) -> bool:
    """Whether showing `path` would show a hidden folder whole (the home or
    /tmp on PATH) or a place that holds credentials."""
    hidden_folders = [h for h in job.get("hide", []) if h]
    if any(_inside(hidden, path) for hidden in [*hidden_folders, *ALWAYS_HIDDEN]):
        return True
    for hidden in hidden_folders:
        for name in CREDENTIALS:
            secret = str(Path(hidden) / name)
            if _inside(path, secret) or _inside(secret, path):
                return True
    return False


def show_toolchains(job: runfiles.Job, environ: dict[str, str]) -> None:
    """Show read-only the folders of the task's PATH (`environ`'s, after the
    job's path_prepend) that the sandbox hides, with what their programs
    need (_installation), so that a `shell=` step or a script finds the
    program plain doit would; none that holds credentials. pyenv picks its
    version from PYENV_VERSION and `.python-version` files: passed on too."""
    path = [*job.get("path_prepend", []), *environ.get("PATH", os.defpath).split(os.pathsep)]
    shown: list[str] = []
    pyenv = False  # a pyenv-like root on PATH, hidden or not: its shims read the version here
    for entry in dict.fromkeys(Path(os.path.normpath(p)) for p in path if p.startswith("/")):
        if not _enterable_folder(entry):
            continue
        needs = _installation(entry, environ)
        pyenv = pyenv or any((n / "shims").is_dir() and (n / "versions").is_dir() for n in needs)
        if _shown(str(entry), job):
            continue
        for needed in [entry, *needs]:
            folder = os.path.normpath(needed)
            if Path(folder).exists() and not _shown(folder, job) and not _holds_credentials(folder, job):
                shown.append(folder)
    if pyenv:
        shown += _python_version_files(job)
        if "PYENV_VERSION" in environ and "PYENV_VERSION" not in job["env"]:
            job["env"]["PYENV_VERSION"] = environ["PYENV_VERSION"]
    # A folder inside another shown one adds nothing.
    kept = [f for f in dict.fromkeys(shown) if not any(o != f and _inside(f, o) for o in shown)]
    job["extra_ro"] = [*job.get("extra_ro", []), *kept]


def _enterable_folder(path: Path) -> bool:
    """Whether `path` is a folder this user can enter. One it cannot (another
    user's, such as /root/.cargo/bin on a PATH that su or sudo kept) holds
    no program it runs: passed over, as exec passes it over, rather than
    looked into (pathlib raises on EACCES)."""
    try:
        return path.is_dir() and os.access(path, os.X_OK)
    except PermissionError:  # a folder above it is closed
        return False


def _python_version_files(job: runfiles.Job) -> list[str]:
    """The `.python-version` files pyenv reads (`pyenv local`, in the
    project's folder or one above it) that the sandbox hides: the project's
    own is hidden by its view unless declared, and a shim there would pick
    another version than the one `resolve_program` asked here."""
    folder = Path(os.path.normpath(job["cwd"]))
    candidates = [folder / ".python-version", *(f / ".python-version" for f in folder.parents)]
    return [
        str(c) for c in candidates
        if c.is_file() and not _shown(str(c), job) and not _holds_credentials(str(c), job)
    ]  # fmt: skip
