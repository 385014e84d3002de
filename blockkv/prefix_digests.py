"""Chained digests of block-aligned token prefixes: equal digests mean equal
prefixes, and a digest is a fixed few bytes whatever the prefix's length.

Digest *k* is a keyed blake3 of digest *k-1* and block *k*'s tokens (uint32
little-endian), cut to ``DIGEST_BYTES``, as vLLM chains its block hashes. A
node's catalog of the bucket's entries keeps one per block instead of the
tokens (remote/remote_catalog.py); a fleet's nodes publish them, salted, to say what
they hold without publishing tokens (``blockkv.wire.residency``). 8 bytes: a collision costs a
wrong candidate, which the exact comparison of tokens that follows rejects.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from blake3 import blake3

DIGEST_BYTES = 8
ROOT = bytes(DIGEST_BYTES)  # the parent of a prompt's first block, unless the caller roots it elsewhere


def chain_digests(tokens: Sequence[int] | np.ndarray, key: bytes, block_size: int, root: bytes = ROOT) -> list[bytes]:
    """The digest of every whole block-aligned prefix of ``tokens``, shortest
    first (``root``: the parent of the first block, e.g. a namespace's digest)."""
    raw = np.asarray(tokens, dtype="<u4").tobytes()
    step = 4 * block_size
    out: list[bytes] = []
    parent = root
    for start in range(0, len(raw) - step + 1, step):
        parent = blake3(parent + raw[start : start + step], key=key).digest(DIGEST_BYTES)
        out.append(parent)
    return out
