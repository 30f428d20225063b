"""`substrax-compute report`: the HTML page of the latest doit, opened in a
real browser (headless Chromium) and checked for what a person sees: each
step's name, its phases as bars as wide as they took, the failure's log
tail (escaped), the step restored from the cache, and no request to any
network. A real doit drives a small local pipeline; a second clone sharing
the run cache ($XDG_CACHE_HOME) made the entry the restore comes from."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest
from dodo_helpers import BWRAP, compute, doit, doit_ok, make_project, show, write_pyproject

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
needs_chromium = pytest.mark.skipif(
    not Path(CHROMIUM).exists(),
    reason="REPORT NOT TESTED IN A BROWSER: chromium is missing (make system-deps installs it)",
)
# Runs without the sandbox are never kept in the run cache: the restore needs bubblewrap.
needs_bwrap = pytest.mark.skipif(not BWRAP, reason="RESTORE NOT TESTED: bubblewrap is missing or unusable")
pytestmark = [needs_chromium, needs_bwrap]

# A line the browser would run or render as markup, were the log not escaped.
HOSTILE = "<script>document.title='pwned'</script><b>bold</b> & done"
PIPELINE = f"""
def task_early():
    yield from remote_step("early", shell="echo early > early.txt", outputs=["early.txt"])

def task_ok():
    yield from remote_step("ok", shell="sleep 1.5 && echo fine > ok.txt", outputs=["ok.txt"])

def task_cached():
    yield from remote_step("cached", shell="echo same > cached.txt", outputs=["cached.txt"])

def task_bad():
    yield from remote_step("bad", command=["/bin/sh", "-c",
        'for i in $(seq 1 60); do echo "line $i"; done; echo "$1"; echo "the last words" >&2; exit 3',
        "bad", {HOSTILE!r}], outputs=["bad.txt"])
"""
CACHE = "[tool.substrax.compute.cache]\n"


@dataclass
class Node:
    tag: str
    attrs: dict[str, str]
    text: str = ""
    children: list[Node] = field(default_factory=list)

    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def find(self, cls: str) -> Iterator[Node]:
        for child in self.children:
            if cls in child.classes():
                yield child
            yield from child.find(cls)

    def all_text(self) -> str:
        return self.text + "".join(child.all_text() for child in self.children)


class DomTree(HTMLParser):
    """The DOM Chromium dumped, as a tree of elements with their text."""

    VOID = frozenset({"meta", "br", "img", "link", "input", "hr"})

    def __init__(self) -> None:
        super().__init__()
        self.root = Node("root", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        if tag not in self.VOID:
            self.stack.append(node)

    def handle_endtag(self, tag: str) -> None:
        while len(self.stack) > 1 and self.stack.pop().tag != tag:
            pass

    def handle_data(self, data: str) -> None:
        self.stack[-1].text += data


def chromium(page: Path, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Headless Chromium on the page, with nothing of its own that reaches
    a network (no sync, no component updates, no background requests)."""
    argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp / 'chromium-profile'}", *args, page.as_uri()]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, show(done)
    return done


def dom_of(page: Path, tmp: Path) -> Node:
    parser = DomTree()
    parser.feed(chromium(page, tmp, "--dump-dom").stdout)
    return parser.root


def rows_by_step(dom: Node) -> dict[str, Node]:
    return {row.attrs["data-step"]: row for row in dom.find("row")}


def bar_width(bar: Node) -> float:
    found = re.search(r"width:([0-9.]+)%", bar.attrs["style"])
    assert found, bar.attrs
    return float(found.group(1))


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """`cached` made by a second clone (its entry in the shared run cache);
    here `early` run by one doit, then the latest, its steps in threads at
    once: `ok` runs, `bad` fails, `cached` is restored."""
    base = tmp_path_factory.mktemp("report")
    with pytest.MonkeyPatch.context() as patch:  # the two clones share this cache alone
        patch.setenv("XDG_CACHE_HOME", str(base / "xdg-cache"))
        (base / "clone").mkdir()
        (base / "here").mkdir()
        clone = make_project(base / "clone", PIPELINE)
        write_pyproject(clone, cache=CACHE)
        doit_ok(clone, "cached")
        root = make_project(base / "here", PIPELINE)
        write_pyproject(root, cache=CACHE)
        doit_ok(root, "early")
        done = doit(root, "--continue", "-n", "3", "-P", "thread", "ok", "cached", "bad")
        assert done.returncode != 0 and "restored from cache entry" in done.stdout, show(done)
        yield root


