"""A pool in memory, for tests: the protocol's semantics with no disk at all.

One lock guards a dict of immutable ``bytes``, so a put-if-absent is one
check-and-set and a reader holds whole bytes or nothing: the reference every
other backend is held to by ``blockkv.testing.pool_tests.PoolTests``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import blake3

from blockkv.errors import BlockMissingError
from blockkv.format.layout import BLOCK_LAYOUT, Layout
from blockkv.fs import Buffer
from blockkv.pool.protocol import BlockFile, check_range


class MemoryPool:
    def __init__(self, layout: Layout = BLOCK_LAYOUT) -> None:
        self.layout = layout
        self._lock = threading.Lock()
        self._objects: dict[str, tuple[bytes, float]] = {}

    def put_if_absent(self, name: str, parts: Sequence[Buffer]) -> bool:
        self.layout.check(name)
        data = b"".join(parts)
        with self._lock:
            if name in self._objects:
                return False
            self._objects[name] = (data, time.time())
            return True

    def _data(self, name: str) -> bytes:
        with self._lock:
            found = self._objects.get(name)
        if found is None:
            raise BlockMissingError(f"{name} is not in the pool")
        return found[0]

    def get(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        check_range(start, end)
        return self._data(self.layout.check(name))[start:end]

    def read_into(self, name: str, buffer: bytearray) -> memoryview:
        data = self._data(name)
        if len(buffer) < len(data):
            return memoryview(data)
        view = memoryview(buffer)[: len(data)]
        view[:] = data
        return view

    def exists(self, name: str) -> bool:
        with self._lock:
            return name in self._objects

    def stat(self, name: str) -> BlockFile:
        with self._lock:
            found = self._objects.get(name)
        if found is None:
            raise BlockMissingError(f"{name} is not in the pool")
        data, mtime = found
        return BlockFile(name, len(data), mtime, blake3.blake3(data).hexdigest()[:32])

    def delete(self, name: str) -> None:
        with self._lock:
            self._objects.pop(name, None)

    def list_prefix(self, prefix: str = "") -> Iterator[str]:
        with self._lock:
            names = list(self._objects)
        return (n for n in names if n.startswith(prefix))
