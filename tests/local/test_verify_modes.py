"""Both per-read checks catch every flipped byte, for every cache kind.

``verify=True`` checks each block read against its xxh3-128 from the
(blake3-checked) header; ``verify="full"`` against its blake3 name. A flipped
byte anywhere in a block file (frame, layout or payload) must make the restore
a miss in both modes, and never hand out wrong tensors; an intact block under
a header whose xxh3 is wrong convicts the header, never the shared block."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from blockkv.errors import CorruptBlockError, CorruptHeaderError
from blockkv.format.blocks import chunks, split_entry
from blockkv.format.descriptor import with_xxh3
from blockkv.format.header import Header, encode_header
from blockkv.format.rebuild import Target, rebuild
from blockkv.store import BlockStore
from blockkv.testing.stateful import live_bits
from blockkv.testing.strategies import CACHE_KINDS, make_caches

MODES = (True, "full")


def _open(root: Path, verify: bool | str) -> BlockStore:
    return BlockStore(root, model_id="tiny", config_fingerprint="fp", tokenizer_hash="tok",
                      max_bytes=1 << 40, block_tokens=4, verify=verify)


def _verify(target: Target, verify: bool | str) -> None:
    """The check a restore runs, over the target's pieces as they are now."""
    check = target.check(full=verify == "full")
    for piece in target.pieces:
        check.update(piece)
    check.finish()


def _bits(caches: list) -> tuple:
    return tuple(live_bits(c) for c in caches)


@pytest.mark.parametrize("verify", MODES)
def test_every_payload_byte_flip_fails_the_check(verify: bool | str) -> None:
    """A target's check over every byte of every block of an entry."""
    caches = make_caches("llama", list(range(1, 10)))
    layout = split_entry(caches, block_tokens=4)
    payloads = {b.ref.name: b"".join(bytes(c) for p in b.parts for c in chunks(p)) for b in layout.blocks}
    entry = with_xxh3(layout.descriptor, layout.block_xxh3)
    targets: list[Target] = []

    def fill(made: Iterator[Target]) -> Iterator[Target]:
        for target in made:
            target.scatter(payloads[target.ref.name])
            targets.append(target)
            yield target

    rebuild(entry, None, None, fill)
    for target in targets:
        _verify(target, verify)  # intact: passes
        for piece in target.pieces:
            for i in range(piece.nbytes):
                piece[i] ^= 0x10
                with pytest.raises(CorruptBlockError):
                    _verify(target, verify)
                piece[i] ^= 0x10


@pytest.mark.parametrize("verify", MODES)
@pytest.mark.parametrize("kind", CACHE_KINDS)
def test_flipped_block_byte_is_a_miss_for_every_kind(tmp_path: Path, kind: str, verify: bool | str) -> None:
    tokens = list(range(3, 14))
    caches = make_caches(kind, tokens)
    rng = random.Random(f"{kind}-{verify}")
    with _open(tmp_path, verify) as store:
        assert store.store(tokens, caches)
        names = sorted(store.find_exact(tokens).entry.blocks)
        for round_ in range(12):
            if round_:
                assert store.store(tokens, caches)  # rewrites the quarantined block
            entry = store.find_exact(tokens).entry
            name = rng.choice(names)
            path = store._dir.pool.path(name)
            data = bytearray(path.read_bytes())
            at = round_ if round_ < 4 else rng.randrange(len(data))  # frame header first, then anywhere
            data[at] ^= rng.randrange(1, 256)
            path.write_bytes(bytes(data))
            assert store.restore(entry) is None, f"flip at {at} of {name} went unnoticed"
            assert store.find_exact(tokens) is None and not path.exists()
        assert store.store(tokens, caches)
        loaded = store.restore(store.find_exact(tokens).entry)
        assert loaded is not None and _bits(loaded.caches) == _bits(caches)
        assert store.check().clean


@pytest.mark.parametrize("wrong, prefix_len", [(0, None), (0, 6), (1, 6)])
def test_a_wrong_xxh3_in_the_header_convicts_the_header_not_the_block(
        tmp_path: Path, wrong: int, prefix_len: int | None) -> None:
    """Also of a cut block (block 1 holds tokens 4-7: a prefix of 6 keeps only
    some of its rows): confirming an xxh3 mismatch with blake3 must hash all
    the block's bytes, the dropped rows too, or a good shared block is called corrupt."""
    tokens = list(range(1, 12))
    caches = make_caches("llama", tokens)
    with _open(tmp_path, True) as store:
        assert store.store(tokens, caches)
        assert store.store(tokens, caches, ns="other")  # shares every block
        entry = store.find_exact(tokens).entry
        path = store._dir.header_path("", entry.id)
        header = store._dir.read_header(path)
        xxh3 = list(header.block_xxh3)
        xxh3[wrong] = "0" * 32
        path.write_bytes(encode_header(Header(header.identity, header.ns, header.tokens, header.descriptor,
                                              header.checkpoint, xxh3)))
        assert store.restore(entry, prefix_len) is None
        assert all(store._dir.pool.exists(n) for n in entry.blocks)  # no good block deleted
        other = store.find_exact(tokens, ns="other")
        assert other is not None
        loaded = store.restore(other.entry, prefix_len)
        assert loaded is not None and loaded.tokens == tuple(tokens[:prefix_len])


def test_headers_without_xxh3_verify_blake3(tmp_path: Path) -> None:
    """A header written before per-block checksums still restores (blake3 per read)."""
    tokens = list(range(1, 12))
    caches = make_caches("llama", tokens)
    with _open(tmp_path, True) as store:
        assert store.store(tokens, caches)
        entry = store.find_exact(tokens).entry
        path = store._dir.header_path("", entry.id)
        h = store._dir.read_header(path)
        path.write_bytes(encode_header(Header(h.identity, h.ns, h.tokens, h.descriptor, h.checkpoint)))
        loaded = store.restore(entry)
        assert loaded is not None and _bits(loaded.caches) == _bits(caches)
        with pytest.raises(CorruptHeaderError):
            with_xxh3(h.descriptor, h.block_xxh3[:-1])
    with pytest.raises(ValueError, match="verify"):
        _open(tmp_path / "x", "fast")
    assert np.array_equal(h.tokens, np.array(tokens, np.uint32))
