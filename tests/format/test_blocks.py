"""blocks: shared-prefix names, frame integrity, full and partial rebuild that
continues generation bit-for-bit like the original cache."""

from __future__ import annotations

import json
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from blockkv.errors import BlockMissingError, CorruptBlockError, CorruptHeaderError
from blockkv.format.blocks import STAGE_BYTES, EntryLayout, hash_runs, split_entry
from blockkv.format.codec import records_offset
from blockkv.format.descriptor import (
    blocks_for_prefix,
    descriptor_min_offset,
    descriptor_trimmable,
    parse_descriptor,
    validate_descriptor,
)
from blockkv.format.frame import _HEADER, decode_block, encode_block
from blockkv.format.rebuild import rebuild
from blockkv.testing.models import prefill, random_tokens, tiny_model


def raw_bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint8))


def frame(layout: EntryLayout, compression: str | None) -> dict[str, bytes]:
    return {b.ref.name: b"".join(bytes(x) for x in encode_block(b, compression)) for b in layout.blocks}


def payloads(layout: EntryLayout, compression: str | None = None) -> dict[str, memoryview]:
    """Blocks through the on-disk frame and back, as the store would read them."""
    return {name: decode_block(name, data) for name, data in frame(layout, compression).items()}


def stored(layout: EntryLayout) -> dict[str, Any]:
    """The descriptor after a JSON round trip, as the store would read it."""
    return validate_descriptor(json.loads(json.dumps(layout.descriptor)))


@pytest.mark.parametrize(
    "kind,n,dtype",
    [
        ("llama", 600, mx.bfloat16),
        ("llama", 70, mx.float16),
        ("gemma3", 12, mx.bfloat16),
        ("gemma3", 300, mx.bfloat16),
        ("mamba", 40, mx.float32),
        ("chunked", 300, mx.bfloat16),
        ("cachelist", 300, mx.bfloat16),
    ],
)
def test_continuation_equivalence(kind: str, n: int, dtype: mx.Dtype) -> None:
    model = tiny_model(kind, dtype=dtype)
    tokens = random_tokens(n + 8, seed=1)
    original, _ = prefill(model, tokens[:n], chunk=64)
    layout = split_entry(original, block_tokens=64, attachments={"hidden": mx.arange(6, dtype=dtype)})
    desc = stored(layout)
    assert records_offset(parse_descriptor(desc).records) == (0 if kind == "mamba" else n)
    restored, attachments = rebuild(desc, payloads(layout, "zstd"))
    assert np.array_equal(raw_bits(attachments["hidden"]), raw_bits(mx.arange(6, dtype=dtype)))
    _, want = prefill(model, tokens[n:], cache=original)
    _, got = prefill(model, tokens[n:], cache=restored)
    assert np.array_equal(raw_bits(want), raw_bits(got))


