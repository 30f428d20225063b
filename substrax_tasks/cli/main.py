"""`substrax-compute`: look at, follow, cancel and clean up runs.

Exit codes: 0 ok, 1 failure (the message says what and what to do), 2 usage.
Every command acts on a run through its handle's pinned settings, never the
current pyproject.toml.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.markup import escape

from substrax_tasks import __version__
from substrax_tasks.backends.base import RunStatus
from substrax_tasks.cli.arguments import arg, command, flag
from substrax_tasks.cli.status_view import (
    attempt_lines,
    damaged_cost_lines,
    machine_lines,
    print_status_table,
    status_json,
)
from substrax_tasks.config.pyproject import find_project
from substrax_tasks.errors import BackendError, HandleError, NoSuchRun, SubstraxError
from substrax_tasks.store.gc import find_leaks
from substrax_tasks.store.handle import RunHandle
from substrax_tasks.store.project import Project
from substrax_tasks.store.run_store import Unreadable
from substrax_tasks.store.selection import Selection, group_of, latest_per_step, select, shortened

if sys.version_info < (3, 11):  # pragma: no cover - 3.10 only
    from exceptiongroup import ExceptionGroup

EPILOG = "Exit codes: 0 ok, 1 failure, 2 usage error."
WORD_HELP = (
    "RUN is, first match wins: a run id, a step (its latest run), a group (the latest run of each "
    "of its steps GROUP:MEMBER), or a unique prefix of a run id."
)
# Cancels of a group's runs at once: each mostly waits (for a grace period,
# a host), so a sweep stops in about the time of one cancel.
CANCEL_THREADS = 8


RUN_WORD = arg("run", metavar="RUN", help="a run id, step, group or run-id prefix")
RUN_ID = arg("run", help="a run id (or a unique prefix of one)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="substrax-compute",
        description="Inspect and control the runs of remote_step() steps.",
        epilog=EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--project",
        metavar="DIR",
        help="the project folder (default: the nearest folder, the current one or above it, "
        "holding a dodo.py or a pyproject.toml with a [tool.substrax] table)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    command(
        commands, "status", cmd_status, "list the latest run of each step and its state",
        "List the latest run of each step and its state (--all: every run). "
        f"{WORD_HELP} Records that cannot be read are named with the reason (when no RUN or "
        "--step filters), and the exit code is then 1.",
        arg("run", nargs="?", metavar="RUN", help="a run id, step, group or run-id prefix"),
        arg("--step", metavar="NAME", help="only the runs of this step, or of this group's steps"),
        flag("--all", help="every run, not only the latest of each step"),
        flag("--json", help='print {"runs": [...], "unreadable": [...], "leaked": [...]}'),
        flag("--machines", help="also ask each ssh host and SkyPilot for leaked run folders and clusters"),
    )  # fmt: skip
    command(
        commands, "steps", cmd_steps, "show every step of the dodo file and where it stands",
        "Load the project's dodo file and show each of its remote steps: up to date, restored "
        "(from which cache entry, made by which run), stale (with the first reason `why` gives), "
        "running, failed, or never run; a one-line count of each above. The check is the one "
        "`doit` makes: what shows stale here is what `doit` would run. Exit 0 either way "
        "(1 if a run record cannot be read).",
        arg("--dodo", metavar="FILE", help="the dodo file (default: dodo.py in the project)"),
        flag("--json", help='print {"summary": {STATE: COUNT, ...}, "steps": [...]}'),
    )  # fmt: skip
    command(
        commands, "logs", cmd_logs, "print a run's log",
        "Print a run's log (stdout and stderr of its command, and the worker's notes). "
        f"{WORD_HELP} For a group, the log of each member's latest run under a header "
        "(==> STEP (RUN) <==); --follow needs one run. For a step restored from the run cache, "
        "the log of the run that made the cache entry, as the entry keeps it (its last 64 KiB).",
        RUN_WORD, flag("--follow", "-f", help="keep printing until the run ends"),
    )  # fmt: skip
    command(
        commands, "cancel", cmd_cancel, "stop a run and its whole process tree",
        "Stop a run: its whole process tree is terminated (SIGTERM, a grace period, "
        f"SIGKILL). A run that has already finished is left alone. {WORD_HELP} For a group, the "
        "latest run of every member is cancelled, all at once; failures are reported together.",
        RUN_WORD,
    )  # fmt: skip
    command(
        commands, "fetch", cmd_fetch, "bring a succeeded run's outputs home, verified",
        "Fetch a succeeded run's outputs, verify them against the manifest taken where "
        "it ran, and move them into place one rename per output (nothing half-fetched is ever "
        "left at a final path). By default into the project, at the declared output paths, "
        "replacing what stands there; with --to, under another folder. Works for any run the "
        "store still holds whose outputs are still there (not torn down), also after the "
        "configuration changed.",
        RUN_ID, arg("--to", metavar="DIR", help="put the outputs under DIR instead of the project"),
    )  # fmt: skip
    command(
        commands, "teardown", cmd_teardown, "remove what a run holds (folders, machines)",
        "Remove what a run holds: its working folders (local), its remote folder "
        "(ssh) or its cluster (skypilot). The handle and the logs stay. A run still going is "
        "cancelled first.",
        RUN_ID,
    )  # fmt: skip
    command(
        commands, "why", cmd_why, "say whether a step is up to date, and what changed",
        "Say whether a remote step is up to date and, if not, which of its inputs, "
        "command, settings, env or outputs changed, naming the paths. Loads the project's dodo "
        "file to see the step as it is declared now. Exit 0 either way.",
        arg("step", help="the step's name, as given to remote_step()"),
        arg("--dodo", metavar="FILE", help="the dodo file (default: dodo.py in the project)"),
    )  # fmt: skip
    command(
        commands, "report", cmd_report, "write an HTML report of the latest doit's runs",
        "Write one self-contained HTML file (no network needed to open it): a timeline of the runs "
        "of the latest doit, each phase (launch, setup, sync, run, fetch, verify + promote) a bar, "
        "where each ran, the steps restored from the cache, and each failure with the end of its log. "
        f"With RUN, that run, step or group instead; with --all, every run. {WORD_HELP}",
        arg("run", nargs="?", metavar="RUN", help="a run id, step, group or run-id prefix"),
        flag("--all", help="every run in the store"),
        arg("-o", "--output", metavar="FILE", help="where to write it (default: substrax-report.html here)"),
    )  # fmt: skip
    from substrax_tasks.cli.cache_commands import add_commands

    add_commands(commands)
    return parser


# ------------------------------------------------------------------ commands


def cmd_status(project: Project, args: argparse.Namespace, out: Console, err: Console) -> int:
    if args.run and args.step:
        args.parser.error("give RUN or --step NAME, not both")
    every, unreadable = project.store.read_all()
    latest = {h.run_id for h in latest_per_step(every)}
    if args.run or args.step:
        word = args.step or args.run
        selected = select(project.store, word, steps_only=bool(args.step), handles=lambda: every)
        # A filtered listing is about those runs only, as `status RUN` always was.
        handles, unreadable = list(selected.runs), []
        named_a_run = selected.kind == "run"
    else:
        handles, named_a_run = every, False
    shown = handles if args.all or named_a_run else [h for h in handles if h.run_id in latest]
    rows: list[tuple[RunHandle, RunStatus]] = []
    for handle in shown:
        try:
            rows.append((handle, project.backend_for(handle).status(handle)))
        except HandleError as exc:  # settings this release cannot use
            unreadable.append(Unreadable(project.store.handle_path(handle.run_id), str(exc)))
        except BackendError as exc:  # e.g. its host is unreachable now
            rows.append((handle, RunStatus("unknown", message=str(exc))))
    # Only when asked: it connects to every host the project names and to
    # SkyPilot, which takes long when one of them cannot be reached.
    leaks, problems = find_leaks(project, every) if args.machines else (None, [])
    if args.json:
        print(status_json(rows, unreadable, leaks, latest))
        return 1 if unreadable else 0
    print_status_table(rows)
    for line in attempt_lines(rows, every_run=named_a_run):
        print(line)
    if not handles and not (args.run or args.step):
        err.print("(steps restored from the run cache have no run here: `substrax-compute steps` "
                  "shows every step of the dodo file)", highlight=False)  # fmt: skip
    copied = [f"run {h.run_id} was launched from the project this one is a copy of: shown here, it stays "
              "that project's (never cancelled, fetched or removed from here)"
              for h, _ in rows if not project.store.owns(h)]  # fmt: skip
    for line in [*copied, *machine_lines(handles, leaks or []), *damaged_cost_lines(rows),
                 *(f"could not look for leaks: {p}" for p in problems)]:  # fmt: skip
        err.print(escape(line), highlight=False)
    for record in unreadable:
        message = f"[bold red]unreadable[/] {escape(str(record.path))}: {escape(record.reason)}"
        err.print(message, highlight=False)
    if len(shown) < len(handles):
        hidden = len(handles) - len(shown)
        err.print(f"({hidden} older run(s) not shown; --all lists every run)", highlight=False)
    return 1 if unreadable else 0


def cmd_steps(project: Project, args: argparse.Namespace, out: Console, err: Console) -> int:
    from substrax_tasks.cli.steps_view import step_state, steps_json, steps_table
    from substrax_tasks.step.dodo import load_dodo  # imports doit: only here

    loaded = load_dodo(project.root, Path(args.dodo) if args.dodo else None)
    every, unreadable = project.store.read_all()
    latest = {h.step: h for h in latest_per_step(every)}
    states = [
        step_state(project, driver, loaded.values[name], latest.get(name))
        for name, driver in loaded.drivers.items()
    ]
    print(steps_json(states) if args.json else steps_table(states))
    for record in unreadable:
        message = f"[bold red]unreadable[/] {escape(str(record.path))}: {escape(record.reason)}"
        err.print(message, highlight=False)
    return 1 if unreadable else 0


def restored_record(project: Project, step: str) -> dict[str, Any] | None:
    """What the record of `step` says of its verified outputs, if they were
    restored from the run cache and no run was launched here since."""
    try:
        record = json.loads(project.store.step_record(step).read_text())
    except (OSError, ValueError):
        return None
    verified = record.get("verified") if isinstance(record, dict) else None
    if not isinstance(verified, dict) or not verified.get("restored_from"):
        return None
    if record.get("run_id") != verified.get("run_id"):  # a run was launched here since
        return None
    return verified


def restored_members(project: Project, group: str) -> dict[str, dict[str, Any]]:
    """The members of `group` restored from the run cache (restored_record), by step."""
    found = {}
    for path in project.store.step_records():
        try:
            step = json.loads(path.read_text()).get("step")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(step, str) and group_of(step) == group:
            verified = restored_record(project, step)
            if verified is not None:
                found[step] = verified
    return found


def kept_log(project: Project, step: str, verified: dict[str, Any]) -> tuple[str, bytes]:
    """The log the cache entry keeps of the run that made the restored
    `step`'s outputs, and a line saying so; SubstraxError if it cannot be shown."""
    from substrax_tasks.cli.cache_commands import run_cache

    made_by, key = verified.get("run_id"), str(verified.get("cache_key") or "")
    kept = run_cache(project).kept_log(key) if key else "its record names no cache entry"
    if isinstance(kept, str):
        raise SubstraxError(
            f"{step} was restored from {verified['restored_from']}, made by run {made_by}, and its log "
            f"cannot be shown: {kept}. `doit -a {step}` runs the step here, with a log of its own"
        )
    log, provenance = kept
    said = (f"{step}: restored from {verified['restored_from']}; the log of run "
            f"{provenance.get('run_id')} on {provenance.get('backend')} ({provenance.get('host')}), "
            "as the cache entry keeps it")  # fmt: skip
    return said, log


