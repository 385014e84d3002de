"""Destination arrays for a restore: mlx arrays whose memory nothing writes
before the restore fills it.

mlx 0.32 has no uninitialised allocation (``mx.zeros`` writes every byte, a
third of a warm restore). Its ``mx.load`` of a Python stream allocates the
array and hands its memory to the stream's ``readinto``; a ``.npy`` stream
whose payload reads write nothing yields exactly that allocation, from the
same buffer cache and heap as any mlx array.

Two things make that safe:

- **Every byte is written before an array is used.** ``rebuild.rebuild``
  counts the bytes its targets cover per destination and refuses an entry
  whose blocks do not cover every byte; a restore that fails part-way drops
  its arrays. Memory reused from another array is never served.
- **The stream is released before we return.** mlx drops its reference to the
  stream on one of its I/O threads, after the load; if the interpreter is
  finalising by then, that thread cannot take the GIL and the process aborts
  at exit (2 in 40 processes that allocated and exited at once). Waiting
  here until every stream has been collected (a weakref callback) closes
  that window: 0 in 150.

An mlx that loads such a stream differently (this rests on how 0.32 reads
one) gets zeroed arrays instead, with one warning: slower, never a miss.
"""

from __future__ import annotations

import io
import logging
import threading
import weakref
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)


_RELEASE_WAIT = 10.0  # seconds: mlx releases a stream microseconds after the load
_refused = False  # mlx refused an unfilled stream once: zeroed arrays from then on


class _Unfilled(io.RawIOBase):
    """A ``.npy`` stream of ``host`` values in ``shape`` whose payload is never written."""

    def __init__(self, host: np.dtype, shape: tuple[int, ...]) -> None:
        head = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            head, {"descr": np.lib.format.dtype_to_descr(host), "fortran_order": False, "shape": tuple(shape)})
        self._head = head.getvalue()
        self._size = len(self._head) + int(np.prod(shape, dtype=np.int64)) * host.itemsize
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        n = memoryview(buffer).nbytes
        if self._pos < len(self._head):  # the header is read; the payload is left as it is
            n = min(n, len(self._head) - self._pos)
            memoryview(buffer).cast("B")[:n] = self._head[self._pos : self._pos + n]
        self._pos += n
        return n


def unfilled_arrays(specs: Sequence[tuple[mx.Dtype, np.dtype, tuple[int, ...]]]) -> list[mx.array]:
    """One evaluated, row-contiguous mlx array per ``(bits dtype, host dtype, shape)``,
    its contents whatever the memory held: the caller writes every byte.

    An mlx that does not load such a stream (another version may read it
    differently) gets zeroed arrays instead, with one warning: a restore
    then costs the zeroing, never a miss."""
    global _refused
    if not _refused:
        try:
            return _loaded(specs)
        except Exception as exc:  # noqa: BLE001 - any refusal by mlx: fall back, say it once
            _refused = True
            log.warning("blockkv: mlx did not load an unfilled stream (%s: %s); restores zero their arrays",
                        type(exc).__name__, exc)
    arrays = [mx.zeros(shape, dtype=bits) for bits, _, shape in specs]
    mx.eval(arrays)
    return arrays


def _loaded(specs: Sequence[tuple[mx.Dtype, np.dtype, tuple[int, ...]]]) -> list[mx.array]:
    sources = [_Unfilled(host, shape) for _, host, shape in specs]
    released = threading.Semaphore(0)
    watches = [weakref.ref(s, lambda _: released.release()) for s in sources]
    arrays = [mx.load(source, format="npy", stream=mx.cpu) for source in sources]
    for a, (bits, _, shape) in zip(arrays, specs):
        if a.dtype != bits or tuple(a.shape) != tuple(shape):
            raise RuntimeError(f"mlx loaded {a.dtype}{tuple(a.shape)} for {bits}{tuple(shape)}")
    mx.eval(arrays)
    del sources
    for _ in watches:
        if not released.acquire(timeout=_RELEASE_WAIT):
            log.warning("blockkv: mlx has not released a load stream after %.0f s", _RELEASE_WAIT)
            break
    return arrays
