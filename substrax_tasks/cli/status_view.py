"""How `substrax-compute status` shows runs: the table, and the record of
each run in `status --json` (whose keys scripts rely on)."""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from typing import Any

from substrax_tasks.backends.base import Leak, RunStatus
from substrax_tasks.store import cost
from substrax_tasks.store.handle import RunHandle, checkpoints_words
from substrax_tasks.store.phase import Phase
from substrax_tasks.store.run_store import Unreadable
from substrax_tasks.store.selection import group_of

STATUS_COLUMNS = ("run", "step", "backend", "state", "started", "duration")


def plain_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]
    lines = [
        "  ".join(str(cell).ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in [headers, *rows]
    ]
    return "\n".join(lines)


def lifetime_left(handle: RunHandle) -> float | None:
    """Seconds until the run's lifetime timer ends it, as its backend reads
    it from the handle; None for a backend this release does not know."""
    from substrax_tasks.backends.registry import backend_class

    try:
        return backend_class(handle.backend).lifetime_left(handle)
    except KeyError:
        return None


def released(handle: RunHandle) -> bool:
    from substrax_tasks.backends.registry import backend_class

    try:
        return backend_class(handle.backend).released(handle)
    except KeyError:
        return False


def machine_end(handle: RunHandle, status: RunStatus) -> float | None:
    """When the run's machine was let go, where its handle does not say
    (the chain records it as it tears the run down): a run torn down
    otherwise (`cancel`, `gc`), or that holds no machine past its command,
    as its command ended; one whose lifetime timer ran out, then; one whose
    launch failed, as it failed; None while it may still hold one."""
    if not handle.state.reached(Phase.LAUNCHED):
        failed = handle.state.times.get("launch")
        at = parse_time(failed.get("end")) if isinstance(failed, dict) else None
        return at.timestamp() if at else None
    ended = parse_time(status.ended_at)
    left = lifetime_left(handle)
    if released(handle) or (status.final and left is None):
        return ended.timestamp() if ended else None
    if left is not None and left < 0:
        return datetime.datetime.now(datetime.timezone.utc).timestamp() + left
    return None


@dataclass(frozen=True)
class Spent:
    """A run's machine time, price, cost so far and cap, as `status` shows them."""

    seconds: float | None
    hourly_cost: float | None
    usd: float | None
    cap: float | None
    projected: bool = False  # the cost of a warm cluster's last run, up to its keep-warm's foreseen end


def held(handle: RunHandle, status: RunStatus) -> list[cost.MachineTime]:
    """The machines the run held, one per attempt (store/cost.py)."""
    return cost.machine_intervals(handle, held_until=machine_end(handle, status))


def spent(handle: RunHandle, status: RunStatus, intervals: list[cost.MachineTime] | None = None) -> Spent:
    """The run's figures: over all its attempts' machines (`intervals`, read when not given)."""
    intervals = held(handle, status) if intervals is None else intervals
    if not intervals:  # none recorded, or a damaged record: its cost is not known, its cap is
        return Spent(None, None, None, cost.cap_of(handle))
    return Spent(cost.machine_seconds(intervals), intervals[-1].hourly_cost, cost.cost_of(intervals),
                 cost.cap_of(handle), any(i.projected for i in intervals))  # fmt: skip


def attempt_figures(handle: RunHandle, intervals: list[cost.MachineTime]) -> list[Spent | None]:
    """Each attempt's machine time, price and cost, as `spent` counts the
    run's (their sum): one machine per attempt (store/cost.py). None for
    each where the machines do not match the attempts one to one (a free
    machine records none; a handle from before either was recorded)."""
    attempts = handle.state.attempts
    if len(intervals) != len(attempts):
        return [None] * len(attempts)
    return [Spent(cost.machine_seconds([i]), i.hourly_cost, cost.cost_of([i]), None, i.projected)
            for i in intervals]  # fmt: skip


@dataclass(frozen=True)
class GroupTotal:
    group: str
    runs: int
    usd: float | None  # None when a run's price is unknown
    caps: float | None  # the sum of the runs' caps; None when one has none


def group_totals(rows: list[tuple[RunHandle, RunStatus]]) -> list[GroupTotal]:
    """Each group's runs among `rows`: what they cost together, against
    the sum of their caps."""
    groups: dict[str, list[Spent]] = {}
    for handle, status in rows:
        group = group_of(handle.step)
        if group is not None:
            groups.setdefault(group, []).append(spent(handle, status))
    totals = []
    for group, runs in groups.items():
        costs, caps = [r.usd for r in runs], [r.cap for r in runs]
        totals.append(GroupTotal(
            group, len(runs), None if None in costs else sum(c or 0.0 for c in costs),
            None if None in caps else sum(c or 0.0 for c in caps),
        ))  # fmt: skip
    return totals


def group_line(total: GroupTotal) -> str:
    caps = f" of max_cost {cost.usd(total.caps)} (the sum of their caps)" if total.caps is not None else ""
    return f"group {total.group}: {cost.usd(total.usd)} over {total.runs} run(s){caps}"


def run_record(handle: RunHandle, status: RunStatus, *, latest: bool) -> dict[str, Any]:
    """One run of `status --json`. Scripts read these keys: add new ones,
    never rename or drop one."""
    intervals = held(handle, status)
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
        "group": group_of(handle.step),
        "latest": latest,
        "lifetime_left_seconds": lifetime_left(handle),
        "gpus": status.gpus,
        # each attempt of its command: machine, times, the checkpoints it started from, its end, its cost
        "attempts": [a.model_dump(mode="json") | attempt_cost(f)
                     for a, f in zip(handle.state.attempts, attempt_figures(handle, intervals), strict=True)],
        **cost_record(spent(handle, status, intervals)),
    }


