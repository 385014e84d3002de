"""The shipped PoolTests against the local and the in-memory pool, and what
only the local one has: its files on disk, never a tmp file left behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from blockkv.format.layout import BLOCK_LAYOUT, Layout
from blockkv.fs import FileLayer
from blockkv.pool.local import LocalPool
from blockkv.pool.memory import MemoryPool
from blockkv.testing.faults import FaultyFileLayer
from blockkv.testing.pool_tests import PoolTests, name_for, payload


class TestLocalPool(PoolTests):
    @pytest.fixture
    def pool(self, layout: Layout, tmp_path: Path) -> LocalPool:
        return LocalPool(tmp_path / "pool", FileLayer(), layout)

    def test_files_live_at_their_layout_location(self, pool: LocalPool, layout: Layout) -> None:
        data = payload(100, 1)
        name = name_for(layout, data)
        pool.put_if_absent(name, [data])
        assert pool.path(name).read_bytes() == data
        assert pool.path(name).relative_to(pool.directory).as_posix() == layout.location(name)
        assert sorted(p.name for p in pool.directory.rglob("*") if p.is_file()) == [pool.path(name).name]

    @pytest.mark.parametrize("fault", ["torn write", "fsync", "rename"])
    def test_a_failed_create_leaves_no_name_and_no_tmp(self, tmp_path: Path, fault: str) -> None:
        fs = FaultyFileLayer()
        pool = LocalPool(tmp_path / "pool", fs)
        data = payload(100, 2)
        name = name_for(BLOCK_LAYOUT, data)
        fs.makedirs(pool.path(name).parent)
        if fault == "torn write":
            fs.tear()
        else:
            fs.fail("fsync" if fault == "fsync" else "replace")
        with pytest.raises(OSError):
            pool.put_if_absent(name, [data])
        assert not pool.exists(name)
        assert [p for p in pool.directory.rglob("*") if p.is_file()] == []
        assert pool.put_if_absent(name, [data])


class TestMemoryPool(PoolTests):
    @pytest.fixture
    def pool(self, layout: Layout) -> MemoryPool:
        return MemoryPool(layout)
