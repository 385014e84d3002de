"""A block's frame on disk: a fixed header (magic, version, compression, raw
length, layout length), the canonical layout JSON, then the payload, raw or
zstd over byte-shuffled parts. Decoding bounds every declared size by the bytes
present and checks the payload against the block's name. No file-system code
lives here."""

from __future__ import annotations

import enum
import json
import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import zstandard

from blockkv.errors import CorruptBlockError, CorruptHeaderError
from blockkv.format.blocks import MAX_RAW_BYTES, Block, Part, chunks, finish_name, hasher, layout_bytes
from blockkv.format.codec import DTYPES, tensor_from_descriptor

# Frame: magic, version u8, compression u8, reserved u16, raw length u64, layout length u32.
MAGIC = b"BKVB"
FRAME_VERSION = 1
_HEADER = struct.Struct("<4sBBHQI")
FRAME_HEAD_BYTES = _HEADER.size  # what ``frame_bound`` needs of a block file
COMPRESSIONS: dict[str | None, int] = {None: 0, "zstd": 1}
ZSTD_LEVEL = 2
MAX_LAYOUT_BYTES = 1 << 16
# zstd cannot expand more than this (a 3-byte RLE block yields 128 KiB).
_ZSTD_MAX_RATIO = 1 << 16


def encode_block(block: Block, compression: str | None = None) -> list[bytes | memoryview]:
    """The block's on-disk frame as buffers to write in order (raw parts are not copied)."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {list(COMPRESSIONS)}, got {compression!r}")
    layout = layout_bytes(block.layout)
    header = frame_head(block.ref.raw_bytes, layout, compression)
    if compression is None:
        return [header, layout, *(c for p in block.parts for c in chunks(p))]
    shuffled = np.empty(block.ref.raw_bytes, np.uint8)
    offset = 0
    for part, p in zip(block.layout, block.parts):
        n, size = p.nbytes, DTYPES[part[0]][1].itemsize
        shuffled[offset : offset + n].reshape(size, -1)[:] = np.ascontiguousarray(p).reshape(-1).view(np.uint8).reshape(-1, size).T
        offset += n
    return [header, layout, zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(shuffled)]


def frame_head(raw_bytes: int, layout: bytes, compression: str | None = None) -> bytes:
    """The fixed header of a block's frame: the layout follows it, then the payload."""
    return _HEADER.pack(MAGIC, FRAME_VERSION, COMPRESSIONS[compression], 0, raw_bytes, len(layout))


def corrupt_block(name: str, what: str) -> CorruptBlockError:
    """The error that proves a block's own bytes wrong: a reader may quarantine the block."""
    return CorruptBlockError(f"block {name[:64]}: {what}")


def _parse_layout(name: str, raw: memoryview) -> list[Part]:
    try:
        obj = json.loads(bytes(raw))
    except (ValueError, RecursionError):
        raise corrupt_block(name, "layout is not JSON") from None
    if not isinstance(obj, list) or len(obj) > MAX_LAYOUT_BYTES:
        raise corrupt_block(name, "layout must be a list")
    layout = []
    for item in obj:
        if not isinstance(item, list) or len(item) != 2:
            raise corrupt_block(name, "bad layout part")
        try:
            t = tensor_from_descriptor({"dtype": item[0], "shape": item[1], "token_axis": False, "token_start": 0})
        except CorruptHeaderError as e:
            raise corrupt_block(name, f"bad layout part: {e}") from None
        layout.append((t.dtype, t.shape))
    return layout


def decode_block(name: str, data: bytes | memoryview, verify: bool = True, key: bytes | None = None) -> memoryview:
    """The canonical payload of a framed block, verified against ``name``
    (``verify=False`` skips only the hash, for stores that opt out of it;
    ``key``: the block was named with keyed blake3, see ``namespace_key``).

    Every declared size is bounded by the data actually present, so garbage
    raises CorruptBlockError without a large allocation."""
    view = memoryview(data).cast("B")
    comp, raw, layout_len = _head(name, view)
    body = _HEADER.size + layout_len
    if body > view.nbytes:
        raise corrupt_block(name, "declared sizes exceed the data")
    layout_raw, stored = view[_HEADER.size : body], view[body:]
    layout = _parse_layout(name, layout_raw)
    if sum(_part_nbytes(p) for p in layout) != raw:
        raise corrupt_block(name, "layout does not add up to the raw length")
    if comp == COMPRESSIONS[None]:
        if stored.nbytes != raw:
            raise corrupt_block(name, "payload length differs from the raw length")
        payload = stored
    else:
        payload = _unshuffle(name, stored, raw, layout)
    if not verify:
        return payload
    if finish_name(hasher(key, payload), bytes(layout_raw)) != name:
        raise corrupt_block(name, "content does not hash to the name")
    return payload


def _head(name: str, view: memoryview) -> tuple[int, int, int]:
    """The compression id, raw length and layout length a frame's fixed header
    declares, each within the format's bounds; CorruptBlockError if ``view``
    does not start with such a header."""
    if view.nbytes < _HEADER.size:
        raise corrupt_block(name, "shorter than its header")
    magic, version, comp, reserved, raw, layout_len = _HEADER.unpack_from(view)
    if magic != MAGIC or version != FRAME_VERSION or reserved != 0 or comp not in COMPRESSIONS.values():
        raise corrupt_block(name, "bad magic, version or compression id")
    if layout_len > MAX_LAYOUT_BYTES or raw > MAX_RAW_BYTES:
        raise corrupt_block(name, "declared sizes exceed the format's bounds")
    return comp, raw, layout_len


