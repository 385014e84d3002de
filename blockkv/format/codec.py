"""mlx-lm cache objects <-> canonical records of raw tensor bits plus small meta.

A record keeps only the live part of a cache (never the pre-allocated tail past
``offset``) and marks which tensors have a token axis (axis -2), so the block
layer can cut them at absolute token positions and share common prefixes.
Decoding goes back through each class's own ``from_state``/state protocol.

Here: the record types, the registry of cache codecs and the API over it, and
records to and from their JSON descriptors; the built-in codecs are in
``kinds``."""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import mlx.core as mx
import numpy as np

from blockkv.errors import CorruptHeaderError
from blockkv.format.unfilled import unfilled_arrays

# mlx dtype name -> (mlx dtype, numpy dtype holding the same raw bits).
DTYPES: dict[str, tuple[mx.Dtype, np.dtype]] = {
    "bool": (mx.bool_, np.dtype(np.bool_)),
    "uint8": (mx.uint8, np.dtype(np.uint8)),
    "uint16": (mx.uint16, np.dtype(np.uint16)),
    "uint32": (mx.uint32, np.dtype(np.uint32)),
    "uint64": (mx.uint64, np.dtype(np.uint64)),
    "int8": (mx.int8, np.dtype(np.int8)),
    "int16": (mx.int16, np.dtype(np.int16)),
    "int32": (mx.int32, np.dtype(np.int32)),
    "int64": (mx.int64, np.dtype(np.int64)),
    "float16": (mx.float16, np.dtype(np.uint16)),
    "bfloat16": (mx.bfloat16, np.dtype(np.uint16)),
    "float32": (mx.float32, np.dtype(np.uint32)),
    "float64": (mx.float64, np.dtype(np.uint64)),
    "complex64": (mx.complex64, np.dtype(np.complex64)),
}
_NAME_OF: dict[mx.Dtype, str] = {mxd: name for name, (mxd, _) in DTYPES.items()}
# Integer view used to move float bits through numpy untouched (no NaN canonicalising).
_BITS_VIEW: dict[str, mx.Dtype] = {
    "float16": mx.uint16,
    "bfloat16": mx.uint16,
    "float32": mx.uint32,
    "float64": mx.uint64,
}

# Bounds for untrusted descriptors: far above any real cache, far below a DoS.
MAX_NDIM = 8
MAX_DIM = 1 << 31
MAX_TENSOR_BYTES = 1 << 40
MAX_RECORDS = 1 << 14
MAX_TENSORS_PER_RECORD = 64
MAX_DEPTH = 4
MAX_META_KEYS = 32
MAX_STR = 256
MAX_INT = 1 << 53

Data = Literal[False, True, "device"]
"""What an encoded record carries: nothing (a descriptor), host bits (numpy),
or ``"device"``: mlx arrays captured now, copied to the host later (off the
caller's thread)."""


def dtype_name(dtype: mx.Dtype) -> str:
    """The canonical name of an mlx dtype (TypeError for dtypes blockkv cannot store)."""
    try:
        return _NAME_OF[dtype]
    except KeyError:
        raise TypeError(f"unsupported mlx dtype {dtype}") from None


def to_host(a: mx.array) -> np.ndarray:
    """The raw bits of ``a`` as a C-contiguous numpy array of the same itemsize."""
    name = dtype_name(a.dtype)
    view = _BITS_VIEW.get(name)
    return np.ascontiguousarray(np.array(a.view(view) if view is not None else a))


def to_device(data: np.ndarray, dtype: str) -> mx.array:
    """Rebuild an mlx array of ``dtype`` from raw bits made by ``to_host`` (one copy)."""
    mx_dtype, host = DTYPES[dtype]
    if data.dtype != host:
        raise TypeError(f"{dtype} needs host dtype {host}, got {data.dtype}")
    out = mx.array(data)
    return out.view(mx_dtype) if dtype in _BITS_VIEW else out


def device_buffers(specs: Sequence[tuple[str, tuple[int, ...]]]) -> list[tuple[mx.array, np.ndarray]]:
    """Fresh mlx arrays of these ``(dtype, shape)`` and writable numpy views of their raw bits.

    Filling a view fills its array: a restore reads block bytes straight into
    the memory mlx will use, with no second copy. The memory is not zeroed
    first (``unfilled.py``): the caller writes every byte or drops the arrays."""
    kinds = [(_BITS_VIEW.get(dtype, DTYPES[dtype][0]), DTYPES[dtype][1], tuple(shape)) for dtype, shape in specs]
    fresh = iter(unfilled_arrays([(bits, shape) for bits, _, shape in kinds if math.prod(shape)]))
    out = []
    for (dtype, _), (bits_dtype, host, shape) in zip(specs, kinds):
        bits = next(fresh) if math.prod(shape) else mx.zeros(shape, dtype=bits_dtype)
        mx.eval(bits)
        view = np.asarray(memoryview(bits)).view(host)  # type: ignore[arg-type]  # mlx arrays are buffers
        if not (view.flags.writeable and view.flags.c_contiguous and view.shape == shape):
            raise RuntimeError("mlx did not expose a writable contiguous buffer")
        out.append((bits.view(DTYPES[dtype][0]) if dtype in _BITS_VIEW else bits, view))
    mx.eval([a for a, _ in out])  # evaluated here: usable from any thread, whichever one made them
    return out


