"""The built-in cache kinds: how each mlx-lm cache class becomes a record and
back, and how far it can be cut. Each is registered by its class's path
(``codec.register_codec_by_path``) when the format package is imported, so
every record a descriptor names by a built-in kind can be checked and decoded.

mlx-lm is imported only to decode (``_classes``, ``_state_api``): importing
it costs ~1 s (it imports transformers), which ``import blockkv``, ``blockkv
ls`` and ``stats`` must not pay; a caller that encodes a cache has imported
it already."""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from blockkv.format.codec import (
    MAX_INT,
    CacheRecord,
    Data,
    TensorRecord,
    capture,
    codec_named,
    decode_cache,
    dtype_name,
    encode_cache,
    register_codec_by_path,
)

if TYPE_CHECKING:
    from mlx_lm.models.cache import (
        ArraysCache,
        CacheList,
        ChunkedKVCache,
        ConcatenateKVCache,
        KVCache,
        QuantizedKVCache,
        RotatingKVCache,
    )

_MODULE = "mlx_lm.models.cache"


def _classes() -> ModuleType:
    """mlx-lm's cache module, imported the first time a record is decoded."""
    return importlib.import_module(_MODULE)


def _state_api() -> ModuleType:
    """``state_api`` (which imports mlx-lm), imported the first time a record is decoded."""
    return importlib.import_module("blockkv.format.state_api")

# ---------------------------------------------------------------- helpers


def _tensor(a: mx.array, token_axis: bool, data: Data, token_start: int = 0) -> TensorRecord:
    """A TensorRecord of ``a``; batch must be 1 so blocks stay shareable."""
    if a.ndim >= 1 and a.shape[0] != 1:
        raise ValueError(f"batch size {a.shape[0]} > 1 is not supported (tensor shape {a.shape})")
    if token_axis and a.ndim < 2:
        raise ValueError(f"token-axis tensor needs >= 2 dims, got shape {a.shape}")
    return TensorRecord(
        dtype=dtype_name(a.dtype),
        shape=tuple(a.shape),
        token_axis=token_axis,
        token_start=token_start,
        data=capture(a, data),
    )


def _opt_array(t: TensorRecord | None) -> mx.array | None:
    return None if t is None else t.array()


def _rows(a: mx.array, stop: int) -> mx.array:
    return a[..., :stop, :]


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(what)


def _check_tokens(record: CacheRecord, count: int, start: int = 0) -> None:
    """Token tensors are all present or all absent and hold rows [start, offset)."""
    _require(len(record.tensors) == count, f"{record.kind} needs {count} tensors")
    present = [t for t in record.tensors if t is not None]
    _require(len(present) in (0, count), f"{record.kind} has partial tensors")
    for t in present:
        _require(t.token_axis, f"{record.kind} tensors must be token-axis")
        _require(t.token_start == start, f"{record.kind} token_start {t.token_start} != {start}")
        _require(
            t.token_stop == record.meta["offset"],
            f"{record.kind} holds tokens up to {t.token_stop}, offset is {record.meta['offset']}",
        )


def _int_meta(record: CacheRecord, *keys: str) -> None:
    for k in keys:
        v = record.meta.get(k)
        _require(type(v) is int and 0 <= v <= MAX_INT, f"{record.kind} meta {k!r} must be a non-negative int")


def _truncate_offset(record: CacheRecord, offset: int, **meta: int) -> CacheRecord:
    tensors = tuple(None if t is None else t.cut(offset) for t in record.tensors)
    return dataclasses.replace(record, meta={**record.meta, "offset": offset, **meta}, tensors=tensors)


# ---------------------------------------------------------------- built-in codecs


class _KVLike:
    """Shared rules of caches whose keys/values grow along the token axis from 0."""

    kind = ""

    def encode(self, cache: Any, data: Data = True) -> CacheRecord:
        """keys/values[..., :offset, :] and the offset (rows past it are never stored)."""
        off = cache.offset
        if cache.keys is None:
            return CacheRecord(self.kind, {"offset": off}, (None, None))
        return CacheRecord(
            self.kind,
            {"offset": off},
            (_tensor(_rows(cache.keys, off), True, data), _tensor(_rows(cache.values, off), True, data)),
        )

    def check(self, record: CacheRecord) -> None:
        _int_meta(record, "offset")
        _check_tokens(record, 2)

    def trimmable(self, record: CacheRecord) -> bool:
        return True

    def minimum_reusable_offset(self, record: CacheRecord) -> int:
        return 0

    def truncate(self, record: CacheRecord, offset: int) -> CacheRecord:
        return _truncate_offset(record, offset)

    def offset(self, record: CacheRecord) -> int | None:
        return record.meta["offset"]


class KVCacheCodec(_KVLike):
    """KVCache: keys/values[..., :offset, :] (the 256-step tail is dropped)."""

    kind = "KVCache"

    def decode(self, record: CacheRecord) -> KVCache:
        k, v = record.tensors
        return _state_api().kv_cache(_opt_array(k), _opt_array(v), record.meta["offset"])


