"""Hypothesis strategies shaped like a prompt cache's real traffic.

Agent sessions share prefixes: a few system prompts, conversations that grow
a turn at a time, branches that rewrite a later turn. Caches are real mlx-lm
cache objects filled by real forward passes of tiny random-weight models, of
every kind blockkv stores (trimmable and not), so a test exercises the codecs
on the shapes a server produces rather than on hand-made arrays.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from hypothesis import strategies as st

from blockkv.testing.models import KINDS, concatenate_cache, prefill, quantized, tiny_model

VOCAB = 256  # the tiny models' vocabulary: tokens must be valid model inputs
Tokens = tuple[int, ...]

# Every cache layout a strategy can produce: the tiny model kinds plus the two
# KVCache variants a server can switch to (kv-quant, concatenate).
CACHE_KINDS: tuple[str, ...] = (*KINDS, "quantized", "concatenate")
TRIMMABLE_KINDS: tuple[str, ...] = ("llama", "chunked", "quantized", "concatenate")
NAMESPACES: tuple[str, ...] = ("", "adapter:a", "user:7")

tokens = st.integers(0, VOCAB - 1)
namespaces = st.sampled_from(NAMESPACES)


def token_runs(min_size: int = 1, max_size: int = 12) -> st.SearchStrategy[Tokens]:
    """A run of tokens (a turn, a system prompt)."""
    return st.lists(tokens, min_size=min_size, max_size=max_size).map(tuple)


@st.composite
def agent_sessions(
    draw: st.DrawFn, max_systems: int = 3, max_conversations: int = 4, max_turns: int = 4
) -> list[Tokens]:
    """Prompts of several agent sessions, in the order a server would see them:
    each conversation starts from a shared system prompt (or branches off an
    earlier prompt) and grows one turn at a time."""
    systems = draw(st.lists(token_runs(2, 12), min_size=1, max_size=max_systems, unique=True))
    prompts: list[Tokens] = []
    for _ in range(draw(st.integers(1, max_conversations))):
        if len(prompts) > 0 and draw(st.booleans()):
            base = draw(st.sampled_from(prompts))
            conv = base[: draw(st.integers(1, len(base)))]
        else:
            conv = draw(st.sampled_from(systems))
        for _ in range(draw(st.integers(1, max_turns))):
            conv = conv + draw(token_runs(1, 8))
            prompts.append(conv)
    return prompts


@st.composite
def related_prompts(draw: st.DrawFn, base: Sequence[int]) -> Tokens:
    """A prompt a server might send after ``base`` was cached: the same, a
    prefix, the next turn, or a branch that rewrites its tail."""
    base = tuple(base)
    if not base:
        raise ValueError("related_prompts needs a non-empty base")
    shape = draw(st.sampled_from(("same", "prefix", "extend", "branch")))
    if shape == "same":
        return base
    if shape == "prefix":
        return base[: draw(st.integers(1, len(base)))]
    if shape == "extend":
        return base + draw(token_runs(1, 8))
    cut = draw(st.integers(0, len(base) - 1))
    return base[:cut] + draw(token_runs(1, 8))


@functools.cache
def _model(kind: str, seed: int) -> nn.Module:
    return tiny_model(kind, seed=seed)


def make_caches(kind: str, prompt: Sequence[int], seed: int = 0, chunk: int | None = None) -> list[Any]:
    """Real caches of layout ``kind`` holding ``prompt``, from a real forward
    pass of the tiny model (weights drawn from ``seed``)."""
    if kind == "quantized":
        cache, _ = prefill(_model("llama", seed), prompt, chunk=chunk)
        return quantized(cache)
    if kind == "concatenate":
        model = _model("llama", seed)
        cache, _ = prefill(model, prompt, cache=concatenate_cache(model), chunk=chunk)
        return cache
    cache, _ = prefill(_model(kind, seed), prompt, chunk=chunk)
    return cache


@st.composite
def caches_for(
    draw: st.DrawFn, prompt: Sequence[int], kinds: Sequence[str] = CACHE_KINDS
) -> tuple[str, list[Any]]:
    """``(kind, caches)`` for ``prompt``: a drawn layout, weights and prefill chunking."""
    kind = draw(st.sampled_from(tuple(kinds)))
    seed = draw(st.integers(0, 2))
    chunk = draw(st.sampled_from((None, 3, 16)))
    return kind, make_caches(kind, prompt, seed, chunk)


ATTACHMENT_DTYPES: tuple[mx.Dtype, ...] = (mx.float32, mx.float16, mx.bfloat16, mx.int32, mx.uint8)


@st.composite
def arrays(draw: st.DrawFn, max_dims: int = 3, max_side: int = 6) -> mx.array:
    """A small random array of a drawn dtype and shape (contents from a drawn seed)."""
    shape = tuple(draw(st.lists(st.integers(1, max_side), min_size=1, max_size=max_dims)))
    dtype = draw(st.sampled_from(ATTACHMENT_DTYPES))
    key = mx.random.key(draw(st.integers(0, 2**16)))
    if dtype in (mx.int32, mx.uint8):
        a = mx.random.randint(0, 200, shape, key=key).astype(dtype)
    else:
        a = (mx.random.normal(shape, key=key) * 4).astype(dtype)
    mx.eval(a)
    return a


def attachments(max_size: int = 2) -> st.SearchStrategy[dict[str, mx.array]]:
    """Named side tensors stored with an entry (vision features, a draft model's state)."""
    names = st.sampled_from(("image:0", "image:1", "audio", "draft"))
    return st.dictionaries(names, arrays(), max_size=max_size)
