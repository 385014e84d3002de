"""``GET /metrics`` on ``blockkv serve``: the disk tier in Prometheus text
format (``prometheus_client``), for an operator to graph and alert on.

Counters are read when scraped from what the caches and stores already count
(``PersistentPromptCache.tier_stats``, ``BlockStore.counters``), so serving
pays nothing for them; only the restore latency is observed as it happens.
mlx-lm's request handler gets the path by a subclass handed to its HTTP server
for the duration of ``serve``; every other path is mlx-lm's own.

With per-key caches the lookups are also counted per key (``blockkv_key_*``,
labelled by a key id: a digest, never the key). A tenant's key then reads
its own ``blockkv_key_*`` samples and nothing else (the totals would show
the size of other tenants' prompts); an operator's key reads everything.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from blockkv.errors import LockTimeout
from blockkv.local.locks import waiting_at_most

log = logging.getLogger(__name__)

PATH = "/metrics"
_TIERS = ("ram", "disk", "bucket")
SCRAPE_WAIT = 0.5  # the longest a scrape waits for a store's index: past a busy spill, not a stopped process
# (name, help, store counter) summed over every model's store
_STORE_COUNTERS = (
    ("blockkv_bytes_read", "Bytes read from the local disk by restores (headers and blocks)", "bytes_read"),
    ("blockkv_bytes_written", "Bytes of new blocks and headers written to the local disk", "bytes_written"),
    ("blockkv_bytes_deduplicated", "Bytes a store did not write because the block was already there",
     "bytes_deduplicated"),
    ("blockkv_bytes_uploaded", "Bytes of headers and blocks uploaded to the bucket", "bytes_uploaded"),
    ("blockkv_evictions", "Entries removed to stay within the byte cap", "evictions"),
    ("blockkv_verify_failures", "Restores that found a block or header failing its hash", "verify_failures"),
    ("blockkv_bucket_errors", "Bucket operations that failed (outages, slow or refused uploads)", "bucket_errors"),
    ("blockkv_index_busy_refreshes", ("Lookups that found the index busy (another process inside a "
                                      "transaction) and were served from what the store already knew"),
     "busy_refreshes"),
    ("blockkv_index_busy_waits", ("Of those, the lookups that first waited for the index (25 ms at most, once "
                                  "per busy spell)"), "busy_waits"),
)


class ServeMetrics:
    """The registry one ``blockkv serve`` exposes, over the prompt caches it made."""

    def __init__(self, caches: Callable[[], list[Any]],
                 key_stats: Callable[[], dict[str, dict[str, int]]] | None = None) -> None:
        """``key_stats``: per-key lookup counts by key id (per-key caches only)."""
        self.registry = CollectorRegistry()
        self._caches = caches
        self._key_stats = key_stats
        self.restore_seconds = Histogram(
            "blockkv_restore_seconds", "Time to restore a prompt cache from the disk or the bucket (lookup to "
            "the cache handed to mlx-lm)",
            ["tier"], registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
        )
        self.registry.register(_Collector(caches))
        if key_stats is not None:
            self.registry.register(_KeyCollector(key_stats, None))

    def watch(self, cache: Any) -> None:
        """Observe ``cache``'s restores (a ``PersistentPromptCache``)."""
        cache.restore_observers.append(lambda tier, _, seconds: self.restore_seconds.labels(tier).observe(seconds))

    def text(self, key: str | None = None) -> bytes:
        """Every metric; or, given a key id, only that key's own counts."""
        if key is None:
            return generate_latest(self.registry)
        own = CollectorRegistry()
        own.register(_KeyCollector(self._key_stats or dict, key))
        return generate_latest(own)