def capture(a: mx.array, data: Data) -> np.ndarray | mx.array | None:
    """What a record keeps of ``a``: host bits, a device snapshot, or nothing.

    ``"device"`` is a new array object of the host dtype (free to make, shares
    the buffer): mlx-lm updates caches in place, and an update rebinds the
    cache's array, never this one, nor donates a buffer this one holds."""
    if data == "device":
        bits = _BITS_VIEW.get(dtype_name(a.dtype))
        return a.view(bits) if bits is not None else mx.stop_gradient(a)
    return to_host(a) if data else None


@dataclass(frozen=True)
class TensorRecord:
    """One stored tensor: its dtype, live shape, token-axis flag and raw bits."""

    dtype: str
    shape: tuple[int, ...]
    token_axis: bool
    token_start: int = 0
    data: np.ndarray | mx.array | None = None  # mx.array only in a "device" snapshot

    @property
    def nbytes(self) -> int:
        """Size of the raw bits, computed from the shape (works without data)."""
        return math.prod(self.shape) * DTYPES[self.dtype][1].itemsize  # exact: int64 wrapped a hostile shape to 0

    @property
    def token_stop(self) -> int:
        """One past the last absolute token position held (token-axis tensors)."""
        return self.token_start + self.shape[-2]

    def array(self) -> mx.array:
        """The tensor as an mlx array (needs data)."""
        if self.data is None:
            raise ValueError("descriptor-only TensorRecord has no data")
        if isinstance(self.data, mx.array):
            return self.data
        return to_device(self.data, self.dtype)

    def cut(self, stop: int) -> TensorRecord:
        """This token-axis tensor limited to absolute positions below ``stop``."""
        rows = max(0, min(stop, self.token_stop) - self.token_start)
        shape = (*self.shape[:-2], rows, self.shape[-1])
        data = None if self.data is None else np.ascontiguousarray(self.data[..., :rows, :])
        return dataclasses.replace(self, shape=shape, data=data)


@dataclass(frozen=True)
class CacheRecord:
    """One cache object: codec name, JSON-safe meta, tensor slots, nested children."""

    kind: str
    meta: dict[str, Any]
    tensors: tuple[TensorRecord | None, ...]
    children: tuple[CacheRecord, ...] = ()


class CacheCodec(Protocol):
    """How one cache class maps to a record and back, and how far it can be cut."""

    def encode(self, cache: Any, data: Data = True) -> CacheRecord:
        """The record of ``cache``; ``data=False`` gives a descriptor-only record."""
        ...

    def decode(self, record: CacheRecord) -> Any:
        """A real cache object from a record with data."""
        ...

    def check(self, record: CacheRecord) -> None:
        """Raise ValueError if the record's meta or tensors are inconsistent."""
        ...

    def trimmable(self, record: CacheRecord) -> bool:
        """Whether the cache can be cut back to a shorter prefix."""
        ...

    def minimum_reusable_offset(self, record: CacheRecord) -> int:
        """The smallest prefix length the cache can be cut back to."""
        ...

    def truncate(self, record: CacheRecord, offset: int) -> CacheRecord:
        """The record cut back to ``offset`` tokens (trimmable records only)."""
        ...

    def offset(self, record: CacheRecord) -> int | None:
        """Tokens the cache has seen, or None if it does not count them."""
        ...


_BY_TYPE: dict[type, tuple[str, CacheCodec]] = {}
_BY_NAME: dict[str, CacheCodec] = {}
_BY_PATH: dict[tuple[str, str], tuple[str, CacheCodec]] = {}  # (module, class name): classes not imported here


def register_codec(cls: type, codec: CacheCodec, name: str | None = None) -> None:
    """Register ``codec`` for instances of exactly ``cls`` under ``name`` (default: class name)."""
    if not isinstance(cls, type):
        raise TypeError(f"register_codec needs a class, got {cls!r}")
    name = cls.__name__ if name is None else name
    if not isinstance(name, str) or not name or len(name) > MAX_STR:
        raise ValueError(f"codec name must be a non-empty str, got {name!r}")
    _BY_TYPE[cls] = (name, codec)
    register_kind(name, codec)


