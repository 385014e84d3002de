"""``blockkv serve --per-key-cache``: each API key's requests read and write
only that key's prompt cache, so no tenant learns from ``cached_tokens`` or
the time to a first token what another sent, and requests of different keys
still run in one batch.

The request handler tags each completion request with its key's namespace
(``auth.namespace_of``: a digest, not the key). mlx-lm's generation thread
makes five prompt-cache calls, none saying which request it serves; a
``Tenancy`` follows the requests through that thread so each call finds its
namespace:

- a lookup: the request mlx-lm tokenized last (``_tokenize`` runs right before
  each lookup, on the batched path and the sequential one);
- a save from the batch (end of a system/user segment, end of a request): the
  batch generator's uid of the cache list it hands out
  (``attributing_batch_generator`` remembers each uid's namespace when the
  request joins the batch, and names the owner of every list it returns);
- a save on the sequential path (requests with images, a seed, a draft
  model, KV quantisation): the request ``_serve_single`` is serving.

``PerKeyPromptCache`` then serves each call inside ``serving(ns)``, where the
RAM tier keys entries ``(model, ns)`` and the stores run with
``isolate_namespaces``. A call no request can be found for is a miss and is
not stored (one warning): a cache is never served or saved under a guess.
``hooks.py`` puts these in place only on mlx-lm versions whose generation
loop was checked to make its calls this way (``BATCHED_MLX_LM``); on others
every request is served alone, as before.
"""

from __future__ import annotations

import argparse
import logging
import threading
from collections.abc import Callable
from typing import Any

from blockkv import BlockStore
from blockkv.node.residency_endpoint import ResidentPromptCache
from blockkv.wire.auth import TENANT_HEADER, ApiKeys, is_key_namespace, namespace_of

log = logging.getLogger(__name__)

NAMESPACE_ATTRIBUTE = "blockkv_namespace"
# what /metrics counts per key: the lookup's counters of PersistentPromptCache.tier_stats
KEY_COUNTS = ("ram_hits", "disk_hits", "bucket_hits", "misses", "tokens_from_ram", "tokens_from_disk",
              "tokens_from_bucket", "tokens_prefilled")
SHARED_NAMESPACE = ""  # the operator's (blockkv warm --shared): read by every key, written by none
DEFAULT_KEY_SHARE = 0.5  # the most of the RAM tier's entries and of the disk cap one key holds
# mlx-lm releases whose ResponseGenerator._generate was read and tested with the hooks below:
# [first, past the last) as version tuples
BATCHED_MLX_LM = ((0, 32, 2), (0, 33))


def parse_share(text: str) -> float:
    """``--key-share``: a fraction (``0.25``) or a percentage (``25%``) in (0, 1]."""
    try:
        share = float(text[:-1]) / 100 if text.strip().endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a fraction or a percentage: {text!r}") from None
    if not 0 < share <= 1:
        raise argparse.ArgumentTypeError(f"a share must be above 0 and at most 100%, got {text!r}")
    return share


def batching_supported(version: str) -> bool:
    """Whether per-key caches may keep mlx-lm ``version``'s batching (``BATCHED_MLX_LM``)."""
    try:
        parsed = tuple(int(part) for part in version.split(".")[:3])
    except ValueError:
        return False
    return BATCHED_MLX_LM[0] <= parsed < BATCHED_MLX_LM[1]


class Tenancy:
    """Which key's namespace each prompt-cache call of mlx-lm's generation thread is for."""

    def __init__(self) -> None:
        self._local = threading.local()  # .request: the namespace last tokenized; .single: the one served alone
        self._owned: dict[int, tuple[Any, str | None]] = {}  # id(cache list) -> (the list, its namespace)
        self._lock = threading.Lock()

    def tokenized(self, request: Any) -> None:
        """mlx-lm tokenized ``request``: the next lookup on this thread is its key's."""
        self._local.request = getattr(request, NAMESPACE_ATTRIBUTE, None)

    def request_namespace(self) -> str | None:
        """The namespace of the request this thread tokenized last (None: untagged)."""
        return getattr(self._local, "request", None)

    def serving_alone(self, ns: str | None) -> None:
        """``_serve_single`` serves a request of ``ns`` now (None: it is done)."""
        self._local.single = ns

    def own(self, cache: Any, ns: str | None) -> None:
        """The batch generator handed out ``cache`` (a cache list) of a request of ``ns``."""
        with self._lock:
            self._owned[id(cache)] = (cache, ns)

    def forget_owned(self) -> None:
        """A new batch step: every list handed out by the last one was saved by now."""
        with self._lock:
            self._owned.clear()

    def owner(self, cache: Any) -> str | None:
        """The namespace ``cache`` is saved under: its batch request's, else the
        request served alone now, else None."""
        with self._lock:
            owned = self._owned.pop(id(cache), None)
        if owned is not None and owned[0] is cache:
            return owned[1]
        return getattr(self._local, "single", None)


