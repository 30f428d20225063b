"""`substrax-compute`: look at, follow, cancel and clean up runs.

Exit codes: 0 ok, 1 failure (the message says what and what to do), 2 usage.
Every command acts on a run through its handle's pinned settings, never the
current pyproject.toml.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from substrax_tasks import __version__
from substrax_tasks.backends.base import RunStatus
from substrax_tasks.errors import SubstraxError
from substrax_tasks.handle import RunHandle
from substrax_tasks.runs import Project

EPILOG = "Exit codes: 0 ok, 1 failure, 2 usage error."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="substrax-compute",
        description="Inspect and control the runs of remote_step() steps.",
        epilog=EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--project", default=".", metavar="DIR", help="the project folder (default: the current folder)"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    status = commands.add_parser(
        "status", help="list runs and their states", description="List runs (or one run) and their states. "
        "Records that cannot be read are named with the reason, and the exit code is then 1.",
    )
    status.add_argument("run", nargs="?", help="a run id (or a unique prefix of one)")
    status.add_argument("--json", action="store_true", help='print {"runs": [...], "unreadable": [...]}')
    status.set_defaults(func=cmd_status)

    logs = commands.add_parser("logs", help="print a run's log", description="Print a run's log (stdout and stderr of its command, and the worker's notes).")
    logs.add_argument("run", help="a run id (or a unique prefix of one)")
    logs.add_argument("--follow", "-f", action="store_true", help="keep printing until the run ends")
    logs.set_defaults(func=cmd_logs)

    cancel = commands.add_parser(
        "cancel", help="stop a run and its whole process tree",
        description="Stop a run: its whole process tree is terminated (SIGTERM, a grace period, "
        "SIGKILL). A run that has already finished is left alone.",
    )
    cancel.add_argument("run", help="a run id (or a unique prefix of one)")
    cancel.set_defaults(func=cmd_cancel)

    teardown = commands.add_parser(
        "teardown", help="remove what a run holds (folders, machines)",
        description="Remove what a run holds: its working folders (local), its remote folder "
        "(ssh) or its cluster (skypilot). The handle and the logs stay. A run still going is "
        "cancelled first.",
    )
    teardown.add_argument("run", help="a run id (or a unique prefix of one)")
    teardown.set_defaults(func=cmd_teardown)
    return parser


# ------------------------------------------------------------------ commands


def cmd_status(project: Project, args: argparse.Namespace, out: Console, err: Console) -> int:
    if args.run:
        handles, unreadable = [project.store.read(args.run)], []
    else:
        handles, unreadable = project.store.read_all()
    rows = [(h, project.backend_for(h).poll(h)) for h in handles]
    if args.json:
        print(
            json.dumps(
                {
                    "runs": [run_record(h, s) for h, s in rows],
                    "unreadable": [{"path": str(u.path), "reason": u.reason} for u in unreadable],
                },
                indent=1,
            )
        )
    else:
        table = Table(title=None if rows else "no runs yet", show_edge=False)
        for column in ("run", "step", "backend", "state", "started", "duration"):
            table.add_column(column, no_wrap=column in ("run", "started", "state"))
        for handle, status in rows:
            table.add_row(
                handle.run_id, handle.step, handle.backend, status.state,
                short_time(status.started_at), duration(status),
            )
        out.print(table)
        for record in unreadable:
            err.print(f"[bold red]unreadable[/] {escape(str(record.path))}: {escape(record.reason)}", highlight=False)
    return 1 if unreadable else 0


def cmd_logs(project: Project, args: argparse.Namespace, out: Console, err: Console) -> int:
    handle = project.store.read(args.run)
    status = project.backend_for(handle).stream_log(handle, sys.stdout.buffer, follow=args.follow)
    if args.follow and status.state != "succeeded":
        err.print(f"run {handle.run_id} ended: {status.state}", highlight=False)
    return 0


def cmd_cancel(project: Project, args: argparse.Namespace, out: Console, err: Console) -> int:
    handle = project.store.read(args.run)
    backend = project.backend_for(handle)
    if not backend.cancel(handle):
        out.print(f"run {handle.run_id} had already finished ({backend.poll(handle).state}); nothing to cancel", highlight=False)
        return 0
    out.print(f"run {handle.run_id}: {backend.poll(handle).state}", highlight=False)
    return 0


def cmd_teardown(project: Project, args: argparse.Namespace, out: Console, err: Console) -> int:
    handle = project.store.read(args.run)
    project.backend_for(handle).teardown(handle)
    out.print(f"run {handle.run_id}: torn down (handle and logs kept)", highlight=False)
    return 0


# ------------------------------------------------------------------ helpers


def run_record(handle: RunHandle, status: RunStatus) -> dict[str, Any]:
    return {
        "run_id": handle.run_id,
        "step": handle.step,
        "backend": handle.backend,
        "state": status.state,
        "created_at": handle.created_at,
        "started_at": status.started_at,
        "ended_at": status.ended_at,
        "exit_code": status.exit_code,
        "message": status.message,
    }


def parse_time(value: str | None) -> datetime.datetime | None:
    if not value:
        return None
    try:
        return datetime.datetime.fromisoformat(value)
    except ValueError:
        return None


def short_time(value: str | None) -> str:
    moment = parse_time(value)
    return moment.astimezone().strftime("%Y-%m-%d %H:%M:%S") if moment else "-"


def duration(status: RunStatus) -> str:
    start = parse_time(status.started_at)
    if start is None:
        return "-"
    end = parse_time(status.ended_at) or datetime.datetime.now(datetime.timezone.utc)
    seconds = max(0, int((end - start).total_seconds()))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out, err = Console(), Console(stderr=True)
    try:
        project = Project.open(args.project)
        code: int = args.func(project, args, out, err)
    except SubstraxError as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
        return 1
    except KeyboardInterrupt:
        err.print("interrupted", highlight=False)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
