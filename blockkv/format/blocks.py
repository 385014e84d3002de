"""Token-aligned, content-addressed blocks of an entry's tensors: how an entry
is cut into blocks and how a block is named.

Block k of an entry holds absolute tokens [k*B, (k+1)*B) of every token-axis
tensor (record order), so entries sharing a prefix share those blocks by name.
State tensors and attachments are one whole-tensor block each. A block's name
is blake3(canonical bytes + layout JSON + its length): equal names mean equal content,
whatever the on-disk compression. The descriptor that lists an entry's blocks is
``descriptor``'s, their frame on disk ``frame``'s, the caches rebuilt from them
``rebuild``'s. No file-system code lives here."""

from __future__ import annotations

import json
import math
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx
import numpy as np
import xxhash
from blake3 import blake3

from blockkv.errors import CorruptHeaderError
from blockkv.format.codec import (
    DTYPES,
    MAX_STR,
    CacheRecord,
    Data,
    TensorRecord,
    capture,
    dtype_name,
    encode_cache,
    map_tensors,
    records_to_descriptor,
    tensor_to_descriptor,
    walk_tensors,
)
from blockkv.format.header import Identity

FORMAT = 1
DEFAULT_BLOCK_TOKENS = 256
MAX_BLOCK_TOKENS = 1 << 20
MAX_BLOCKS = 1 << 20
MAX_ATTACHMENTS = 256
MAX_RAW_BYTES = 1 << 34  # the most payload bytes a block may declare
# the codec id in every header says how its blocks are named
CODEC_ID = f"blockkv-blocks-{FORMAT}"
KEYED_CODEC_ID = f"{CODEC_ID}+ns-keyed"  # isolate_namespaces: blocks named with their namespace's key
_NS_KEY_CONTEXT = "blockkv 2026-12 namespace block key v1"
# A thread's staging buffer: within a core's L2, and far over the 64 KiB up to
# which xxhash and blake3 hash under the GIL (a KV row slice is 32 KiB per head)
STAGE_BYTES = 512 << 10
_staging = threading.local()


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


def chunks(a: np.ndarray) -> list[memoryview]:
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


def hash_runs(parts: Sequence[np.ndarray]) -> Iterator[memoryview]:
    """The parts' bytes in C order, in buffers large enough that a hash update
    of one releases the GIL: a C-contiguous part as itself, strided ones (a
    block's rows of a KV buffer, one 32 KiB piece per head) gathered by numpy,
    which releases the GIL too, into this thread's staging buffer up to
    ``STAGE_BYTES`` at a time. So a store's two hashing threads hash at once.
    Each buffer is valid until the next one is asked for."""
    stage = getattr(_staging, "buffer", None)
    if stage is None:
        stage = _staging.buffer = np.empty(STAGE_BYTES, np.uint8)  # kept for the thread's next blocks
    whole, used = memoryview(stage), 0
    for part in parts:
        if part.flags.c_contiguous or not part.ndim or part.strides[-1] != part.itemsize:
            if used:
                yield whole[:used]
                used = 0
            yield from chunks(part)
            continue
        for piece in _pieces(part, STAGE_BYTES):
            if used and used + piece.nbytes > STAGE_BYTES:
                yield whole[:used]
                used = 0
            if piece.nbytes > STAGE_BYTES:  # one row longer than the buffer: contiguous, hashed where it is
                yield memoryview(piece.view(np.uint8))
                continue
            raw = piece.view(np.uint8)
            np.copyto(stage[used : used + piece.nbytes].reshape(raw.shape), raw)
            used += piece.nbytes
    if used:
        yield whole[:used]


