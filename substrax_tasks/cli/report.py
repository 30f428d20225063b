"""`substrax-compute report`: one HTML file a person opens to see what a
`doit` did: a timeline of its runs, each phase a coloured bar, where each
ran, restored steps, failures with the end of their log.

The page is self-contained (inline CSS, no script, no font or image
fetched): it opens from a mail attachment or a CI artifact with no network.
What it shows comes from the records alone: the phase times the driver
writes into each handle (run/timeline.py) and the step records of steps
restored from the run cache. A run from before those times were recorded
shows without bars.
"""

from __future__ import annotations

import datetime
import html
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from substrax_tasks.backends.base import RunStatus
from substrax_tasks.cli.status_view import cost_cell, group_line, group_totals, spent
from substrax_tasks.errors import BackendError, HandleError, SubstraxError
from substrax_tasks.run.timeline import PHASES, phase_times
from substrax_tasks.store.cost import usd
from substrax_tasks.store.selection import group_of, latest_per_step, select

if TYPE_CHECKING:
    from substrax_tasks.store.handle import RunHandle
    from substrax_tasks.store.project import Project

# The end of a failed run's log the page shows: enough to see the error.
LOG_TAIL_LINES = 30
LOG_TAIL_BYTES = 8192
DEFAULT_FILE = "substrax-report.html"  # in the current folder, as Nextflow writes timeline.html
LOG_READ_CHUNK = 1 << 20  # what a backend's read_log returns at most per call
PHASE_COLOURS = {
    "launch": "#8e7cc3", "setup": "#e69138", "sync": "#3d85c6",
    "run": "#6aa84f", "fetch": "#45a5a5", "promote": "#c27ba0",
}  # fmt: skip
PHASE_LABELS = {"promote": "verify + promote"}
STATE_COLOURS = {
    "succeeded": "#2e7d32", "failed": "#c62828", "timed_out": "#c62828", "cancelled": "#6d6d6d",
    "lost": "#c62828", "running": "#1565c0", "pending": "#6d6d6d", "restored": "#6a1b9a",
}  # fmt: skip


@dataclass
class RunRow:
    """One run as the page shows it."""

    handle: RunHandle
    status: RunStatus
    where: str
    times: dict[str, dict[str, Any]]
    log_tail: str = ""
    cost: str | None = None  # as `status` shows it: $0.0123, with its cap: $0.0123/$0.0500


@dataclass
class RestoredRow:
    """A step whose outputs came from the run cache: no run, no handle."""

    step: str
    entry: str
    made_by: str
    made_on: str
    at: str | None


