"""The tiny model directory loads offline with mlx-lm and has a usable chat template."""

from __future__ import annotations

from pathlib import Path

import mlx_lm
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from blockkv.model_dir import KINDS, build_model_dir, sample_text

_CACHE_TYPES = {"llama": {KVCache}, "gemma3": {RotatingKVCache, KVCache}, "mamba": {ArraysCache}}


@pytest.mark.parametrize("kind", KINDS)
def test_builds_a_model_mlx_lm_loads(kind: str, tmp_path: Path) -> None:
    root = build_model_dir(tmp_path / kind, kind)
    loaded = mlx_lm.load(str(root))
    model, tokenizer = loaded[0], loaded[1]
    assert {type(c) for c in make_prompt_cache(model)} == _CACHE_TYPES[kind]
    system = sample_text(40, seed=3)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert tokenizer.decode(prompt).startswith("<|system|>" + system + "<|end|><|user|>hi")
    # Greedy output depends on the context (random weights wide enough to not collapse).
    a = mlx_lm.generate(model, tokenizer, prompt, max_tokens=6)
    b = mlx_lm.generate(model, tokenizer, prompt[:-3] + prompt[-1:], max_tokens=6)
    assert a != b


def test_seed_reproduces_weights(tmp_path: Path) -> None:
    a = build_model_dir(tmp_path / "a", seed=5)
    b = build_model_dir(tmp_path / "b", seed=5)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model kind"):
        build_model_dir(tmp_path, "gpt9")
    with pytest.raises(ValueError, match="vocab_size"):
        build_model_dir(tmp_path, vocab_size=10)
    with pytest.raises(ValueError, match="n_words"):
        sample_text(-1)