def _pieces(a: np.ndarray, limit: int) -> Iterator[np.ndarray]:
    """``a`` split along its leading axes into sub-arrays of at most ``limit``
    bytes (or single rows of its last axis, where one row is longer), in C order."""
    if a.nbytes <= limit or a.ndim <= 1:
        yield a
        return
    step = max(1, limit // a[0].nbytes)
    for i in range(0, a.shape[0], step):
        if step == 1:
            yield from _pieces(a[i], limit)
        else:
            yield a[i : i + step]


def layout_bytes(layout: Sequence[Part]) -> bytes:
    """Canonical layout: compact JSON ``[[dtype, [dims...]], ...]`` (prefix-free)."""
    return json.dumps([[d, list(s)] for d, s in layout], separators=(",", ":")).encode()


def finish_name(h: Any, layout: bytes) -> str:
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


def block_naming_key(identity: Identity, ns: str) -> bytes | None:
    """The key an entry's blocks are named with: its namespace's under isolation, else none.
    The header records both, so every reader can verify every block it reads."""
    return namespace_key(ns) if identity.codec == KEYED_CODEC_ID else None


def modes(identity: Identity) -> tuple[Identity, Identity]:
    """The identity as a store writes it without and with ``isolate_namespaces``:
    the same model's entries either way (``blockkv serve --per-key-cache``'s
    are namespaces of it), only their blocks are named differently."""
    return replace(identity, codec=CODEC_ID), replace(identity, codec=KEYED_CODEC_ID)


def hasher(key: bytes | None, data: bytes | memoryview = b"") -> blake3:
    """The blake3 a block's name is made with: keyed in an isolated namespace."""
    return blake3(data) if key is None else blake3(data, key=key)


def _make_block(layout: list[Part], parts: list[np.ndarray], start: int, stop: int,
                key: bytes | None = None) -> Block:
    h, check = hasher(key), xxhash.xxh3_128()
    for run in hash_runs(parts):
        h.update(run)
        check.update(run)
    raw, canonical = sum(p.nbytes for p in parts), layout_bytes(layout)
    ref = BlockRef(finish_name(h, canonical), raw, start, stop, finish_name(check, canonical))
    return Block(ref, parts, layout)


# ---------------------------------------------------------------- layout planning


def _check_block_tokens(block_tokens: Any) -> int:
    if type(block_tokens) is not int or not 0 < block_tokens <= MAX_BLOCK_TOKENS:
        raise ValueError(f"block_tokens must be a positive int <= {MAX_BLOCK_TOKENS}, got {block_tokens!r}")
    return block_tokens


def token_ranges(tensors: Sequence[TensorRecord], block_tokens: int) -> list[tuple[int, int]]:
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


def block_parts(tensors: Sequence[TensorRecord], start: int, stop: int) -> list[tuple[int, int, int]]:
    """(tensor index, first row, end row) relative to each tensor, for one token block."""
    out = []
    for i, t in enumerate(tensors):
        a, b = max(start, t.token_start) - t.token_start, min(stop, t.token_stop) - t.token_start
        if a < b:
            out.append((i, a, b))
    return out


def row_geometry(t: TensorRecord) -> tuple[int, int]:
    """(heads, bytes of one head's token row) of a token-axis tensor: a token
    row adds ``heads`` runs of that many bytes to a block."""
    return math.prod(t.shape[:-2]), t.shape[-1] * DTYPES[t.dtype][1].itemsize


def rows_part(t: TensorRecord, a: int, b: int) -> Part:
    """The part of a block that rows [a, b) of token tensor ``t`` make."""
    return (t.dtype, (*t.shape[:-2], b - a, t.shape[-1]))


def present_tensors(records: Sequence[CacheRecord]) -> list[TensorRecord]:
    """The tensors the records hold, in block order (empty slots skipped)."""
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
    mx.eval([t.data for t in present_tensors(records) + list(extra.values())])
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
    present = present_tensors(records)
    token = [t for t in present if t.token_axis]
    state = [t for t in present if not t.token_axis] + list(extra.values())
    blocks: dict[str, Block] = {}
    ranges = token_ranges(token, block_tokens)

    def specs() -> Iterator[tuple[list[Part], list[np.ndarray], int, int]]:
        for start, stop in ranges:
            spec = block_parts(token, start, stop)
            parts = [token[i].data[..., a:b, :] for i, a, b in spec]  # views: hashed and written in place
            yield [rows_part(token[i], a, b) for i, a, b in spec], parts, start, stop
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