def restored_step_log(project: Project, word: str, err: Console) -> bool:
    """`logs STEP` of a step whose outputs were restored from the run cache
    (and not run here since): the log the cache entry keeps of the run that
    made it, printed; False if `word` names no such step."""
    verified = restored_record(project, word)
    if verified is None:
        return False
    said, log = kept_log(project, word, verified)
    err.print(escape(said), highlight=False)
    sys.stdout.buffer.write(log)
    sys.stdout.buffer.flush()
    return True


def cmd_logs(project: Project, args: argparse.Namespace, out: Console, err: Console) -> int:
    if restored_step_log(project, args.run, err):
        if args.follow:
            err.print(f"{args.run} is not running: it was restored from the run cache", highlight=False)
        return 0
    restored = restored_members(project, args.run)
    try:
        selected: Selection | None = select(project.store, args.run)
    except NoSuchRun:
        if not restored:  # a group all restored has no runs: its members' kept logs
            raise
        selected = None
    if selected is not None and selected.kind != "group":
        handle = selected.latest()[0]
        status = project.backend_for(handle).stream_log(handle, sys.stdout.buffer, follow=args.follow)
        if args.follow and status.state != "succeeded":
            err.print(f"run {handle.run_id} ended: {status.state}", highlight=False)
        return 0
    # Each member's latest run, or the run the cache kept the log of where
    # its outputs were restored (then after the runs, by name).
    runs = [h for h in selected.latest() if h.step not in restored] if selected is not None else []
    members: list[tuple[str, RunHandle | None]] = [(h.step, h) for h in runs]
    members += [(step, None) for step in sorted(restored)]
    if args.follow:
        raise SubstraxError(
            f"{args.run} is a group of {len(members)} steps ({shortened(sorted(s for s, _ in members))}); "
            f"--follow follows one run: substrax-compute logs --follow {members[0][0]}"
        )
    # One after the other, each under a header as `tail` prints several
    # files: a member whose log cannot be read does not hide the others.
    failures: list[Exception] = []
    for number, (step, run) in enumerate(members):
        which = run.run_id if run is not None else f"restored: {restored[step].get('restored_from')}"
        header = f"==> {step} ({which}) <==\n"
        sys.stdout.write(header if number == 0 else "\n" + header)
        sys.stdout.flush()  # the header before the log's bytes, written below it
        try:
            if run is None:
                sys.stdout.buffer.write(kept_log(project, step, restored[step])[1])
            else:
                project.backend_for(run).stream_log(run, sys.stdout.buffer, follow=False)
        except SubstraxError as exc:
            failures.append(member_failure(run, exc) if run is not None else exc)
        sys.stdout.buffer.flush()
    if failures:
        message = f"{len(failures)} of {len(members)} logs of {args.run} could not be read"
        raise ExceptionGroup(message, failures)
    return 0


