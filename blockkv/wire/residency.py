"""Salted digests of block-aligned token prefixes: how a fleet's nodes say
what they hold and how its router asks, without either side publishing tokens.

A prompt's blocks are ``block_size`` tokens each; digest *k* is a keyed blake3
of digest *k-1* and block *k*'s tokens (uint32 little-endian), cut to 8 bytes,
chained as vLLM chains its block hashes: equal digests mean equal prefixes, and
a digest says nothing about the tokens to anyone without the key. The key is
derived from the fleet's salt (``--fleet-salt``, shared by every node and the
router), so digests of a well-known system prompt cannot be looked up in a
table made without it, nor compared across fleets.

8 bytes: a collision costs a misrouted request (the node itself decides what it
restores, by its own exact lookup), never a wrong answer.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
from blake3 import blake3

from blockkv.prefix_digests import DIGEST_BYTES, chain_digests

MEDIA = ("RAM", "DISK")  # the tiers a node publishes: mlx-lm's prompt cache, its local store
MAX_WAIT_S = 30.0  # the longest long poll of /blockkv/events a node holds open
BLOCK_SIZE = 32  # tokens per digest: a turn is rarely shorter, and a long prompt is a few hundred digests
SALT_ENV = "BLOCKKV_FLEET_SALT"
# What a node restores, which its router must predict: restoring a token from
# disk costs a small fraction of prefilling it (issue 16 measured a 1,835-token
# prompt: 0.13 s restored, 7.3 s prefilled, 56x), so a node's cache restores a
# prefix when it saves one token of prefill per 16 it reads, with margin.
RESTORE_READ_PER_SAVED = 16
RESTORE_TIERS = ("disk", "bucket")  # the tiers whose restore times a node publishes (``restored``)
_CONTEXT = "blockkv 2026 fleet residency digests v1"


def digest_key(salt: str | None) -> bytes:
    """The 32-byte digest key of a fleet: ``salt``, else ``$BLOCKKV_FLEET_SALT``, else empty."""
    if salt is None:
        salt = os.environ.get(SALT_ENV, "")
    if not isinstance(salt, str):
        raise TypeError(f"the fleet salt must be a str, got {type(salt).__name__}")
    return blake3(salt.encode(), derive_key_context=_CONTEXT).digest()


def namespace_key(key: bytes, ns: str) -> bytes:
    """The digest key of namespace ``ns``'s entries (per-key caches): derived
    from the fleet's ``key`` and the namespace, so a key's digests match only
    that key's prompts; ``key`` itself for the shared namespace ``""``."""
    return blake3(ns.encode(), key=key).digest() if ns else key


def salt_check(key: bytes) -> str:
    """A value two parties compare to learn whether they share a key (it reveals nothing of it)."""
    return blake3(b"salt check", key=key).hexdigest(DIGEST_BYTES)


def prefix_digests(tokens: Sequence[int] | np.ndarray, key: bytes, block_size: int = BLOCK_SIZE) -> list[str]:
    """Hex digests of every whole block-aligned prefix of ``tokens``, shortest
    first (``blockkv/prefix_digests.py``, which a node's remote catalog uses too)."""
    return [d.hex() for d in chain_digests(tokens, key, block_size)]


def is_digest(value: object) -> bool:
    """A well-formed digest as published (16 lowercase hex characters)."""
    return (isinstance(value, str) and len(value) == 2 * DIGEST_BYTES
            and all(c in "0123456789abcdef" for c in value))
