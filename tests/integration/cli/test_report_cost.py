"""The report's costs as `status` shows them (issue 39, item 6): sub-cent
costs to four places with their caps, a total per group, and a relaunched
run's attempts each a bar of its own. Seen as a person sees it: the page
in headless Chromium, its DOM read and its screenshot's pixels looked at.

A real doit of a sweep and of a counting step whose worker is SIGKILLed
mid-run (its machine lost: `preemptions=1` relaunches it), on this machine
at a price of a cent every 100 s.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import zlib
from pathlib import Path

from checkpoint_parts import COUNT_PY, count_step, kept_state
from dodo_helpers import (
    compute,
    doit,
    make_project,
    popen_doit,
    popen_output,
    show,
    stop,
    wait_for,
    write_pyproject,
)
from test_report import bar_width, chromium, dom_of, needs_chromium, rows_by_step

pytestmark = [needs_chromium]

BODY = """
def task_fit():
    for m in "ab":
        yield from remote_step(f"fit:{m}", shell=f"sleep 1; echo {m} > fit-{m}.txt", outputs=[f"fit-{m}.txt"],
                               max_cost=0.008)

def task_count():
""" + count_step("count", 10, 0.3, preemptions=1)
RUN_COLOUR = (0x6A, 0xA8, 0x4F)  # the run phase's bars (report.PHASE_COLOURS)
# A lost attempt's bar, drawn at opacity .55 over the track (#f6f8fa).
FADED = tuple(round(0.55 * c + 0.45 * t) for c, t in zip(RUN_COLOUR, (0xF6, 0xF8, 0xFA), strict=True))


def worker_of(root: Path, step: str) -> int | None:
    for status in (root / ".substrax" / "runs").glob(f"{step}-*/status.json"):
        pid = json.loads(status.read_text()).get("worker_pid")
        if isinstance(pid, int):
            return pid
    return None


def pixels(png: Path) -> tuple[int, int, list[bytes]]:
    """Width, height and each row of RGB(A) bytes of an 8-bit PNG as Chromium writes it."""
    data = png.read_bytes()
    chunks: dict[bytes, bytes] = {}
    at = 8
    idat = b""
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + length]
        idat += body if kind == b"IDAT" else b""
        chunks.setdefault(kind, body)
        at += 12 + length
    width, height, depth, colour = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert depth == 8 and colour in (2, 6), (depth, colour)
    size = 3 if colour == 2 else 4
    raw, rows, previous = zlib.decompress(idat), [], bytes(width * size)
    stride = width * size
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for x in range(stride):
            left = line[x - size] if x >= size else 0
            up, corner = previous[x], previous[x - size] if x >= size else 0
            if kind == 1:
                line[x] = (line[x] + left) & 0xFF
            elif kind == 2:
                line[x] = (line[x] + up) & 0xFF
            elif kind == 3:
                line[x] = (line[x] + (left + up) // 2) & 0xFF
            elif kind == 4:
                p = left + up - corner
                near = min(
                    (abs(p - left), left), (abs(p - up), up), (abs(p - corner), corner), key=lambda t: t[0]
                )
                line[x] = (line[x] + near[1]) & 0xFF
        rows.append(bytes(line))
        previous = bytes(line)
    return width, size, rows


def segments(row: bytes, size: int) -> list[str]:
    """The separate runs of a run bar's colour a row of pixels crosses, in
    order: "run", or "faded" for a lost attempt's."""
    found: list[str] = []
    inside = None
    for x in range(0, len(row), size):
        pixel = row[x : x + 3]
        hit = next((name for name, colour in (("run", RUN_COLOUR), ("faded", FADED))
                    if all(abs(p - c) <= 3 for p, c in zip(pixel, colour, strict=True))), None)  # fmt: skip
        if hit is not None and hit != inside:
            found.append(hit)
        inside = hit
    return found


def test_the_report_shows_costs_as_status_does_a_total_per_group_and_a_bar_per_attempt(
    tmp_path: Path,
) -> None:
    root = make_project(
        tmp_path, BODY, default_tasks=["fit"], files={"count.py": COUNT_PY, "data.txt": "one\n"}
    )
    write_pyproject(root, extra="hourly_cost = 0.36\n")  # a cent every 100 s: every run costs under a cent
    swept = doit(root, "-n", "2", "-P", "thread", "fit", timeout=120)
    assert swept.returncode == 0, show(swept)
    proc = popen_doit(root, "count")
    try:
        wait_for(lambda: int((kept_state(root, "count") or {}).get("i", 0)) >= 3 and worker_of(root, "count"),
                 "the count's worker and 3 counts checkpointed", timeout=120)  # fmt: skip
        os.kill(worker_of(root, "count") or 0, signal.SIGKILL)  # its machine lost, as the OOM killer does
        assert proc.wait(timeout=120) == 0, popen_output(root)
    finally:
        stop(proc)
    runs = {r["step"]: r for r in json.loads(compute(root, "status", "--json").stdout)["runs"]}
    assert len(runs["count"]["attempts"]) == 2, runs["count"]
    assert all(0 < r["cost_usd"] < 0.005 for r in runs.values()), runs  # under a cent: $0.00 to cents

    page = tmp_path / "r.html"
    made = compute(root, "report", "--all", "-o", str(page))
    assert made.returncode == 0, show(made)
    dom = dom_of(page, tmp_path)
    rows = rows_by_step(dom)
    for step, run in runs.items():
        (cost,) = [n.all_text() for n in rows[step].find("cost")]
        cap = {"fit:a": "/$0.0080", "fit:b": "/$0.0080"}.get(step, "")
        assert cost == f"${run['cost_usd']:.4f}{cap}", (step, cost, run["cost_usd"])
    (total,) = dom.find("group-total")
    fit_total = runs["fit:a"]["cost_usd"] + runs["fit:b"]["cost_usd"]
    assert (
        total.all_text()
        == f"group fit: ${fit_total:.4f} over 2 run(s) of max_cost $0.0160 (the sum of their caps)"
    )
    # The relaunched run: one bar per attempt, the lost one marked; its other phases as before.
    attempts = [b for b in rows["count"].find("bar") if b.attrs.get("data-phase") == "run"]
    assert [(b.attrs["data-attempt"], b.attrs["class"]) for b in attempts] == [
        ("1", "bar attempt lost"), ("2", "bar attempt succeeded")], attempts  # fmt: skip
    assert all(bar_width(b) > 0 for b in attempts)
    plain = [b for b in rows["fit:a"].find("bar") if b.attrs["data-phase"] == "run"]
    assert [b.attrs.get("data-attempt") for b in plain] == [None], plain

    shot = tmp_path / "report.png"
    chromium(page, tmp_path, f"--screenshot={shot}", "--window-size=1400,900", "--hide-scrollbars")
    _width, size, lines = pixels(shot)
    # As a person sees it: a line of the page crosses the count's two attempts, the lost one faded,
    # then the one that succeeded; the sweep's rows (and the legend's key) cross one bar each.
    crossed = {tuple(segments(line, size)) for line in lines} - {()}
    assert crossed == {("run",), ("faded", "run")}, crossed
