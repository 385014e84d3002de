"""The checks a caller's arguments pass before the store does anything (and
the handle's own: closed, or inherited through fork): wrong
arguments raise ValueError/TypeError naming the problem, while failures of
the disk never raise (they degrade to a miss or "not stored"). A store's
caches are captured here too (``prepare_store``): only they say whether the
tokens are the ones the caches were filled with."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import mlx.core as mx
import numpy as np

from blockkv.format.blocks import Snapshot, snapshot
from blockkv.format.codec import record_offsets
from blockkv.records import CHECKPOINT_NS, Entry, GenerationCheckpoint

MAX_NS_BYTES = 1024  # a namespace names a tenant or session, not a payload
MAX_TOKEN = (1 << 32) - 1
_T = TypeVar("_T")


def open_only(method: Callable[..., _T]) -> Callable[..., _T]:
    """Refuse a call on a closed handle, or on one inherited through fork (LMDB
    and flock state do not survive fork: the child must open its own)."""

    @functools.wraps(method)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> _T:
        if self._closed:
            raise ValueError("store is closed")
        if os.getpid() != self._pid:
            raise RuntimeError(f"this BlockStore was opened in process {self._pid} and used in a child "
                               f"created by fork ({os.getpid()}): open a new BlockStore in the child")
        return method(self, *args, **kwargs)

    return guarded


def check_options(*, model_id: str, config_fingerprint: str, tokenizer_hash: str, max_bytes: int,
                  limit: Callable[[], int] | None, block_tokens: int, compression: str | None,
                  verify: bool | str, gc_grace: float, tmp_grace: float, lock_timeout: float,
                  isolate_namespaces: bool, namespace_share: float | None) -> None:
    """The options of ``BlockStore(...)``."""
    for name, value in (("model_id", model_id), ("config_fingerprint", config_fingerprint),
                        ("tokenizer_hash", tokenizer_hash)):
        if not isinstance(value, str) or not value:
            raise TypeError(f"{name} must be a non-empty str, got {value!r}")
    check_size("max_bytes", max_bytes)
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens <= 0:
        raise ValueError(f"block_tokens must be a positive int, got {block_tokens!r}")
    if compression not in (None, "zstd"):
        raise ValueError(f"compression must be None or 'zstd', got {compression!r}")
    if verify not in (True, False, "full"):
        raise ValueError(f"verify must be True (xxh3-128 per read), 'full' (blake3 per read) or False, got {verify!r}")
    if limit is not None and not callable(limit):
        raise TypeError("limit must be a callable returning the live byte cap")
    for name, value in (("gc_grace", gc_grace), ("tmp_grace", tmp_grace), ("lock_timeout", lock_timeout)):
        if not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{name} must be a non-negative number of seconds, got {value!r}")
    if not isinstance(isolate_namespaces, bool):
        raise TypeError(f"isolate_namespaces must be a bool, got {type(isolate_namespaces).__name__}")
    if namespace_share is not None and (isinstance(namespace_share, bool)
                                        or not isinstance(namespace_share, (int, float))
                                        or not 0 < namespace_share <= 1):
        raise ValueError(f"namespace_share must be a fraction in (0, 1], got {namespace_share!r}")


def tokens_array(tokens: Sequence[int]) -> np.ndarray:
    """Tokens as uint32, or a TypeError/ValueError naming what is wrong."""
    if isinstance(tokens, mx.array):  # what MLX users hold; same rules as a numpy array
        tokens = np.array(tokens)
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise TypeError(f"tokens must be a 1-D sequence of ints, got an array of {tokens.dtype} {tokens.shape}")
        arr = tokens
    else:
        if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
            raise TypeError(f"tokens must be a sequence of ints, got {type(tokens).__name__}")
        for t in tokens:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise TypeError(f"tokens must be ints, got {type(t).__name__} {t!r}")
        arr = np.array(tokens, dtype=np.int64) if tokens else np.empty(0, np.int64)
    if len(arr) and (arr.min() < 0 or arr.max() > MAX_TOKEN):
        raise ValueError("token ids must be in [0, 2**32)")
    return np.ascontiguousarray(arr, dtype=np.uint32)


def check_ns(ns: str, *, reserved_ok: bool = False) -> None:
    """A caller's namespace: a str of at most MAX_NS_BYTES UTF-8 bytes, not reserved."""
    if not isinstance(ns, str):
        raise TypeError(f"ns must be a str, got {type(ns).__name__}")
    try:
        size = len(ns.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ValueError(f"ns must be encodable as UTF-8 ({exc.reason} at index {exc.start})") from None
    if size > MAX_NS_BYTES:
        raise ValueError(f"ns is {size} bytes of UTF-8; at most {MAX_NS_BYTES} are allowed")
    if not reserved_ok and ns.startswith(CHECKPOINT_NS):
        raise ValueError(f"ns may not start with {CHECKPOINT_NS!r}: reserved for generation checkpoints")


def check_size(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int number of bytes, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def check_prefix_len(entry: Entry, prefix_len: int | None) -> int:
    if prefix_len is None:
        return entry.length
    if isinstance(prefix_len, bool) or not isinstance(prefix_len, int):
        raise TypeError(f"prefix_len must be an int, got {type(prefix_len).__name__}")
    if not 0 < prefix_len <= entry.length:
        raise ValueError(f"prefix_len must be in [1, {entry.length}], got {prefix_len}")
    if prefix_len < entry.length and not entry.trimmable:
        raise ValueError("prefix_len cuts an entry whose caches cannot be trimmed")
    if prefix_len < entry.minimum_reusable_offset:
        raise ValueError(f"prefix_len {prefix_len} is below the entry's minimum reusable offset "
                         f"{entry.minimum_reusable_offset}")
    return prefix_len


def prepare_store(tokens: Sequence[int], caches: Sequence[Any], ns: str, attachments: Mapping[str, Any] | None,
                  checkpoint: GenerationCheckpoint | None) -> tuple[np.ndarray, str, Snapshot, GenerationCheckpoint | None]:
    """Validate arguments and capture the tensors on the caller's thread (bad
    input raises here). Capturing is cheap; the host copy and hashing happen
    in ``Commits.store``, which ``store_async`` runs on its worker thread."""
    arr = tokens_array(tokens)
    check_ns(ns, reserved_ok=checkpoint is not None)
    if not len(arr):
        raise ValueError("tokens is empty: there is no prompt to store")
    if isinstance(caches, (str, bytes)) or not isinstance(caches, Sequence):
        raise TypeError(f"caches must be a list of mlx-lm cache objects, got {type(caches).__name__}")
    if not caches:
        raise ValueError("caches is empty: pass the model's cache list (one per layer)")
    if attachments is not None and not isinstance(attachments, Mapping):
        raise TypeError("attachments must be a mapping of name to mx.array")
    snap = snapshot(list(caches), attachments)
    counts = record_offsets(snap.records)
    if counts and counts != {len(arr)}:  # restoring it would hand mlx-lm a cache that is not the prompt's
        raise ValueError(f"{len(arr)} tokens but the caches hold {' / '.join(map(str, sorted(counts)))} "
                         "tokens: pass exactly the tokens the caches were filled with")
    return arr, ns, snap, checkpoint