def attempt_cost(figures: Spent | None) -> dict[str, Any]:
    """An attempt's own machine time, price and cost in `status --json` (null: not known)."""
    if figures is None:
        return {"machine_seconds": None, "hourly_cost": None, "cost_usd": None}
    return {"machine_seconds": figures.seconds, "hourly_cost": figures.hourly_cost, "cost_usd": figures.usd}


def damaged_cost_lines(rows: list[tuple[RunHandle, RunStatus]]) -> list[str]:
    """A line for each run whose machine record is damaged: its cost shows as not known."""
    return [f"run {handle.run_id}: its cost is not known: its machine record is damaged ({damage})"
            for handle, _status in rows if (damage := cost.machine_damage(handle)) is not None]  # fmt: skip


def cost_record(figures: Spent) -> dict[str, Any]:
    return {"machine_seconds": figures.seconds, "hourly_cost": figures.hourly_cost, "cost_usd": figures.usd,
            "max_cost": figures.cap, "cost_projected": figures.projected}  # fmt: skip


def status_json(
    rows: list[tuple[RunHandle, RunStatus]], unreadable: list[Unreadable], leaks: list[Leak] | None,
    latest: set[str],
) -> str:
    """`status --json`; `leaks` None when they were not looked for."""
    return json.dumps({
        "runs": [run_record(h, s, latest=h.run_id in latest) for h, s in rows],
        "groups": [{"group": t.group, "runs": t.runs, "cost_usd": t.usd, "max_cost": t.caps}
                   for t in group_totals(rows)],
        "unreadable": [{"path": str(u.path), "reason": u.reason} for u in unreadable],
        # null, not "none leaked", when not looked for
        "leaked": None if leaks is None else
        [{"backend": k.backend, "where": k.where, "name": k.name, "ours": k.ours}
         | ({"warm": k.warm} if k.warm is not None else {})
         | ({"kind": k.kind} if k.kind is not None else {}) for k in leaks],
    }, indent=1)  # fmt: skip


def machine_lines(handles: list[RunHandle], leaks: list[Leak]) -> list[str]:
    """What may still hold a machine: runs and their time left, then leaks."""
    lines = []
    for handle in handles:
        left = lifetime_left(handle)
        if left is not None:
            late = f"{clock(-left, tenths=False)} ago (overdue)"
            when = f"in {clock(left, tenths=False)}" if left > 0 else late
            lines.append(f"run {handle.run_id} may still hold a machine: its lifetime timer ends it {when}")
    for leak in leaks:
        if leak.warm is not None:
            lines.append(f"warm cluster {leak.name} on {leak.where}: {leak.warm}; `substrax-compute gc "
                         "--machines` takes it down")  # fmt: skip
            continue
        if leak.kind == "environment":
            lines.append(f"unused environment {leak.name} on {leak.where}: no run folder there names it and "
                         "none used it for days; `substrax-compute gc --machines` removes it")  # fmt: skip
            continue
        fix = ("`substrax-compute gc --machines` removes it" if leak.ours else
               "no handle of this project names it: another project's, or leaked before")
        kind = "cluster" if leak.where == "SkyPilot" else "run folder"
        lines.append(f"leaked {kind} {leak.name} on {leak.where}: no live handle accounts for it; {fix}")
    return lines


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