@dataclass
class Report:
    title: str
    scope: str
    runs: list[RunRow] = field(default_factory=list)
    restored: list[RestoredRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------ what is shown


def restored_records(project: Project) -> list[tuple[dict[str, Any], RestoredRow]]:
    """Each step whose outputs now in place were restored from the cache,
    with the record's verified part (it names the doit that restored it)."""
    found = []
    for path in project.store.step_records():
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        verified = record.get("verified") if isinstance(record, dict) else None
        if not isinstance(verified, dict) or not verified.get("restored_from"):
            continue
        prov = verified.get("provenance")
        prov = prov if isinstance(prov, dict) else {}
        made_on = f"{prov.get('backend') or '?'} ({prov.get('host') or '?'})"
        found.append((verified, RestoredRow(
            step=str(record.get("step") or path.stem), entry=str(verified["restored_from"]),
            made_by=str(verified.get("run_id") or "?"), made_on=made_on,
            at=verified.get("restored_at") if isinstance(verified.get("restored_at"), str) else None,
        )))  # fmt: skip
    return found


def doits_of(handle: RunHandle) -> set[str]:
    return {str(t["doit"]) for t in phase_times(handle.state.times).values() if t.get("doit")}


def gather(project: Project, word: str | None, every: bool) -> Report:
    """The runs and restores the page covers: a word's (a run, a step, a
    group), every one (--all), or by default those of the latest doit (the
    newest doit id the records carry: each doit process writes its own into
    the times it records)."""
    handles, _unreadable = project.store.read_all()
    restores = restored_records(project)
    if every:
        report = Report("every run", "all runs in the store")
        report.runs = [row_of(project, h) for h in handles]
        report.restored = [r for _v, r in restores]
        return report
    if word is not None:
        selection = select(project.store, word, handles=lambda: handles)
        named = f"{selection.kind} {selection.name}"
        report = Report(named, f"the runs of {named}")
        report.runs = [row_of(project, h) for h in selection.runs]
        steps = set(selection.steps)
        report.restored = [r for _v, r in restores if selection.kind != "run" and (
            r.step in steps or r.step == selection.name or group_of(r.step) == selection.name)]  # fmt: skip
        return report
    ids = set().union(*map(doits_of, handles), (str(v["doit"]) for v, _r in restores if v.get("doit")))
    if not ids:
        report = Report("latest runs", "the latest run of each step")
        if handles:
            report.notes.append("No run records which doit made it (runs from an earlier release): "
                                "the latest run of each step is shown, without phase times.")  # fmt: skip
        report.runs = [row_of(project, h) for h in latest_per_step(handles)]
        return report
    latest = max(ids)  # ids sort as their doits began to act
    started = parse(latest.split("Z-")[0])  # the id begins with when that doit first acted
    when = f"acting from {clock(started)}" if started else latest
    report = Report("latest doit", f"the runs of the latest doit ({when})")
    report.runs = [row_of(project, h) for h in handles if latest in doits_of(h)]
    report.restored = [r for v, r in restores if v.get("doit") == latest]
    return report


def row_of(project: Project, handle: RunHandle) -> RunRow:
    try:
        backend = project.backend_for(handle)
        status = backend.status(handle)
        where = f"{handle.backend} ({backend.ran_on(handle)})"
    except (BackendError, HandleError) as exc:  # its host unreachable now, settings this release refuses
        unknown = RunStatus("unknown", message=str(exc))
        return RunRow(handle, unknown, handle.backend, phase_times(handle.state.times))
    figures = spent(handle, status)  # over all its attempts, as `status` counts it
    kept = handle.state.cost_usd  # a handle from before the machine was recorded: the cost it kept
    cost = (cost_cell(figures) if figures.hourly_cost else
            usd(kept) if isinstance(kept, (int, float)) else None)  # fmt: skip
    row = RunRow(handle, status, where, phase_times(handle.state.times), cost=cost)
    if status.final and status.state != "succeeded":
        try:
            row.log_tail = log_tail(backend.read_log, handle)
        except SubstraxError as exc:
            row.log_tail = f"(its log could not be read: {exc})"
    return row


def log_tail(read_log: Any, handle: RunHandle) -> str:
    """The last lines of a run's log, read in the chunks its backend gives."""
    offset, tail = 0, b""
    while True:
        chunk: bytes = read_log(handle, offset)
        tail = (tail + chunk)[-LOG_TAIL_BYTES:]
        offset += len(chunk)
        if len(chunk) < LOG_READ_CHUNK:
            break
    lines = tail.decode(errors="replace").splitlines()
    return "\n".join(lines[-LOG_TAIL_LINES:])


# ------------------------------------------------------------------ the page


def parse(value: str | None) -> datetime.datetime | None:
    if not value:
        return None
    try:
        moment = datetime.datetime.fromisoformat(value)
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=datetime.timezone.utc)


def seconds(value: float) -> str:
    """A duration as a person reads it, to a tenth of a second."""
    if value < 60:
        return f"{value:.1f} s"
    minutes, secs = divmod(value, 60)
    if minutes < 60:
        return f"{int(minutes)} min {secs:04.1f} s"
    hours, minutes = divmod(minutes, 60)
    return f"{int(hours)} h {int(minutes):02d} min"


def clock(moment: datetime.datetime) -> str:
    return moment.astimezone().strftime("%Y-%m-%d %H:%M:%S")


@dataclass(frozen=True)
class Scale:
    """The timeline's axis: its first moment and how long it spans."""

    origin: datetime.datetime
    total: float  # seconds, never 0

    def at(self, moment: datetime.datetime) -> float:
        """Where `moment` falls, in percent of the axis."""
        return 100.0 * (moment - self.origin).total_seconds() / self.total

    def width(self, took: float) -> float:
        return 100.0 * took / self.total