def register_kind(name: str, codec: CacheCodec) -> None:
    """Decode records of ``kind == name`` with ``codec``, with no class to
    encode (yet: ``register_codec`` and ``register_codec_by_path`` add one)."""
    _BY_NAME[name] = codec


def register_codec_by_path(module: str, class_name: str, codec: CacheCodec) -> None:
    """Register ``codec`` under ``class_name`` for exactly the class ``module.class_name``
    without importing it: the built-in kinds are mlx-lm's classes, and importing
    mlx-lm (and transformers with it) costs ~1 s that ``import blockkv``, ``ls``
    and ``stats`` need not pay. The class is matched when a cache of it is first
    met (its module is then imported already); a record names it by ``class_name``."""
    _BY_PATH[(module, class_name)] = (class_name, codec)
    register_kind(class_name, codec)


def codec_for(cache: Any) -> tuple[str, CacheCodec]:
    """The registered (name, codec) for ``cache``'s exact class; TypeError if none."""
    cls = type(cache)
    found = _BY_TYPE.get(cls)
    if found is None:
        found = _BY_PATH.get((cls.__module__, cls.__qualname__))
        if found is None or getattr(sys.modules.get(cls.__module__), cls.__qualname__, None) is not cls:
            raise TypeError(f"no blockkv codec registered for cache class {cls.__name__}")
        _BY_TYPE[cls] = found
    return found


def codec_named(kind: str) -> CacheCodec:
    """The codec registered under a record's ``kind``; ValueError if none."""
    try:
        return _BY_NAME[kind]
    except KeyError:
        raise ValueError(f"unknown cache kind {kind!r}") from None


# ---------------------------------------------------------------- public API


def encode_cache(cache: Any, data: Data = True) -> CacheRecord:
    """The record of one cache object, stamped with its registered name."""
    name, codec = codec_for(cache)
    record = codec.encode(cache, data)
    return record if record.kind == name else dataclasses.replace(record, kind=name)


def decode_cache(record: CacheRecord) -> Any:
    """A real mlx-lm cache object from a record with data."""
    return codec_named(record.kind).decode(record)


def encode_caches(caches: Sequence[Any]) -> list[CacheRecord]:
    """Records (with raw bits) of a prompt cache list."""
    return [encode_cache(c) for c in caches]


def decode_caches(records: Sequence[CacheRecord]) -> list[Any]:
    """mlx-lm cache objects from records with data."""
    return [decode_cache(r) for r in records]


def _as_records(items: Sequence[Any]) -> list[CacheRecord]:
    """Records (descriptor-only for live caches: no tensor copy) of caches or records."""
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise TypeError(f"expected a list of caches or records, got {type(items).__name__}")
    return [x if isinstance(x, CacheRecord) else encode_cache(x, data=False) for x in items]


def trimmable(caches_or_records: Sequence[Any]) -> bool:
    """Whether every cache can be cut back to a shorter prefix (True for [])."""
    return all(codec_named(r.kind).trimmable(r) for r in _as_records(caches_or_records))


def minimum_reusable_offset(caches_or_records: Sequence[Any]) -> int:
    """The smallest prefix length all caches can be cut back to together."""
    records = _as_records(caches_or_records)
    return max((codec_named(r.kind).minimum_reusable_offset(r) for r in records), default=0)


def records_offset(records: Sequence[CacheRecord]) -> int:
    """Tokens the caches have seen (max offset; 0 if none counts tokens, e.g. SSM only)."""
    offsets = [o for r in records if (o := codec_named(r.kind).offset(r)) is not None]
    return max(offsets, default=0)


def record_offsets(records: Sequence[CacheRecord]) -> set[int]:
    """The token counts of the caches that keep one (empty if none does, e.g. SSM only)."""
    return {o for r in records if (o := codec_named(r.kind).offset(r)) is not None}


def truncate_records(records: Sequence[CacheRecord], offset: int) -> list[CacheRecord]:
    """The records cut back to ``offset`` tokens; ValueError if they cannot be."""
    if not trimmable(records):
        raise ValueError("these caches are not trimmable")
    low, high = minimum_reusable_offset(records), records_offset(records)
    if type(offset) is not int or not low <= offset <= high:
        raise ValueError(f"prefix length {offset!r} outside the reusable range [{low}, {high}]")
    return [codec_named(r.kind).truncate(r, offset) for r in records]


def walk_tensors(records: Sequence[CacheRecord]) -> list[TensorRecord | None]:
    """Every tensor slot in canonical order: a record's tensors, then its children's."""
    out: list[TensorRecord | None] = []
    for r in records:
        out.extend(r.tensors)
        out.extend(walk_tensors(r.children))
    return out


