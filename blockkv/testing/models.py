"""Tiny random-weight mlx-lm models, so every test fills real cache objects by
real forward passes in milliseconds instead of using hand-made stand-ins."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map
from mlx_lm.models.cache import (
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    make_prompt_cache,
)

from blockkv.model_configs import KINDS, VOCAB, model_config  # noqa: F401 - KINDS: the kit's kinds are these


def tiny_model(kind: str, seed: int = 0, dtype: mx.Dtype = mx.float32) -> nn.Module:
    """A 64-wide random-weight model of ``kind`` (see ``KINDS``), weights in ``dtype``."""
    module_name, config = model_config(kind)
    module = importlib.import_module(f"mlx_lm.models.{module_name}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    # Some layers start at zero (baichuan's key conv): randomize those too, or
    # their caches would hold nothing but zeros.
    model.update(
        tree_map(
            lambda p: mx.random.normal(p.shape) * 0.5 if not mx.any(p).item() else p,
            model.parameters(),
        )
    )
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def prefill(
    model: nn.Module,
    tokens: Sequence[int],
    cache: list[Any] | None = None,
    chunk: int | None = None,
) -> tuple[list[Any], mx.array]:
    """Run ``tokens`` through ``model`` (in pieces of ``chunk`` if given), filling
    ``cache`` (a fresh ``make_prompt_cache`` if None); returns the cache and the
    logits of the last piece."""
    if not tokens:
        raise ValueError("prefill needs at least one token")
    if chunk is not None and chunk <= 0:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    if cache is None:
        cache = make_prompt_cache(model)
    step = chunk or len(tokens)
    logits = None
    for i in range(0, len(tokens), step):
        logits = model(mx.array(list(tokens[i : i + step]))[None], cache=cache)
        mx.eval(logits, [c.state for c in cache])
    assert logits is not None
    return cache, logits


def quantized(
    cache_list: list[Any], group_size: int = 32, bits: int = 8
) -> list[QuantizedKVCache]:
    """Quantize a list of ``KVCache`` via mlx-lm's own ``KVCache.to_quantized``."""
    out = []
    for c in cache_list:
        if not isinstance(c, KVCache):
            raise TypeError(f"quantized() needs KVCache entries, got {type(c).__name__}")
        out.append(c.to_quantized(group_size=group_size, bits=bits))
    return out


def concatenate_cache(model: nn.Module) -> list[ConcatenateKVCache]:
    """A fresh ``ConcatenateKVCache`` per layer, for ``prefill(model, ..., cache=...)``."""
    return [ConcatenateKVCache() for _ in model.layers]


def random_tokens(n: int, seed: int = 0) -> list[int]:
    """``n`` reproducible token ids below the tiny vocabulary size."""
    state = mx.random.key(seed)
    return np.asarray(mx.random.randint(0, VOCAB, (n,), key=state)).astype(int).tolist()


def chunked_cache_fills() -> bool:
    """Whether this mlx-lm's ``ChunkedKVCache`` takes a second forward pass
    once it holds a chunk: before 0.32 its ``maybe_trim_front`` cut the
    pre-allocated buffer and the next update failed (mlx-lm's bug, fixed in
    ml-explore/mlx-lm#1673), so its llama4 never fills one past a chunk."""
    cache, rows = ChunkedKVCache(2), mx.zeros((1, 1, 2, 1))
    try:
        for _ in range(2):
            cache.maybe_trim_front()
            cache.update_and_fetch(rows, rows)
    except ValueError:
        return False
    return True
