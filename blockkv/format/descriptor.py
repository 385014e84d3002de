"""The entry descriptor: the JSON in a header that lists an entry's records and
its blocks, parsed with bounds before anything is allocated. A descriptor that
contradicts itself is a corrupt header (CorruptHeaderError). No file-system
code lives here."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from blockkv.errors import CorruptHeaderError
from blockkv.format.blocks import (
    FORMAT,
    MAX_ATTACHMENTS,
    MAX_BLOCK_TOKENS,
    MAX_BLOCKS,
    MAX_RAW_BYTES,
    BlockRef,
    present_tensors,
    row_geometry,
    token_ranges,
)
from blockkv.format.codec import (
    MAX_STR,
    CacheRecord,
    TensorRecord,
    minimum_reusable_offset,
    records_from_descriptor,
    records_to_descriptor,
    tensor_from_descriptor,
    trimmable,
    truncate_records,
)


@dataclass(frozen=True)
class ParsedDescriptor:
    """A validated descriptor (``parse_descriptor``)."""

    block_tokens: int
    records: list[CacheRecord]
    attachments: dict[str, TensorRecord]
    token_refs: list[BlockRef]
    state_refs: list[BlockRef]

    def records_at(self, prefix_len: int | None) -> list[CacheRecord]:
        """The records cut to ``prefix_len``; ValueError for untrimmable entries or bad lengths."""
        if prefix_len is None:
            return self.records
        if not trimmable(self.records):
            raise ValueError("entry is not trimmable: prefix_len must be None")
        return truncate_records(self.records, prefix_len)


def bad_descriptor(what: str) -> CorruptHeaderError:
    """The error for a descriptor that contradicts itself: the header is what is corrupt."""
    return CorruptHeaderError(f"bad entry descriptor: {what}")


_NAME = re.compile(r"[0-9a-f]{64}")
_CHECKSUM = re.compile(r"[0-9a-f]{32}")


def _is_name(v: Any) -> bool:
    return isinstance(v, str) and _NAME.fullmatch(v) is not None


def _is_count(v: Any, high: int = MAX_RAW_BYTES) -> bool:
    return type(v) is int and 0 <= v <= high


_KEYS = {"format", "block_tokens", "records", "attachments", "token_blocks", "state_blocks"}


def parse_descriptor(obj: Any) -> ParsedDescriptor:
    """The descriptor validated with bounds: every size and range is recomputed
    from the records. Every function here takes its result in place of the JSON
    form, and an already parsed descriptor is returned as it is, so a restore
    parses it once."""
    if isinstance(obj, ParsedDescriptor):
        return obj
    if not isinstance(obj, dict) or set(obj) != _KEYS:
        raise bad_descriptor(f"must be a dict with keys {sorted(_KEYS)}")
    if obj["format"] != FORMAT or type(obj["format"]) is not int:
        raise bad_descriptor(f"unknown format {str(obj['format'])[:MAX_STR]!r}")
    block_tokens = obj["block_tokens"]
    if not _is_count(block_tokens, MAX_BLOCK_TOKENS) or block_tokens == 0:
        raise bad_descriptor("block_tokens must be a positive bounded int")
    records = records_from_descriptor(obj["records"])
    raw_att, token_raw, state_raw = obj["attachments"], obj["token_blocks"], obj["state_blocks"]
    if not isinstance(raw_att, dict) or len(raw_att) > MAX_ATTACHMENTS:
        raise bad_descriptor("attachments must be a small dict")
    attachments = {}
    for key in sorted(raw_att, key=str):
        if not isinstance(key, str) or not 0 < len(key) <= MAX_STR:
            raise bad_descriptor("attachment names must be short strings")
        attachments[key] = tensor_from_descriptor(raw_att[key])
        if attachments[key].token_axis:
            raise bad_descriptor("attachments are state tensors")
    if not isinstance(token_raw, list) or len(token_raw) > MAX_BLOCKS:
        raise bad_descriptor("token_blocks must be a bounded list")
    if not isinstance(state_raw, list) or len(state_raw) > MAX_BLOCKS:
        raise bad_descriptor("state_blocks must be a bounded list")
    present = present_tensors(records)
    token = [t for t in present if t.token_axis]
    state = [t for t in present if not t.token_axis] + list(attachments.values())
    ranges = token_ranges(token, block_tokens)
    if len(ranges) != len(token_raw) or len(state) != len(state_raw):
        raise bad_descriptor("block lists do not match the records")
    spans: dict[tuple[int, int], int] = {}  # bytes of a token row, summed over the tensors spanning the same tokens
    for t in token:
        spans[t.token_start, t.token_stop] = spans.get((t.token_start, t.token_stop), 0) + math.prod(row_geometry(t))
    token_refs = []
    for (start, stop), ref in zip(ranges, token_raw):
        raw = sum((min(stop, b) - max(start, a)) * row for (a, b), row in spans.items() if a < stop and start < b)
        if not (isinstance(ref, list) and len(ref) == 4 and _is_name(ref[0]) and ref[1:] == [raw, start, stop]):
            raise bad_descriptor(f"token block for [{start}, {stop}) does not match the records")
        token_refs.append(BlockRef(ref[0], raw, start, stop))
    state_refs = []
    for t, ref in zip(state, state_raw):
        if not (isinstance(ref, list) and len(ref) == 2 and _is_name(ref[0]) and ref[1] == t.nbytes):
            raise bad_descriptor("state block does not match its tensor")
        state_refs.append(BlockRef(ref[0], t.nbytes, -1, -1))
    return ParsedDescriptor(block_tokens, records, attachments, token_refs, state_refs)


def with_xxh3(descriptor: Any, block_xxh3: Any) -> ParsedDescriptor:
    """The parsed descriptor with each block ref's xxh3 from the header (``None``:
    a header from before checksums; restores then verify blake3)."""
    entry = parse_descriptor(descriptor)
    if block_xxh3 is None:
        return entry
    n = len(entry.token_refs)
    if not (isinstance(block_xxh3, list) and len(block_xxh3) == n + len(entry.state_refs)
            and all(isinstance(c, str) and _CHECKSUM.fullmatch(c) is not None
                    for c in block_xxh3)):
        raise bad_descriptor("block_xxh3 must hold one 32-hex checksum per block")
    return replace(entry, token_refs=[replace(r, xxh3=c) for r, c in zip(entry.token_refs, block_xxh3)],
                   state_refs=[replace(r, xxh3=c) for r, c in zip(entry.state_refs, block_xxh3[n:])])


def validate_descriptor(obj: Any) -> dict[str, Any]:
    """``obj`` if it is a well-formed, self-consistent entry descriptor; else CorruptHeaderError."""
    parse_descriptor(obj)
    return obj


def descriptor_trimmable(descriptor: Any) -> bool:
    """Whether the entry can be rebuilt at a shorter prefix."""
    return trimmable(parse_descriptor(descriptor).records)


def descriptor_min_offset(descriptor: Any) -> int:
    """The shortest prefix the entry can be rebuilt at."""
    return minimum_reusable_offset(parse_descriptor(descriptor).records)


def _unique(refs: Sequence[BlockRef]) -> list[BlockRef]:
    seen: dict[str, BlockRef] = {}
    for r in refs:
        seen.setdefault(r.name, r)
    return list(seen.values())


def blocks_for_prefix(descriptor: Any, prefix_len: int | None) -> list[BlockRef]:
    """Blocks needed to rebuild at ``prefix_len`` (None: all): the token blocks
    covering [0, prefix_len) and every state block, unique by name."""
    entry = parse_descriptor(descriptor)
    entry.records_at(prefix_len)
    token = entry.token_refs if prefix_len is None else [r for r in entry.token_refs if r.start < prefix_len]
    return _unique(token + entry.state_refs)


def prefix_descriptor(descriptor: dict[str, Any], prefix_len: int) -> dict[str, Any]:
    """The descriptor of an entry's first ``prefix_len`` tokens, cut where a
    token block ends: the same blocks up to there, so a prefix of a trimmable
    entry is an entry of its own (a node keeps the part of a bucket entry it
    fetched). ValueError if the entry cannot be cut there."""
    entry = parse_descriptor(descriptor)
    records = entry.records_at(prefix_len)  # ValueError for an untrimmable entry or a length out of range
    kept = [r for r in entry.token_refs if r.start < prefix_len]
    if not kept or kept[-1].stop != prefix_len:
        raise ValueError(f"{prefix_len} tokens do not end a token block")
    cut = {"format": FORMAT, "block_tokens": entry.block_tokens, "records": records_to_descriptor(records),
           "attachments": descriptor["attachments"], "token_blocks": descriptor["token_blocks"][: len(kept)],
           "state_blocks": descriptor["state_blocks"]}
    try:
        parse_descriptor(cut)
    except CorruptHeaderError as exc:  # a kind whose state tensors change when it is cut
        raise ValueError(f"the entry cannot be cut at {prefix_len} tokens: {exc}") from None
    return cut
