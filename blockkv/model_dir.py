"""A tiny real model directory that ``mlx_lm.load(path)`` opens offline.

The demo, the server test and the drop-in tests all need what a user has on
disk: ``config.json``, safetensors weights and a tokenizer with a chat
template. This builds one with random weights (mlx-lm's own model classes)
and a byte-level BPE tokenizer trained in-process, so nothing touches the
network and every run is reproducible from its seed.
"""

from __future__ import annotations

import importlib
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten

from blockkv.model_configs import model_config

SPECIAL_TOKENS: tuple[str, ...] = ("<|end|>", "<|system|>", "<|user|>", "<|assistant|>")
EOS_TOKEN = "<|end|>"

# Roles become special tokens, so the system prompt's tokens never merge with
# what follows it and mlx-lm's server can split the prompt at its end.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_WORDS: tuple[str, ...] = tuple(
    (
        "agent tool call plan step result error retry file read write search query "
        "answer user system prompt context memory cache token model layer block "
        "disk store restore session turn reply check test build run deploy config "
        "value key path list map set index range limit budget time cost fast slow "
        "safe exact prefix suffix shared long short first last next previous the a "
        "of to in for with on by from and or not if then else when while return"
    ).split()
)

# kind -> (mlx_lm.models module, config without vocab/eos). Small enough to
# build in well under a second; the caches they make are the point:
# The tiny configs of blockkv.testing.models; gemma3's window is 32 here so a
# chat turn's system segment fits before the ring wraps. llama: KVCache;
# gemma3: RotatingKVCache + KVCache; mamba: ArraysCache.
_KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": model_config("llama"),
    "gemma3": (model_config("gemma3")[0], {**model_config("gemma3")[1], "sliding_window": 32}),
    "mamba": model_config("mamba"),
}

KINDS: tuple[str, ...] = tuple(_KINDS)


def sample_text(n_words: int, seed: int = 0) -> str:
    """``n_words`` reproducible words from the tokenizer's training vocabulary."""
    if n_words < 0:
        raise ValueError(f"n_words must be >= 0, got {n_words}")
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n_words))


def _corpus() -> Iterator[str]:
    for seed in range(200):
        yield sample_text(64, seed=seed)


def _write_tokenizer(path: Path, vocab_size: int) -> int:
    """Train a byte-level BPE on the built-in corpus; returns the EOS id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "pad_token": EOS_TOKEN,
        "model_max_length": 1 << 20,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    eos = tok.token_to_id(EOS_TOKEN)
    assert eos is not None
    return eos


def build_model_dir(
    path: str | Path,
    kind: str = "llama",
    *,
    seed: int = 0,
    vocab_size: int = 512,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a loadable random-weight model of ``kind`` (see ``KINDS``) into ``path``.

    ``overrides`` replaces config keys (e.g. ``hidden_size`` for a model slow
    enough that prefill time shows). Returns ``path``.
    """
    if kind not in _KINDS:
        raise ValueError(f"unknown model kind {kind!r}; expected one of {KINDS}")
    if vocab_size < 300:
        raise ValueError(f"vocab_size must be >= 300 (bytes + specials), got {vocab_size}")
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    eos = _write_tokenizer(root, vocab_size)
    module_name, base = _KINDS[kind]
    config = {**base, "vocab_size": vocab_size, "eos_token_id": eos, **(overrides or {})}
    module = importlib.import_module(f"mlx_lm.models.{module_name}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    # mlx-lm's default init gives a near-uniform next-token distribution, so
    # greedy decoding repeats one token; wider matrices make the output depend
    # on the context, which is what an "identical output" check needs.
    params = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    weights = {
        name: (mx.random.normal(w.shape) * (2.0 / w.shape[-1] ** 0.5) if w.ndim >= 2 else w)
        for name, w in params
    }
    mx.save_safetensors(str(root / "model.safetensors"), weights)
    (root / "config.json").write_text(json.dumps(config, indent=2))
    return root