class ConcatenateKVCacheCodec(_KVLike):
    """ConcatenateKVCache: its arrays may hold rows past ``offset`` after a trim."""

    kind = "ConcatenateKVCache"

    def decode(self, record: CacheRecord) -> ConcatenateKVCache:
        k, v = record.tensors
        if k is None or v is None:
            return _classes().ConcatenateKVCache()
        return _state_api().concatenate_kv_cache(k.array(), v.array())


class QuantizedKVCacheCodec(_KVLike):
    """QuantizedKVCache: each of keys/values is a tuple (w, scales[, biases])."""

    def encode(self, cache: QuantizedKVCache, data: Data = True) -> CacheRecord:
        off = cache.offset
        meta = {"offset": off, "group_size": cache.group_size, "bits": cache.bits}
        if cache.keys is None:
            return CacheRecord("QuantizedKVCache", {**meta, "parts": 0}, ())
        parts = [*cache.keys, *cache.values]
        meta["parts"] = len(cache.keys)
        return CacheRecord("QuantizedKVCache", meta, tuple(_tensor(_rows(a, off), True, data) for a in parts))

    def check(self, record: CacheRecord) -> None:
        _int_meta(record, "offset", "group_size", "bits", "parts")
        _require(record.meta["parts"] <= 3, "QuantizedKVCache has at most 3 parts per tensor")
        _check_tokens(record, 2 * record.meta["parts"])
        _require(None not in record.tensors, "QuantizedKVCache tensors cannot be empty slots")

    def decode(self, record: CacheRecord) -> QuantizedKVCache:
        m = record.meta
        n = m["parts"]
        arrays = [t.array() for t in record.tensors if t is not None]
        keys, values = (tuple(arrays[:n]), tuple(arrays[n:])) if n else (None, None)
        return _state_api().quantized_kv_cache(keys, values, m["offset"], m["group_size"], m["bits"])


class RotatingKVCacheCodec:
    """RotatingKVCache: token-axis while ``offset < max_size`` (buffer still in
    temporal order), the whole ring as state tensors once it has wrapped."""

    def encode(self, cache: RotatingKVCache, data: Data = True) -> CacheRecord:
        off = cache.offset
        meta = {"offset": off, "keep": cache.keep, "max_size": cache.max_size, "_idx": cache._idx}
        if cache.keys is None:
            return CacheRecord("RotatingKVCache", meta, (None, None))
        if off < cache.max_size:
            pair = (_rows(cache.keys, off), _rows(cache.values, off))
            return CacheRecord("RotatingKVCache", meta, tuple(_tensor(a, True, data) for a in pair))
        pair = (cache.keys, cache.values)
        return CacheRecord("RotatingKVCache", meta, tuple(_tensor(a, False, data) for a in pair))

    def decode(self, record: CacheRecord) -> RotatingKVCache:
        k, v = record.tensors
        m = record.meta
        return _state_api().rotating_kv_cache(_opt_array(k), _opt_array(v), m["offset"], m["keep"], m["max_size"],
                                           m["_idx"])

    def check(self, record: CacheRecord) -> None:
        _int_meta(record, "offset", "keep", "max_size", "_idx")
        if self.trimmable(record):
            _require(record.meta["_idx"] == record.meta["offset"], "unwrapped RotatingKVCache needs _idx == offset")
            _check_tokens(record, 2)
        else:
            _require(len(record.tensors) == 2, "RotatingKVCache needs 2 tensors")
            _require(all(t is not None and not t.token_axis for t in record.tensors), "wrapped ring is state")

    def trimmable(self, record: CacheRecord) -> bool:
        return record.meta["offset"] < record.meta["max_size"]

    def minimum_reusable_offset(self, record: CacheRecord) -> int:
        return 0

    def truncate(self, record: CacheRecord, offset: int) -> CacheRecord:
        return _truncate_offset(record, offset, _idx=offset)

    def offset(self, record: CacheRecord) -> int | None:
        return record.meta["offset"]