def cmd_cancel(project: Project, args: argparse.Namespace, out: Console, err: Console) -> int:
    selected = select(project.store, args.run)
    runs = selected.latest()
    if selected.kind == "group":
        note = f"{selected.name}: cancelling the latest run of each of its {len(runs)} steps"
        out.print(escape(note), highlight=False)
    if len(runs) == 1:  # in this thread, as always: Ctrl-C reaches it
        outcomes = [cancel_one(project, runs[0])]
    else:  # every run is attempted, whatever happens to the others
        with ThreadPoolExecutor(max_workers=min(CANCEL_THREADS, len(runs))) as pool:
            outcomes = list(pool.map(lambda handle: cancel_one(project, handle), runs))
    for line in (o for o in outcomes if isinstance(o, str)):
        out.print(line, highlight=False)
    failures = [(h, o) for h, o in zip(runs, outcomes, strict=True) if isinstance(o, Exception)]
    if len(runs) == 1 and failures:
        raise failures[0][1]  # as a cancel of one run always reported it
    if failures:
        message = f"{len(failures)} of {len(runs)} runs of {selected.name} were not cancelled"
        raise ExceptionGroup(message, [member_failure(h, exc) for h, exc in failures])
    return 0


def own_run(project: Project, handle: RunHandle) -> RunHandle:
    """The run, if this client launched it: one recorded in a copy of
    another project's state folder stays that project's (store/client.py)."""
    if not project.store.owns(handle):
        raise SubstraxError(
            f"run {handle.run_id} was launched from the project this one is a copy of: it is that "
            "project's to cancel, fetch or tear down; run the command there"
        )
    return handle


