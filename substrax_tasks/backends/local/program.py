"""The program a local step runs: the one plain doit would run.

doit execs the argv's program found on its own PATH. The sandbox hides the
home and /tmp, where pyenv shims, venvs and user installs often live, so
the same name looked up in there finds another program (`python3` becomes
/usr/bin/python3, without the user's packages) or none. So the program is
found here, on this process's PATH, and the job names it by its path, with
what it needs shown read-only; a program that cannot be shown whole fails
the launch, naming both paths. Local backend only: over ssh and SkyPilot
the argv runs on a machine whose PATH this process does not know.
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
