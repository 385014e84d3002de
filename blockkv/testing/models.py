"""Tiny random-weight mlx-lm models, so every test fills real cache objects by
real forward passes in milliseconds instead of using hand-made stand-ins."""

from __future__ import annotations

import copy
import importlib
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.models.cache import (
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    make_prompt_cache,
)

_VOCAB = 256

# kind -> (mlx_lm.models module, config). Every config: 64 hidden, vocab 256.
_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # Plain KVCache per layer.
    "llama": (
        "llama",
        {
            "model_type": "llama",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "rms_norm_eps": 1e-5,
            "vocab_size": _VOCAB,
            "tie_word_embeddings": True,
        },
    ),
    # RotatingKVCache (window 16, wraps fast) on layer 0, KVCache on layer 1.
    "gemma3": (
        "gemma3_text",
        {
            "model_type": "gemma3_text",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "vocab_size": _VOCAB,
            "query_pre_attn_scalar": 32,
            "sliding_window": 16,
            "sliding_window_pattern": 2,
        },
    ),
    # ArraysCache (conv state + SSM state) per layer.
    "mamba": (
        "mamba",
        {
            "model_type": "mamba",
            "vocab_size": _VOCAB,
            "hidden_size": 64,
            "intermediate_size": 128,
            "state_size": 8,
            "num_hidden_layers": 2,
            "conv_kernel": 4,
            "use_bias": False,
            "use_conv_bias": True,
            "time_step_rank": 4,
        },
    ),
    # ChunkedKVCache (chunk 32) on layers 0-2, KVCache on layer 3 (llama4 needs 4).
    "chunked": (
        "llama4",
        {
            "model_type": "llama4",
            "text_config": {
                "model_type": "llama4_text",
                "attention_bias": False,
                "attention_chunk_size": 32,
                "head_dim": 16,
                "hidden_size": 64,
                "interleave_moe_layer_step": 8,  # > layers: dense MLPs only (CPU gather_mm is fp32-only)
                "intermediate_size": 64,
                "intermediate_size_mlp": 128,
                "max_position_embeddings": 4096,
                "num_attention_heads": 4,
                "num_experts_per_tok": 1,
                "num_hidden_layers": 4,
                "num_key_value_heads": 2,
                "num_local_experts": 2,
                "rms_norm_eps": 1e-5,
                "rope_scaling": None,
                "rope_theta": 10000.0,
                "use_qk_norm": True,
                "vocab_size": _VOCAB,
            },
        },
    ),
    # CacheList(ArraysCache, RotatingKVCache | KVCache) per layer.
    "cachelist": (
        "baichuan_m1",
        {
            "model_type": "baichuan_m1",
            "vocab_size": _VOCAB,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rope_theta": 10000.0,
            "sliding_window": 16,
            "sliding_window_layers": [0],
            "conv_window": 2,
            "rms_norm_eps": 1e-5,
        },
    ),
}

KINDS: tuple[str, ...] = tuple(_CONFIGS)


def model_config(kind: str) -> tuple[str, dict[str, Any]]:
    """(mlx_lm.models module name, a copy of the config) of a tiny ``kind``."""
    if kind not in _CONFIGS:
        raise ValueError(f"unknown model kind {kind!r}; expected one of {KINDS}")
    module, config = _CONFIGS[kind]
    return module, copy.deepcopy(config)


def tiny_model(kind: str, seed: int = 0, dtype: mx.Dtype = mx.float32) -> nn.Module:
    """A 64-wide random-weight model of ``kind`` (see ``KINDS``), weights in ``dtype``."""
    if kind not in _CONFIGS:
        raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {KINDS}")
    module_name, config = _CONFIGS[kind]
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
    return mx.random.randint(0, _VOCAB, (n,), key=state).tolist()


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
