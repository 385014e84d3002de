"""Rebuilding an mlx-lm cache object the way the installed mlx-lm does.

mlx-lm changed its cache state protocol in 0.32: there ``from_state(state)``
takes every field in ``state`` (``ArraysCache`` included its ``left_padding``
and ``lengths``); from 0.28.1 to 0.31 ``from_state(state, meta_state)`` took
the arrays in ``state`` and the scalars as strings in ``meta_state``. The
codecs (``kinds``) hand the fields of a record to one function per class here,
which speaks whichever protocol mlx-lm has, so an entry written under one
version restores under the other (the records themselves never held mlx-lm's
state layout).
"""

from __future__ import annotations

import inspect
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    _BaseCache,
)

# True for mlx-lm 0.28.1-0.31: from_state(state, meta_state), scalars as strings
TWO_PART_STATE = "meta_state" in inspect.signature(_BaseCache.from_state).parameters


def _meta(*values: int) -> tuple[str, ...]:
    return tuple(str(v) for v in values)


def kv_cache(keys: mx.array | None, values: mx.array | None, offset: int) -> KVCache:
    if not TWO_PART_STATE:
        return KVCache.from_state((keys, values, offset))
    if keys is None:
        return KVCache()
    return KVCache.from_state((keys, values), "")  # the offset is the arrays' length


def concatenate_kv_cache(keys: mx.array, values: mx.array) -> ConcatenateKVCache:
    if TWO_PART_STATE:
        return ConcatenateKVCache.from_state((keys, values), "")
    return ConcatenateKVCache.from_state((keys, values))


def quantized_kv_cache(keys: tuple[mx.array, ...] | None, values: tuple[mx.array, ...] | None,
                       offset: int, group_size: int, bits: int) -> QuantizedKVCache:
    if not TWO_PART_STATE:
        return QuantizedKVCache.from_state((keys, values, offset, group_size, bits))
    if keys is None:
        return QuantizedKVCache(group_size=group_size, bits=bits)
    return QuantizedKVCache.from_state((keys, values), _meta(offset, group_size, bits))


def rotating_kv_cache(keys: mx.array | None, values: mx.array | None, offset: int, keep: int,
                      max_size: int, idx: int) -> RotatingKVCache:
    if not TWO_PART_STATE:
        return RotatingKVCache.from_state((keys, values, offset, keep, max_size, idx))
    if keys is None:
        return RotatingKVCache(max_size=max_size, keep=keep)
    return RotatingKVCache.from_state((keys, values), _meta(keep, max_size, offset, idx))


def chunked_kv_cache(keys: mx.array | None, values: mx.array | None, offset: int, chunk_size: int,
                     start_position: int) -> ChunkedKVCache:
    if not TWO_PART_STATE:
        return ChunkedKVCache.from_state((keys, values, offset, chunk_size, start_position))
    if keys is None:
        return ChunkedKVCache(chunk_size)
    cache = ChunkedKVCache.from_state((keys, values), _meta(chunk_size, start_position))
    # the old state setter takes the offset from the arrays' length, which
    # misses the rows dropped from the front: set what the cache had seen
    cache.offset = offset
    return cache


def arrays_cache(arrays: list[mx.array | None], left_padding: mx.array | None,
                 lengths: mx.array | None) -> ArraysCache:
    if not TWO_PART_STATE:
        return ArraysCache.from_state((arrays, left_padding, lengths))
    cache = ArraysCache.from_state(arrays, "")
    cache.left_padding, cache.lengths = left_padding, lengths  # attributes, not state, before 0.32
    return cache


def batch_extra(cache: Any, name: str) -> mx.array | None:
    """An ``ArraysCache``'s ``left_padding`` or ``lengths``: None when it has
    none, including the empty array an mlx-lm main of August 2026 put there
    for "none" (and older versions that lack the attribute)."""
    value = getattr(cache, name, None)
    return None if value is None or value.size == 0 else value