def attempt_bars(row: RunRow, scale: Scale) -> list[str]:
    """The run phase of a relaunched run: a bar per attempt of its command
    (`preemptions`), each as long as it ran, the lost ones marked."""
    e = html.escape
    bars = []
    for a in row.handle.state.attempts:
        start, end = parse(a.started_at), parse(a.ended_at or row.status.ended_at)
        if start is None or end is None:
            continue
        took = max((end - start).total_seconds(), 0.0)
        outcome = a.outcome or "going"
        label = f"run, attempt {a.number} on {a.machine}: {seconds(took)} ({outcome})"
        bars.append(
            f'<div class="bar attempt {e(outcome)}" data-phase="run" data-attempt="{a.number}" '
            f'data-seconds="{took:.3f}" style="left:{scale.at(start):.4f}%;width:{scale.width(took):.4f}%;'
            f'background:{PHASE_COLOURS["run"]}" title="{e(label)}"></div>'
        )
    return bars


def run_html(row: RunRow, scale: Scale) -> str:
    e = html.escape
    bars = []
    by_attempt = len(row.handle.state.attempts) > 1
    if by_attempt:
        bars += attempt_bars(row, scale)
    for phase in PHASES:
        if by_attempt and phase == "run":
            continue
        t = row.times.get(phase)
        start, end = (parse(t["start"]), parse(t["end"])) if t else (None, None)
        if t is None or start is None or end is None:
            continue
        took = max((end - start).total_seconds(), 0.0)
        outcome = str(t.get("outcome") or "ok")
        label = f"{PHASE_LABELS.get(phase, phase)}: {seconds(took)}"
        label += f" ({outcome})" if outcome != "ok" else ""
        bars.append(
            f'<div class="bar {e(outcome)}" data-phase="{phase}" data-seconds="{took:.3f}" '
            f'style="left:{scale.at(start):.4f}%;width:{scale.width(took):.4f}%;'
            f'background:{PHASE_COLOURS[phase]}" title="{e(label)}"></div>'
        )
    starts = [m for m in (parse(t["start"]) for t in row.times.values()) if m is not None]
    ends = [m for m in (parse(t["end"]) for t in row.times.values()) if m is not None]
    took_all = seconds((max(ends) - min(starts)).total_seconds()) if starts and ends else ""
    track = "".join(bars) or '<span class="untimed">no phase times recorded (an older run)</span>'
    state = row.status.state
    code = f" (exit {row.status.exit_code})" if row.status.exit_code not in (None, 0) else ""
    cost = f'<span class="cost">{e(row.cost)}</span>' if row.cost is not None else ""
    return (
        f'<div class="row run" data-step="{e(row.handle.step)}" data-state="{e(state)}">'
        f'<div class="who"><b class="step">{e(row.handle.step)}</b>'
        f'<span class="where">{e(row.where)} · {e(row.handle.run_id)}</span></div>'
        f'<div class="state" style="color:{STATE_COLOURS.get(state, "#555")}">{e(state)}{e(code)}'
        f'<span class="took">{e(took_all)}</span>{cost}</div>'
        f'<div class="track">{track}</div></div>'
    )


def restored_html(restored: RestoredRow, scale: Scale) -> str:
    e = html.escape
    at = parse(restored.at)
    note = f"made by run {e(restored.made_by)} on {e(restored.made_on)}; nothing launched"
    if at is None:
        track = f'<span class="restore-note" style="left:8px">{note}</span>'
    else:
        where = scale.at(at)
        # The note beside the marker, on the side with room for it.
        side = f"left:calc({where:.4f}% + 14px)" if where < 50 else f"right:calc({100 - where:.4f}% + 14px)"
        track = (f'<div class="restore-mark" style="left:{where:.4f}%" title="restored at {e(clock(at))}">'
                 f'</div><span class="restore-note" style="{side}">{note}</span>')  # fmt: skip
    return (
        f'<div class="row restored" data-step="{e(restored.step)}" data-state="restored">'
        f'<div class="who"><b class="step">{e(restored.step)}</b>'
        f'<span class="where" title="{e(restored.entry)}">from {e(restored.entry)}</span></div>'
        f'<div class="state" style="color:{STATE_COLOURS["restored"]}">restored'
        f'<span class="took">from the cache</span></div>'
        f'<div class="track">{track}</div></div>'
    )


def took(entry: dict[str, Any] | None) -> float | None:
    start, end = (parse(entry["start"]), parse(entry["end"])) if entry else (None, None)
    return None if start is None or end is None else max((end - start).total_seconds(), 0.0)


