"""codec: bit-exact round trips of real mlx-lm caches, trim rules, descriptors."""

from __future__ import annotations

import json
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from blockkv.errors import CorruptHeaderError
from blockkv.format import state_api
from blockkv.format.codec import (
    decode_caches,
    encode_caches,
    minimum_reusable_offset,
    records_from_descriptor,
    records_to_descriptor,
    register_codec,
    trimmable,
    truncate_records,
)
from blockkv.testing.models import (
    chunked_cache_fills,
    concatenate_cache,
    prefill,
    quantized,
    random_tokens,
    tiny_model,
)

# mlx-lm before 0.32 cannot fill a ChunkedKVCache past one chunk (its own bug):
# the oldest-version CI run skips the cases that need one
needs_chunked = pytest.mark.skipif(not chunked_cache_fills(), reason="this mlx-lm's ChunkedKVCache "
                                   "fails past one chunk (mlx-lm's bug, fixed in 0.32)")


def raw_bits(a: mx.array) -> np.ndarray:
    """Raw bytes of an array, so comparisons see every bit (NaN payloads, -0)."""
    return np.array(a.view(mx.uint8))


def assert_state_equal(a: Any, b: Any) -> None:
    """Two cache states (nested arrays/scalars/None) are equal bit for bit."""
    if isinstance(a, mx.array):
        assert isinstance(b, mx.array) and a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(raw_bits(a), raw_bits(b))
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_state_equal(x, y)
    else:
        assert a == b


def live_state(cache: Any) -> Any:
    """A cache's state with the pre-allocated tail past ``offset`` cut off."""
    if isinstance(cache, CacheList):
        return [live_state(c) for c in cache.caches]
    if isinstance(cache, ArraysCache):
        return cache.state
    state = list(cache.state)
    if isinstance(cache, RotatingKVCache) and cache.offset >= cache.max_size:
        return state
    rows = cache.offset - getattr(cache, "start_position", 0)
    cut = lambda x: x[..., :rows, :]  # noqa: E731
    state[:2] = [[cut(p) for p in x] if isinstance(x, (list, tuple)) else cut(x) for x in state[:2]]
    return state


def round_trip(caches: list[Any]) -> list[Any]:
    records = encode_caches(caches)
    json.dumps(records_to_descriptor(records))
    out = decode_caches(records)
    assert [type(c) for c in out] == [type(c) for c in caches]
    for a, b in zip(caches, out):
        assert_state_equal(live_state(a), live_state(b))
    return out


CASES = [
    ("llama", 300, mx.bfloat16),
    ("llama", 40, mx.float16),
    ("llama", 40, mx.float32),
    ("gemma3", 10, mx.bfloat16),  # ring not yet wrapped
    ("gemma3", 70, mx.bfloat16),  # wrapped
    ("mamba", 30, mx.bfloat16),
    pytest.param("chunked", 100, mx.bfloat16, marks=needs_chunked),
    ("cachelist", 40, mx.float32),
]


@pytest.mark.parametrize("kind,n,dtype", CASES)
def test_round_trip_bit_exact(kind: str, n: int, dtype: mx.Dtype) -> None:
    model = tiny_model(kind, dtype=dtype)
    caches, _ = prefill(model, random_tokens(n), chunk=32)
    round_trip(caches)


def test_only_live_part_is_encoded() -> None:
    caches, _ = prefill(tiny_model("llama"), random_tokens(20))
    assert caches[0].keys.shape[2] == 256
    (k, v) = encode_caches(caches)[0].tensors
    assert k.shape[2] == 20 and k.data.nbytes == k.nbytes


def test_quantized_and_concatenate_round_trip() -> None:
    model = tiny_model("llama", dtype=mx.bfloat16)
    caches, _ = prefill(model, random_tokens(50))
    q = round_trip(quantized(caches, group_size=32, bits=8))
    assert all(t.token_axis for t in encode_caches(q)[0].tensors)
    concat, _ = prefill(model, random_tokens(50), cache=concatenate_cache(model))
    round_trip(concat)


def test_arrays_cache_none_slot_and_padding() -> None:
    caches, _ = prefill(tiny_model("mamba"), random_tokens(12))
    partial = ArraysCache(3, left_padding=[2])
    partial[0] = caches[0][0]
    partial.lengths = mx.array([9])
    (out,) = round_trip([partial])
    assert out.cache[1] is None and out.cache[2] is None


