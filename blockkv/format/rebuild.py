"""Caches rebuilt from their blocks: destination mlx arrays allocated once
(not zeroed), a ``Target`` per block over the bytes of them its payload is, a
``Check`` that verifies the payload where it lands, and the proof that every
byte was written before anything is served; and ``ParsedEntry``, what a
restore makes of a header's bytes. No file-system code lives here."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
import numpy as np
import xxhash

from blockkv.errors import BlockMissingError, CorruptError, CorruptHeaderError
from blockkv.format.blocks import (
    BlockRef,
    block_naming_key,
    block_parts,
    finish_name,
    hasher,
    layout_bytes,
    present_tensors,
    row_geometry,
    rows_part,
)
from blockkv.format.codec import TensorRecord, decode_caches, device_buffers, map_tensors
from blockkv.format.descriptor import (
    ParsedDescriptor,
    bad_descriptor,
    blocks_for_prefix,
    parse_descriptor,
    with_xxh3,
)
from blockkv.format.frame import corrupt_block, frame_head, max_raw_bytes
from blockkv.format.header import Header, decode_header

Fetch = Callable[[BlockRef], "bytes | memoryview"]
Allocate = Callable[[Sequence[tuple[str, tuple[int, ...]]]], list[tuple[mx.array, np.ndarray]]]


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
        return frame_head(self.ref.raw_bytes, self.layout) + self.layout

    def fits(self, payload: bytes | memoryview, layout: bytes | None = None) -> bool:
        """Whether a block's payload (and its frame's ``layout``, when known) is
        the size and layout the header declares for it."""
        return memoryview(payload).nbytes == self.ref.raw_bytes and layout in (None, self.layout)

    def scatter(self, payload: bytes | memoryview, layout: bytes | None = None) -> None:
        """Fill the pieces from a decoded payload verified against its name (and
        its frame's ``layout``). One that does not fit convicts the header: the
        block is what its name says, the header's account of it is wrong."""
        if not self.fits(payload, layout):
            raise CorruptHeaderError(f"the header's size or layout of block {self.ref.name} "
                                     f"does not fit the block ({memoryview(payload).nbytes} bytes)")
        view, offset = memoryview(payload).cast("B"), 0
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
        return finish_name(h, self.layout)


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
        self._hash = xxhash.xxh3_128() if self._fast else hasher(key)
        self.update = self._hash.update

    def finish(self) -> None:
        ref = self._target.ref
        if self._fast:
            if finish_name(self._hash, self._target.layout) == ref.xxh3:
                return
            if self._target._digest(hasher(self._key)) == ref.name:
                raise CorruptHeaderError(f"the header's xxh3-128 of block {ref.name} is wrong")
        elif finish_name(self._hash, self._target.layout) == ref.name:
            return
        raise corrupt_block(ref.name, "content does not hash to the name")


def _flat(view: np.ndarray) -> memoryview:
    return memoryview(view.reshape(-1).view(np.uint8))


class _TokenTargets:
    """Targets of an entry's token blocks over the destination arrays ``dest``
    (cut to ``rows`` token rows per tensor). The per-tensor geometry and each
    distinct block layout are worked out once per restore, not once per block:
    at 34 blocks of 32 tensors that was a quarter of a warm restore."""

    def __init__(self, full: Sequence[TensorRecord], dest: Sequence[memoryview], rows: Sequence[int]) -> None:
        self._full, self._dest, self._rows = full, dest, rows
        self._geometry = [row_geometry(t) for t in full]
        # where each head's rows start in its destination, in bytes (8,704 slices a restore: 1.63 -> 1.32 ms)
        self._heads = [[h * n * row for h in range(heads)] for (heads, row), n in zip(self._geometry, rows)]
        self._layouts: dict[tuple[tuple[int, int], ...], bytes] = {}

    def __call__(self, ref: BlockRef) -> Target:
        """Pieces of token block ``ref``: per tensor and per leading index (head), the
        block's rows that the cut keeps, then scratch for the rows it drops."""
        spec = block_parts(self._full, ref.start, ref.stop)
        pieces: list[memoryview | None] = []
        dropped: list[tuple[int, int]] = []  # (piece index, bytes) of rows beyond the cut
        covers = []
        for i, a, b in spec:
            heads, row = self._geometry[i]
            dest, starts = self._dest[i], self._heads[i]
            end = max(a, min(b, self._rows[i]))
            covers.append((i, heads * (end - a) * row))
            lo, hi = a * row, end * row
            if b == end:  # the whole block is kept: the common case
                pieces += [dest[o + lo : o + hi] for o in starts]
                continue
            for o in starts:
                if end > a:
                    pieces.append(dest[o + lo : o + hi])
                dropped.append((len(pieces), (b - end) * row))
                pieces.append(None)
        if dropped:  # hashed after the read, so every dropped run needs its own bytes
            scratch, used = memoryview(bytearray(sum(n for _, n in dropped))), 0
            for k, n in dropped:
                pieces[k], used = scratch[used : used + n], used + n
        key = tuple((i, b - a) for i, a, b in spec)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = layout_bytes([rows_part(self._full[i], a, b) for i, a, b in spec])
        return Target(ref, layout, pieces, tuple(covers))  # type: ignore[arg-type]


def rebuild(
    descriptor: Any,
    payloads: Mapping[str, bytes | memoryview] | Fetch | None = None,
    prefix_len: int | None = None,
    fill: Callable[[Iterator[Target]], Iterable[Target]] | None = None,
    allocate: Allocate = device_buffers,
) -> tuple[list[Any], dict[str, mx.array]]:
    """Real mlx-lm caches (at ``prefix_len`` if given) and the attachments.

    The blocks ``blocks_for_prefix`` names become ``Target`` s over the memory of
    the mlx arrays that the caches will hold. ``fill(targets)`` fills them all
    (in any order, on any threads; a store reads the files straight into them)
    and yields each target once it is filled.
    Without it, ``payloads`` maps names to verified payloads, or is a function
    fetching one, asked one block at a time (a returned buffer may be reused
    once the next is asked for), and each payload is scattered into its target.
    ``allocate`` makes the destination arrays (``codec.device_buffers``, or it
    run on another thread: ``EntryRead`` says why)."""
    entry = parse_descriptor(descriptor)
    records = entry.records_at(prefix_len)
    full = [t for t in present_tensors(entry.records) if t.token_axis]
    cut = [t for t in present_tensors(records) if t.token_axis]
    state_tensors = [t for t in present_tensors(entry.records) if not t.token_axis] + list(entry.attachments.values())
    dest = allocate([(t.dtype, t.shape) for t in cut + state_tensors])  # not zeroed: see below
    token_dest, state_dest = dest[: len(cut)], [a for a, _ in dest[len(cut) :]]
    flats = [_flat(view) for _, view in token_dest]
    token_target = _TokenTargets(full, flats, [t.shape[-2] for t in cut])

    def targets() -> Iterator[Target]:  # made as ``fill`` asks for them
        for ref in entry.token_refs:
            if prefix_len is not None and ref.start >= prefix_len:
                break
            yield token_target(ref)
        for k, (ref, t, (_, view)) in enumerate(zip(entry.state_refs, state_tensors, dest[len(cut) :])):
            yield Target(ref, layout_bytes([(t.dtype, t.shape)]), [_flat(view)], ((len(cut) + k, view.nbytes),))

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
        raise bad_descriptor("its blocks do not cover every byte of the cache")
    token, state = iter(a for a, _ in token_dest), iter(state_dest)
    filled = map_tensors(records, lambda t: replace(t, data=next(token) if t.token_axis else next(state)))
    attachments = {k: next(state) for k in entry.attachments}
    return decode_caches(filled), attachments


@dataclass(frozen=True)
class ParsedEntry:
    """An entry's header as a restore reads it: verified, its descriptor parsed
    once with each block's xxh3 (a 34-block descriptor took 7 ms a parse)."""

    header: Header
    descriptor: ParsedDescriptor

    @classmethod
    def parse(cls, data: bytes) -> ParsedEntry:
        """A header file's bytes verified and parsed; CorruptHeaderError otherwise."""
        header = decode_header(data)
        return cls(header, with_xxh3(header.descriptor, header.block_xxh3))

    @property
    def key(self) -> bytes | None:
        """The key its blocks are named with (``block_naming_key``): the header names the mode and the namespace."""
        return block_naming_key(self.header.identity, self.header.ns)

    def rebuild(
        self, prefix_len: int | None, fill: Callable[[Iterator[Target]], Iterable[Target]],
        stored_bytes: Callable[[str], int], allocate: Allocate = device_buffers,
    ) -> tuple[list[Any], dict[str, mx.array]]:
        """``rebuild`` at ``prefix_len``, once each block it needs is known to fit
        the bytes stored for it (``stored_bytes(name)``): every array allocated is
        bounded by bytes on disk, never by a size the header declares, so a
        planted header cannot force a huge allocation."""
        for ref in blocks_for_prefix(self.descriptor, prefix_len):
            stored = stored_bytes(ref.name)
            if ref.raw_bytes > max_raw_bytes(stored):
                raise CorruptError(f"the header declares {ref.raw_bytes} bytes for block {ref.name}, "
                                   f"whose {stored}-byte file cannot hold them")
        return rebuild(self.descriptor, None, prefix_len, fill, allocate)