def table_html(runs: list[RunRow]) -> str:
    """Each run's phases in figures, to a tenth of a second; its cost where
    the handle records one (a column only when some run does)."""
    e = html.escape
    with_cost = any(row.cost is not None for row in runs)
    head = "".join(f"<th>{e(PHASE_LABELS.get(p, p))}</th>" for p in PHASES)
    lines = []
    for row in runs:
        cells = []
        for phase in PHASES:
            took_phase = took(row.times.get(phase))
            shown = "&ndash;" if took_phase is None else e(seconds(took_phase))
            cells.append(f'<td class="num">{shown}</td>')
        cost = f'<td class="num">{e(row.cost or "")}</td>' if with_cost else ""
        lines.append(f"<tr><td><code>{e(row.handle.step)}</code></td><td>{e(row.status.state)}</td>"
                     f"{''.join(cells)}{cost}</tr>")  # fmt: skip
    cost_head = "<th>cost</th>" if with_cost else ""
    # Each group's runs together (a sweep's members), as `status` totals them.
    groups = group_totals([(row.handle, row.status) for row in runs]) if with_cost else []
    totals = "".join(f'<p class="group-total" data-group="{e(t.group)}">{e(group_line(t))}</p>'
                     for t in groups)  # fmt: skip
    return (f'<h2>Phases</h2><table class="phases"><thead><tr><th>step</th><th>state</th>{head}{cost_head}'
            f"</tr></thead><tbody>{''.join(lines)}</tbody></table>{totals}") if runs else ""  # fmt: skip


def failure_html(row: RunRow) -> str:
    e = html.escape
    said = row.status.state
    if row.status.exit_code is not None:
        said += f", exit code {row.status.exit_code}"
    if row.status.message:
        said += f": {row.status.message}"
    return (
        f'<section class="failure" data-step="{e(row.handle.step)}">'
        f"<h3>{e(row.handle.step)} <small>{e(row.handle.run_id)} · {e(said)}</small></h3>"
        f'<p class="hint">whole log: <code>substrax-compute logs {e(row.handle.run_id)}</code></p>'
        f'<pre class="log-tail">{e(row.log_tail) or "(its log is empty)"}</pre></section>'
    )


