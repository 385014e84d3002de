"""A drop-in for mlx-lm's ``LRUPromptCache`` that adds a disk tier.

mlx-lm's own RAM cache stays the hot tier (this class subclasses it, so every
eviction and trim rule is mlx-lm's). Each inserted entry is also handed to a
``BlockStore`` write-behind (``store_async``), so no request waits on disk; a
fetch the RAM tier cannot serve well falls back to the store, and a new
process on the same directory finds every entry again. One store is opened per
model key, with an identity hashed from that model's files and the KV
quantisation, so two models or two revisions never share entries.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, wait
from functools import partial
from pathlib import Path
from typing import Any

from mlx_lm.models.cache import LRUPromptCache

from blockkv import BlockStore
from blockkv.fs import FileLayer
from blockkv.identity import KVQuant, StoreIdentity, identity_from_key

__all__ = ["PersistentPromptCache"]

log = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 16 << 30


def _text_only(tokens: list[int]) -> bool:
    """mlx-lm's server keys image prompts with negative per-image ids: their
    caches depend on pixels the key only names, so they stay in RAM."""
    return min(tokens) >= 0


class PersistentPromptCache(LRUPromptCache):
    """``LRUPromptCache`` (RAM, hot) over one ``BlockStore`` per model (disk, cold).

    ``max_size``/``max_bytes`` bound the RAM tier exactly as in mlx-lm;
    ``cache_bytes`` caps each model's store on disk. ``kv`` and
    ``chat_template`` must match how the model is served (they are part of the
    store identity). ``identity`` maps a model key to a ``StoreIdentity``; the
    default hashes the files of the paths in mlx-lm's
    ``(model, adapter, draft_model)`` key. ``fs`` is the stores' file layer
    (the fault-injection seam).
    """

    def __init__(
        self,
        max_size: int = 10,
        max_bytes: int = 1 << 63,
        *,
        cache_dir: str | Path,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        kv: KVQuant = KVQuant(),
        chat_template: str | None = None,
        block_tokens: int = 256,
        identity: Callable[[Any], StoreIdentity] | None = None,
        fs: FileLayer | None = None,
    ) -> None:
        if not isinstance(cache_dir, (str, Path)):
            raise TypeError(f"cache_dir must be a str or Path, got {type(cache_dir).__name__}")
        if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or cache_bytes <= 0:
            raise ValueError(f"cache_bytes must be a positive int, got {cache_bytes!r}")
        super().__init__(max_size, max_bytes)
        self.cache_dir = Path(cache_dir).expanduser()
        self._cache_bytes = cache_bytes
        self._block_tokens = block_tokens
        self._fs = fs
        self._identity = identity or partial(identity_from_key, kv=kv, chat_template=chat_template)
        self._stores: dict[Any, BlockStore | None] = {}
        self._pending: set[Future[bool]] = set()
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(
            (
                "ram_hits",
                "disk_hits",
                "misses",
                "tokens_from_ram",
                "tokens_from_disk",
                "spills",
                "spills_skipped",
                "spill_failures",
            ),
            0,
        )

    # -- the disk tier ----------------------------------------------------
    def store_for(self, model: Any) -> BlockStore | None:
        """The store for mlx-lm model key ``model`` (opened on first use); None
        if its directory cannot be opened, and the model then runs RAM-only."""
        if model not in self._stores:
            ident = self._identity(model)
            try:
                self._stores[model] = BlockStore(
                    self.cache_dir,
                    model_id=ident.model_id,
                    config_fingerprint=ident.config_fingerprint,
                    tokenizer_hash=ident.tokenizer_hash,
                    max_bytes=self._cache_bytes,
                    block_tokens=self._block_tokens,
                    fs=self._fs,
                )
            except OSError as e:
                log.warning("blockkv: cannot open cache %s (%s); RAM-only for %r", self.cache_dir, e, model)
                self._stores[model] = None
        return self._stores[model]

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    @property
    def tier_stats(self) -> dict[str, int]:
        """Hits, restored tokens and spills per tier since construction."""
        with self._lock:
            return {**self._counts, "pending_spills": len(self._pending)}

    # -- LRUPromptCache interface ------------------------------------------
    def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[list[Any] | None, list[int]]:
        """mlx-lm's RAM lookup, then the store when it restores a longer prefix.

        The disk tier holds caches, not logits: ``find`` caps a match at all but
        the last prompt token, so at least one token is always left to compute."""
        cache, rest = super().fetch_nearest_cache(model, tokens)
        from_ram = len(tokens) - len(rest)
        if from_ram < len(tokens) - 1 and _text_only(tokens):
            store = self.store_for(model)
            match = store.find(tokens) if store is not None else None
            if store is not None and match is not None and match.prefix_len > from_ram:
                loaded = store.restore(match.entry, prefix_len=match.prefix_len)
                if loaded is not None:
                    self._count(disk_hits=1, tokens_from_disk=match.prefix_len)
                    log.info(
                        "blockkv: restored %d of %d prompt tokens from disk", match.prefix_len, len(tokens)
                    )
                    return loaded.caches, tokens[match.prefix_len :]
        if cache is None:
            self._count(misses=1)
        else:
            self._count(ram_hits=1, tokens_from_ram=from_ram)
        return cache, rest

    def insert_cache(
        self,
        model: Any,
        tokens: list[int],
        prompt_cache: list[Any],
        *,
        cache_type: str = "assistant",
    ) -> None:
        """Insert into the RAM tier, then spill to disk write-behind.

        ``store_async`` snapshots the arrays before returning, so the caller's
        later in-place cache updates cannot change what is written."""
        super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
        if not tokens or not _text_only(tokens):
            return
        store = self.store_for(model)
        if store is None:
            return
        key = list(tokens)
        if store.find_exact(key) is not None:
            self._count(spills_skipped=1)
            return
        future = store.store_async(key, prompt_cache)
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._spilled)

    def _spilled(self, future: Future[bool]) -> None:
        with self._lock:
            self._pending.discard(future)
        error = future.exception() if not future.cancelled() else None
        if error is not None:
            log.warning("blockkv: spilling a prompt cache failed: %s", error)
        if error is None and not future.cancelled() and future.result():
            self._count(spills=1)
        else:
            self._count(spill_failures=1)

    # -- lifetime -----------------------------------------------------------
    def flush(self) -> None:
        """Wait until every spill started so far is on disk (or has failed)."""
        with self._lock:
            pending = list(self._pending)
        wait(pending)

    def close(self) -> None:
        """Flush the write-behind queue and close every store."""
        self.flush()
        for store in self._stores.values():
            if store is not None:
                store.close()
        self._stores.clear()

    def __enter__(self) -> PersistentPromptCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
