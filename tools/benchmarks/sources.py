"""The caches every section stores: real mlx-lm ``KVCache`` objects of realistic
shapes holding random bf16 K/V over a token stream. Prefixes share the exact
same bytes, so deduplication is real; a restore is checked bit for bit against
them, so no figure is that of a wrong answer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from .config import Shape

VOCAB = 128_256


def kv_cache(keys: mx.array, values: mx.array) -> KVCache:
    """A real mlx-lm ``KVCache`` holding exactly ``keys.shape[2]`` tokens, as after a prefill."""
    cache = KVCache()
    cache.keys, cache.values, cache.offset = keys, values, keys.shape[2]
    return cache


class KVSource:
    """Random bf16 K/V for a token stream; ``caches(n)`` is its first ``n`` tokens,
    sharing the same bytes as every longer prefix (so dedup is real)."""

    def __init__(
        self,
        shape: Shape,
        keys: list[mx.array],
        values: list[mx.array],
        tokens: list[int],
    ):
        self.shape, self.keys, self.values, self.tokens = shape, keys, values, tokens

    @classmethod
    def random(cls, shape: Shape, n_tokens: int, seed: int) -> KVSource:
        """``n_tokens`` tokens of fresh random K/V and token ids."""
        key = mx.random.key(seed)
        dims = (1, shape.kv_heads, n_tokens, shape.head_dim)
        keys, values = [], []
        for layer_key in mx.random.split(key, shape.layers):
            k_key, v_key = mx.random.split(layer_key)
            keys.append(mx.random.normal(dims, key=k_key).astype(mx.bfloat16))
            values.append(mx.random.normal(dims, key=v_key).astype(mx.bfloat16))
        mx.eval(keys, values)
        tokens = np.random.default_rng(seed).integers(0, VOCAB, n_tokens).tolist()
        return cls(shape, keys, values, tokens)

    def extended(self, tail: KVSource) -> KVSource:
        """This stream followed by ``tail``: the prefix bytes are this stream's bytes."""
        keys = [mx.concatenate([a, b], axis=2) for a, b in zip(self.keys, tail.keys)]
        values = [
            mx.concatenate([a, b], axis=2) for a, b in zip(self.values, tail.values)
        ]
        mx.eval(keys, values)
        return KVSource(self.shape, keys, values, self.tokens + tail.tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def caches(self, n: int | None = None) -> list[KVCache]:
        """Real mlx-lm caches of the first ``n`` tokens (all when None)."""
        n = len(self) if n is None else n
        return [
            kv_cache(k[:, :, :n, :], v[:, :, :n, :])
            for k, v in zip(self.keys, self.values)
        ]

    def raw_bytes(self, n: int | None = None) -> bytes:
        """The K/V bytes of the first ``n`` tokens, concatenated (for the limits)."""
        parts = [
            np.asarray(x.view(mx.uint16)).tobytes()
            for c in self.caches(n)
            for x in (c.keys, c.values)
        ]
        return b"".join(parts)


def eval_caches(caches: Sequence[Any]) -> None:
    """Force every array of restored caches to be materialised."""
    mx.eval([c.state for c in caches])


def check_restored(caches: Sequence[Any], src: KVSource, n: int) -> None:
    """The restored caches hold exactly the source's first ``n`` tokens (bit for bit)."""
    assert len(caches) == src.shape.layers
    for c, k, v in zip(caches, src.keys, src.values):
        assert c.offset == n, f"restored {c.offset} tokens, expected {n}"
        assert mx.array_equal(c.keys[:, :, :n], k[:, :, :n]).item()
        assert mx.array_equal(c.values[:, :, :n], v[:, :, :n]).item()
