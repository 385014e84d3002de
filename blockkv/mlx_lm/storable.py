"""What of an mlx-lm prompt-cache entry the disk tier can hold exactly.

A stored entry is a token list and caches holding exactly those tokens (the
store refuses anything else: restoring it would hand mlx-lm a cache that is
not the prompt's). mlx-lm's server inserts two kinds of entries that are not:

- with ``--draft-model`` the draft model's caches (appended to the model's)
  are one token behind the model's, so the entry's caches disagree on its
  length;
- an image prompt's key carries each image as negative ids (60 bits of its
  data URL's sha256), which name pixels the tokens do not hold.

Both keep what they can: the longest prefix every cache holds, and no token
past the first image. Caches longer than that prefix are cut back on shallow
copies (mlx-lm's ``trim`` only moves an offset), so mlx-lm's RAM entry is
untouched; an entry that cannot be cut (an SSM state, a wrapped window) is
not stored.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from blockkv.format.codec import codec_named, encode_cache


def text_prefix_len(tokens: Sequence[int]) -> int:
    """How many tokens come before the first image id (a negative one)."""
    return next((i for i, t in enumerate(tokens) if t < 0), len(tokens))


def storable(tokens: list[int], caches: list[Any]) -> tuple[list[int], list[Any]] | None:
    """``(tokens, caches)`` cut to what the disk can hold exactly, or None if
    nothing can be. Caches without a codec are returned as they are, for the
    store to refuse (the caller keeps such kinds in the RAM tier)."""
    try:
        records = [encode_cache(c, data=False) for c in caches]
    except (TypeError, ValueError):
        return tokens, caches
    offsets = [codec_named(r.kind).offset(r) for r in records]
    held = [o for o in offsets if o is not None]
    keep = min([text_prefix_len(tokens), *held])
    if keep == len(tokens) and all(o == keep for o in held):
        return tokens, caches
    if keep <= 0 or len(held) < len(offsets):  # a state without an offset holds every token of the key: no cut
        return None
    cut = [_cut_copy(c, offset - keep) for c, offset in zip(caches, held)]
    if any(c is None for c in cut):
        return None
    return tokens[:keep], cut


def _cut_copy(cache: Any, n: int) -> Any | None:
    """``cache`` less its last ``n`` tokens, on a copy sharing its arrays; None if it cannot be cut."""
    if n == 0:
        return cache
    if hasattr(cache, "caches") or not cache.is_trimmable():  # a CacheList's copy would share its children
        return None
    cut = copy.copy(cache)
    return cut if cut.trim(n) == n else None
