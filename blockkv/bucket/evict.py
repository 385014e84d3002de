"""The fleet-wide LRU eviction over one bucket (docs/scale-out.md, "Fleet-wide
LRU eviction"): headers go, least recently used first, until headers plus the
blocks the rest reference fit; their blocks are freed by a later GC run."""

from __future__ import annotations

from blockkv.bucket.bucket_dir import BucketDir
from blockkv.bucket.gc import Collector
from blockkv.bucket.objects import outage


def evict_plan(bucket: BucketDir, collector: Collector, target_bytes: int) -> list[str]:
    """The headers ``evict_to(target_bytes)`` would remove, least recently
    used first: headers plus the blocks the rest reference then fit in
    ``target_bytes``. Only lists and reads headers (a dry run)."""
    if isinstance(target_bytes, bool) or not isinstance(target_bytes, int) or target_bytes < 0:
        raise ValueError(f"target_bytes must be a non-negative int, got {target_bytes!r}")
    with outage("eviction"):
        listed = bucket.list_headers()
        used = {i.name.removeprefix("used/"): i.last_modified for i in bucket.meta.list_info("used/")}
        sizes = {i.name: i.size for i in bucket.blocks.list_info()}
    refs = collector.blocks_of(listed, {n: i.size for n, i in listed.items()})
    counts: dict[str, int] = {}
    for names in refs.values():
        for b in names or ():
            counts[b] = counts.get(b, 0) + 1
    total = sum(i.size for i in listed.values()) + sum(sizes.get(b, 0) for b in counts)
    order = sorted(listed, key=lambda n: (max(listed[n].last_modified, used.get(n, 0.0)), n))
    plan = []
    for name in order:
        if total <= target_bytes:
            break
        plan.append(name)
        total -= listed[name].size
        for b in refs.get(name) or ():
            counts[b] -= 1
            if counts[b] == 0:
                total -= sizes.get(b, 0)
    return plan


def evict_to(bucket: BucketDir, collector: Collector, target_bytes: int) -> list[str]:
    """Fleet-wide LRU: remove least recently used entries' headers (and their
    last-use marks) until headers plus the blocks the rest reference fit in
    ``target_bytes``. Blocks are freed by a later ``gc`` after the grace period."""
    evicted = []
    for name in evict_plan(bucket, collector, target_bytes):
        with outage("eviction"):
            bucket.headers.delete(name)
            bucket.meta.delete(f"used/{name}")
        evicted.append(name)
    return evicted
