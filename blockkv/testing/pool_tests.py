"""PoolTests: the behaviour every ``BlobPool`` backend must show (zarr's StoreTests).

Subclass it as ``class TestMyPool(PoolTests)`` and define a ``pool`` fixture
that builds an empty pool for the given ``layout`` (both the block and the
header layout are run)::

    class TestMemoryPool(PoolTests):
        @pytest.fixture
        def pool(self, layout):
            return MemoryPool(layout)

The tests use real threads on the real backend: racing creates of one name
and reads racing a delete, the two places an object store and a filesystem
differ most.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import blake3
import pytest

from blockkv.errors import BlockMissingError
from blockkv.format.layout import BLOCK_LAYOUT, HEADER_LAYOUT, Layout
from blockkv.pool.protocol import BlobPool

T = TypeVar("T")


def name_for(layout: Layout, data: bytes, ns: str = "0123456789abcdef") -> str:
    """A valid name of ``layout`` for ``data``: its blake3 for a block, a fresh uuid for a header."""
    if layout is BLOCK_LAYOUT:
        return blake3.blake3(data).hexdigest()
    return f"{ns}/{uuid.uuid4().hex}.bkv"


def payload(size: int, seed: int) -> bytes:
    """``size`` bytes that differ at every position from any other seed's."""
    block = blake3.blake3(seed.to_bytes(8, "little")).digest(length=4096)
    return (block * (size // len(block) + 1))[:size]


class PoolTests:
    """Subclasses provide the ``pool`` fixture; sizes may be lowered for slow backends."""

    object_size = 1 << 20  # for the race tests: big enough that a read takes many syscalls
    racers = 8
    race_rounds = 5

    @pytest.fixture(params=[BLOCK_LAYOUT, HEADER_LAYOUT], ids=["blocks", "headers"])
    def layout(self, request: pytest.FixtureRequest) -> Layout:
        return request.param

    @pytest.fixture
    def pool(self, layout: Layout) -> BlobPool:
        raise NotImplementedError("a PoolTests subclass defines the pool fixture")

    # -- the protocol's shape ----------------------------------------------
    def test_is_a_blob_pool(self, pool: BlobPool, layout: Layout) -> None:
        assert isinstance(pool, BlobPool)
        assert pool.layout is layout

    def test_put_creates_once_and_never_overwrites(self, pool: BlobPool, layout: Layout) -> None:
        data = payload(10_000, 1)
        name = name_for(layout, data)
        assert not pool.exists(name)
        assert pool.put_if_absent(name, [data]) is True
        assert pool.exists(name)
        assert pool.put_if_absent(name, [payload(10_000, 2)]) is False
        assert pool.get(name) == data

    def test_put_joins_parts_of_every_buffer_kind(self, pool: BlobPool, layout: Layout) -> None:
        data = payload(3000, 3)
        name = name_for(layout, data)
        parts: list[bytes | bytearray | memoryview] = [
            data[:1000], bytearray(data[1000:1001]), memoryview(data)[1001:2999], b"", data[2999:]]
        assert pool.put_if_absent(name, parts)
        assert pool.get(name) == data

    def test_empty_object(self, pool: BlobPool, layout: Layout) -> None:
        name = name_for(layout, b"")
        assert pool.put_if_absent(name, [])
        assert pool.get(name) == b""
        assert pool.stat(name).size == 0

    def test_ranges_read_like_slices(self, pool: BlobPool, layout: Layout) -> None:
        data = payload(5000, 4)
        name = name_for(layout, data)
        pool.put_if_absent(name, [data])
        for start, end in [(0, None), (0, 1), (17, 4000), (4999, None), (4000, 9000), (5000, None),
                           (6000, None), (6000, 7000), (123, 123)]:
            assert pool.get(name, start, end) == data[start:end], (start, end)

    def test_bad_ranges_and_names_are_value_errors(self, pool: BlobPool, layout: Layout) -> None:
        data = payload(100, 5)
        name = name_for(layout, data)
        pool.put_if_absent(name, [data])
        for start, end in [(-1, None), (10, 5)]:
            with pytest.raises(ValueError):
                pool.get(name, start, end)
        for bad in ["", "../" + name, name.upper(), name + "/x", "ab/" + name, 42]:
            with pytest.raises(ValueError):
                pool.put_if_absent(bad, [data])  # type: ignore[arg-type]
            with pytest.raises(ValueError):
                pool.get(bad)  # type: ignore[arg-type]

    def test_read_into_uses_the_buffer_when_it_fits(self, pool: BlobPool, layout: Layout) -> None:
        data = payload(4096, 6)
        name = name_for(layout, data)
        pool.put_if_absent(name, [data])
        buffer = bytearray(8192)
        view = pool.read_into(name, buffer)
        assert bytes(view) == data
        view[0:1] = b"\xff"
        assert buffer[0] == 0xFF  # the view is the caller's buffer, not a copy
        small = bytearray(10)
        assert bytes(pool.read_into(name, small)) == data
        assert len(small) == 10  # never resized: views of its earlier contents stay valid

    def test_missing_names(self, pool: BlobPool, layout: Layout) -> None:
        name = name_for(layout, b"never written")
        assert not pool.exists(name)
        with pytest.raises(BlockMissingError):
            pool.get(name)
        with pytest.raises(BlockMissingError):
            pool.get(name, 1, 2)
        with pytest.raises(BlockMissingError):
            pool.read_into(name, bytearray(16))
        with pytest.raises(FileNotFoundError):
            pool.stat(name)
        pool.delete(name)  # deleting what is gone is not an error

    def test_stat(self, pool: BlobPool, layout: Layout) -> None:
        data = payload(777, 7)
        name = name_for(layout, data)
        pool.put_if_absent(name, [data])
        st = pool.stat(name)
        assert st.name == name and st.size == len(data)
        assert st.mtime > 0
        assert st.etag is None or isinstance(st.etag, str)

    def test_delete_then_create_again(self, pool: BlobPool, layout: Layout) -> None:
        data = payload(100, 8)
        name = name_for(layout, data)
        pool.put_if_absent(name, [data])
        pool.delete(name)
        assert not pool.exists(name)
        with pytest.raises(BlockMissingError):
            pool.get(name)
        pool.delete(name)
        assert pool.put_if_absent(name, [data]) is True
        assert pool.get(name) == data

    def test_list_prefix(self, pool: BlobPool, layout: Layout) -> None:
        assert list(pool.list_prefix()) == []
        made = set()
        for seed in range(12):
            data = payload(50, 100 + seed)
            name = name_for(layout, data, ns=f"{seed % 2:016x}")
            pool.put_if_absent(name, [data])
            made.add(name)
        assert set(pool.list_prefix()) == made
        first = sorted(made)[0]  # [:17] of a header name is its namespace directory, "<16 hex>/"
        for prefix in [first[:1], first[:3], first[:17], sorted(made)[-1], "zz"]:
            assert set(pool.list_prefix(prefix)) == {n for n in made if n.startswith(prefix)}
        gone = sorted(made)[0]
        pool.delete(gone)
        assert set(pool.list_prefix()) == made - {gone}

    # -- races -------------------------------------------------------------
    def _race(self, n: int, fn: Callable[[int], T]) -> list[T]:
        start = threading.Barrier(n)

        def run(i: int) -> T:
            start.wait()
            return fn(i)

        with ThreadPoolExecutor(n) as ex:
            return list(ex.map(run, range(n)))

    def test_racing_creates_of_one_name(self, pool: BlobPool, layout: Layout) -> None:
        """Exactly one of the racers creates; every one then reads the creator's bytes."""
        for rnd in range(self.race_rounds):
            datas = [payload(self.object_size, 1000 * rnd + i) for i in range(self.racers)]
            name = name_for(layout, datas[0])

            def put_and_read(i: int) -> tuple[bool, bytes]:
                return pool.put_if_absent(name, [datas[i]]), pool.get(name)

            results = self._race(self.racers, put_and_read)
            winners = [i for i, (created, _) in enumerate(results) if created]
            assert len(winners) == 1, winners
            assert all(seen == datas[winners[0]] for _, seen in results)

    def test_reads_racing_a_delete_are_whole_or_missing(self, pool: BlobPool, layout: Layout) -> None:
        """Readers loop on a name until it is gone while one thread deletes it:
        every read returns all of its bytes or BlockMissingError, never a torn read."""
        data = payload(self.object_size, 9)
        name = name_for(layout, data)
        for _ in range(self.race_rounds):
            pool.put_if_absent(name, [data])
            all_read_once = threading.Barrier(self.racers)

            def read_or_delete(i: int) -> int:
                if i == 0:
                    all_read_once.wait()
                    pool.delete(name)
                    return 0
                whole = 0
                buffer = bytearray(self.object_size)
                while True:
                    try:
                        got = bytes(pool.read_into(name, buffer)) if i % 2 else pool.get(name)
                    except BlockMissingError:
                        return whole
                    assert got == data, f"torn read: {len(got)} bytes"
                    whole += 1
                    if whole == 1:
                        all_read_once.wait()

            reads = self._race(self.racers, read_or_delete)
            assert all(n >= 1 for n in reads[1:])
            assert not pool.exists(name)