def test_every_dtype_bits_survive() -> None:
    """NaN payloads, -0 and subnormals survive in every float dtype."""
    raw = np.array([0x7FC1, 0xFFFF, 0x8000, 0x0001, 0x7F80], np.uint16)
    for dt in (mx.bfloat16, mx.float16):
        a = mx.array(raw).view(dt).reshape(1, 1, 5, 1)
        (out,) = round_trip([state_api.kv_cache(a, a, 5)])
        assert np.array_equal(np.array(out.keys.view(mx.uint16)).ravel(), raw)
    f32 = mx.array(np.array([0x7FC00001, 0x80000000], np.uint32)).view(mx.float32).reshape(1, 1, 2, 1)
    round_trip([state_api.kv_cache(f32, f32, 2)])


def test_batch_above_one_is_refused() -> None:
    k = mx.zeros((2, 1, 4, 8))
    with pytest.raises(ValueError, match="batch size 2"):
        encode_caches([state_api.kv_cache(k, k, 4)])


def test_unknown_cache_class_is_named() -> None:
    class MyCache(KVCache):
        pass

    with pytest.raises(TypeError, match="MyCache"):
        encode_caches([MyCache()])
    with pytest.raises(TypeError, match="class"):
        register_codec("MyCache", object())  # type: ignore[arg-type]


def test_trim_rules() -> None:
    llama, _ = prefill(tiny_model("llama"), random_tokens(20))
    short, _ = prefill(tiny_model("gemma3"), random_tokens(10))
    wrapped, _ = prefill(tiny_model("gemma3"), random_tokens(40))
    mamba, _ = prefill(tiny_model("mamba"), random_tokens(10))
    nested, _ = prefill(tiny_model("cachelist"), random_tokens(10))
    assert trimmable([]) and minimum_reusable_offset([]) == 0
    assert trimmable(llama) and trimmable(short)
    assert not trimmable(wrapped) and not trimmable(mamba) and not trimmable(nested)
    assert trimmable([CacheList(*llama)]) and not trimmable([CacheList(*llama, *mamba)])
    assert trimmable(encode_caches(llama)) and not trimmable(encode_caches(wrapped))


@needs_chunked
def test_chunked_minimum_offset_is_chunk_aligned_start() -> None:
    caches, _ = prefill(tiny_model("chunked"), random_tokens(100), chunk=30)
    start = caches[0].start_position
    assert start > 0 and start % 32 != 0
    assert minimum_reusable_offset(caches) == -(-start // 32) * 32
    records = encode_caches(caches)
    with pytest.raises(ValueError, match="reusable range"):
        truncate_records(records, start)
    cut = truncate_records(records, 96)
    assert cut[0].tensors[0].shape[2] == 96 - start and cut[0].meta["offset"] == 96


def test_untrimmable_truncation_refused() -> None:
    caches, _ = prefill(tiny_model("mamba"), random_tokens(10))
    with pytest.raises(ValueError, match="not trimmable"):
        truncate_records(encode_caches(caches), 5)


def test_descriptor_round_trip_and_bounds() -> None:
    caches, _ = prefill(tiny_model("cachelist"), random_tokens(30))
    records = encode_caches(caches)
    desc = json.loads(json.dumps(records_to_descriptor(records)))
    back = records_from_descriptor(desc)
    assert records_to_descriptor(back) == desc
    assert trimmable(back) == trimmable(caches)
    bad_dim = json.loads(json.dumps(desc))
    bad_dim[0]["children"][1]["tensors"][0]["shape"][2] = 1 << 40
    bad_kind = json.loads(json.dumps(desc))
    bad_kind[0]["kind"] = "Pickle"
    bad_meta = json.loads(json.dumps(desc))
    del bad_meta[0]["children"][1]["meta"]["offset"]
    for bad in (bad_dim, bad_kind, bad_meta, {"x": 1}, [[]] * 3):
        with pytest.raises(CorruptHeaderError):
            records_from_descriptor(bad)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@given(json_values)
def test_descriptor_fuzz_only_corrupt_header(obj: Any) -> None:
    try:
        records_from_descriptor(obj)
    except CorruptHeaderError:
        pass
