"""Does a list of caches fit a model? The layout a model's own
``make_prompt_cache`` gives, checked before any cache reaches mlx-lm.

A store's identity keeps one model's entries from another's, but an entry can
still come from elsewhere: an imported file, a planted header, a bucket. A
cache whose layout is not the model's (another KV head count, head dim, dtype,
window, kind or layer count) makes mlx-lm's generation thread die on its first
``concatenate``, and the server answers nothing after that; one that fits is at
worst another model's numbers (which the identity guards). So every cache list
from a file or a tier is compared, layer by layer, with the caches the model
itself makes after one token: kind, the settings that shape it (window, chunk,
quantisation), each tensor's dtype and every axis but the token axis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from blockkv.format.codec import CacheRecord, TensorRecord, encode_cache
from blockkv.mlx_lm.identity import KVQuant

# meta that says where a cache is, not what shape it has
_POSITIONS = frozenset({"offset", "_idx", "start_position"})


class ModelLayout:
    """The cache layout of a model (and its draft model, whose caches mlx-lm's
    server appends to the model's), as its ``make_prompt_cache`` makes it after
    one token; with KV quantisation on, each layer may also be its quantised form."""

    def __init__(self, models: Sequence[Any], kv: KVQuant = KVQuant()) -> None:
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        self._layers: list[list[CacheRecord]] = []
        for model in models:
            caches = make_prompt_cache(model)
            model(mx.array([[0]]), cache=caches)  # one token: every tensor takes its shape
            for c in caches:
                forms = [encode_cache(c, data=False)]
                if kv.bits is not None and hasattr(c, "to_quantized"):
                    try:
                        forms.append(encode_cache(c.to_quantized(group_size=kv.group_size, bits=kv.bits), data=False))
                    except ValueError:  # settings this model cannot quantise with: mlx-lm cannot make that form either
                        pass
                self._layers.append(forms)

    def misfit(self, caches: Sequence[Any]) -> str | None:
        """Why ``caches`` do not fit the model, or None when they do."""
        if len(caches) != len(self._layers):
            return f"{len(caches)} caches, the model makes {len(self._layers)}"
        for i, (cache, forms) in enumerate(zip(caches, self._layers)):
            try:
                got = encode_cache(cache, data=False)
            except (TypeError, ValueError) as exc:
                return f"layer {i}: {exc}"
            reasons = [_differs(got, want) for want in forms]
            if all(reasons):
                return f"layer {i}: {reasons[0]}"
        return None


def _differs(got: CacheRecord, want: CacheRecord) -> str | None:
    if got.kind != want.kind:
        return f"a {got.kind}, the model makes a {want.kind}"
    shape_got = {k: v for k, v in got.meta.items() if k not in _POSITIONS}
    shape_want = {k: v for k, v in want.meta.items() if k not in _POSITIONS}
    if shape_got != shape_want:
        return f"{got.kind} {shape_got}, the model's is {shape_want}"
    if len(got.tensors) != len(want.tensors) or len(got.children) != len(want.children):
        return f"{got.kind} of another structure"
    for slot, (a, b) in enumerate(zip(got.tensors, want.tensors)):
        if a is not None and b is not None and (a.dtype, _fixed_axes(got, a)) != (b.dtype, _fixed_axes(want, b)):
            return f"{got.kind} tensor {slot} is {a.dtype} {list(a.shape)}, the model's is {b.dtype} {list(b.shape)}"
    for child_got, child_want in zip(got.children, want.children):
        reason = _differs(child_got, child_want)
        if reason is not None:
            return reason
    return None


def _fixed_axes(record: CacheRecord, t: TensorRecord) -> tuple[int, ...]:
    """Every axis but the token axis (a sliding window's rows count tokens too)."""
    if (t.token_axis or record.kind == "RotatingKVCache") and len(t.shape) >= 2:
        return (*t.shape[:-2], t.shape[-1])
    return t.shape