def cancel_one(project: Project, handle: RunHandle) -> str | Exception:
    """Cancel one run: what to print, or why it failed."""
    try:
        backend = project.backend_for(own_run(project, handle))
        if not backend.cancel(handle):
            state = backend.status(project.store.read(handle.run_id)).state
            return f"run {handle.run_id} had already finished ({state}); nothing to cancel"
        # The handle as cancel left it: it recorded how the run ended.
        ended = backend.status(project.store.read(handle.run_id))
        return f"run {handle.run_id}: {ended.state}"
    except (SubstraxError, ExceptionGroup, OSError) as exc:
        return exc


def member_failure(handle: RunHandle, exc: Exception) -> SubstraxError:
    """One run's failure, among a group's, as one line naming its step."""
    text = str(exc)
    if isinstance(exc, ExceptionGroup):  # a skypilot cancel's several failures
        text = f"{exc.message}: " + "; ".join(str(e) for e in exc.exceptions)
    return SubstraxError(f"{handle.step} ({handle.run_id}): {text}")


def cmd_fetch(project: Project, args: argparse.Namespace, out: Console, err: Console) -> int:
    from substrax_tasks.run.promote import (
        JOURNAL,
        NotProduced,
        promote_verified,
        replaced_extras,
        said_extras,
        verify_staged,
    )
    from substrax_tasks.run.steplock import StepLock
    from substrax_tasks.uptodate.manifests import ManifestError

    handle = own_run(project, project.store.read(args.run))
    backend = project.backend_for(handle)
    status = backend.status(handle)
    if status.state != "succeeded":
        raise BackendError(
            f"run {handle.run_id} is {status.state}: only a succeeded run has outputs to fetch"
        )
    # The run's staging folder is one client's at a time (promote.verify_staged):
    # a doit driving the step holds this lock too.
    lock = StepLock(project.store.step_lock(handle.step), handle.step)
    lock.acquire()
    try:
        if not backend.outputs_available(handle):
            raise BackendError(
                f"run {handle.run_id}: its outputs are no longer where it ran (torn down, or its "
                "lifetime ran out); `doit` reruns the step"
            )
        outputs = list(handle.spec.outputs)
        base = Path(str(handle.state.project or project.root))
        dest = Path(args.to).resolve() if args.to else base
        cache = project.store.run_dir(handle.run_id) / "fetch-cache.json"
        try:
            verified = verify_staged(backend.fetch(handle), outputs, cache, f"run {handle.run_id}")
        except (ManifestError, NotProduced) as exc:  # as the chain says it
            raise SubstraxError(f"run {handle.run_id}: {exc}; nothing was promoted") from None
        in_place = verified.root.resolve() == base.resolve()
        if in_place and dest == base:
            out.print(f"run {handle.run_id}: its outputs are in place and verified", highlight=False)
            return 0
        if in_place:
            raise BackendError(
                f"run {handle.run_id} wrote its outputs in place (no sandbox); copy them from {base}"
            )
        try:
            extras = replaced_extras(verified, dest, outputs)
            promote_verified(verified, dest, outputs, project.store.run_dir(handle.run_id) / JOURNAL, cache)
        except OSError as exc:
            raise SubstraxError(
                f"run {handle.run_id}: could not move its outputs into place under {dest} ({exc}); "
                "fix that, then fetch it again"
            ) from None
    finally:
        lock.release()
    if extras:
        out.print(escape(said_extras(extras, f"run {handle.run_id}")), highlight=False)
    out.print(
        f"run {handle.run_id}: {len(outputs)} output(s) fetched into {dest}, verified against its manifest",
        highlight=False,
    )
    return 0


