"""The order the test files run in (a plugin of tests/conftest.py): the
longest first.

`make test` gives whole files to two xdist workers (`--dist loadfile
--no-loadscope-reorder`), each taking the next file of the queue, in
collection order, when it runs low. A file of minutes taken last keeps one
worker busy alone at the end while the other has nothing left; taken first,
the short files fill in beside it. How long each file takes is measured,
not guessed: tests/file_seconds.txt holds the seconds of each file in one
`make test` (written by `bench/bench_tests.py --file-seconds JUNIT_XML`). A
file it does not name yet (a new one) counts as a file of average length.
The order within a file is kept.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
FILE_SECONDS = TESTS / "file_seconds.txt"


def read_file_seconds(path: Path = FILE_SECONDS) -> dict[str, float]:
    """{test file, relative to the repository: seconds}; empty without the file."""
    seconds: dict[str, float] = {}
    if not path.is_file():
        return seconds
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            value, name = line.split(maxsplit=1)
            seconds[name] = float(value)
    return seconds


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seconds = read_file_seconds()
    if not seconds:
        return
    unknown = statistics.mean(seconds.values())
    root = TESTS.parent
    first_seen: dict[Path, int] = {}
    for index, item in enumerate(items):
        first_seen.setdefault(item.path, index)

    def longest_first(item: pytest.Item) -> tuple[float, int]:
        path = Path(item.path)
        name = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
        return -seconds.get(name, unknown), first_seen[item.path]

    items.sort(key=longest_first)  # stable: a file's tests keep their order