class _KeyCollector:
    """The ``blockkv_key_*`` counters: every key's, or only key id ``only``'s."""

    def __init__(self, key_stats: Callable[[], dict[str, dict[str, int]]], only: str | None) -> None:
        self._key_stats = key_stats
        self._only = only

    def collect(self) -> Iterator[Metric]:
        stats = self._key_stats()
        if self._only is not None:
            stats = {self._only: stats.get(self._only, {})}
        hits = CounterMetricFamily("blockkv_key_hits", "One key's prompt lookups served from a tier",
                                   labels=["key", "tier"])
        tokens = CounterMetricFamily("blockkv_key_tokens_restored", "One key's prompt tokens not prefilled, by "
                                     "the tier that held them", labels=["key", "tier"])
        misses = CounterMetricFamily("blockkv_key_misses", "One key's prompt lookups no tier could serve",
                                     labels=["key"])
        prefilled = CounterMetricFamily("blockkv_key_tokens_prefilled", "One key's prompt tokens left to prefill "
                                        "after the lookup", labels=["key"])
        for key, counts in sorted(stats.items()):
            for tier in _TIERS:
                hits.add_metric([key, tier], counts.get(f"{tier}_hits", 0))
                tokens.add_metric([key, tier], counts.get(f"tokens_from_{tier}", 0))
            misses.add_metric([key], counts.get("misses", 0))
            prefilled.add_metric([key], counts.get("tokens_prefilled", 0))
        yield from (hits, tokens, misses, prefilled)


class _Collector:
    """Counters and gauges read from the caches and their stores at scrape time.
    A store's bytes are read from its index, waiting ``SCRAPE_WAIT`` at most:
    while another process holds it (stopped inside a transaction) the scrape
    shows the last figure read."""

    def __init__(self, caches: Callable[[], list[Any]]) -> None:
        self._caches = caches
        self._last_bytes: dict[Any, int] = {}  # store -> its disk bytes when last read

    def collect(self) -> Iterator[Metric]:
        caches = self._caches()
        stats = [c.tier_stats for c in caches]
        total = lambda key: sum(s[key] for s in stats)  # noqa: E731
        hits = CounterMetricFamily("blockkv_hits", "Prompt lookups served from a tier", labels=["tier"])
        tokens = CounterMetricFamily("blockkv_tokens_restored", "Prompt tokens not prefilled, by the tier that "
                                     "held them", labels=["tier"])
        for tier in _TIERS:
            hits.add_metric([tier], total(f"{tier}_hits"))
            tokens.add_metric([tier], total(f"tokens_from_{tier}"))
        yield hits
        yield tokens
        yield CounterMetricFamily("blockkv_misses", "Prompt lookups no tier could serve", value=total("misses"))
        yield CounterMetricFamily("blockkv_tokens_prefilled", "Prompt tokens left to prefill after the lookup",
                                  value=total("tokens_prefilled"))
        yield CounterMetricFamily("blockkv_spills", "Entries written to the disk tier", value=total("spills"))
        yield CounterMetricFamily("blockkv_spill_failures", "Entries the disk tier did not take",
                                  value=total("spill_failures"))
        yield GaugeMetricFamily("blockkv_pending_spills", "Entries handed to the disk tier and not written yet",
                                value=total("pending_spills"))
        stores = [s for c in caches for s in c.stores()]
        counters = [s.counters() for s in stores]
        for name, text, key in _STORE_COUNTERS:
            yield CounterMetricFamily(name, text, value=sum(c[key] for c in counters))
        disk = GaugeMetricFamily("blockkv_disk_bytes", "Bytes one model's store holds on disk (headers and "
                                 "referenced blocks)", labels=["model", "fingerprint"])
        cap = GaugeMetricFamily("blockkv_disk_cap_bytes", "The byte cap of one model's store",
                                labels=["model", "fingerprint"])
        for store in stores:
            used = self._disk_bytes(store)
            if used is None:
                continue
            labels = [store.identity.model_id, store.directory.name]
            disk.add_metric(labels, used)
            cap.add_metric(labels, store.max_bytes)
        yield disk
        yield cap

    def _disk_bytes(self, store: Any) -> int | None:
        """``store.total_bytes`` now if its index is free, else the last figure read (None: none yet)."""
        try:
            with waiting_at_most(SCRAPE_WAIT):
                self._last_bytes[store] = store.total_bytes
        except LockTimeout:
            pass
        except Exception as exc:  # noqa: BLE001 - a scrape must not fail on one store
            log.debug("blockkv: /metrics could not read %s: %s", store.directory, exc)
            return None
        return self._last_bytes.get(store)


def with_metrics_path(handler_class: type, metrics: ServeMetrics,
                      view: Callable[[Any], str | None] | None = None) -> type:
    """mlx-lm's request handler, answering ``GET /metrics`` too: everything, or,
    when ``view(handler)`` names a key id, that key's own counts only."""

    class Handler(handler_class):  # type: ignore[misc, valid-type]
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.split("?", 1)[0] != PATH:
                return super().do_GET()
            body = metrics.text(view(self) if view is not None else None)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return None

    return Handler
