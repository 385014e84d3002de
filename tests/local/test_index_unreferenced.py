"""The cap check's question of the block table (``Index.unreferenced``), read
as one array: the same answers as the rows read one object each, for blocks
referenced, waiting out their grace, past it and dated in the future."""

from __future__ import annotations

from pathlib import Path

import pytest

from blockkv.local.index import Index

T0 = 1_700_000_000.0
GRACE = 60.0


def by_rows(index: Index, now: float, grace: float) -> tuple[int, bool]:
    """The question answered from ``Index.blocks``' row objects, as the cap check once did."""
    rows = [r for r in index.blocks().values() if r.refs == 0]
    return sum(r.size for r in rows), any(not now - grace < r.zero_since <= now for r in rows)


@pytest.mark.parametrize(
    ("freed_at", "now", "expected"),
    [
        (T0 + 10, T0 + 30, (7 + 11, False)),  # both freed blocks inside their grace
        (T0 + 10, T0 + GRACE + 1, (7 + 11, True)),  # the rebuilt one (freed at T0) is past it
        (T0 + 100, T0 + 30, (7 + 11, True)),  # one freed "later than now": a clock stepped back
    ],
)
def test_unreferenced_agrees_with_the_rows(tmp_path: Path, freed_at: float, now: float,
                                           expected: tuple[int, bool]) -> None:
    index = Index(tmp_path / "index")
    try:
        assert index.unreferenced(now, GRACE) == (0, False)  # an empty table
        index.rebuild([], {"a" * 32: 7}, now=T0)  # a block file no entry references: freed now
        index.take_refs("e" * 32, "entries/e.bkv", {"b" * 32: 5})  # held by a store in flight
        index.take_refs("f" * 32, "entries/f.bkv", {"c" * 32: 11})
        index.rollback_pending("f" * 32, now=freed_at)  # its store died: the block freed then
        assert index.unreferenced(now, GRACE) == by_rows(index, now, GRACE) == expected
    finally:
        index.close()