def render(report: Report, generated: datetime.datetime) -> str:
    e = html.escape
    spans = [
        (parse(t["start"]), parse(t["end"])) for row in report.runs for t in row.times.values()
    ] + [(parse(r.at), parse(r.at)) for r in report.restored]
    moments = [m for pair in spans for m in pair if m is not None]
    origin = min(moments) if moments else generated
    scale = Scale(origin, max(((max(moments) - origin).total_seconds() if moments else 0.0), 0.001))
    states: dict[str, int] = {}
    for row in report.runs:
        states[row.status.state] = states.get(row.status.state, 0) + 1
    chips = [f'<span class="chip" style="background:{STATE_COLOURS.get(s, "#555")}">{n} {e(s)}</span>'
             for s, n in sorted(states.items())]  # fmt: skip
    if report.restored:
        chips.append(f'<span class="chip" style="background:{STATE_COLOURS["restored"]}">'
                     f"{len(report.restored)} restored</span>")  # fmt: skip
    legend = "".join(
        f'<span class="key"><i style="background:{PHASE_COLOURS[p]}"></i>{e(PHASE_LABELS.get(p, p))}</span>'
        for p in PHASES
    )
    rows = [run_html(row, scale) for row in report.runs] + [restored_html(r, scale) for r in report.restored]
    failed = [row for row in report.runs if row.status.final and row.status.state != "succeeded"]
    failures = [failure_html(row) for row in failed]
    axis = (f'<div class="axis"><span>{e(clock(origin))}</span><span>+{e(seconds(scale.total))}</span></div>'
            if moments else "")  # fmt: skip
    return PAGE.format(
        title=e(f"substrax-tasks report: {report.title}"), scope=e(report.scope),
        generated=e(clock(generated)), chips="".join(chips), legend=legend, axis=axis,
        rows="".join(rows) or '<p class="note">No runs or restores to show.</p>',
        notes="".join(f'<p class="note">{e(n)}</p>' for n in report.notes),
        failures=f"<h2>Failures</h2>{''.join(failures)}" if failures else "", table=table_html(report.runs),
    )  # fmt: skip


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>
:root {{ color-scheme: light; }}
body {{ font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; background: #f6f7f9;
  color: #1f2328; }}
header {{ background: #24292f; color: #fff; padding: 18px 28px; }}
header h1 {{ margin: 0; font-size: 20px; font-weight: 600; }}
header p {{ margin: 4px 0 0; color: #c9d1d9; }}
main {{ padding: 18px 28px 40px; }}
.chips {{ margin: 10px 0 0; }}
.chip {{ display: inline-block; color: #fff; border-radius: 12px; padding: 1px 10px; margin-right: 6px;
  font-size: 13px; }}
.legend {{ margin: 6px 0 14px; color: #57606a; }}
.key {{ margin-right: 16px; white-space: nowrap; }}
.key i {{ display: inline-block; width: 12px; height: 12px; border-radius: 3px; margin-right: 5px;
  vertical-align: -1px; }}
.timeline {{ background: #fff; border: 1px solid #d0d7de; border-radius: 8px; padding: 8px 14px; }}
.row {{ display: grid; grid-template-columns: 300px 150px 1fr; align-items: center; gap: 12px;
  padding: 7px 0; border-bottom: 1px solid #eaeef2; }}
.row:last-child {{ border-bottom: 0; }}
.who {{ overflow: hidden; }}
.step {{ display: block; font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 13px; }}
.where {{ display: block; color: #57606a; font-size: 12px; white-space: nowrap; overflow: hidden;
  text-overflow: ellipsis; }}
.state {{ font-weight: 600; font-size: 13px; }}
.took, .cost {{ display: block; color: #57606a; font-weight: 400; font-size: 12px; }}
.track {{ position: relative; height: 22px; background: #f6f8fa; border-radius: 4px; }}
.bar {{ position: absolute; top: 3px; height: 16px; min-width: 2px; border-radius: 3px; }}
.bar.failed {{ outline: 2px solid #c62828; outline-offset: 1px; }}
.bar.interrupted, .bar.lost {{ opacity: .55; }}
.bar.attempt {{ border-right: 2px solid #fff; box-sizing: border-box; }}
.group-total {{ margin: 8px 0 0; font-variant-numeric: tabular-nums; }}
.untimed, .restore-note {{ position: absolute; left: 8px; top: 2px; color: #6e7781; font-size: 12px;
  white-space: nowrap; }}
.restore-note {{ left: auto; color: #6a1b9a; }}
.restore-mark {{ position: absolute; top: 4px; width: 12px; height: 12px; margin-left: -6px;
  background: #6a1b9a; transform: rotate(45deg); border-radius: 2px; }}
.axis {{ display: flex; justify-content: space-between; color: #6e7781; font-size: 12px;
  margin: 0 0 4px 474px; }}
h2 {{ font-size: 16px; margin: 26px 0 10px; }}
.failure {{ background: #fff; border: 1px solid #f0b8b8; border-left: 4px solid #c62828; border-radius: 6px;
  padding: 8px 14px; margin-bottom: 12px; }}
.failure h3 {{ margin: 2px 0; font-size: 14px; font-family: ui-monospace, Menlo, monospace; }}
.failure small {{ color: #57606a; font-weight: 400; font-family: system-ui, sans-serif; }}
.hint {{ margin: 2px 0 6px; color: #57606a; font-size: 12px; }}
.log-tail {{ background: #161b22; color: #e6edf3; padding: 10px 12px; border-radius: 6px; overflow-x: auto;
  font-size: 12px; margin: 0; white-space: pre-wrap; }}
.note {{ color: #57606a; }}
.phases {{ border-collapse: collapse; background: #fff; border: 1px solid #d0d7de; font-size: 13px; }}
.phases th, .phases td {{ padding: 5px 12px; border-bottom: 1px solid #eaeef2; text-align: left; }}
.phases th {{ background: #f6f8fa; font-weight: 600; }}
.phases td.num {{ text-align: right; font-variant-numeric: tabular-nums; }}
</style></head>
<body>
<header><h1>{title}</h1><p>{scope} · made {generated}</p><div class="chips">{chips}</div></header>
<main>
{notes}
<div class="legend">{legend}</div>
{axis}
<div class="timeline">{rows}</div>
{failures}
{table}
</main>
</body></html>
"""


def write_report(project: Project, word: str | None, every: bool, output: Path | None) -> Path:
    """Write the page; where it went."""
    report = gather(project, word, every)
    page = render(report, datetime.datetime.now(datetime.timezone.utc))
    path = output if output is not None else Path(DEFAULT_FILE)
    try:
        path.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise SubstraxError(f"could not write the report to {path} ({exc}); name another file with -o") \
            from None
    return path

