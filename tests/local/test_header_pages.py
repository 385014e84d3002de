"""The paged catalog (issue #45): once loaded, the tries read their edge
labels from the entries' header files, checked against a digest of the
indexed tokens; what the store hands out holds its tokens and block names.

A header that lends a label, damaged or rewritten, must never make ``find``
return a match its tokens do not have, and its restore is a miss. Real
stores, real caches from a tiny model's forward passes, compared bit for bit.
"""

from __future__ import annotations

import logging
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from blockkv import BlockStore
from blockkv.format.header import Header, decode_header, encode_header
from blockkv.fs import FileLayer
from blockkv.testing.models import prefill, random_tokens, tiny_model
from blockkv.testing.stateful import live_bits

IDENT = {"model_id": "m", "config_fingerprint": "fp-paged", "tokenizer_hash": "t", "max_bytes": 1 << 30,
         "block_tokens": 16}
SHARED = random_tokens(32, seed=40)
A = SHARED + random_tokens(24, seed=41)
B = SHARED + random_tokens(24, seed=42)
FLIPPED = len(SHARED) + 5  # a token of A's own edge: the label only A lends


def caches(tokens: list[int]) -> list[Any]:
    return prefill(tiny_model("llama"), tokens)[0]


def restored_exactly(store: BlockStore, tokens: list[int]) -> bool:
    match = store.find_exact(tokens)
    loaded = store.restore(match.entry) if match is not None else None
    return loaded is not None and all(live_bits(x) == live_bits(y) for x, y in zip(loaded.caches, caches(tokens)))


def stored_pair(root: Path) -> Path:
    """A and B stored (sharing SHARED); the path of A's header."""
    with BlockStore(root, **IDENT) as s:
        assert s.store(A, caches(A)) and s.store(B, caches(B))
        entry = s.find_exact(A).entry
        return s._dir.header_path(entry.ns, entry.id)


def token_offset(data: bytes, i: int) -> int:
    (meta_len,) = struct.unpack_from("<I", data, 12)
    return 20 + meta_len + 4 * i


@pytest.mark.parametrize("rewrite", ["damaged", "rewritten"])
def test_a_header_that_lends_a_label_changed_under_the_index_makes_no_wrong_match(
        tmp_path: Path, rewrite: str) -> None:
    """"damaged": a token flipped, the digest left (proof of corruption);
    "rewritten": the same token changed and the digest made valid (nothing
    proves either the header or the index wrong)."""
    path = stored_pair(tmp_path)
    if rewrite == "damaged":
        data = bytearray(path.read_bytes())
        data[token_offset(bytes(data), FLIPPED)] ^= 0x01
        path.write_bytes(bytes(data))
    else:
        old = decode_header(path.read_bytes())
        tokens = np.array(old.tokens)
        tokens[FLIPPED] ^= 0x01
        path.write_bytes(encode_header(Header(old.identity, old.ns, tokens, old.descriptor, old.checkpoint,
                                              old.block_xxh3)))
    hostile = list(A)
    hostile[FLIPPED] ^= 0x01
    with BlockStore(tmp_path, **IDENT) as s:  # loaded from the index: every label is read from a header cold
        assert s._catalog._pages.headers._cache == {}
        match = s.find(hostile + [7])
        assert match is not None and match.prefix_len == FLIPPED  # the indexed tokens decide, not the header's
        assert match.entry.tokens[:FLIPPED] == tuple(hostile[:FLIPPED])
        exact = s.find_exact(A)
        assert exact is not None and exact.entry.tokens == tuple(A)  # handed out holding the index's tokens
        assert s.find_exact(hostile) is None
        assert s.restore(exact.entry) is None  # the header is not the one indexed: a miss, never its caches
        assert s.restore(match.entry, match.prefix_len) is None
        if rewrite == "damaged":  # proof of corruption: dropped
            assert s.find_exact(A) is None and not path.exists()
        else:  # nothing proves which is wrong: kept, a miss
            assert s.find_exact(A) is not None and path.exists()
        assert restored_exactly(s, B)


def test_a_label_whose_header_is_gone_reads_from_another_entry_below(tmp_path: Path) -> None:
    """Another process removes A, which lends the label of the edge A and B
    share; this handle has not followed yet (its catalog still holds A): the
    label is read from B, and A's own edge matches nothing."""
    stored_pair(tmp_path)
    with BlockStore(tmp_path, **IDENT) as s:  # no lookup yet: no label read, none kept
        with BlockStore(tmp_path, **IDENT) as other:
            gone = other.find_exact(A).entry
            other.remove(gone)
        assert gone.id in s._catalog
        match = s._catalog.find(np.array(B + [3], np.uint32), "")
        assert match is not None and match.entry.id != gone.id and match.prefix_len == len(B)
        match = s._catalog.find(np.array(A + [3], np.uint32), "")
        assert match is None or match.prefix_len <= len(SHARED)
        assert restored_exactly(s, B) and s.find_exact(A) is None  # followed now


def test_entries_handed_out_hold_their_tokens_and_blocks_after_removal_and_close(tmp_path: Path) -> None:
    stored_pair(tmp_path)
    with BlockStore(tmp_path, **IDENT) as s:
        found, exact = s.find(A + [9]), s.find_exact(B)
        listed = {e.id: e for e in s.entries()}
        blocks = {e.id: e.blocks for e in listed.values()}
        assert found is not None and exact is not None and len(listed) == 2
        plan = s.evict_to(0)
        assert {e.id for e in plan} == set(listed) and len(s) == 0
        assert {e.id: e.blocks for e in plan} == blocks
    assert found.entry.tokens == tuple(A) and exact.entry.tokens == tuple(B)
    assert found.entry.blocks == blocks[found.entry.id] and exact.entry.blocks == blocks[exact.entry.id]
    assert sorted(e.tokens for e in listed.values()) == sorted([tuple(A), tuple(B)])


def test_labels_are_read_through_a_bounded_cache(tmp_path: Path) -> None:
    """The last-read headers are kept, never more than the cache's bytes."""
    stored_pair(tmp_path)
    with BlockStore(tmp_path, **IDENT) as s:
        pages = s._catalog._pages.headers
        pages._cache_bytes = max(e.header_bytes for e in s._catalog.entries())  # room for one header
        assert s.find(A + [1]) is not None and s.find(B + [1]) is not None
        assert 0 < pages._cached <= pages._cache_bytes and len(pages._cache) == 1


def test_a_file_layer_whose_read_fails_unexpectedly_costs_a_lookup_a_warning_not_an_exception(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A caller's FileLayer written before ``read`` took ``limit`` (tools/bench.py's
    had one): the header read for a label raises TypeError. The lookup must not
    raise: it reads the index's row (its lock is free) and restores bit-exact,
    with one warning."""

    class OldFileLayer(FileLayer):
        def read(self, path: Path) -> bytes:  # type: ignore[override]
            return super().read(path)

    stored_pair(tmp_path)
    with BlockStore(tmp_path, **IDENT, fs=OldFileLayer()) as s, caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert restored_exactly(s, A) and restored_exactly(s, B)
            assert s.find(B + [1]).entry.id == s.find_exact(B).entry.id
    warned = [r for r in caplog.records if "reading a header for a lookup failed" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