def seconds_between(started_at: str | None, ended_at: str | None) -> float | None:
    """How long a run took, or has taken so far (no end yet); None if it has not started."""
    start = parse_time(started_at)
    if start is None:
        return None
    end = parse_time(ended_at) or datetime.datetime.now(datetime.timezone.utc)
    return (end - start).total_seconds()


def duration(handle: RunHandle, status: RunStatus) -> str:
    """How long its command ran: over all its attempts when it was
    relaunched, as its cost counts every attempt's machine."""
    seconds = seconds_between(status.started_at, status.ended_at)
    attempts = handle.state.attempts
    if len(attempts) < 2:
        return "-" if seconds is None else clock(seconds, tenths=True)
    # The last attempt as the backend sees it now (it may be going); the earlier ones as recorded.
    earlier = sum(seconds_between(a.started_at, a.ended_at) or 0.0 for a in attempts[:-1])
    return f"{clock(earlier + (seconds or 0.0), tenths=True)} over {len(attempts)} attempts"


def clock(seconds: float, *, tenths: bool = True) -> str:
    """[h:]mm:ss.s, or [h:]mm:ss without `tenths` (a timer's time left):
    a step of a sweep takes a second or two, which whole seconds show as 0:00."""
    if tenths:
        whole, tenth = divmod(round(max(0.0, seconds) * 10), 10)
    else:
        whole, tenth = max(0, int(seconds)), 0
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
    return f"{text}.{tenth}" if tenths else text


def print_status_table(rows: list[tuple[RunHandle, RunStatus]]) -> None:
    """Plain columns, on a terminal as in a pipe: what scripts and `grep`
    read, and fast for a store of a thousand runs. The GPUs each run was
    given go in a column shown only when a run has any."""
    with_gpus = any(s.gpus for _h, s in rows)
    figures = [spent(h, s) for h, s in rows]
    # The cost column once a run has a price (a run on this machine with
    # no hourly_cost set costs nothing and shows none).
    with_cost = any(f.hourly_cost for f in figures)
    columns = [*STATUS_COLUMNS, *(["cost"] if with_cost else []), *(["gpus"] if with_gpus else [])]
    cells = [
        [h.run_id, h.step, h.backend, s.state, short_time(s.started_at), duration(h, s)]
        + ([cost_cell(f)] if with_cost else [])
        + ([",".join(s.gpus or []) or "-"] if with_gpus else [])
        for (h, s), f in zip(rows, figures, strict=True)
    ]
    print(plain_table(columns, cells) if rows else "no runs yet")
    if with_cost:
        for total in group_totals(rows):
            print(group_line(total))


def attempt_lines(rows: list[tuple[RunHandle, RunStatus]], *, every_run: bool) -> list[str]:
    """Each attempt of the runs that were relaunched (`preemptions`), or of
    every run shown when `every_run` (a run named): where it ran, when, the
    checkpoints it started from, how it ended, and on a priced machine its
    machine time and cost (the run's cost in the table is their sum)."""
    lines = []
    for handle, status in rows:
        attempts = handle.state.attempts
        if len(attempts) < 2 and not (every_run and attempts):
            continue
        for a, figures in zip(attempts, attempt_figures(handle, held(handle, status)), strict=True):
            ran = seconds_between(a.started_at, a.ended_at)
            lines.append(
                f"run {handle.run_id} attempt {a.number} on {a.machine}: started {short_time(a.started_at)}"
                f", ran {'-' if ran is None else clock(ran)}, {a.outcome or 'going'}"
                + (f" ({a.message})" if a.message and a.outcome != "succeeded" else "")
                + (f"; from {checkpoints_words(a.snapshot)}" if a.snapshot else "; from no checkpoints")
                + (f"; its machine {clock(figures.seconds or 0.0)}, cost {cost.usd(figures.usd)}"
                   if figures is not None and figures.hourly_cost else "")
            )
    return lines


def cost_cell(figures: Spent) -> str:
    """$0.0123, with its cap where it has one: $0.0123/$0.0500; ~$0.0123 projected (a warm
    cluster's last run, its keep-warm counted to its foreseen end)."""
    said = cost.usd(figures.usd) + (f"/{cost.usd(figures.cap)}" if figures.cap is not None else "")
    return f"~{said}" if figures.projected and figures.usd is not None else said
