"""A drop-in for mlx-lm's ``LRUPromptCache`` that adds a disk tier.

mlx-lm's own RAM cache stays the hot tier (this class subclasses it, so every
eviction and trim rule is mlx-lm's). Each inserted entry is also handed to a
``BlockStore`` write-behind (``store_async``), so no request waits on disk; a
fetch the RAM tier cannot serve well falls back to the store, and a new
process on the same directory finds every entry again. One store is opened per
model key, with an identity hashed from that model's files and the KV
quantisation, so two models or two revisions never share entries.

The disk tier never raises into the caller: a cache object blockkv has no codec
for stays in the RAM tier (one warning per class), a store that cannot be
opened leaves its model RAM-only until a later use opens it, and a failing
read or write is a miss or a not-stored. An entry whose caches hold fewer
tokens than its key (a draft model's) or whose key names images is stored as
what the disk can hold exactly (``storable``). A restored cache list that does not fit the model's own layout
(``cache_fit``: a planted or imported entry of another model) is a miss too,
never handed to mlx-lm, whose generation thread would die on it. What the RAM
tier does is exactly what ``LRUPromptCache`` does.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, wait
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, cast

from mlx_lm.models.cache import LRUPromptCache

from blockkv import BlockStore
from blockkv.format.codec import codec_for, encode_cache, minimum_reusable_offset, record_offsets, trimmable
from blockkv.fs import FileLayer
from blockkv.local.locks import waiting_at_most
from blockkv.mlx_lm.budget import DiskShare
from blockkv.mlx_lm.cache_fit import ModelLayout
from blockkv.mlx_lm.identity import KVQuant, StoreIdentity, identity_from_key
from blockkv.mlx_lm.storable import storable, text_prefix_len
from blockkv.wire.residency import RESTORE_READ_PER_SAVED

__all__ = ["PersistentPromptCache"]

log = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 16 << 30
# A prompt segment's cache (mlx-lm's batched server inserts the prompt but its
# last token, cache_type "user", and a first turn's system prompt, "system")
# waits for its request's final cache instead of being written at once: that
# cache continues it and, trimmable, supersedes it on disk (the store's rule),
# so writing it is work thrown away (issue #45: half the spills). At most this
# many wait at once; the oldest beyond it is written.
HELD_SEGMENTS = 8


# A model key whose store could not be opened is tried again at its next use,
# at most this often: a first run opens before mlx-lm has downloaded the model.
RETRY_OPEN_S = 1.0
# A retried open runs on a request's path: it waits this long at most for any lock (the
# first open, before serving, waits as long as a store's open does). A process stopped
# inside the index then costs a request this, not the open's wait, each time it is tried.
RETRY_OPEN_WAIT = 0.1


@dataclass
class _OpenFailure:
    at: float  # time.monotonic() of the last try
    reason: str
    tries: int


class PersistentPromptCache(LRUPromptCache):
    """``LRUPromptCache`` (RAM, hot) over one ``BlockStore`` per model (disk, cold).

    ``max_size``/``max_bytes`` bound the RAM tier exactly as in mlx-lm;
    ``cache_bytes`` caps each model's store on disk: bytes, or a ``DiskShare``
    of the disk holding ``cache_dir``, read again at each store. ``kv`` and
    ``chat_template`` must match how the model is served (they are part of the
    store identity). ``identity`` maps a model key to a ``StoreIdentity``; the
    default hashes the files of the paths in mlx-lm's
    ``(model, adapter, draft_model)`` key. A disk match is restored only when it
    is at least ``min_restore_tokens`` long (default: one block,
    ``block_tokens``: reading a block to skip a few tokens of prefill costs more
    than it saves) and beats the RAM tier's answer by at least one token per
    ``RESTORE_READ_PER_SAVED`` it reads (a restore reads the whole prefix: a
    server was seen restoring 1,504 tokens to beat its RAM tier by one).
    ``fs`` is the stores' file layer (the fault-injection seam). ``remote``
    (``s3://bucket/prefix``) and ``remote_options`` go to every store: the
    fleet of servers on one bucket share their entries (docs/scale-out.md);
    ``cache_dir`` stays each server's own local tier. ``models`` maps a model
    key to its loaded model objects (the model, then its draft model, as
    mlx-lm's server concatenates their caches): a restored cache list is served
    only if it fits their layout; without ``models`` the caller vouches for
    every entry the store holds.

    ``isolate_namespaces`` opens the stores with blockkv's
    ``isolate_namespaces`` (no block shared between namespaces); a call made
    inside ``serving(ns)`` then reads and writes namespace ``ns`` only, in the
    RAM tier (mlx-lm's entries are keyed ``(model, ns)``) and on disk alike, so
    neither tier tells one namespace what another holds.
    """

    def __init__(
        self,
        max_size: int = 10,
        max_bytes: int = 1 << 63,
        *,
        cache_dir: str | Path,
        cache_bytes: int | DiskShare = DEFAULT_CACHE_BYTES,
        kv: KVQuant = KVQuant(),
        chat_template: str | None = None,
        block_tokens: int = 256,
        min_restore_tokens: int | None = None,
        identity: Callable[[Any], StoreIdentity] | None = None,
        fs: FileLayer | None = None,
        remote: str | None = None,
        remote_options: Mapping[str, str] | None = None,
        models: Callable[[Any], Sequence[Any] | None] | None = None,
        isolate_namespaces: bool = False,
    ) -> None:
        if not isinstance(cache_dir, (str, Path)):
            raise TypeError(f"cache_dir must be a str or Path, got {type(cache_dir).__name__}")
        check_remote(remote, remote_options)
        if not isinstance(cache_bytes, DiskShare) and (
                isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or cache_bytes <= 0):
            raise ValueError(f"cache_bytes must be a positive int or a DiskShare, got {cache_bytes!r}")
        if min_restore_tokens is None:
            min_restore_tokens = block_tokens
        if isinstance(min_restore_tokens, bool) or not isinstance(min_restore_tokens, int) or min_restore_tokens < 1:
            raise ValueError(f"min_restore_tokens must be an int >= 1, got {min_restore_tokens!r}")
        super().__init__(max_size, max_bytes)
        self.cache_dir = Path(cache_dir).expanduser()
        self.min_restore_tokens = min_restore_tokens
        self._cache_bytes = cache_bytes
        self._block_tokens = block_tokens
        self._fs = fs
        self._remote = remote
        self._remote_options = dict(remote_options) if remote_options is not None else None
        self._kv = kv
        self.isolate_namespaces = bool(isolate_namespaces)
        self._serving = threading.local()  # .ns: the namespace of the request this thread serves
        self._identity = identity or partial(identity_from_key, kv=kv, chat_template=chat_template)
        self._stores: dict[Any, BlockStore] = {}
        self._open_failures: dict[Any, _OpenFailure] = {}
        self._open_lock = threading.Lock()
        self._models = models
        self._layouts: dict[Any, ModelLayout | None] = {}
        self._pending: set[Future[bool]] = set()
        self._held: dict[tuple[str, tuple[int, ...]], tuple[Any, list[Any]]] = {}  # (ns, key) -> (model, cache)
        self._ram_only_kinds: set[tuple[type, ...]] = set()
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        # called with (tier, tokens, seconds) after each restore ("disk" or "bucket"), its
        # seconds from the lookup to the copy served: serve's /metrics, and the restore
        # times a node publishes to its router (node/journal.py)
        self.restore_observers: list[Callable[[str, int, float], None]] = []
        self._counts = dict.fromkeys(
            (
                "ram_hits",
                "disk_hits",
                "bucket_hits",
                "misses",
                "misfits",
                "tokens_from_ram",
                "tokens_from_disk",
                "tokens_from_bucket",
                "tokens_prefilled",
                "promoted_to_ram",
                "spills",
                "spills_skipped",
                "spills_superseded",
                "spills_not_uploaded",
                "spill_failures",
                "ram_only_inserts",
            ),
            0,
        )

    def __bool__(self) -> bool:
        """A cache object is always there to use, even while it holds nothing
        (``__len__`` alone would make ``if cache:`` skip an empty one)."""
        return True

    # -- the disk tier ----------------------------------------------------
    def store_for(self, model: Any) -> BlockStore | None:
        """The store for mlx-lm model key ``model`` (opened on first use); None
        while no identity can be made for the key or its directory cannot be
        opened: the model runs RAM-only meanwhile, and the open is tried again
        at its next use (at most every ``RETRY_OPEN_S``), for the life of the
        process: a first run's model is still downloading when serve starts."""
        store = self._stores.get(model)
        if store is not None:
            return store
        with self._open_lock:  # serve opens the default model's store on a thread of its own too
            store = self._stores.get(model)
            return store if store is not None else self._try_open(model)

    def _try_open(self, model: Any) -> BlockStore | None:
        failed = self._open_failures.get(model)
        if failed is not None and time.monotonic() - failed.at < RETRY_OPEN_S:
            return None
        try:
            with waiting_at_most(RETRY_OPEN_WAIT) if failed is not None else nullcontext():
                store = self._open_store(self._identity(model), self._remote)
        except Exception as e:  # noqa: BLE001 - any failure here only costs the disk tier, until it opens
            tries = failed.tries + 1 if failed is not None else 1
            self._open_failures[model] = _OpenFailure(time.monotonic(), str(e), tries)
            self._warn_once(f"open:{model!r}", "blockkv: cannot open cache %s for %r (%s); RAM-only for it until "
                            "it opens (tried again at its next use)", self.cache_dir, model, e)
            return None
        if failed is not None:
            log.info("blockkv: cache %s for %r opened after %d failed tries: its disk tier is on", self.cache_dir,
                     model, failed.tries)
            self._open_failures.pop(model, None)
        self._stores[model] = store
        return store

    def disk_tier(self, model: Any) -> tuple[str, str | None]:
        """Whether model key ``model`` has its disk tier now, without opening it:
        ``("on", None)``, ``("off", why)`` (its last open failed; tried again at
        its next use) or ``("not open yet", None)``."""
        if model in self._stores:
            return "on", None
        failed = self._open_failures.get(model)
        return ("off", failed.reason) if failed is not None else ("not open yet", None)

    def _open_store(self, ident: Any, remote: str | None) -> BlockStore:
        """The model's store; if its bucket refuses it (missing, another
        model's or a planted IDENTITY), the local tier alone, with one warning."""
        share = self._cache_bytes if isinstance(self._cache_bytes, DiskShare) else None
        opened: list[BlockStore] = []  # the share counts what the store holds, once it is open
        try:
            store = BlockStore(self.cache_dir, model_id=ident.model_id, config_fingerprint=ident.config_fingerprint,
                               tokenizer_hash=ident.tokenizer_hash,
                               max_bytes=share.floor if share is not None else cast(int, self._cache_bytes),
                               limit=share.limit(self.cache_dir, lambda: opened[0].total_bytes if opened else 0)
                               if share is not None else None,
                               block_tokens=self._block_tokens, fs=self._fs, remote=remote,
                               remote_options=self._remote_options if remote is not None else None,
                               isolate_namespaces=self.isolate_namespaces)
            opened.append(store)
            return store
        except (FileNotFoundError, ValueError) as e:
            if remote is None:
                raise
            log.warning("blockkv: the bucket %s refused the cache (%s); local disk tier only", remote, e)
            return self._open_store(ident, None)

    def stores(self) -> list[BlockStore]:
        """The stores opened so far, one per model key that has one."""
        return list(self._stores.values())

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def _warn_once(self, key: str, message: str, *args: object, level: int = logging.WARNING) -> None:
        """One warning per kind of trouble: a full disk must not flood the log."""
        with self._lock:
            first = key not in self._warned
            self._warned.add(key)
        log.log(level if first else logging.DEBUG, message, *args)

    @property
    def tier_stats(self) -> dict[str, int]:
        """Hits, restored tokens and spills per tier since construction."""
        with self._lock:
            return {**self._counts, "pending_spills": len(self._pending)}

    # -- namespaces -------------------------------------------------------------
    @contextmanager
    def serving(self, ns: str) -> Iterator[None]:
        """Lookups and inserts this thread makes meanwhile are namespace ``ns``'s
        (``isolate_namespaces`` only: without it every caller shares one cache)."""
        if not isinstance(ns, str):
            raise TypeError(f"ns must be a str, got {type(ns).__name__}")
        if ns and not self.isolate_namespaces:
            raise ValueError("a namespace of its own needs isolate_namespaces=True")
        previous = getattr(self._serving, "ns", "")
        self._serving.ns = ns
        try:
            yield
        finally:
            self._serving.ns = previous

    def _namespace(self, model: Any) -> tuple[Any, str]:
        """(mlx-lm's key for the RAM tier, the store's namespace) of a call now."""
        ns = getattr(self._serving, "ns", "")
        return ((model, ns) if ns else model), ns

    # -- LRUPromptCache interface ------------------------------------------
    def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[list[Any] | None, list[int]]:
        """mlx-lm's RAM lookup, then the store when its match is worth reading
        (long enough, and clearly longer than the RAM tier's).

        The disk tier holds caches, not logits: ``find`` caps a match at all but
        the last prompt token, so at least one token is always left to compute.
        A restored prefix is also inserted into the RAM tier, so the next
        session that shares it is served from RAM."""
        ram_key, ns = self._namespace(model)
        cache, rest = super().fetch_nearest_cache(ram_key, tokens)
        from_ram = len(tokens) - len(rest)
        restored = self._fetch_from_disk(model, tokens, from_ram, ram_key, ns)
        if restored is not None:
            self._count(tokens_prefilled=len(restored[1]))
            return restored
        if cache is None:
            self._count(misses=1, tokens_prefilled=len(rest))
        else:
            self._count(ram_hits=1, tokens_from_ram=from_ram, tokens_prefilled=len(rest))
        return cache, rest

    def _fetch_from_disk(
        self, model: Any, tokens: list[int], from_ram: int, ram_key: Any, ns: str
    ) -> tuple[list[Any], list[int]] | None:
        # the disk holds no image (storable.py): an image prompt is looked up by its text before the first one
        searchable = list(tokens[: text_prefix_len(tokens)])
        # find leaves at least one token to compute, so len(searchable) - 1 is the most it can match
        if not self._worth_restoring(len(searchable) - 1, from_ram):
            return None
        started = time.perf_counter()
        try:
            store = self.store_for(model)
            match = store.find(searchable, ns) if store is not None else None
            if store is None or match is None or not self._worth_restoring(match.prefix_len, from_ram):
                return None
            tier = store.tier_of(match.entry)
            loaded = store.restore(match.entry, prefix_len=match.prefix_len)
            if loaded is None:
                return None
            misfit = self._misfit(model, loaded.caches, match.prefix_len)
            if misfit is not None:
                self._count(misfits=1)
                self._warn_once("misfit", "blockkv: entry %s does not fit the model (%s); served without it",
                                match.entry.id, misfit)
                return None
            prefix = list(tokens[: match.prefix_len])
            # Into mlx-lm's RAM tier by mlx-lm's own rules; the caller gets a copy
            # to extend in place, as from any RAM hit.
            super().insert_cache(ram_key, prefix, loaded.caches)
            served = copy.deepcopy(loaded.caches)
            seconds = time.perf_counter() - started
        except Exception as e:  # noqa: BLE001 - the disk tier must never fail a request
            self._warn_once(f"fetch:{type(e).__name__}", "blockkv: disk lookup failed (%s); served without it", e)
            return None
        self._count(**{f"{tier}_hits": 1, f"tokens_from_{tier}": match.prefix_len}, promoted_to_ram=1)
        for observe in self.restore_observers:
            observe(tier, match.prefix_len, seconds)
        log.info(
            "blockkv: restored %d of %d prompt tokens from %s (kept in the RAM tier for the next session)",
            match.prefix_len, len(tokens), "the bucket" if tier == "bucket" else "disk",
        )
        return served, tokens[match.prefix_len :]

    def _misfit(self, model: Any, caches: list[Any], prefix_len: int) -> str | None:
        """Why restored ``caches`` do not fit the ``prefix_len`` tokens they are
        served for (a planted header's tokens can outrun its caches: mlx-lm would
        skip the difference) or the model of key ``model`` (None: they fit; the
        model's layout is checked only with ``models``, made once per key, and
        one that cannot be made refuses every restore)."""
        held = record_offsets([encode_cache(c, data=False) for c in caches])
        if held and held != {prefix_len}:
            return f"its caches hold {'/'.join(map(str, sorted(held)))} tokens, its match {prefix_len}"
        if self._models is None:
            return None
        if model not in self._layouts:
            loaded = self._models(model)
            if not loaded:
                return "the model is not loaded"
            self._layouts[model] = None  # a probe that raises is not retried on every request
            self._layouts[model] = ModelLayout(loaded, self._kv)
        layout = self._layouts[model]
        return "the model's layout is unknown" if layout is None else layout.misfit(caches)

    def _worth_restoring(self, prefix_len: int, from_ram: int) -> bool:
        """A disk match of ``prefix_len`` tokens against the RAM tier's ``from_ram``:
        at least ``min_restore_tokens`` long, and saving at least one token of
        prefill per ``RESTORE_READ_PER_SAVED`` it reads (a restore reads the whole
        prefix, so one that barely beats the RAM tier costs more than it saves)."""
        saved = prefix_len - from_ram
        return prefix_len >= self.min_restore_tokens and saved > 0 and saved * RESTORE_READ_PER_SAVED >= prefix_len

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
        later in-place cache updates cannot change what is written. A prompt
        segment's cache (``cache_type`` other than "assistant") is held until
        its request's final cache, which supersedes it (``HELD_SEGMENTS``). A
        cache list with a class blockkv cannot encode stays in the RAM tier only."""
        ram_key, ns = self._namespace(model)
        super().insert_cache(ram_key, tokens, prompt_cache, cache_type=cache_type)
        if not tokens:
            return
        self._spill_safely(model, list(tokens), prompt_cache, ns, cache_type)

    def _spill_safely(self, model: Any, key: list[int], prompt_cache: list[Any], ns: str,
                      cache_type: str = "assistant") -> None:
        """``_spill``, with what fails kept from the caller: a class with no codec
        makes its cache lists RAM-only (one warning), anything else is a spill failure."""
        kinds = tuple(type(c) for c in prompt_cache)
        if kinds in self._ram_only_kinds:
            self._count(ram_only_inserts=1)
            return
        try:
            self._spill(model, key, prompt_cache, ns, cache_type)
        except Exception as e:  # noqa: BLE001 - the disk tier must never fail a request
            unknown = _classes_without_codec(prompt_cache)
            if unknown:
                self._ram_only_kinds.add(kinds)
                self._count(ram_only_inserts=1)
                for name in unknown:
                    self._warn_once(
                        f"codec:{name}",
                        "blockkv: no codec for cache class %s; such entries stay in the RAM tier only",
                        name,
                    )
            else:
                self._count(spill_failures=1)
                self._warn_once(f"spill:{type(e).__name__}", "blockkv: spilling a prompt cache failed: %s", e)

    def _spill(self, model: Any, key: list[int], prompt_cache: list[Any], ns: str, cache_type: str) -> None:
        store = self.store_for(model)
        if store is None:
            return
        if cache_type != "assistant":  # a prompt segment: held for the final cache that continues it
            self._hold(model, key, prompt_cache, ns)
            return
        self._settle_held(model, key, prompt_cache, ns)
        if text_prefix_len(key) < len(key):
            self._warn_once("image", "blockkv: image prompts are stored on disk up to their first image only: an "
                            "image's KV stays in the RAM tier (docs/mlx-lm.md)", level=logging.INFO)
        kept = storable(key, prompt_cache)
        if kept is None:
            self._count(ram_only_inserts=1)
            return
        key, prompt_cache = kept
        if store.find_exact(key, ns) is not None:
            self._count(spills_skipped=1)
            return
        future = store.store_async(key, prompt_cache, ns)
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(partial(self._spilled, store, key, ns))

    def _hold(self, model: Any, key: list[int], prompt_cache: list[Any], ns: str) -> None:
        """Keep a prompt segment's cache back (``HELD_SEGMENTS``); mlx-lm never
        changes a cache once inserted (it hands out deep copies), so holding
        the reference holds what was inserted."""
        with self._lock:
            self._held[(ns, tuple(key))] = (model, prompt_cache)
            overflow = list(self._held.items())[: max(0, len(self._held) - HELD_SEGMENTS)]
            for k, _ in overflow:
                del self._held[k]
        for (held_ns, held_key), (held_model, held_cache) in overflow:
            self._spill_safely(held_model, list(held_key), held_cache, held_ns)

    def _settle_held(self, model: Any, key: list[int], prompt_cache: list[Any], ns: str) -> None:
        """The held segments this final cache continues: superseded (dropped) if
        it is trimmable down to them, as the store would remove them once it
        lands; written otherwise."""
        tokens = tuple(key)
        with self._lock:
            continued = [(k, v) for k, v in self._held.items()
                         if k[0] == ns and v[0] == model and tokens[: len(k[1])] == k[1]]
            for k, _ in continued:
                del self._held[k]
        if not continued:
            return
        supersedes = trimmable(prompt_cache)
        floor = minimum_reusable_offset(prompt_cache) if supersedes else 0
        for (held_ns, held_key), (held_model, held_cache) in continued:
            if supersedes and floor <= len(held_key):
                self._count(spills_superseded=1)
            else:
                self._spill_safely(held_model, list(held_key), held_cache, held_ns)

    def _write_held(self) -> None:
        """Every held segment written (no final cache came, or a flush asks for everything)."""
        with self._lock:
            held, self._held = self._held, {}
        for (ns, key), (model, cache) in held.items():
            self._spill_safely(model, list(key), cache, ns)

    def _spilled(self, store: BlockStore, key: list[int], ns: str, future: Future[bool]) -> None:
        with self._lock:
            self._pending.discard(future)
        error = future.exception() if not future.cancelled() else None
        if error is not None:
            self._warn_once(f"spill:{type(error).__name__}", "blockkv: spilling a prompt cache failed: %s", error)
        if error is None and not future.cancelled() and future.result():
            self._count(spills=1)
        elif error is None and not future.cancelled() and store.remote is not None and self._kept(store, key, ns):
            self._count(spills=1, spills_not_uploaded=1)  # the bucket did not acknowledge it: stored locally
        else:
            self._count(spill_failures=1)

    def _kept(self, store: BlockStore, key: list[int], ns: str) -> bool:
        """Whether the local tier holds the entry a spill the bucket did not take was for."""
        try:
            match = store.find_exact(key, ns)
            return match is not None and store.tier_of(match.entry) == "disk"  # another node's copy is not ours
        except Exception:  # noqa: BLE001 - a store that cannot say: not stored
            return False

    # -- lifetime -----------------------------------------------------------
    def flush(self) -> None:
        """Write every held prompt segment, then wait until every spill started
        so far is on disk (or has failed)."""
        self._write_held()
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


def check_remote(remote: str | None, remote_options: Mapping[str, str] | None) -> None:
    """Refuse a wrong ``remote``/``remote_options`` when the cache is made: a
    store opened later would only log it and leave the model RAM-only."""
    if remote is None:
        if remote_options is not None:
            raise ValueError("remote_options given without remote")
        return
    if not isinstance(remote, str):
        raise TypeError(f"remote must be an s3://bucket/prefix string, got {type(remote).__name__}")
    from blockkv.pool.s3 import parse_url
    from blockkv.remote.options import (
        split_options,  # needs obstore: pip install 'blockkv[s3]'
    )

    parse_url(remote)
    split_options(remote_options)


def _classes_without_codec(prompt_cache: list[Any]) -> list[str]:
    """Names of the cache classes in a list that blockkv has no codec for."""
    unknown: list[str] = []
    for c in prompt_cache:
        try:
            codec_for(c)
        except TypeError:
            if type(c).__name__ not in unknown:
                unknown.append(type(c).__name__)
    return unknown
