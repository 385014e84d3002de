"""An entry's row in the index's ``entries`` table, and loading many at once.

A row holds what ``find`` and open need without reading the header: a JSON
head (ns, header path and bytes, block names, trim facts, checkpoint,
attachments, owner), then the tokens as little-endian u32.
"""

from __future__ import annotations

import gc
import json
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from blockkv.errors import CorruptError
from blockkv.records import EntryRecord


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off for a bulk load. Loading 10k entries
    makes some 100k objects and no garbage cycles, yet triggers collections
    that walk the whole heap; in a big process (a server, the benchmark)
    those cost more than the load (an open at 10k entries: 360-390 ms
    without them, 475-775 ms with). Loads on several threads overlap: the
    last one out restores what the first one found (off stays off)."""
    global _gc_pauses, _gc_was_enabled
    with _gc_mutex:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_mutex:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()


_gc_mutex = threading.Lock()
_gc_pauses = 0
_gc_was_enabled = True


def pack_record(record: EntryRecord) -> bytes:
    """An entry's row: a JSON head, then its tokens as little-endian u32."""
    meta = json.dumps(
        {
            "ns": record.ns,
            "path": record.path,
            "hdr": record.header_bytes,
            "blocks": list(record.blocks),
            "trim": record.trimmable,
            "mro": record.minimum_reusable_offset,
            "ckpt": record.checkpoint,
            "att": list(record.attachments),
            "owner": record.owner,
        },
        separators=(",", ":"),
    ).encode()
    return struct.pack("<I", len(meta)) + meta + np.ascontiguousarray(record.tokens, "<u4").tobytes()


def unpack_record(entry_id: str, data: bytes) -> EntryRecord:
    try:
        (n,) = struct.unpack_from("<I", data)
        return _record(entry_id, json.loads(data[4 : 4 + n]), data, 4 + n)
    except (ValueError, KeyError, TypeError, struct.error) as exc:
        raise CorruptError(f"index record {entry_id} unreadable: {exc}") from None


def unpack_records(rows: list[tuple[bytes, bytes]], *, copy: bool = True) -> list[EntryRecord]:
    """Every (key, value) row of the entries table as a record, in order. The
    JSON heads are parsed as one array (a third of the per-call cost of
    parsing 10k small documents one by one); if that fails, row by row, so
    the error names the row. ``copy=False``: the tokens are views of the rows
    (of the map, in a transaction with buffers: valid only inside it)."""
    try:
        heads, ends = [], []
        for _, v in rows:
            (n,) = struct.unpack_from("<I", v)
            heads.append(bytes(v[4 : 4 + n]))
            ends.append(4 + n)
        metas = json.loads(b"[" + b",".join(heads) + b"]")
        if len(metas) != len(rows):
            raise ValueError("a head is not one JSON value")
        return [_record(bytes(k).decode(), m, v, end, copy) for (k, v), m, end in zip(rows, metas, ends)]
    except (ValueError, KeyError, TypeError, struct.error):
        return [unpack_record(bytes(k).decode(), bytes(v)) for k, v in rows]


def record_tokens(data: bytes | memoryview) -> np.ndarray:
    """A row's tokens, as a view of the row (no JSON parsed)."""
    (n,) = struct.unpack_from("<I", data)
    return np.frombuffer(data, "<u4", offset=4 + n)


def record_blocks(data: bytes | memoryview) -> tuple[str, ...]:
    """A row's block names (only its JSON head parsed)."""
    (n,) = struct.unpack_from("<I", data)
    return tuple(json.loads(bytes(data[4 : 4 + n]))["blocks"])


def _record(entry_id: str, m: Any, data: bytes | memoryview, offset: int, copy: bool = True) -> EntryRecord:
    tokens = np.frombuffer(data, "<u4", offset=offset)
    return EntryRecord(
        entry_id, m["ns"], m["path"], int(m["hdr"]), tuple(m["blocks"]), bool(m["trim"]),
        int(m["mro"]), m["ckpt"], tuple(m["att"]), str(m["owner"]), tokens.copy() if copy else tokens,
    )
