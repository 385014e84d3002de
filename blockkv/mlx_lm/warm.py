"""The tokens and cache of a prompt as mlx-lm builds them, for ``blockkv warm``
(a system prompt stored before the first request) and ``blockkv import``
(the prompt an ``mlx_lm.cache_prompt`` file was made from).

mlx-lm's server stores a cache at the end of a chat's system messages: up to
the first token where a user message begins (``ResponseGenerator._tokenize``).
``system_tokens`` finds the same boundary, so a warmed entry is a prefix the
server's first request matches exactly, which an SSM or a wrapped sliding
window needs (they cannot be cut back)."""

from __future__ import annotations

import os
from typing import Any

PREFILL_STEP = 2048  # tokens per forward pass, mlx-lm's default prefill step
_PROBES = ("Hello", "?")  # two different user messages: the system part is what they share


def cache_prompt_tokens(model_path: str | os.PathLike[str], text: str) -> list[int]:
    """The tokens ``mlx_lm.cache_prompt --prompt TEXT`` caches for this model."""
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    if tokenizer.has_chat_template:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=False,
                                                  continue_final_message=True))
    return list(tokenizer.encode(text))


def system_tokens(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The tokens of ``messages`` (system messages) that mlx-lm's server caches
    as the system segment of any chat that starts with them."""
    head = list(tokenizer.apply_chat_template([*messages, {"role": "user", "content": ""}],
                                              add_generation_prompt=False))
    end = len(head)
    for probe in _PROBES:
        prompt = tokenizer.apply_chat_template([*messages, {"role": "user", "content": probe}],
                                               add_generation_prompt=True)
        end = min(end, next((i for i, (a, b) in enumerate(zip(head, prompt)) if a != b), len(prompt)))
    if end == 0:
        raise ValueError("the chat template puts nothing of the system messages before a user message")
    return head[:end]


def system_prompt_cache(model: str, messages: list[dict[str, Any]], kv: Any, adapter: str | None = None,
                        chat_template: str | None = None) -> tuple[list[int], list[Any]]:
    """(tokens, caches) of the system segment of ``messages``, prefilled by the
    model as mlx-lm's server would (KV quantised as ``kv`` says)."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import maybe_quantize_kv_cache
    from mlx_lm.models.cache import make_prompt_cache

    tokenizer_config = {"chat_template": chat_template} if chat_template else {}
    loaded = load(str(model), adapter_path=adapter, tokenizer_config=tokenizer_config)
    net, tokenizer = loaded[0], loaded[1]
    if not tokenizer.has_chat_template:
        raise ValueError(f"{model} has no chat template: the server caches no system segment for it")
    tokens = system_tokens(tokenizer, messages)
    caches = make_prompt_cache(net)
    for i in range(0, len(tokens), PREFILL_STEP):
        net(mx.array(tokens[i : i + PREFILL_STEP])[None], cache=caches)
        mx.eval([c.state for c in caches])
    if kv.bits is not None:
        maybe_quantize_kv_cache(caches, kv.start, kv.group_size, kv.bits)
    return tokens, caches