class PerKeyPromptCache(ResidentPromptCache):
    """A ``ResidentPromptCache`` serving each call in the namespace ``tenancy``
    finds for it, each key holding at most ``key_share`` of the RAM tier's
    entries (``max_size``, at least one) and of each store's byte cap, so that
    one key's requests evict that key's least recently used entries, never
    everyone's."""

    def __init__(self, *args: Any, tenancy: Tenancy, key_share: float = DEFAULT_KEY_SHARE, **kwargs: Any) -> None:
        if isinstance(key_share, bool) or not isinstance(key_share, (int, float)) or not 0 < key_share <= 1:
            raise ValueError(f"key_share must be a fraction in (0, 1], got {key_share!r}")
        super().__init__(*args, isolate_namespaces=True, **kwargs)
        self.tenancy = tenancy
        self.key_share = float(key_share)
        self._by_key: dict[str, dict[str, int]] = {}  # namespace -> KEY_COUNTS

    def key_stats(self) -> dict[str, dict[str, int]]:
        """``KEY_COUNTS`` of each namespace's lookups since the start."""
        with self._lock:
            return {ns: dict(counts) for ns, counts in self._by_key.items()}

    def store_for(self, model: Any) -> BlockStore | None:
        store = super().store_for(model)
        if store is not None:
            store.namespace_share = self.key_share  # read at each store, as the cap is
        return store

    def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[list[Any] | None, list[int]]:
        """The key's own nearest cache, or the shared namespace's (an operator's
        ``blockkv warm --shared`` prompt) when that covers more of the prompt."""
        ns = self.tenancy.request_namespace()
        if ns is None:
            self._warn_once("unattributed", "blockkv: a prompt-cache call with no key to serve it under; "
                            "served and kept without a cache")
            self._count(misses=1, tokens_prefilled=len(tokens))
            return None, tokens
        found, counted = self._lookup(ns, model, tokens)
        if self._shared_length(model, tokens) > len(tokens) - len(found[1]):
            shared, shared_counted = self._lookup(SHARED_NAMESPACE, model, tokens)
            if len(shared[1]) < len(found[1]):  # the lookup served is the one counted
                found, counted, shared_counted = shared, shared_counted, counted
            self._count(**{name: -value for name, value in shared_counted.items()})
        with self._lock:
            counts = self._by_key.setdefault(ns, dict.fromkeys(KEY_COUNTS, 0))
            for name in KEY_COUNTS:
                counts[name] += counted[name]
        return found

    def _lookup(self, ns: str, model: Any, tokens: list[int]) -> tuple[tuple[list[Any] | None, list[int]],
                                                                       dict[str, int]]:
        """mlx-lm's lookup (RAM, then disk) in namespace ``ns``, and what it counted."""
        with self.serving(ns):
            before = self.tier_stats  # the lookup's counters move on this thread only
            found = super().fetch_nearest_cache(model, tokens)
            after = self.tier_stats
        return found, {name: after[name] - before[name] for name in KEY_COUNTS}

    def _shared_length(self, model: Any, tokens: list[int]) -> int:
        """How much of ``tokens`` the shared namespace's entries on disk cover (0: none)."""
        if not tokens or min(tokens) < 0:  # mlx-lm keys an image prompt with negative ids: never on disk
            return 0
        try:
            store = self.store_for(model)
            match = store.find(list(tokens), SHARED_NAMESPACE) if store is not None else None
        except Exception as e:  # noqa: BLE001 - the disk tier must never fail a request
            self._warn_once(f"shared:{type(e).__name__}", "blockkv: shared-namespace lookup failed (%s)", e)
            return 0
        return match.prefix_len if match is not None else 0

    def _spill(self, model: Any, key: list[int], prompt_cache: list[Any], ns: str,
               cache_type: str = "assistant") -> None:
        """Not a key's copy of an entry the shared namespace holds (a system
        segment that is the operator's prompt): that one copy serves every key."""
        store = self.store_for(model)
        if ns and store is not None and store.find_exact(key, SHARED_NAMESPACE) is not None:
            self._count(spills_skipped=1)
            return
        super()._spill(model, key, prompt_cache, ns, cache_type)

    def insert_cache(self, model: Any, tokens: list[int], prompt_cache: list[Any], *,
                     cache_type: str = "assistant") -> None:
        ns = self.tenancy.owner(prompt_cache)
        if ns is None:
            self._warn_once("unattributed", "blockkv: a prompt-cache call with no key to serve it under; "
                            "served and kept without a cache")
            return
        self._keep_share((model, ns), tokens)
        with self.serving(ns):
            super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)

    def _keep_share(self, ram_key: Any, tokens: list[int]) -> None:
        """Before an insert under ``ram_key`` (mlx-lm's key of a namespace's
        entries): if the namespace holds its share already, its own least
        recently used entry leaves (mlx-lm's LRU would take anyone's)."""
        try:
            held = [(key, t) for cache_type in self._lru._ordering for key, t in self._lru._lrus[cache_type]
                    if key == ram_key and t != tokens]
            if len(held) < max(1, int(self.max_size * self.key_share)):
                return
            key, oldest = held[0]
            self._lru.remove(key, oldest)
            entry = self._trie.pop(key, oldest)
            self._n_bytes -= entry.nbytes
            self._n_bytes_by_type[entry.cache_type] -= entry.nbytes
        except Exception as e:  # noqa: BLE001 - another mlx-lm's internals: no RAM quota, never a failed request
            self._warn_once("ram-share", "blockkv: cannot keep keys to their share of the RAM tier (%r)", e)