def map_tensors(
    records: Sequence[CacheRecord], fn: Callable[[TensorRecord], TensorRecord]
) -> list[CacheRecord]:
    """The records with ``fn`` applied to every present tensor, in ``walk_tensors`` order."""
    return [
        dataclasses.replace(
            r,
            tensors=tuple(None if t is None else fn(t) for t in r.tensors),
            children=tuple(map_tensors(r.children, fn)),
        )
        for r in records
    ]


# ---------------------------------------------------------------- descriptors


def tensor_to_descriptor(t: TensorRecord) -> dict[str, Any]:
    """The JSON-safe description of a tensor (no data)."""
    return {"dtype": t.dtype, "shape": list(t.shape), "token_axis": t.token_axis, "token_start": t.token_start}


def _record_to_descriptor(r: CacheRecord) -> dict[str, Any]:
    return {
        "kind": r.kind,
        "meta": dict(r.meta),
        "tensors": [None if t is None else tensor_to_descriptor(t) for t in r.tensors],
        "children": [_record_to_descriptor(c) for c in r.children],
    }


def records_to_descriptor(records: Sequence[CacheRecord]) -> list[dict[str, Any]]:
    """JSON-safe descriptions of records, without data."""
    return [_record_to_descriptor(r) for r in records]


def _bad(what: str) -> CorruptHeaderError:
    return CorruptHeaderError(f"bad cache descriptor: {what}")


def _is_int(v: Any, low: int = 0, high: int = MAX_INT) -> bool:
    return type(v) is int and low <= v <= high


def tensor_from_descriptor(obj: Any) -> TensorRecord:
    """A descriptor-only TensorRecord, bounds-checked; CorruptHeaderError otherwise."""
    if not isinstance(obj, dict) or set(obj) != {"dtype", "shape", "token_axis", "token_start"}:
        raise _bad("tensor must be a dict with dtype, shape, token_axis, token_start")
    dtype, shape, token_axis, start = obj["dtype"], obj["shape"], obj["token_axis"], obj["token_start"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _bad(f"unknown dtype {str(dtype)[:MAX_STR]!r}")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(_is_int(d, 0, MAX_DIM) for d in shape):
        raise _bad("shape must be a list of at most 8 bounded non-negative ints")
    if type(token_axis) is not bool or not _is_int(start) or (token_axis and len(shape) < 2):
        raise _bad("token_axis must be a bool (with >= 2 dims) and token_start a non-negative int")
    if not token_axis and start != 0:
        raise _bad("a state tensor has token_start 0")
    t = TensorRecord(dtype, tuple(shape), token_axis, start)
    if t.nbytes > MAX_TENSOR_BYTES:
        raise _bad(f"tensor of {t.nbytes} bytes is too large")
    return t


def _meta_from(obj: Any) -> dict[str, Any]:
    if not isinstance(obj, dict) or len(obj) > MAX_META_KEYS:
        raise _bad("meta must be a small dict")
    for k, v in obj.items():
        if not isinstance(k, str) or len(k) > MAX_STR:
            raise _bad("meta keys must be short strings")
        ok = v is None or type(v) in (bool, float) or _is_int(v, -MAX_INT) or (isinstance(v, str) and len(v) <= MAX_STR)
        if not ok:
            raise _bad(f"meta {k!r} must be a small scalar")
    return dict(obj)


def _record_from(obj: Any, depth: int, budget: list[int]) -> CacheRecord:
    budget[0] -= 1
    if budget[0] < 0 or depth > MAX_DEPTH:
        raise _bad("too many or too deeply nested records")
    if not isinstance(obj, dict) or set(obj) != {"kind", "meta", "tensors", "children"}:
        raise _bad("record must be a dict with kind, meta, tensors, children")
    kind, tensors, children = obj["kind"], obj["tensors"], obj["children"]
    if not isinstance(kind, str) or kind not in _BY_NAME:
        raise _bad(f"unknown cache kind {str(kind)[:MAX_STR]!r}")
    if not isinstance(tensors, list) or len(tensors) > MAX_TENSORS_PER_RECORD:
        raise _bad("tensors must be a list of at most 64 slots")
    if not isinstance(children, list):
        raise _bad("children must be a list")
    record = CacheRecord(
        kind,
        _meta_from(obj["meta"]),
        tuple(None if t is None else tensor_from_descriptor(t) for t in tensors),
        tuple(_record_from(c, depth + 1, budget) for c in children),
    )
    try:
        _BY_NAME[kind].check(record)
    except (ValueError, TypeError, KeyError) as e:
        raise _bad(str(e)) from None
    return record


def records_from_descriptor(obj: Any) -> list[CacheRecord]:
    """Descriptor-only records from untrusted JSON, bounded before anything is allocated."""
    if not isinstance(obj, list) or len(obj) > MAX_RECORDS:
        raise _bad("records must be a list")
    budget = [MAX_RECORDS]
    return [_record_from(r, 0, budget) for r in obj]