def test_the_report_shows_the_latest_doit_in_a_browser(pipeline: Path, tmp_path: Path) -> None:
    page = tmp_path / "r.html"
    done = compute(pipeline, "report", "-o", str(page))
    assert done.returncode == 0 and str(page) in done.stdout, show(done)
    text = page.read_text()
    # Self-contained: nothing the browser would fetch.
    assert not re.search(r"https?://|<link|<img|<script|@import|url\(", text, re.IGNORECASE), text

    dom = dom_of(page, tmp_path)
    rows = rows_by_step(dom)
    assert set(rows) == {"ok", "bad", "cached"}  # not `early`, run by an earlier doit
    assert rows["ok"].attrs["data-state"] == "succeeded" and rows["bad"].attrs["data-state"] == "failed"
    for step, row in rows.items():
        assert [n.all_text() for n in row.find("step")] == [step]

    # Every phase of the run that succeeded is a bar, each as wide as it took.
    bars = {bar.attrs["data-phase"]: bar for bar in rows["ok"].find("bar")}
    assert set(bars) == {"launch", "setup", "sync", "run", "fetch", "promote"}
    took = {phase: float(bar.attrs["data-seconds"]) for phase, bar in bars.items()}
    assert took["run"] >= 1.5 and took["run"] == max(took.values())
    per_second = bar_width(bars["run"]) / took["run"]
    for phase, bar in bars.items():
        assert bar_width(bar) == pytest.approx(took[phase] * per_second, abs=0.01), phase
    assert "local (" in rows["ok"].all_text()  # where it ran: the backend and the host

    # The failed run: its run phase marked failed, the end of its log shown as text.
    assert [bar.attrs["class"] for bar in rows["bad"].find("bar") if bar.attrs["data-phase"] == "run"] \
        == ["bar failed"]  # fmt: skip
    [failure] = dom.find("failure")
    assert failure.attrs["data-step"] == "bad" and "exit code 3" in failure.all_text()
    [tail] = failure.find("log-tail")
    assert HOSTILE in tail.all_text() and "the last words" in tail.all_text()
    assert "line 60" in tail.all_text() and "line 1\n" not in tail.all_text()  # its end, not all of it
    assert "pwned" not in dom_text_title(dom) and not any(n.tag == "script" for n in walk(dom))

    # The restored step: from which entry, made by which run, nothing launched.
    restored = rows["cached"]
    assert restored.attrs["data-state"] == "restored"
    assert "from cache entry" in restored.all_text() and "made by run cached-" in restored.all_text()
    assert list(restored.find("restore-mark"))

    shot = tmp_path / "report.png"
    chromium(page, tmp_path, f"--screenshot={shot}", "--window-size=1400,900", "--hide-scrollbars")
    assert shot.stat().st_size > 10_000  # kept in the test's folder, for a person to look at


def walk(node: Node) -> Iterator[Node]:
    for child in node.children:
        yield child
        yield from walk(child)


def dom_text_title(dom: Node) -> str:
    return "".join(n.all_text() for n in walk(dom) if n.tag == "title")


def test_a_step_word_and_all_and_an_old_run_without_times(pipeline: Path, tmp_path: Path) -> None:
    page = tmp_path / "ok.html"
    done = compute(pipeline, "report", "ok", "-o", str(page))
    assert done.returncode == 0, show(done)
    assert set(rows_by_step(dom_of(page, tmp_path))) == {"ok"}

    # A handle from before the phases were timed: the run is still shown.
    [handle_file] = (pipeline / ".substrax" / "runs").glob("ok-*/handle.json")
    handle = json.loads(handle_file.read_text())
    handle["state"].pop("times")
    handle_file.write_text(json.dumps(handle))
    page = tmp_path / "all.html"
    done = compute(pipeline, "report", "--all", "-o", str(page))
    assert done.returncode == 0, show(done)
    rows = rows_by_step(dom_of(page, tmp_path))
    assert set(rows) == {"early", "ok", "bad", "cached"}
    assert not list(rows["ok"].find("bar")) and "no phase times recorded" in rows["ok"].all_text()

    done = compute(pipeline, "report", "ok", "--all")
    assert done.returncode == 2 and "not both" in done.stderr, show(done)