def attributing_batch_generator(base: type, tenancy: Tenancy) -> type:
    """mlx-lm's ``BatchGenerator`` class ``base``, naming in ``tenancy`` the
    namespace of every cache list it hands out (``hooks.py`` puts it in place)."""

    class AttributingBatchGenerator(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.blockkv_namespaces: dict[int, str | None] = {}  # uid -> its request's namespace

        def insert_segments(self, *args: Any, **kwargs: Any) -> Any:
            uids = super().insert_segments(*args, **kwargs)
            for uid in uids:  # mlx-lm looked this request's cache up just before
                self.blockkv_namespaces[uid] = tenancy.request_namespace()
            return uids

        def extract_cache(self, uids: Any) -> Any:
            extracted = super().extract_cache(uids)
            for uid, (cache, _) in extracted.items():
                tenancy.own(cache, self.blockkv_namespaces.get(uid))
            return extracted

        def next(self) -> Any:
            tenancy.forget_owned()
            prompt_responses, generation_responses = super().next()
            for response in generation_responses:
                if response.prompt_cache is not None:  # finished: mlx-lm saves it now
                    tenancy.own(response.prompt_cache, self.blockkv_namespaces.pop(response.uid, None))
            return prompt_responses, generation_responses

        def remove(self, uids: Any, *args: Any, **kwargs: Any) -> Any:
            removed = super().remove(uids, *args, **kwargs)
            for uid in uids:
                self.blockkv_namespaces.pop(uid, None)
            return removed

    return AttributingBatchGenerator


def tokenizing(tokenize: Callable[..., Any], tenancy: Tenancy) -> Callable[..., Any]:
    """mlx-lm's ``ResponseGenerator._tokenize``, telling ``tenancy`` whose request it tokenizes."""

    def _tokenize(self: Any, tokenizer: Any, request: Any, args: Any) -> Any:
        tenancy.tokenized(request)
        return tokenize(self, tokenizer, request, args)

    return _tokenize


def serving_alone(serve_single: Callable[..., Any], tenancy: Tenancy) -> Callable[..., Any]:
    """mlx-lm's ``ResponseGenerator._serve_single``, telling ``tenancy`` whose request it serves."""

    def _serve_single(self: Any, request: Any, stream: Any) -> Any:
        tenancy.serving_alone(getattr(request[1], NAMESPACE_ATTRIBUTE, None))
        try:
            return serve_single(self, request, stream)
        finally:
            tenancy.serving_alone(None)

    return _serve_single


def never_batchable(self: Any, args: Any) -> bool:
    """``ResponseGenerator._is_batchable`` under per-key caches on an mlx-lm
    outside ``BATCHED_MLX_LM``: every request is served alone."""
    return False


def key_stats_of(caches: Callable[[], list[Any]]) -> Callable[[], dict[str, dict[str, int]]]:
    """Every key's lookup counts (``KEY_COUNTS``), by key id, summed over ``caches()``."""

    def key_stats() -> dict[str, dict[str, int]]:
        total: dict[str, dict[str, int]] = {}
        for cache in caches():
            for ns, counts in cache.key_stats().items():
                mine = total.setdefault(key_id(ns), dict.fromkeys(KEY_COUNTS, 0))
                for name, value in counts.items():
                    mine[name] += value
        return total

    return key_stats


def metrics_view(operators: ApiKeys) -> Callable[[Any], str | None]:
    """Which ``/metrics`` a request reads: everything with an operator's key
    (None), else its own key's counts (its key id)."""

    operator = is_operator(operators)

    def view(handler: Any) -> str | None:
        return None if operator(handler) else key_id(namespace_of(handler.api_key))

    return view


def key_id(ns: str) -> str:
    """The label /metrics shows for a key's namespace: a digest of a digest of
    the key, saying nothing of it."""
    return ns.removeprefix("key-")[:12]


def is_operator(operators: ApiKeys) -> Callable[[Any], bool]:
    """Whether a request (its handler) carries one of the operator's keys."""
    return lambda handler: bool(operators) and operators.match(handler.headers.get("Authorization")) is not None


def tagging_handler(base: type, operators: ApiKeys) -> type:
    """mlx-lm's handler class ``base`` (checked by ``auth.with_keys``) tagging
    each completion request with the namespace of the key that sent it, or, sent
    with an operator's key (a ``blockkv route`` in front), the namespace its
    ``TENANT_HEADER`` names: the router's client's."""
    operator = is_operator(operators)

    class TaggingHandler(base):  # type: ignore[misc, valid-type]
        def handle_completion(self, request: Any, stop_words: Any) -> Any:
            named = self.headers.get(TENANT_HEADER)
            ns = named if is_key_namespace(named) and operator(self) else namespace_of(self.api_key)
            setattr(request, NAMESPACE_ATTRIBUTE, ns)
            return super().handle_completion(request, stop_words)

    return TaggingHandler
