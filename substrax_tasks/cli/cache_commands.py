"""`substrax-compute cache status|push|forget` and `substrax-compute gc`."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

from substrax_tasks.cache.run_cache import CacheOptions, RunCache, human_size
from substrax_tasks.cache.storage import Damaged
from substrax_tasks.cli.arguments import arg, command, flag
from substrax_tasks.constants import CACHE_ENV
from substrax_tasks.errors import BackendError, SubstraxError
from substrax_tasks.run.promote import remove_path
from substrax_tasks.store.gc import (
    kept_checkpoints,
    removable,
    remove_leaks,
    stale_checkpoints,
    verified_records,
)
from substrax_tasks.store.project import Project

if TYPE_CHECKING:
    from substrax_tasks.backends.base import KeptCheckpoints


def add_commands(commands: Any) -> None:
    cache = command(
        commands, "cache", cmd_cache, "look at and manage the cache of verified runs",
        "The cache of verified runs (docs/cache.md): status shows its entries, size and "
        "this project's hits and misses; push uploads a step's local entry (or every step's) to "
        "the shared store; forget removes a step's entry (from the shared store too in readwrite mode).",
    )  # fmt: skip
    actions = cache.add_subparsers(dest="action", required=True, metavar="ACTION")
    command(actions, "status", cmd_cache, "entries, size, hits and misses", "")
    step = arg("step", nargs="?", metavar="STEP", help="the step whose verified outputs to upload")
    command(actions, "push", cmd_cache, "upload local entries to the shared store", "",
            step, flag("--all", help="every step of the project"))  # fmt: skip
    command(actions, "forget", cmd_cache, "remove a step's entry", "", arg("step", metavar="STEP"))
    command(
        commands, "gc", cmd_gc, "prune old runs' files and trim the local cache",
        "Remove what finished runs no longer need from the store (staging folders, "
        "fetched copies, manifests no step record points to), keeping each run's handle, status "
        "and logs; never touches a run still going or whose outputs are not home yet. Then trim "
        "the local cache to max_size (and, with --older-than, drop its entries not used for that "
        "many days). Checkpoints kept for a key no step of the dodo file has any more (a changed "
        "command or input, a step removed) go too. --machines also removes the remote run folders "
        "and clusters of this project "
        "that no live handle accounts for (leaked; `status --machines` lists them), stopping what "
        "runs there. --dry-run lists what would go.",
        flag("--dry-run", "-n", help="list what would be removed; remove nothing"),
        arg("--older-than", metavar="DAYS", type=_days, default=None,
            help="also remove local cache entries not restored or stored for DAYS days"),
        flag("--machines", help="also remove leaked run folders and clusters"),
        arg("--dodo", metavar="FILE",
            help="the dodo file whose steps' checkpoints are kept (default: dodo.py in the project)"),
    )  # fmt: skip


def _stale_checkpoints(
    project: Project, args: argparse.Namespace, handles: list[Any], kept: list[KeptCheckpoints]
) -> list[KeptCheckpoints]:
    """The checkpoints of keys no step of the dodo file has now
    (store/gc.py); the dodo is loaded (and each such step's key taken) only
    when some are kept."""
    if not kept:
        return []
    from substrax_tasks.step.dodo import load_dodo  # imports doit: only here
    from substrax_tasks.uptodate import check as uptodate

    loaded = load_dodo(project.root, Path(args.dodo) if args.dodo else None)
    keys: dict[str, str | None] = {}
    for name, driver in loaded.drivers.items():
        if driver.spec.checkpoints is None:
            continue
        try:
            keys[name] = uptodate.key(uptodate.key_parts(driver.step))
        except SubstraxError:  # its inputs refused now: which key it will have is not known
            keys[name] = None
    return stale_checkpoints(project, keys, handles, kept)


def _days(text: str) -> float:
    try:
        days = float(text)
    except ValueError:
        days = -1.0
    if not days >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of days (e.g. 30, or 0.5)")
    return days


def run_cache(project: Project) -> RunCache:
    return RunCache(CacheOptions(**project.cache), project.root, project.store)


def _cache_key(records: dict[str, dict[str, Any]], step: str) -> str:
    key = records.get(step, {}).get("cache_key")
    if not key:
        raise SubstraxError(f"step {step!r} has no verified outputs here to name an entry; run `doit {step}`")
    return str(key)


def cmd_cache(project: Project, args: argparse.Namespace, out: Console, err: Console) -> int:
    cache, records = run_cache(project), verified_records(project.store)
    if args.action == "status":
        entries, objects = cache.usage()
        # all the folder's bytes: its objects, and the entries' manifests
        # (about 150 bytes a file), signatures, stats and logs
        size = sum(s for s, _ in objects.values()) + sum(own for *_, own in entries)
        settings = cache.settings
        out.print(f"local: {cache.local.name}: {len(entries)} entries, {human_size(size)} on disk "
                  f"(max_size {human_size(settings.max_bytes)}){_off(settings)}",
                  highlight=False)  # fmt: skip
        shared = f"{settings.shared} ({settings.mode})" if settings.shared else "none"
        out.print(f"shared: {escape(shared)}", highlight=False)
        stats = cache.stats()
        counts = f"{stats.get('hits', 0)} hits, {stats.get('misses', 0)} misses"
        out.print(f"this project: {counts}", highlight=False)
        return 0
    if args.action == "forget":
        gone = cache.forget(_cache_key(records, args.step))
        out.print(f"{args.step}: entry removed from {', '.join(gone)}" if gone else
                  f"{args.step}: no entry to remove", highlight=False)  # fmt: skip
        return 0
    if (args.step is None) == (not args.all):
        args.parser.error("give STEP or --all")
    steps = [args.step] if args.step else [step for step, v in records.items() if v.get("cache_key")]
    for step in steps:
        try:
            sent = cache.push(_cache_key(records, step))
        except Damaged as exc:
            raise SubstraxError(f"{step}: {exc}") from None
        except Exception as exc:
            raise BackendError(f"{step}: pushing to {project.cache['shared']} failed: {exc}") from exc
        out.print(f"{step}: pushed ({sent} new objects)", highlight=False)
    return 0


def _off(settings: CacheOptions) -> str:
    if not settings.enabled:
        return "; disabled"
    return "" if settings.used() else f"; off here ({CACHE_ENV}=off)"


# ------------------------------------------------------------------ gc


def cmd_gc(project: Project, args: argparse.Namespace, out: Console, err: Console) -> int:
    verb = "would remove" if args.dry_run else "removed"
    handles = project.store.read_all()[0]
    for path in removable(project, handles):
        out.print(f"{verb} {escape(str(path))}", highlight=False)
        if not args.dry_run:
            remove_path(path)
    for what in run_cache(project).trim(dry_run=args.dry_run, older_than_days=args.older_than):
        out.print(f"{verb} cache {escape(what)}", highlight=False)
    kept, problems = kept_checkpoints(project, handles)
    try:
        stale = _stale_checkpoints(project, args, handles, kept)
    except SubstraxError as exc:
        stale = []
        problems.append(f"checkpoints kept, as the dodo file could not be read to tell which are still "
                        f"used: {exc}")  # fmt: skip
    for old in stale:
        out.print(escape(f"{verb} checkpoints {old.where} (step {old.step}: no step of the dodo file has "
                         "that key any more)"), highlight=False)  # fmt: skip
        if not args.dry_run:
            try:
                old.remove()
            except SubstraxError as exc:
                problems.append(f"could not remove the checkpoints {old.where}: {exc}")
            if not old.where.startswith(str(project.store.root)):
                continue
            with contextlib.suppress(OSError):  # the step's last key: its folder goes too
                Path(old.where).parent.rmdir()
    leaks, more = remove_leaks(project, handles, dry_run=args.dry_run) if args.machines else ([], [])
    problems += more
    for leak in leaks:
        out.print(escape(f"{verb} {leak.name} on {leak.where}"), highlight=False)
    for problem in problems:
        err.print(f"[bold red]error:[/] {escape(problem)}", highlight=False)
    return 1 if problems else 0
