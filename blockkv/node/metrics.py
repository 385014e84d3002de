"""``GET /metrics`` on ``blockkv serve``: the disk tier in Prometheus text
format (``prometheus_client``), for an operator to graph and alert on.

Counters are read when scraped from what the caches and stores already count
(``PersistentPromptCache.tier_stats``, ``BlockStore.counters``), so serving
pays nothing for them; only the restore latency is observed as it happens.
mlx-lm's request handler gets the path by a subclass handed to its HTTP server
for the duration of ``serve``; every other path is mlx-lm's own.
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

log = logging.getLogger(__name__)

PATH = "/metrics"
_TIERS = ("ram", "disk", "bucket")
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
)


class ServeMetrics:
    """The registry one ``blockkv serve`` exposes, over the prompt caches it made."""

    def __init__(self, caches: Callable[[], list[Any]]) -> None:
        self.registry = CollectorRegistry()
        self._caches = caches
        self.restore_seconds = Histogram(
            "blockkv_restore_seconds", "Time to restore a prompt cache from the disk or the bucket",
            ["tier"], registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
        )
        self.registry.register(_Collector(caches))

    def watch(self, cache: Any) -> None:
        """Observe ``cache``'s restores (a ``PersistentPromptCache``)."""
        cache.restore_observers.append(lambda tier, seconds: self.restore_seconds.labels(tier).observe(seconds))

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _Collector:
    """Counters and gauges read from the caches and their stores at scrape time."""

    def __init__(self, caches: Callable[[], list[Any]]) -> None:
        self._caches = caches

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
            try:
                used = store.total_bytes
            except Exception as exc:  # noqa: BLE001 - a scrape must not fail on one store
                log.debug("blockkv: /metrics could not read %s: %s", store.directory, exc)
                continue
            labels = [store.identity.model_id, store.directory.name]
            disk.add_metric(labels, used)
            cap.add_metric(labels, store.max_bytes)
        yield disk
        yield cap


def with_metrics_path(handler_class: type, metrics: ServeMetrics) -> type:
    """mlx-lm's request handler, answering ``GET /metrics`` too."""

    class Handler(handler_class):  # type: ignore[misc, valid-type]
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.split("?", 1)[0] != PATH:
                return super().do_GET()
            body = metrics.text()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return None

    return Handler