class ChunkedKVCacheCodec(_KVLike):
    """ChunkedKVCache: rows [start_position, offset); the dropped front is gone."""

    def encode(self, cache: ChunkedKVCache, data: Data = True) -> CacheRecord:
        off, start = cache.offset, cache.start_position
        meta = {"offset": off, "chunk_size": cache.chunk_size, "start_position": start}
        if cache.keys is None:
            return CacheRecord("ChunkedKVCache", meta, (None, None))
        pair = (_rows(cache.keys, off - start), _rows(cache.values, off - start))
        return CacheRecord("ChunkedKVCache", meta, tuple(_tensor(a, True, data, start) for a in pair))

    def decode(self, record: CacheRecord) -> ChunkedKVCache:
        k, v = record.tensors
        m = record.meta
        return _state_api().chunked_kv_cache(_opt_array(k), _opt_array(v), m["offset"], m["chunk_size"],
                                          m["start_position"])

    def check(self, record: CacheRecord) -> None:
        _int_meta(record, "offset", "chunk_size", "start_position")
        _require(record.meta["chunk_size"] > 0, "ChunkedKVCache chunk_size must be positive")
        _require(record.meta["start_position"] <= record.meta["offset"], "start_position past offset")
        _check_tokens(record, 2, record.meta["start_position"])

    def minimum_reusable_offset(self, record: CacheRecord) -> int:
        # The next token attends to its whole chunk [p//C*C, p]: that chunk must
        # not begin before the first position still held.
        m = record.meta
        return min(m["offset"], -(-m["start_position"] // m["chunk_size"]) * m["chunk_size"])


class ArraysCacheCodec:
    """ArraysCache: recurrent state tensors (None slots kept), then left_padding
    and lengths. No token axis, so it can never be cut back."""

    def encode(self, cache: ArraysCache, data: Data = True) -> CacheRecord:
        slots = [None if a is None else _tensor(a, False, data) for a in cache.cache]
        api = _state_api()
        for extra in (api.batch_extra(cache, "left_padding"), api.batch_extra(cache, "lengths")):
            if extra is not None and extra.size != 1:
                raise ValueError(f"batch size {extra.size} > 1 is not supported (ArraysCache padding)")
            slots.append(None if extra is None else _tensor(extra, False, data))
        return CacheRecord("ArraysCache", {"size": len(cache.cache)}, tuple(slots))

    def decode(self, record: CacheRecord) -> ArraysCache:
        arrays = [_opt_array(t) for t in record.tensors]
        return _state_api().arrays_cache(arrays[:-2], arrays[-2], arrays[-1])

    def check(self, record: CacheRecord) -> None:
        _int_meta(record, "size")
        _require(len(record.tensors) == record.meta["size"] + 2, "ArraysCache needs size + 2 slots")
        _require(all(t is None or not t.token_axis for t in record.tensors), "ArraysCache holds state only")

    def trimmable(self, record: CacheRecord) -> bool:
        return False

    def minimum_reusable_offset(self, record: CacheRecord) -> int:
        return 0

    def truncate(self, record: CacheRecord, offset: int) -> CacheRecord:
        raise ValueError("ArraysCache cannot be cut back")

    def offset(self, record: CacheRecord) -> int | None:
        return None


class MambaCacheCodec(ArraysCacheCodec):
    """MambaCache (mlx-lm before 0.30): an ArraysCache of two slots under its
    own name. Where mlx-lm has no such class, its records decode as the
    ArraysCache that mlx-lm's mamba models make there."""

    def encode(self, cache: ArraysCache, data: Data = True) -> CacheRecord:
        return dataclasses.replace(super().encode(cache, data), kind="MambaCache")

    def decode(self, record: CacheRecord) -> ArraysCache:
        cache = super().decode(record)
        mamba = getattr(_classes(), "MambaCache", None)
        if mamba is not None:
            cache.__class__ = mamba  # the same object layout: a subclass adding only a constructor
        return cache


class CacheListCodec:
    """CacheList: no tensors of its own; each child is a nested record."""

    def encode(self, cache: CacheList, data: Data = True) -> CacheRecord:
        return CacheRecord("CacheList", {}, (), tuple(encode_cache(c, data) for c in cache.caches))

    def decode(self, record: CacheRecord) -> CacheList:
        return _classes().CacheList(*(decode_cache(c) for c in record.children))

    def check(self, record: CacheRecord) -> None:
        _require(not record.tensors and record.children, "CacheList needs children and no tensors")

    def trimmable(self, record: CacheRecord) -> bool:
        return all(codec_named(c.kind).trimmable(c) for c in record.children)

    def minimum_reusable_offset(self, record: CacheRecord) -> int:
        return max(codec_named(c.kind).minimum_reusable_offset(c) for c in record.children)

    def truncate(self, record: CacheRecord, offset: int) -> CacheRecord:
        children = tuple(codec_named(c.kind).truncate(c, offset) for c in record.children)
        return dataclasses.replace(record, children=children)

    def offset(self, record: CacheRecord) -> int | None:
        offsets = [o for c in record.children if (o := codec_named(c.kind).offset(c)) is not None]
        return max(offsets, default=None)


register_codec_by_path(_MODULE, "KVCache", KVCacheCodec())
register_codec_by_path(_MODULE, "ConcatenateKVCache", ConcatenateKVCacheCodec())
register_codec_by_path(_MODULE, "QuantizedKVCache", QuantizedKVCacheCodec())
register_codec_by_path(_MODULE, "RotatingKVCache", RotatingKVCacheCodec())
register_codec_by_path(_MODULE, "ChunkedKVCache", ChunkedKVCacheCodec())
register_codec_by_path(_MODULE, "ArraysCache", ArraysCacheCodec())
register_codec_by_path(_MODULE, "CacheList", CacheListCodec())
# mlx-lm before 0.30 has the class (met by path when a cache of it is encoded);
# where it has none, the name still decodes the records an older one wrote
register_codec_by_path(_MODULE, "MambaCache", MambaCacheCodec())
