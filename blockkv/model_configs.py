"""The tiny mlx-lm model configurations blockkv builds random-weight models from.

Each kind is chosen for the cache objects its model makes (every kind mlx-lm
persists), at 64 hidden units so a forward pass takes milliseconds. The
testing kit's models (``blockkv.testing.models``) and the loadable model
directories of the demo and the docs (``model_dir.py``) are built from them.
"""

from __future__ import annotations

import copy
from typing import Any

VOCAB = 256  # every tiny config's vocabulary: random tokens are drawn below it

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
            "vocab_size": VOCAB,
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
            "vocab_size": VOCAB,
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
            "vocab_size": VOCAB,
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
                "vocab_size": VOCAB,
            },
        },
    ),
    # CacheList(ArraysCache, RotatingKVCache | KVCache) per layer.
    "cachelist": (
        "baichuan_m1",
        {
            "model_type": "baichuan_m1",
            "vocab_size": VOCAB,
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
