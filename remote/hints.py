"""What the end of a failed run's log says went wrong because of where it
ran, and the fix: a write the read-only sandbox refused, a Unix socket
network_isolation refused, or a project file the run's view left out (a run
sees the step's declared inputs only).

Stdlib only, Python 3.8+; shipped beside worker.py, which says it in the
run's final status, so every backend's failure shows it.
"""

from __future__ import annotations

import os
import re
from typing import Any, Mapping, Optional

# How much of the end of a failed run's log is read for the cause of a write
# refused by the read-only sandbox: the error that ended a command is last.
EROFS_TAIL_BYTES = 64 * 1024
EROFS_TEXT = "Read-only file system"
# The path in a line naming EROFS: quoted ('p', "p", `p', and coreutils'
# curly quotes) or, unquoted, the field before ": Read-only file system"
# (sh: "cannot create p: ...", bash: "p: ...").
QUOTED = re.compile("'([^']+)'|\"([^\"]+)\"|`([^'`]+)'|\u2018([^\u2019]+)\u2019")
UNQUOTED = re.compile(r"(?:^|:\s|\s)(/?[^\s:'\"]+):\s+" + EROFS_TEXT)
# strerror(EAFNOSUPPORT): what socket(AF_UNIX, ...) fails with under
# network_isolation (sandbox.py's seccomp filter), and rarely anything else.
NO_UNIX_SOCKETS_TEXT = "Address family not supported by protocol"


def refused_writes(text: str, cwd: str) -> list[str] | None:
    """The paths that lines of `text` say a write was refused on with EROFS,
    relative ones resolved against `cwd`, each once, in order; None when no
    line names EROFS, [] when lines do but name no path."""
    lines = [line for line in text.splitlines() if EROFS_TEXT in line]
    if not lines:
        return None
    paths: list[str] = []
    for line in lines:
        found = [next(g for g in m.groups() if g) for m in QUOTED.finditer(line)]
        found = [f for f in found if f != EROFS_TEXT]
        if not found:  # unquoted: only what looks like a file ("Error: ..." does not)
            found = [f for f in UNQUOTED.findall(line) if "/" in f or "." in f]
        for path in found:
            path = os.path.normpath(os.path.join(cwd, path))
            if path not in paths:
                paths.append(path)
    return paths


def log_tail(job: Mapping[str, Any]) -> str:
    """The end of the run's log: the error that ended a command is last."""
    try:
        with open(job["log_file"], "rb") as log:
            log.seek(max(0, os.fstat(log.fileno()).st_size - EROFS_TAIL_BYTES))
            return log.read().decode(errors="replace")
    except OSError:
        return ""


def left_out_hint(job: Mapping[str, Any], tail: str) -> str | None:
    """For a failed run: the project entries its view left out (see
    project_view.py) that its log mentions, by path (absolute too: "can't
    open file '/.../x.py'"), name, or a module's or package's quoted name
    ("No module named 'helper'" for helper.py, 'mypkg' for mypkg/), and how
    to include them."""
    named = []
    for rel in job.get("left_out", []):
        name = os.path.basename(rel)
        stem = name[:-3] if name.endswith(".py") else name
        words = "|".join(re.escape(w) for w in {rel, name})
        if re.search(r"(?<![\w.-])(%s)(?![\w-]|\.\w)|'%s'" % (words, re.escape(stem)), tail):
            named.append(rel)
    if not named:
        return None
    one = len(named) == 1
    them = "it" if one else "them"
    return ("the run sees the step's declared inputs only, and %s %s not declared; declare %s in "
            "inputs=[...] (in outputs=[...] if the command writes %s)"
            % (", ".join(named[:5]), "is" if one else "are", them, them))


def erofs_hint(job: Mapping[str, Any], tail: str | None = None) -> str | None:
    """For a failed sandboxed run: what the end of its log (`tail`) says the
    sandbox refused to write, and the fix; None when it names no EROFS."""
    paths = refused_writes(log_tail(job) if tail is None else tail, job["cwd"])
    if paths is None:
        return None
    project = job["project"].rstrip("/") + "/"
    # Project paths as the dodo names them (over ssh the project is a copy).
    shown = [p[len(project):] if p.startswith(project) else p for p in paths][-3:]
    in_project = any(p.startswith(project) for p in paths)
    what = "a write to " + ", ".join(shown) if shown else "a write"
    message = ("the sandbox refused %s (Read-only file system): only the declared outputs, "
               "$HOME and $TMPDIR are writable there" % what)
    if in_project or not shown:
        them = "them as outputs" if len(shown) > 1 else "it as an output"
        return message + "; declare %s, or write under $TMPDIR" % them
    return message + "; write under $TMPDIR"


def unix_socket_hint(job: Mapping[str, Any], tail: str) -> str | None:
    """For a failed run under network_isolation whose log ends with a
    refused socket: why (no Unix sockets there), and the ways around it."""
    if not job.get("network_isolation") or NO_UNIX_SOCKETS_TEXT not in tail:
        return None
    return ("the sandbox refused a Unix socket (%s): with network_isolation = true a task may not make one, "
            "so that no socket of the host is reachable; use multiprocessing's \"fork\" or \"spawn\" start "
            "method (not \"forkserver\", the default from Python 3.14) and no Manager, call "
            "torch.multiprocessing.set_sharing_strategy(\"file_system\") for DataLoader workers, "
            "or set network_isolation = false" % NO_UNIX_SOCKETS_TEXT)


# How sh, bash and env end when the program they were to run is on no
# folder of PATH. Only the exit code is read: a log's "No such file or
# directory" is as often a missing data file.
NOT_FOUND_EXIT = 127


def not_found_hint(job: Mapping[str, Any], exit_code: Optional[int], path: str, boxed: bool) -> Optional[str]:
    """For a run that ended with exit 127 (a program not found): the PATH
    the task had and, in the sandbox, what was hidden of it."""
    if exit_code != NOT_FOUND_EXIT:
        return None
    said = "a program the step ran was not found (exit %d): the step's PATH was %s" % (
        NOT_FOUND_EXIT, path or "unset")
    if boxed:
        hidden = [h for h in job.get("hide", []) if h] + ["/tmp", "/var/tmp"]
        shown = [p for p in job.get("extra_ro", [])
                 if any(p == h or p.startswith(h.rstrip("/") + "/") for h in hidden)]
        also = " (of them it shows, read-only, only %s)" % ", ".join(shown) if shown else ""
        said += "; the sandbox hides %s%s" % (", ".join(hidden), also)
        said += ("; install the program in a folder of that PATH outside them, set PATH in the step's env, "
                 "or name the program by its path")
    else:
        said += "; install the program in a folder of that PATH, or name it by its path"
    return said