class FrameBound(NamedTuple):
    """How long a block file can be, from its frame's fixed header."""

    most: int  # the bytes it may be read up to
    exact: bool  # its length is fixed: a longer file is not this frame (``decode_block`` says so)


def frame_bound(head: bytes | memoryview) -> FrameBound | None:
    """How long a block file starting with ``head`` (its first
    ``FRAME_HEAD_BYTES``) can be, from what its own frame declares, which the
    format caps (``MAX_RAW_BYTES``): a check's bound, since an orphan has no
    entry's header to size it. A raw payload is exactly its raw length; a zstd
    one at most ``max_frame_bytes``, but not exactly: a zstd frame padded with
    empty blocks decodes to the same bytes. None if ``head`` is no frame's
    header: ``decode_block`` convicts the file on those bytes alone."""
    try:
        comp, raw, layout_len = _head("", memoryview(head).cast("B"))
    except CorruptBlockError:
        return None
    if comp == COMPRESSIONS[None]:
        return FrameBound(_HEADER.size + layout_len + raw, exact=True)
    return FrameBound(max_frame_bytes(raw), exact=False)


class Judgement(enum.Enum):
    GOOD = "good"
    BROKEN = "broken"  # the frame does not decode: bad under any key
    UNNAMED = "unnamed"  # decodes, but is not its name under any key tried


@dataclass(frozen=True)
class Verdict:
    judgement: Judgement
    key: bytes | None = None  # the key it verified under (GOOD)
    raw_bytes: int = 0  # the payload length its frame declares (GOOD, UNNAMED)

    @property
    def good(self) -> bool:
        return self.judgement is Judgement.GOOD


def judge_block(name: str, data: bytes | memoryview, keys: Iterable[bytes | None]) -> Verdict:
    """A copy of block ``name`` judged under each of ``keys`` in turn (each
    once). A block is named with the key of the namespace that stored it
    (``namespace_key``; None: unkeyed) and its name does not say which, so a
    header naming it under another key proves nothing against it; what an
    UNNAMED verdict proves is the caller's to say (``bucket/bucket_verdicts.py``,
    ``local/verdicts.py``)."""
    try:
        payload = decode_block(name, data, verify=False)
    except CorruptBlockError:
        return Verdict(Judgement.BROKEN)
    raw = frame_raw_bytes(data)
    for key in dict.fromkeys(keys):
        if frame_name(data, payload, key) == name:
            return Verdict(Judgement.GOOD, key, raw)
    return Verdict(Judgement.UNNAMED, None, raw)


def frame_layout(data: bytes | memoryview) -> bytes:
    """The layout bytes of a frame ``decode_block`` accepted: with the payload,
    what its name was hashed from."""
    layout_len = _HEADER.unpack_from(memoryview(data).cast("B"))[5]
    return bytes(memoryview(data).cast("B")[_HEADER.size : _HEADER.size + layout_len])


def _part_nbytes(part: Part) -> int:
    return math.prod(part[1]) * DTYPES[part[0]][1].itemsize


def frame_name(data: bytes | memoryview, payload: bytes | memoryview, key: bytes | None = None) -> str:
    """The name a frame's content has under ``key`` (``payload``: what
    ``decode_block(..., verify=False)`` returned for ``data``): to find which
    key, if any, a block was named with."""
    return finish_name(hasher(key, payload), frame_layout(data))


def frame_raw_bytes(data: bytes | memoryview) -> int:
    """The raw (payload) length a frame declares; check it with ``decode_block`` first."""
    return _HEADER.unpack_from(memoryview(data).cast("B"))[4]


def max_frame_bytes(raw_bytes: int) -> int:
    """The most bytes a frame of a block of ``raw_bytes`` payload can have: its
    header, the largest layout and the payload, stored or as zstd's worst case."""
    return _HEADER.size + MAX_LAYOUT_BYTES + raw_bytes + (raw_bytes >> 7) + (64 << 10)


def max_raw_bytes(stored: int) -> int:
    """The most payload bytes a block file of ``stored`` bytes can decode to:
    what a reader may allocate for it, whatever a header declares."""
    return stored * _ZSTD_MAX_RATIO


def _unshuffle(name: str, stored: memoryview, raw: int, layout: list[Part]) -> memoryview:
    if raw > stored.nbytes * _ZSTD_MAX_RATIO:
        raise corrupt_block(name, "raw length impossible for this much zstd data")
    try:
        if zstandard.frame_content_size(stored) != raw:
            raise corrupt_block(name, "zstd frame size differs from the raw length")
        plain = zstandard.ZstdDecompressor().decompress(stored, max_output_size=raw, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise corrupt_block(name, f"zstd: {e}") from None
    if len(plain) != raw:
        raise corrupt_block(name, "zstd output differs from the raw length")
    src = np.frombuffer(plain, np.uint8)
    out = np.empty(raw, np.uint8)
    offset = 0
    for part in layout:
        n, size = _part_nbytes(part), DTYPES[part[0]][1].itemsize
        out[offset : offset + n].reshape(-1, size)[:] = src[offset : offset + n].reshape(size, -1).T
        offset += n
    return memoryview(out)
