"""Token-aligned, content-addressed blocks of an entry's tensors, and their frame.

Block k of an entry holds absolute tokens [k*B, (k+1)*B) of every token-axis
tensor (record order), so entries sharing a prefix share those blocks by name.
State tensors and attachments are one whole-tensor block each. A block's name
is blake3(canonical bytes + layout JSON + its length): equal names mean equal content,
whatever the on-disk compression. No file-system code lives here."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx
import numpy as np
import xxhash
import zstandard
from blake3 import blake3

from blockkv.errors import BlockMissingError, CorruptBlockError, CorruptHeaderError
from blockkv.format.codec import (
    DTYPES,
    MAX_STR,
    CacheRecord,
    Data,
    TensorRecord,
    capture,
    decode_caches,
    device_buffers,
    dtype_name,
    encode_cache,
    map_tensors,
    minimum_reusable_offset,
    records_from_descriptor,
    records_offset,
    records_to_descriptor,
    tensor_from_descriptor,
    tensor_to_descriptor,
    trimmable,
    truncate_records,
    walk_tensors,
)

FORMAT = 1
DEFAULT_BLOCK_TOKENS = 256
MAX_BLOCK_TOKENS = 1 << 20
MAX_BLOCKS = 1 << 20
MAX_ATTACHMENTS = 256

# Frame: magic, version u8, compression u8, reserved u16, raw length u64, layout length u32.
MAGIC = b"BKVB"
FRAME_VERSION = 1
_HEADER = struct.Struct("<4sBBHQI")
COMPRESSIONS: dict[str | None, int] = {None: 0, "zstd": 1}
ZSTD_LEVEL = 2
MAX_LAYOUT_BYTES = 1 << 16
MAX_RAW_BYTES = 1 << 34
_NS_KEY_CONTEXT = "blockkv 2026-12 namespace block key v1"
# zstd cannot expand more than this (a 3-byte RLE block yields 128 KiB).
_ZSTD_MAX_RATIO = 1 << 16


Part = tuple[str, tuple[int, ...]]  # (mlx dtype name, shape) of one part of a block


@dataclass(frozen=True)
class BlockRef:
    """A block an entry needs: name, canonical size, absolute token range (-1, -1 for state)."""

    name: str
    raw_bytes: int
    start: int
    stop: int
    xxh3: str = ""  # xxh3-128 of the same bytes as the name, from the header ("": none recorded)


@dataclass
class Block:
    """A block's canonical bytes as host arrays (views of the cache buffers, no copies), with
    their layout (needed to hash and to byte-shuffle them)."""

    ref: BlockRef
    parts: list[np.ndarray]
    layout: list[Part]


@dataclass
class EntryLayout:
    """An entry split into blocks plus the JSON-safe descriptor that rebuilds it."""

    descriptor: dict[str, Any]
    blocks: list[Block]
    block_xxh3: list[str] = field(default_factory=list)  # per descriptor block ref, for the header


# ---------------------------------------------------------------- naming


def _chunks(a: np.ndarray) -> list[memoryview]:
    """``a``'s bytes in C order as contiguous pieces, without copying: hashing
    or writing them in turn equals hashing or writing ``ascontiguousarray(a)``.
    (A row slice of a KV buffer is one piece per head.)"""
    if a.flags.c_contiguous:
        return [memoryview(a.reshape(-1).view(np.uint8))]
    k, run = a.ndim, a.itemsize
    while k > 0 and (a.shape[k - 1] == 1 or a.strides[k - 1] == run):
        run *= a.shape[k - 1]
        k -= 1
    rows = a.view()
    try:
        rows.shape = (-1, run // a.itemsize)  # raises rather than copy when the leading dims do not merge
    except AttributeError:
        return [memoryview(a[idx].reshape(-1).view(np.uint8)) for idx in np.ndindex(*a.shape[:k])]
    return [memoryview(r.view(np.uint8)) for r in rows]


def _layout_bytes(layout: Sequence[Part]) -> bytes:
    """Canonical layout: compact JSON ``[[dtype, [dims...]], ...]`` (prefix-free)."""
    return json.dumps([[d, list(s)] for d, s in layout], separators=(",", ":")).encode()


def _part_nbytes(part: Part) -> int:
    return math.prod(part[1]) * DTYPES[part[0]][1].itemsize


def _name(h: Any, layout: bytes) -> str:
    """Finish a hash of the payload with the layout and its u64 length.

    The payload goes first so that it starts at offset 0, where blake3 hashes
    many 1 KiB chunks at once; behind any prefix it ran at half the speed
    (112 vs 48 ms for a 256 MiB entry). The trailing length makes the split
    between payload and layout unambiguous."""
    h.update(layout + struct.pack("<Q", len(layout)))
    return h.hexdigest()


def namespace_key(ns: str) -> bytes:
    """The blake3 key naming the blocks of an isolated namespace (``isolate_namespaces``):
    equal content in two namespaces gets two names, so no block is shared across them."""
    return blake3(ns.encode("utf-8", "surrogatepass"), derive_key_context=_NS_KEY_CONTEXT).digest()


def _hasher(key: bytes | None, data: bytes | memoryview = b"") -> blake3:
    return blake3(data) if key is None else blake3(data, key=key)


def _make_block(layout: list[Part], parts: list[np.ndarray], start: int, stop: int,
                key: bytes | None = None) -> Block:
    h, check = _hasher(key), xxhash.xxh3_128()
    for p in parts:
        for chunk in _chunks(p):
            h.update(chunk)
            check.update(chunk)
    raw, layout_bytes = sum(p.nbytes for p in parts), _layout_bytes(layout)
    ref = BlockRef(_name(h, layout_bytes), raw, start, stop, _name(check, layout_bytes))
    return Block(ref, parts, layout)


# ---------------------------------------------------------------- layout planning


def _check_block_tokens(block_tokens: Any) -> int:
    if type(block_tokens) is not int or not 0 < block_tokens <= MAX_BLOCK_TOKENS:
        raise ValueError(f"block_tokens must be a positive int <= {MAX_BLOCK_TOKENS}, got {block_tokens!r}")
    return block_tokens


def _token_ranges(tensors: Sequence[TensorRecord], block_tokens: int) -> list[tuple[int, int]]:
    """Absolute [start, stop) of every block holding at least one token row."""
    spans = [(t.token_start, t.token_stop) for t in tensors if t.token_stop > t.token_start]
    if not spans:
        return []
    end = max(b for _, b in spans)
    first, last = min(a for a, _ in spans) // block_tokens, -(-end // block_tokens)
    if last - first > MAX_BLOCKS:
        raise CorruptHeaderError(f"entry spans {last - first} token blocks (max {MAX_BLOCKS})")
    ranges = [(k * block_tokens, min((k + 1) * block_tokens, end)) for k in range(first, last)]
    return [(a, b) for a, b in ranges if any(s < b and a < e for s, e in spans)]


def _block_parts(tensors: Sequence[TensorRecord], start: int, stop: int) -> list[tuple[int, int, int]]:
    """(tensor index, first row, end row) relative to each tensor, for one token block."""
    out = []
    for i, t in enumerate(tensors):
        a, b = max(start, t.token_start) - t.token_start, min(stop, t.token_stop) - t.token_start
        if a < b:
            out.append((i, a, b))
    return out


def _row_geometry(t: TensorRecord) -> tuple[int, int]:
    """(heads, bytes of one head's token row) of a token-axis tensor: a token
    row adds ``heads`` runs of that many bytes to a block."""
    return math.prod(t.shape[:-2]), t.shape[-1] * DTYPES[t.dtype][1].itemsize


def _rows_part(t: TensorRecord, a: int, b: int) -> Part:
    return (t.dtype, (*t.shape[:-2], b - a, t.shape[-1]))


def _present(records: Sequence[CacheRecord]) -> list[TensorRecord]:
    return [t for t in walk_tensors(records) if t is not None]


# ---------------------------------------------------------------- split


def _attachment_records(attachments: Mapping[str, mx.array] | None, data: Data) -> dict[str, TensorRecord]:
    if attachments is None:
        return {}
    if not isinstance(attachments, Mapping) or len(attachments) > MAX_ATTACHMENTS:
        raise TypeError(f"attachments must be a mapping of at most {MAX_ATTACHMENTS} arrays")
    out = {}
    for key in sorted(attachments):
        a = attachments[key]
        if not isinstance(key, str) or not 0 < len(key) <= MAX_STR:
            raise ValueError(f"attachment name must be a non-empty str of <= {MAX_STR} chars, got {key!r}")
        if not isinstance(a, mx.array):
            raise TypeError(f"attachment {key!r} must be an mx.array, got {type(a).__name__}")
        out[key] = TensorRecord(dtype_name(a.dtype), tuple(a.shape), False, 0, capture(a, data))
    return out


@dataclass(frozen=True)
class Snapshot:
    """An entry captured on the caller's thread: records and attachments whose
    data are evaluated mlx arrays that no later in-place cache update can
    change. Copying to the host and hashing (the slow part) happen later, in
    ``split_entry``, on whatever thread runs it."""

    records: list[CacheRecord]
    attachments: dict[str, TensorRecord]


def snapshot(caches: Sequence[Any], attachments: Mapping[str, mx.array] | None = None) -> Snapshot:
    """Validate and capture an entry (bad caches raise here, on the caller's thread).

    Arrays are evaluated here because a lazy array can only be evaluated on
    the thread whose stream built it."""
    records = [encode_cache(c, "device") for c in caches]
    extra = _attachment_records(attachments, "device")
    mx.eval([t.data for t in _present(records) + list(extra.values())])
    return Snapshot(records, extra)


def _to_host(t: TensorRecord) -> TensorRecord:
    """The snapshot's bits as a numpy view of the evaluated mlx buffer (no copy)."""
    return replace(t, data=np.asarray(memoryview(t.data)))


def _hashed(specs: Iterable[tuple[list[Part], list[np.ndarray], int, int]], key: bytes | None,
            hashers: Executor | None, workers: int = 2) -> Iterator[Block]:
    """Each spec made a named block, in order. With ``hashers``, up to ``2 x workers``
    blocks are hashed ahead on its threads (blake3 releases the GIL), so a
    store's hashing runs on more than one core while the caller writes."""
    if hashers is None:
        for layout, parts, start, stop in specs:
            yield _make_block(layout, parts, start, stop, key)
        return
    window: list[Future[Block]] = []
    try:
        for layout, parts, start, stop in specs:
            window.append(hashers.submit(_make_block, layout, parts, start, stop, key))
            if len(window) >= 2 * workers:
                yield window.pop(0).result()
        while window:
            yield window.pop(0).result()
    finally:
        for f in window:  # the consumer stopped early (a failed write): hash nothing more
            f.cancel()


def _add(blocks: dict[str, Block], block: Block, on_block: Callable[[Block], None] | None) -> BlockRef:
    if block.ref.name not in blocks:
        blocks[block.ref.name] = block
        if on_block is not None:
            on_block(block)
    return block.ref


def split_entry(
    caches: Sequence[Any] | Snapshot,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    attachments: Mapping[str, mx.array] | None = None,
    on_block: Callable[[Block], None] | None = None,
    key: bytes | None = None,
    hashers: Executor | None = None,
) -> EntryLayout:
    """Cut an entry's caches (and attachments), or a snapshot of them, into
    blocks and a descriptor. ``on_block`` sees each distinct block as soon as
    it is named, so a store can write it while the next one is hashed.
    ``key`` (``namespace_key``) names the blocks with keyed blake3;
    ``hashers`` (two threads) hash blocks ahead of ``on_block``."""
    _check_block_tokens(block_tokens)
    if isinstance(caches, Snapshot):
        if attachments is not None:
            raise ValueError("a Snapshot already holds its attachments")
        snap = caches
    else:
        snap = snapshot(caches, attachments)
    records = map_tensors(snap.records, _to_host)
    extra = {k: _to_host(t) for k, t in snap.attachments.items()}
    present = _present(records)
    token = [t for t in present if t.token_axis]
    state = [t for t in present if not t.token_axis] + list(extra.values())
    blocks: dict[str, Block] = {}
    ranges = _token_ranges(token, block_tokens)

    def specs() -> Iterator[tuple[list[Part], list[np.ndarray], int, int]]:
        for start, stop in ranges:
            spec = _block_parts(token, start, stop)
            parts = [token[i].data[..., a:b, :] for i, a, b in spec]  # views: hashed and written in place
            yield [_rows_part(token[i], a, b) for i, a, b in spec], parts, start, stop
        for t in state:
            yield [(t.dtype, t.shape)], [t.data], -1, -1

    refs = [_add(blocks, block, on_block) for block in _hashed(specs(), key, hashers)]
    token_refs, state_refs = refs[: len(ranges)], refs[len(ranges) :]
    descriptor = {
        "format": FORMAT,
        "block_tokens": block_tokens,
        "records": records_to_descriptor(records),
        "attachments": {k: tensor_to_descriptor(t) for k, t in extra.items()},
        "token_blocks": [[r.name, r.raw_bytes, r.start, r.stop] for r in token_refs],
        "state_blocks": [[r.name, r.raw_bytes] for r in state_refs],
    }
    return EntryLayout(descriptor, list(blocks.values()), [r.xxh3 for r in token_refs + state_refs])


# ---------------------------------------------------------------- descriptor


@dataclass(frozen=True)
class _Entry:
    """A validated descriptor."""

    block_tokens: int
    records: list[CacheRecord]
    attachments: dict[str, TensorRecord]
    token_refs: list[BlockRef]
    state_refs: list[BlockRef]


def _bad(what: str) -> CorruptHeaderError:
    return CorruptHeaderError(f"bad entry descriptor: {what}")


def _is_name(v: Any) -> bool:
    return isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)


def _is_count(v: Any, high: int = MAX_RAW_BYTES) -> bool:
    return type(v) is int and 0 <= v <= high


_KEYS = {"format", "block_tokens", "records", "attachments", "token_blocks", "state_blocks"}


def _parse(obj: Any) -> _Entry:
    """Bounded validation: every size and range is recomputed from the records.
    An already parsed descriptor is returned as it is (parse once per restore)."""
    if isinstance(obj, _Entry):
        return obj
    if not isinstance(obj, dict) or set(obj) != _KEYS:
        raise _bad(f"must be a dict with keys {sorted(_KEYS)}")
    if obj["format"] != FORMAT or type(obj["format"]) is not int:
        raise _bad(f"unknown format {str(obj['format'])[:MAX_STR]!r}")
    block_tokens = obj["block_tokens"]
    if not _is_count(block_tokens, MAX_BLOCK_TOKENS) or block_tokens == 0:
        raise _bad("block_tokens must be a positive bounded int")
    records = records_from_descriptor(obj["records"])
    raw_att, token_raw, state_raw = obj["attachments"], obj["token_blocks"], obj["state_blocks"]
    if not isinstance(raw_att, dict) or len(raw_att) > MAX_ATTACHMENTS:
        raise _bad("attachments must be a small dict")
    attachments = {}
    for key in sorted(raw_att, key=str):
        if not isinstance(key, str) or not 0 < len(key) <= MAX_STR:
            raise _bad("attachment names must be short strings")
        attachments[key] = tensor_from_descriptor(raw_att[key])
        if attachments[key].token_axis:
            raise _bad("attachments are state tensors")
    if not isinstance(token_raw, list) or len(token_raw) > MAX_BLOCKS:
        raise _bad("token_blocks must be a bounded list")
    if not isinstance(state_raw, list) or len(state_raw) > MAX_BLOCKS:
        raise _bad("state_blocks must be a bounded list")
    present = _present(records)
    token = [t for t in present if t.token_axis]
    state = [t for t in present if not t.token_axis] + list(attachments.values())
    ranges = _token_ranges(token, block_tokens)
    if len(ranges) != len(token_raw) or len(state) != len(state_raw):
        raise _bad("block lists do not match the records")
    spans = [(t.token_start, t.token_stop, math.prod(_row_geometry(t))) for t in token]
    token_refs = []
    for (start, stop), ref in zip(ranges, token_raw):
        raw = sum((min(stop, b) - max(start, a)) * row for a, b, row in spans if a < stop and start < b)
        if not (isinstance(ref, list) and len(ref) == 4 and _is_name(ref[0]) and ref[1:] == [raw, start, stop]):
            raise _bad(f"token block for [{start}, {stop}) does not match the records")
        token_refs.append(BlockRef(ref[0], raw, start, stop))
    state_refs = []
    for t, ref in zip(state, state_raw):
        if not (isinstance(ref, list) and len(ref) == 2 and _is_name(ref[0]) and ref[1] == t.nbytes):
            raise _bad("state block does not match its tensor")
        state_refs.append(BlockRef(ref[0], t.nbytes, -1, -1))
    return _Entry(block_tokens, records, attachments, token_refs, state_refs)


def with_xxh3(descriptor: Any, block_xxh3: Any) -> _Entry:
    """The parsed descriptor with each block ref's xxh3 from the header (``None``:
    a header from before checksums; restores then verify blake3)."""
    entry = _parse(descriptor)
    if block_xxh3 is None:
        return entry
    n = len(entry.token_refs)
    if not (isinstance(block_xxh3, list) and len(block_xxh3) == n + len(entry.state_refs)
            and all(isinstance(c, str) and len(c) == 32 and all(ch in "0123456789abcdef" for ch in c)
                    for c in block_xxh3)):
        raise _bad("block_xxh3 must hold one 32-hex checksum per block")
    return replace(entry, token_refs=[replace(r, xxh3=c) for r, c in zip(entry.token_refs, block_xxh3)],
                   state_refs=[replace(r, xxh3=c) for r, c in zip(entry.state_refs, block_xxh3[n:])])


def validate_descriptor(obj: Any) -> dict[str, Any]:
    """``obj`` if it is a well-formed, self-consistent entry descriptor; else CorruptHeaderError."""
    _parse(obj)
    return obj


def parse_descriptor(obj: Any) -> _Entry:
    """A validated descriptor that every function here accepts in place of the
    JSON form, so a restore validates it once."""
    return _parse(obj)


def descriptor_trimmable(descriptor: Any) -> bool:
    """Whether the entry can be rebuilt at a shorter prefix."""
    return trimmable(_parse(descriptor).records)


def descriptor_min_offset(descriptor: Any) -> int:
    """The shortest prefix the entry can be rebuilt at."""
    return minimum_reusable_offset(_parse(descriptor).records)


def descriptor_tokens(descriptor: Any) -> int:
    """The entry's cache offset (0 when no cache counts tokens, e.g. SSM only)."""
    return records_offset(_parse(descriptor).records)


def _prefix(entry: _Entry, prefix_len: int | None) -> list[CacheRecord]:
    """The records cut to ``prefix_len``; ValueError for untrimmable entries or bad lengths."""
    if prefix_len is None:
        return entry.records
    if not trimmable(entry.records):
        raise ValueError("entry is not trimmable: prefix_len must be None")
    return truncate_records(entry.records, prefix_len)


def _unique(refs: Sequence[BlockRef]) -> list[BlockRef]:
    seen: dict[str, BlockRef] = {}
    for r in refs:
        seen.setdefault(r.name, r)
    return list(seen.values())


def blocks_for_prefix(descriptor: Any, prefix_len: int | None) -> list[BlockRef]:
    """Blocks needed to rebuild at ``prefix_len`` (None: all): the token blocks
    covering [0, prefix_len) and every state block, unique by name."""
    entry = _parse(descriptor)
    _prefix(entry, prefix_len)
    token = entry.token_refs if prefix_len is None else [r for r in entry.token_refs if r.start < prefix_len]
    return _unique(token + entry.state_refs)


# ---------------------------------------------------------------- rebuild


Fetch = Callable[[BlockRef], "bytes | memoryview"]


def _fetcher(payloads: Mapping[str, bytes | memoryview] | Fetch) -> Fetch:
    if callable(payloads):
        return payloads

    def fetch(ref: BlockRef) -> bytes | memoryview:
        try:
            return payloads[ref.name]
        except KeyError:
            raise BlockMissingError(f"block {ref.name} is not among the payloads") from None

    return fetch


@dataclass(frozen=True)
class Target:
    """Where one block's payload lands: the destination pieces (byte views of
    the mlx arrays being rebuilt, plus scratch for rows cut off), in payload
    order. A reader can fill them straight from the file with one scatter read
    and hash them in place: no staging buffer, no second copy."""

    ref: BlockRef
    layout: bytes  # canonical layout JSON: part of the name and of the frame
    pieces: list[memoryview]
    covers: tuple[tuple[int, int], ...] = ()  # (destination array, bytes of it the pieces are)

    @property
    def frame_prefix(self) -> bytes:
        """The exact bytes an uncompressed frame of this block has before its payload."""
        return _HEADER.pack(MAGIC, FRAME_VERSION, COMPRESSIONS[None], 0, self.ref.raw_bytes,
                            len(self.layout)) + self.layout

    def scatter(self, payload: bytes | memoryview) -> None:
        """Fill the pieces from a decoded, verified payload."""
        view, offset = memoryview(payload).cast("B"), 0
        if view.nbytes != self.ref.raw_bytes:
            raise CorruptBlockError(f"block {self.ref.name} has {view.nbytes} bytes, expected {self.ref.raw_bytes}")
        for piece in self.pieces:
            piece[:] = view[offset : offset + piece.nbytes]
            offset += piece.nbytes

    def check(self, full: bool = False, key: bytes | None = None) -> Check:
        """A check of this block's bytes fed piece by piece as they arrive, so a
        reader can hash each run of pieces while it is still in the CPU cache."""
        return Check(self, full, key)

    def _digest(self, h: Any) -> str:
        for piece in self.pieces:
            h.update(piece)
        return _name(h, self.layout)


class Check:
    """Is a target's payload, fed in order, the block's? Against its xxh3-128
    from the header, or (``full``, or no xxh3 recorded) against its blake3 name
    (keyed with ``key`` in an isolated namespace, see ``namespace_key``).

    ``finish`` raises CorruptBlockError only on proof that the block's bytes are
    wrong: an xxh3 mismatch is confirmed with blake3 first, and a block that
    does hash to its name convicts the header instead (CorruptHeaderError),
    so a bad header can never get a good shared block deleted."""

    def __init__(self, target: Target, full: bool, key: bytes | None) -> None:
        self._target, self._key = target, key
        self._fast = bool(target.ref.xxh3) and not full
        self._hash = xxhash.xxh3_128() if self._fast else _hasher(key)
        self.update = self._hash.update

    def finish(self) -> None:
        ref = self._target.ref
        if self._fast:
            if _name(self._hash, self._target.layout) == ref.xxh3:
                return
            if self._target._digest(_hasher(self._key)) == ref.name:
                raise CorruptHeaderError(f"the header's xxh3-128 of block {ref.name} is wrong")
        elif _name(self._hash, self._target.layout) == ref.name:
            return
        raise _corrupt(ref.name, "content does not hash to the name")


def _flat(view: np.ndarray) -> memoryview:
    return memoryview(view.reshape(-1).view(np.uint8))


class _TokenTargets:
    """Targets of an entry's token blocks over the destination arrays ``dest``
    (cut to ``rows`` token rows per tensor). The per-tensor geometry and each
    distinct block layout are worked out once per restore, not once per block:
    at 34 blocks of 32 tensors that was a quarter of a warm restore."""

    def __init__(self, full: Sequence[TensorRecord], dest: Sequence[memoryview], rows: Sequence[int]) -> None:
        self._full, self._dest, self._rows = full, dest, rows
        self._geometry = [_row_geometry(t) for t in full]
        self._layouts: dict[tuple[tuple[int, int], ...], bytes] = {}

    def __call__(self, ref: BlockRef) -> Target:
        """Pieces of token block ``ref``: per tensor and per leading index (head), the
        block's rows that the cut keeps, then scratch for the rows it drops."""
        spec = _block_parts(self._full, ref.start, ref.stop)
        pieces: list[memoryview | None] = []
        dropped: list[tuple[int, int]] = []  # (piece index, bytes) of rows beyond the cut
        covers = []
        for i, a, b in spec:
            heads, row = self._geometry[i]
            rows, dest = self._rows[i], self._dest[i]
            end = max(a, min(b, rows))
            covers.append((i, heads * (end - a) * row))
            if b == end:  # the whole block is kept: the common case
                pieces += [dest[(base + a) * row : (base + b) * row] for base in range(0, heads * rows, rows)]
                continue
            for base in range(0, heads * rows, rows):
                if end > a:
                    pieces.append(dest[(base + a) * row : (base + end) * row])
                dropped.append((len(pieces), (b - end) * row))
                pieces.append(None)
        if dropped:  # hashed after the read, so every dropped run needs its own bytes
            scratch, used = memoryview(bytearray(sum(n for _, n in dropped))), 0
            for k, n in dropped:
                pieces[k], used = scratch[used : used + n], used + n
        key = tuple((i, b - a) for i, a, b in spec)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = _layout_bytes([_rows_part(self._full[i], a, b) for i, a, b in spec])
        return Target(ref, layout, pieces, tuple(covers))  # type: ignore[arg-type]


def rebuild(
    descriptor: Any,
    payloads: Mapping[str, bytes | memoryview] | Fetch | None = None,
    prefix_len: int | None = None,
    fill: Callable[[Iterator[Target]], Iterable[Target]] | None = None,
) -> tuple[list[Any], dict[str, mx.array]]:
    """Real mlx-lm caches (at ``prefix_len`` if given) and the attachments.

    The blocks ``blocks_for_prefix`` names become ``Target`` s over the memory of
    the mlx arrays that the caches will hold. ``fill(targets)`` fills them all
    (in any order, on any threads; a store reads the files straight into them)
    and yields each target once it is filled.
    Without it, ``payloads`` maps names to verified payloads, or is a function
    fetching one, asked one block at a time (a returned buffer may be reused
    once the next is asked for), and each payload is scattered into its target."""
    entry = _parse(descriptor)
    records = _prefix(entry, prefix_len)
    full = [t for t in _present(entry.records) if t.token_axis]
    cut = [t for t in _present(records) if t.token_axis]
    state_tensors = [t for t in _present(entry.records) if not t.token_axis] + list(entry.attachments.values())
    dest = device_buffers([(t.dtype, t.shape) for t in cut + state_tensors])  # not zeroed: see below
    token_dest, state_dest = dest[: len(cut)], [a for a, _ in dest[len(cut) :]]
    flats = [_flat(view) for _, view in token_dest]
    token_target = _TokenTargets(full, flats, [t.shape[-2] for t in cut])

    def targets() -> Iterator[Target]:  # made as ``fill`` asks for them
        for ref in entry.token_refs:
            if prefix_len is not None and ref.start >= prefix_len:
                break
            yield token_target(ref)
        for k, (ref, t, (_, view)) in enumerate(zip(entry.state_refs, state_tensors, dest[len(cut) :])):
            yield Target(ref, _layout_bytes([(t.dtype, t.shape)]), [_flat(view)], ((len(cut) + k, view.nbytes),))

    if fill is None:
        fetch = _fetcher(payloads if payloads is not None else {})

        def fill(made: Iterator[Target]) -> Iterator[Target]:  # one at a time: a fetched buffer may be reused
            for target in made:
                target.scatter(fetch(target.ref))
                yield target

    written = [0] * len(dest)
    for target in fill(targets()):
        for i, n in target.covers:
            written[i] += n
    # the arrays were not zeroed: every byte must be one a filled target wrote, or none is served
    # (targets never overlap: each holds its own block's rows, or a whole state tensor)
    if written != [view.nbytes for _, view in dest]:
        raise _bad("its blocks do not cover every byte of the cache")
    token, state = iter(a for a, _ in token_dest), iter(state_dest)
    filled = map_tensors(records, lambda t: replace(t, data=next(token) if t.token_axis else next(state)))
    attachments = {k: next(state) for k in entry.attachments}
    return decode_caches(filled), attachments


# ---------------------------------------------------------------- block frame


def encode_block(block: Block, compression: str | None = None) -> list[bytes | memoryview]:
    """The block's on-disk frame as buffers to write in order (raw parts are not copied)."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {list(COMPRESSIONS)}, got {compression!r}")
    layout = _layout_bytes(block.layout)
    header = _HEADER.pack(MAGIC, FRAME_VERSION, COMPRESSIONS[compression], 0, block.ref.raw_bytes, len(layout))
    if compression is None:
        return [header, layout, *(c for p in block.parts for c in _chunks(p))]
    shuffled = np.empty(block.ref.raw_bytes, np.uint8)
    offset = 0
    for part, p in zip(block.layout, block.parts):
        n, size = p.nbytes, DTYPES[part[0]][1].itemsize
        shuffled[offset : offset + n].reshape(size, -1)[:] = np.ascontiguousarray(p).reshape(-1).view(np.uint8).reshape(-1, size).T
        offset += n
    return [header, layout, zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(shuffled)]


def _corrupt(name: str, what: str) -> CorruptBlockError:
    return CorruptBlockError(f"block {name[:64]}: {what}")


def _parse_layout(name: str, raw: memoryview) -> list[Part]:
    try:
        obj = json.loads(bytes(raw))
    except (ValueError, RecursionError):
        raise _corrupt(name, "layout is not JSON") from None
    if not isinstance(obj, list) or len(obj) > MAX_LAYOUT_BYTES:
        raise _corrupt(name, "layout must be a list")
    layout = []
    for item in obj:
        if not isinstance(item, list) or len(item) != 2:
            raise _corrupt(name, "bad layout part")
        try:
            t = tensor_from_descriptor({"dtype": item[0], "shape": item[1], "token_axis": False, "token_start": 0})
        except CorruptHeaderError as e:
            raise _corrupt(name, f"bad layout part: {e}") from None
        layout.append((t.dtype, t.shape))
    return layout


def decode_block(name: str, data: bytes | memoryview, verify: bool = True, key: bytes | None = None) -> memoryview:
    """The canonical payload of a framed block, verified against ``name``
    (``verify=False`` skips only the hash, for stores that opt out of it;
    ``key``: the block was named with keyed blake3, see ``namespace_key``).

    Every declared size is bounded by the data actually present, so garbage
    raises CorruptBlockError without a large allocation."""
    view = memoryview(data).cast("B")
    if view.nbytes < _HEADER.size:
        raise _corrupt(name, "shorter than its header")
    magic, version, comp, reserved, raw, layout_len = _HEADER.unpack_from(view)
    if magic != MAGIC or version != FRAME_VERSION or reserved != 0 or comp not in COMPRESSIONS.values():
        raise _corrupt(name, "bad magic, version or compression id")
    body = _HEADER.size + layout_len
    if layout_len > MAX_LAYOUT_BYTES or body > view.nbytes or raw > MAX_RAW_BYTES:
        raise _corrupt(name, "declared sizes exceed the data")
    layout_raw, stored = view[_HEADER.size : body], view[body:]
    layout = _parse_layout(name, layout_raw)
    if sum(_part_nbytes(p) for p in layout) != raw:
        raise _corrupt(name, "layout does not add up to the raw length")
    if comp == COMPRESSIONS[None]:
        if stored.nbytes != raw:
            raise _corrupt(name, "payload length differs from the raw length")
        payload = stored
    else:
        payload = _unshuffle(name, stored, raw, layout)
    if not verify:
        return payload
    if _name(_hasher(key, payload), bytes(layout_raw)) != name:
        raise _corrupt(name, "content does not hash to the name")
    return payload


def frame_name(data: bytes | memoryview, payload: bytes | memoryview, key: bytes | None = None) -> str:
    """The name a frame's content has under ``key`` (``payload``: what
    ``decode_block(..., verify=False)`` returned for ``data``): to find which
    key, if any, a block was named with."""
    view = memoryview(data).cast("B")
    layout_len = _HEADER.unpack_from(view)[5]
    return _name(_hasher(key, payload), bytes(view[_HEADER.size : _HEADER.size + layout_len]))


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
        raise _corrupt(name, "raw length impossible for this much zstd data")
    try:
        if zstandard.frame_content_size(stored) != raw:
            raise _corrupt(name, "zstd frame size differs from the raw length")
        plain = zstandard.ZstdDecompressor().decompress(stored, max_output_size=raw, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise _corrupt(name, f"zstd: {e}") from None
    if len(plain) != raw:
        raise _corrupt(name, "zstd output differs from the raw length")
    src = np.frombuffer(plain, np.uint8)
    out = np.empty(raw, np.uint8)
    offset = 0
    for part in layout:
        n, size = _part_nbytes(part), DTYPES[part[0]][1].itemsize
        out[offset : offset + n].reshape(-1, size)[:] = src[offset : offset + n].reshape(size, -1).T
        offset += n
    return memoryview(out)
