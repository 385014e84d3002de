"""Destination arrays for a restore: mlx arrays whose memory nothing writes
before the restore fills it.

mlx 0.32 has no uninitialised allocation (``mx.zeros`` writes every byte, a
third of a warm restore). Its ``mx.load`` of a Python stream allocates each
array and hands its memory to the stream's ``readinto``; a safetensors
stream whose payload reads write nothing yields exactly those allocations,
from the same buffer cache and heap as any mlx array: one array (its own
buffer) per tensor the stream's header declares. One stream for all of a
restore's arrays, not one ``.npy`` stream per array: 32 arrays of 1 MiB took
1.2 against 1.9 ms of CPU (4.1 against 2.9 at 8.5 MiB), a fixed cost of every
restore that weighs most on small entries.

Two things make that safe:

- **Every byte is written before an array is used.** ``rebuild.rebuild``
  counts the bytes its targets cover per destination and refuses an entry
  whose blocks do not cover every byte; a restore that fails part-way drops
  its arrays. Memory reused from another array is never served.
- **The stream is released before we return.** mlx drops its reference to the
  stream on one of its I/O threads, after the load; if the interpreter is
  finalising by then, that thread cannot take the GIL and the process aborts
  at exit (2 in 40 processes that allocated and exited at once). Waiting
  here until the stream has been collected (a weakref callback) closes
  that window: 0 in 150.

An mlx that loads such a stream differently (this rests on how 0.32 reads
one) gets zeroed arrays instead, with one warning: slower, never a miss.
"""

from __future__ import annotations

import io
import json
import logging
import math
import struct
import threading
import weakref
from collections.abc import Sequence

import mlx.core as mx

log = logging.getLogger(__name__)


_RELEASE_WAIT = 10.0  # seconds: mlx releases a stream microseconds after the load
_refused = False  # mlx refused an unfilled stream once: zeroed arrays from then on


# safetensors' name of each dtype an unfilled array is made of (floats come as their bits, codec._BITS_VIEW)
_SAFETENSORS_DTYPES: dict[mx.Dtype, str] = {
    mx.bool_: "BOOL", mx.uint8: "U8", mx.uint16: "U16", mx.uint32: "U32", mx.uint64: "U64",
    mx.int8: "I8", mx.int16: "I16", mx.int32: "I32", mx.int64: "I64", mx.complex64: "C64",
}


class _Unfilled(io.RawIOBase):
    """A safetensors stream of tensors ``"0"``, ``"1"``, ... in ``specs`` whose payload is never written."""

    def __init__(self, specs: Sequence[tuple[mx.Dtype, tuple[int, ...]]]) -> None:
        tensors, offset = {}, 0
        for i, (dtype, shape) in enumerate(specs):
            nbytes = math.prod(shape) * dtype.size
            tensors[str(i)] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                               "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header = json.dumps(tensors).encode()
        header += b" " * (-len(header) % 8)  # the payload starts 8-byte aligned
        self._head = struct.pack("<Q", len(header)) + header
        self._size = len(self._head) + offset
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


def unfilled_arrays(specs: Sequence[tuple[mx.Dtype, tuple[int, ...]]]) -> list[mx.array]:
    """One evaluated, row-contiguous mlx array per ``(bits dtype, shape)`` (no
    empty shape), its contents whatever the memory held: the caller writes every byte.

    An mlx that does not load such a stream (another version may read it
    differently) gets zeroed arrays instead, with one warning: a restore
    then costs the zeroing, never a miss."""
    global _refused
    if not specs:
        return []
    if not _refused:
        try:
            return _loaded(specs)
        except Exception as exc:  # noqa: BLE001 - any refusal by mlx: fall back, say it once
            _refused = True
            log.warning("blockkv: mlx did not load an unfilled stream (%s: %s); restores zero their arrays",
                        type(exc).__name__, exc)
    arrays = [mx.zeros(shape, dtype=bits) for bits, shape in specs]
    mx.eval(arrays)
    return arrays


def _loaded(specs: Sequence[tuple[mx.Dtype, tuple[int, ...]]]) -> list[mx.array]:
    source = _Unfilled(specs)
    released = threading.Semaphore(0)
    watch = weakref.ref(source, lambda _: released.release())  # the callback fires only while ``watch`` lives
    loaded = mx.load(source, format="safetensors", stream=mx.cpu)
    arrays = [loaded[str(i)] for i in range(len(specs))]
    for a, (bits, shape) in zip(arrays, specs):
        if a.dtype != bits or tuple(a.shape) != tuple(shape):
            raise RuntimeError(f"mlx loaded {a.dtype}{tuple(a.shape)} for {bits}{tuple(shape)}")
    mx.eval(arrays)
    del source, loaded
    if not released.acquire(timeout=_RELEASE_WAIT):
        log.warning("blockkv: mlx has not released a load stream after %.0f s", _RELEASE_WAIT)
    del watch
    return arrays