def cmd_teardown(project: Project, args: argparse.Namespace, out: Console, err: Console) -> int:
    handle = own_run(project, project.store.read(args.run))
    project.backend_for(handle).teardown(handle, force=True)
    from substrax_tasks.run.spending import record_release

    record_release(project.store, handle)
    out.print(f"run {handle.run_id}: torn down (handle and logs kept)", highlight=False)
    return 0


def cmd_report(project: Project, args: argparse.Namespace, out: Console, err: Console) -> int:
    if args.run and args.all:
        args.parser.error("give RUN or --all, not both")
    from substrax_tasks.cli.report import write_report

    path = write_report(project, args.run, args.all, Path(args.output) if args.output else None)
    out.print(f"report written to {escape(str(path))}", highlight=False)
    return 0


def cmd_why(project: Project, args: argparse.Namespace, out: Console, err: Console) -> int:
    from substrax_tasks.step.dodo import find_step  # imports doit: only here
    from substrax_tasks.uptodate.check import status

    driver, doit_values = find_step(project.root, args.step, Path(args.dodo) if args.dodo else None)
    # The very function doit's check calls: `why` cannot disagree with it.
    reasons = status(driver.step, doit_values, every_reason=True).reasons
    if not reasons:
        out.print(f"{args.step}: up to date", highlight=False)
        return 0
    out.print(f"{args.step}: not up to date", highlight=False)
    for reason in reasons:
        out.print(f"  - {escape(reason)}", highlight=False)
    from substrax_tasks.cli.cache_commands import run_cache
    from substrax_tasks.uptodate.check import key_parts

    cache = run_cache(project)
    found = cache.find(key_parts(driver.step)) if cache.settings.used() else None
    if found:
        said = f"  it would be restored from {found} (`doit -a {args.step}` runs it)"
        out.print(escape(said), highlight=False)
    return 0


