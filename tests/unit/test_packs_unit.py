"""Which files an entry packs and how its list of packs is read back
(cache/packs.py): the layout is the manifest's alone, and an entry whose
packs do not add up is refused. The packing and restoring themselves, on
disk, are tests/integration/cache/test_packs.py."""

from __future__ import annotations

from typing import Any

import pytest

from substrax_tasks.cache import packs

pytestmark = pytest.mark.unit


def file(digest: str, size: int) -> dict[str, Any]:
    return {"type": "file", "path": f"p/{digest}", "sha256": digest * 64, "size": size}


def test_small_files_are_packed_once_each_in_manifest_order_and_big_ones_are_not() -> None:
    files = [file("a", 10), file("b", packs.PACK_BELOW), file("a", 10), file("c", packs.PACK_BELOW - 1)]
    assert packs.plan(files) == [[("a" * 64, 10), ("c" * 64, packs.PACK_BELOW - 1)]]
    assert packs.plan([file("b", 1 << 20)]) == []


def test_a_pack_closes_once_it_holds_pack_target_bytes() -> None:
    size = packs.PACK_BELOW - 1
    count = packs.PACK_TARGET // size + 2
    files = [file(f"{i:x}", size) for i in range(count)]
    layout = packs.plan(files)
    assert [len(members) for members in layout] == [count - 1, 1]
    assert sum(s for _, s in layout[0]) >= packs.PACK_TARGET > sum(s for _, s in layout[0][:-1])


def entry(listed: list[dict[str, Any]], below: int = packs.PACK_BELOW) -> dict[str, Any]:
    return {"packs": listed, "pack_below": below}


FILES = [file("a", 10), file("b", 20), file("c", 30)]


def test_an_entry_s_packs_take_their_members_from_its_manifest() -> None:
    listed = [{"sha256": "1" * 64, "size": 30, "count": 2}, {"sha256": "2" * 64, "size": 30, "count": 1}]
    found = packs.parse(entry(listed), FILES)
    assert [p.members for p in found] == [[("a" * 64, 10), ("b" * 64, 20)], [("c" * 64, 30)]]
    assert packs.parse({}, FILES) == []  # made before packs: one object per file
    assert packs.parse(entry([], below=15), FILES) == []


@pytest.mark.parametrize(
    ("listed", "below"),
    [
        ([{"sha256": "1" * 64, "size": 60, "count": 2}], packs.PACK_BELOW),  # a file left out
        ([{"sha256": "1" * 64, "size": 61, "count": 3}], packs.PACK_BELOW),  # not the sum of its members
        ([{"sha256": "1" * 64, "size": 60, "count": 4}], packs.PACK_BELOW),  # more members than files
        ([{"sha256": "1" * 64, "size": 10, "count": 1}], 5),  # nothing is below 5 bytes
        ([{"sha256": "1" * 64, "count": 3}], packs.PACK_BELOW),  # no size
        ([{"sha256": "1" * 64, "size": 0, "count": 0}], packs.PACK_BELOW),  # an empty pack
    ],
)
def test_packs_that_do_not_add_up_are_refused(listed: list[dict[str, Any]], below: int) -> None:
    with pytest.raises(ValueError, match="pack"):
        packs.parse(entry(listed, below), FILES)