@pytest.mark.parametrize("kind,n,p", [("llama", 600, 300), ("llama", 600, 0), ("gemma3", 14, 9), ("chunked", 300, 288)])
def test_partial_rebuild_reads_only_prefix_blocks(kind: str, n: int, p: int) -> None:
    model = tiny_model(kind, dtype=mx.bfloat16)
    tokens = random_tokens(n, seed=2)
    caches, _ = prefill(model, tokens, chunk=32)
    layout = split_entry(caches, block_tokens=64)
    desc = stored(layout)
    assert descriptor_trimmable(desc) and descriptor_min_offset(desc) <= p
    refs = blocks_for_prefix(desc, p)
    assert len(refs) == -(-p // 64) and all(r.start < p for r in refs)
    every = payloads(layout)
    restored, _ = rebuild(desc, {r.name: every[r.name] for r in refs}, prefix_len=p)
    assert all(c.offset == p for c in restored)
    if p == 0:
        return
    direct, _ = prefill(model, tokens[:p], chunk=32)
    _, want = prefill(model, tokens[p : p + 4], cache=direct)
    _, got = prefill(model, tokens[p : p + 4], cache=restored)
    assert np.array_equal(raw_bits(want), raw_bits(got))


def test_prefix_len_refused_when_untrimmable_or_out_of_range() -> None:
    model = tiny_model("gemma3")
    caches, _ = prefill(model, random_tokens(40))
    desc = stored(split_entry(caches))
    with pytest.raises(ValueError, match="not trimmable"):
        blocks_for_prefix(desc, 10)
    caches, _ = prefill(tiny_model("llama"), random_tokens(40))
    layout = split_entry(caches)
    for bad in (41, -1):
        with pytest.raises(ValueError, match="prefix length"):
            rebuild(stored(layout), payloads(layout), prefix_len=bad)
    with pytest.raises(BlockMissingError):
        rebuild(stored(layout), {})


def test_shared_prefix_shares_blocks() -> None:
    model = tiny_model("llama", dtype=mx.bfloat16)
    prefix = random_tokens(600, seed=3)
    a, _ = prefill(model, prefix + random_tokens(100, seed=4), chunk=100)
    b, _ = prefill(model, prefix + random_tokens(100, seed=5), chunk=100)
    ta, tb = (stored(split_entry(c, block_tokens=256))["token_blocks"] for c in (a, b))
    assert [r[2:] for r in ta] == [[0, 256], [256, 512], [512, 700]]
    assert ta[0][0] == tb[0][0] and ta[1][0] == tb[1][0] and ta[2][0] != tb[2][0]


def test_block_name_ignores_compression_and_sees_dtype() -> None:
    caches, _ = prefill(tiny_model("llama", dtype=mx.float16), random_tokens(30))
    layout = split_entry(caches)
    raw, packed = frame(layout, None), frame(layout, "zstd")
    for name in raw:
        assert bytes(decode_block(name, raw[name])) == bytes(decode_block(name, packed[name]))
    as_bf16 = [type(c).from_state((c.keys.view(mx.bfloat16), c.values.view(mx.bfloat16), c.offset)) for c in caches]
    names = {b.ref.name for b in layout.blocks}
    assert names.isdisjoint(b.ref.name for b in split_entry(as_bf16).blocks)


def test_zstd_shuffle_compresses_bf16_kv() -> None:
    caches, _ = prefill(tiny_model("llama", dtype=mx.bfloat16), random_tokens(256))
    (block,) = split_entry(caches).blocks
    packed = sum(len(x) for x in encode_block(block, "zstd"))
    assert packed < 0.9 * block.ref.raw_bytes


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_every_byte_flip_and_truncation_detected(compression: str | None) -> None:
    caches, _ = prefill(tiny_model("llama"), random_tokens(8))
    layout = split_entry(caches)
    name, data = next(iter(frame(layout, compression).items()))
    for i in range(0, len(data), 7):
        flipped = bytearray(data)
        flipped[i] ^= 0x40
        with pytest.raises(CorruptBlockError):
            decode_block(name, bytes(flipped))
    for cut in (0, 5, _HEADER.size, len(data) - 1):
        with pytest.raises(CorruptBlockError):
            decode_block(name, data[:cut])
    with pytest.raises(CorruptBlockError):
        decode_block(name, data + b"\0")
    assert bytes(decode_block("f" * 64, data, verify=False)) == bytes(decode_block(name, data))


@given(st.binary(max_size=200), st.integers(0, 1 << 40), st.integers(0, 1 << 20), st.sampled_from([0, 1, 7]))
def test_decode_block_fuzz_only_corrupt_block(tail: bytes, raw: int, layout_len: int, comp: int) -> None:
    name = "0" * 64
    for data in (tail, _HEADER.pack(b"BKVB", 1, comp, 0, raw, layout_len) + tail):
        try:
            decode_block(name, data)
        except CorruptBlockError:
            pass


def test_descriptor_tampering_detected() -> None:
    caches, _ = prefill(tiny_model("chunked"), random_tokens(100))
    good = stored(split_entry(caches, block_tokens=32))
    edits = [
        lambda d: d["token_blocks"][0].__setitem__(1, 1),
        lambda d: d["token_blocks"].pop(),
        lambda d: d["token_blocks"][0].__setitem__(0, "zz"),
        lambda d: d["records"][0]["tensors"][0]["shape"].__setitem__(2, 1 << 30),
        lambda d: d.__setitem__("block_tokens", 0),
        lambda d: d.__setitem__("format", 99),
        lambda d: d["state_blocks"].append(["0" * 64, 4]),
    ]
    for edit in edits:
        bad = json.loads(json.dumps(good))
        edit(bad)
        with pytest.raises(CorruptHeaderError):
            validate_descriptor(bad)


def test_bad_arguments_named() -> None:
    caches, _ = prefill(tiny_model("llama"), random_tokens(8))
    for bad in (0, -256, 2.5, "256"):
        with pytest.raises(ValueError, match="block_tokens"):
            split_entry(caches, block_tokens=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="attachment"):
        split_entry(caches, attachments={"x": [1, 2]})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="compression"):
        encode_block(split_entry(caches).blocks[0], "lz4")
    k = mx.zeros((3, 1, 4, 8))
    with pytest.raises(ValueError, match="batch size 3"):
        split_entry([type(caches[0]).from_state((k, k, 4))])
    with pytest.raises(TypeError, match="object"):
        split_entry([object()])


@pytest.mark.parametrize("shape, cut", [
    ((1, 8, 600, 64), (slice(None), slice(None), slice(100, 356), slice(None))),  # a block's rows: 32 KiB per head
    ((1, 40, 300, 128), (slice(None), slice(None), slice(0, 256), slice(None))),  # larger than the staging buffer
    ((1, 2, 2304, 256), (slice(None), slice(None), slice(0, 2048), slice(None))),  # one head's rows: 1 MiB
    ((1, 2, 3, 300_000), (slice(None), slice(None), slice(0, 2), slice(None))),  # one row larger than the buffer
    ((2, 3, 5, 7), (slice(None),) * 4),  # contiguous
    ((4, 6, 10), (slice(None), slice(None), slice(None, None, 2))),  # a strided last axis
    ((1, 1, 0, 8), (slice(None),) * 4),  # empty
])
def test_hash_runs_are_the_parts_bytes_in_order(shape: tuple[int, ...], cut: tuple[slice, ...]) -> None:
    """What a store hashes (its blocks' names and xxh3) is the parts' C-order
    bytes, whatever the staging: the same names as ever."""
    rng = np.random.default_rng(0)
    base = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    parts = [base[cut], base[..., :1], base[cut]]
    want = b"".join(np.ascontiguousarray(p).tobytes() for p in parts)
    runs = [bytes(r) for r in hash_runs(parts)]  # each copied out before the next is asked for
    assert b"".join(runs) == want
    assert all(len(r) <= max(STAGE_BYTES, max(p.nbytes for p in parts)) for r in runs)