# ------------------------------------------------------------------ helpers

def console(stream: TextIO) -> Console:
    """Messages are never broken inside a path; away from a terminal (a pipe,
    a file) nothing is cut or wrapped to 80 columns either. No emoji codes:
    a step "fit:b" followed by ":" would print as an emoji."""
    width = None if stream.isatty() else 10_000
    return Console(file=stream, soft_wrap=True, width=width, emoji=False)


def reader_went_away() -> int:
    """stdout's reader closed the pipe (`status | head -1`): what it read
    was all it wanted. Nothing more is printed, no traceback; stdout goes to
    /dev/null so the interpreter's last flush cannot fail on it. Exit 1, as
    a program killed by SIGPIPE would not have exited 0 either."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out, err = console(sys.stdout), console(sys.stderr)
    try:
        root = Path(args.project) if args.project is not None else find_project(Path.cwd())
        project = Project.open(root, invalid_ok=True)
        if project.config_error is not None:
            err.print(
                f"[bold red]error:[/] {escape(str(project.config_error))}\n"
                "(runs are reached with the settings pinned in their handles)",
                highlight=False,
            )
        code: int = args.func(project, args, out, err)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the interpreter's exit
    except SubstraxError as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
        return 1
    except ExceptionGroup as group:  # cancel attempts every step: each failure is shown
        err.print(f"[bold red]error:[/] {escape(group.message)}", highlight=False)
        for failure in group.exceptions:
            err.print(f"  - {escape(str(failure))}", highlight=False)
        return 1
    except KeyboardInterrupt:
        err.print("interrupted", highlight=False)
        return 1
    except BrokenPipeError:
        return reader_went_away()
    # status reports on everything: a broken configuration fails it
    return 1 if project.config_error is not None and args.func is cmd_status else code


if __name__ == "__main__":
    sys.exit(main())
