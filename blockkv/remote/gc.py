"""The fleet's mark-and-sweep GC and LRU eviction over one bucket, with no
coordinator (docs/scale-out.md, "GC across nodes").

A run's marker object dates it by the server's clock; headers listed after
the marker are its roots; it condemns blocks no root references that are
older than the grace period, and deletes only inside its sweep window. The
writer's half is ``wait_for_gc_runs`` (a store's commit, session.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Container, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from blockkv.format.descriptor import blocks_for_prefix
from blockkv.remote.objects import CLOCK_SLACK, BucketError, outage

if TYPE_CHECKING:
    from blockkv.remote.bucket import Bucket


@dataclass
class GcReport:
    headers: int = 0  # roots seen
    blocks: int = 0  # blocks listed
    deleted: list[str] = field(default_factory=list)
    young: int = 0  # unreferenced but kept (inside the grace period, or nothing swept)
    stopped_early: bool = False  # the sweep window closed before every candidate went
    unreadable_headers: list[str] = field(default_factory=list)  # while any exists, nothing is swept


@dataclass
class GcPlan:
    """What a GC run's mark phase condemned, for its sweep."""

    marker: str
    start: float  # server time the run began (its marker's Last-Modified)
    doomed: list[str]
    roots: set[str]  # header names listed after the marker
    report: GcReport


class Collector:
    """GC runs and eviction on one bucket (``Bucket.gc``, ``gc_mark``,
    ``gc_sweep``, ``evict_plan``, ``evict_to``). Keeps the block names each
    header it read references: headers never change."""

    def __init__(self, bucket: Bucket) -> None:
        self._bucket = bucket
        self._header_blocks: dict[str, tuple[str, ...] | None] = {}

    def _blocks_of(self, names: Iterable[str]) -> dict[str, tuple[str, ...] | None]:
        """Block names each header references (cached: headers never change).
        A header that is gone is left out; one that cannot be read maps to None
        (damaged, or of a format this version does not know: its blocks are unknown)."""
        names = list(names)
        found, damaged = self._bucket.fetch_headers(n for n in names if n not in self._header_blocks)
        for name in damaged:
            self._header_blocks[name] = None
        for name, (_, header) in found.items():
            refs = blocks_for_prefix(header.descriptor, None)
            self._header_blocks[name] = tuple(dict.fromkeys(r.name for r in refs))
        return {n: self._header_blocks[n] for n in names if n in self._header_blocks}

    def mark(self) -> GcPlan:
        """Mark: write this run's marker (its Last-Modified is the run's start);
        headers listed after it are the roots; condemn blocks no root references
        whose Last-Modified is more than ``grace`` before the start."""
        bucket = self._bucket
        self._blocks_of(bucket.list_headers())  # the slow part (reading headers) before the window opens
        marker = f"gc/{uuid.uuid4().hex}"
        with outage("gc"):
            bucket.meta.put_if_absent(marker, [b""])
            start = bucket.meta.last_modified(marker)
            roots = self._blocks_of(bucket.list_headers())
            self._header_blocks = {n: self._header_blocks[n] for n in roots}  # forget removed headers
            live = {b for refs in roots.values() if refs for b in refs}
            listed = list(bucket.blocks.list_info())
        cutoff = start - bucket.grace - CLOCK_SLACK
        unreadable = sorted(n for n, refs in roots.items() if refs is None)
        # a header we cannot read may need any block: only proof deletes, so this run deletes nothing
        doomed = [] if unreadable else [i.name for i in listed if i.name not in live and i.last_modified < cutoff]
        report = GcReport(headers=len(roots), blocks=len(listed), unreadable_headers=unreadable)
        report.young = sum(1 for i in listed if i.name not in live) - len(doomed)
        return GcPlan(marker, start, doomed, set(roots), report)

    def sweep(self, plan: GcPlan) -> GcReport:
        """Sweep: delete the condemned blocks, only while the server's clock is
        inside ``sweep_window`` of the run's start (a writer that saw the marker
        waits that out, or for the ``.done`` mark written once every delete returned)."""
        bucket = self._bucket
        report = plan.report
        for at in range(0, len(plan.doomed), 100):
            if bucket.server_now() + bucket.request_bound + CLOCK_SLACK >= plan.start + bucket.sweep_window:
                report.stopped_early = True  # the rest waits for the next run
                break
            batch = plan.doomed[at : at + 100]
            with outage("gc delete"):
                bucket.blocks.delete_many(batch)
            report.deleted += batch
        with outage("gc"):
            bucket.meta.put_if_absent(f"{plan.marker}.done", [b""])
        self._reap_markers(plan.start, plan.roots)
        return report

    def _reap_markers(self, now: float, roots: Container[str]) -> None:
        """The protocol's own objects that tell nobody anything any more: GC
        markers whose window closed long ago, clock probes of handles idle for
        a grace period (a probe re-creates its object), last-use marks of
        entries gone for a grace period."""
        bucket = self._bucket
        old = now - bucket.grace - CLOCK_SLACK
        try:
            with outage("marker cleanup"):
                doomed = [i.name for i in bucket.meta.list_info("gc/") if i.last_modified + bucket.sweep_window < old]
                doomed += [i.name for i in bucket.meta.list_info("clock/")
                           if i.last_modified < old and i.name != bucket.clock_probe]
                doomed += [i.name for i in bucket.meta.list_info("used/")
                           if i.last_modified < old and i.name.removeprefix("used/") not in roots]
                bucket.meta.delete_many(doomed)
        except BucketError:
            pass

    def evict_plan(self, target_bytes: int) -> list[str]:
        """The headers ``evict_to(target_bytes)`` would remove, least recently
        used first: headers plus the blocks the rest reference then fit in
        ``target_bytes``. Only lists and reads headers (a dry run)."""
        if isinstance(target_bytes, bool) or not isinstance(target_bytes, int) or target_bytes < 0:
            raise ValueError(f"target_bytes must be a non-negative int, got {target_bytes!r}")
        bucket = self._bucket
        with outage("eviction"):
            listed = bucket.list_headers()
            used = {i.name.removeprefix("used/"): i.last_modified for i in bucket.meta.list_info("used/")}
            sizes = {i.name: i.size for i in bucket.blocks.list_info()}
        refs = self._blocks_of(listed)
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

    def evict_to(self, target_bytes: int) -> list[str]:
        """Fleet-wide LRU: remove least recently used entries' headers (and their
        last-use marks) until headers plus the blocks the rest reference fit in
        ``target_bytes``. Blocks are freed by a later ``gc`` after the grace period."""
        evicted = []
        for name in self.evict_plan(target_bytes):
            with outage("eviction"):
                self._bucket.headers.delete(name)
                self._bucket.meta.delete(f"used/{name}")
            evicted.append(name)
        return evicted


def gc_runs_since(bucket: Bucket, since: float) -> dict[str, float | None]:
    """GC runs whose sweep window was open at or after server time ``since``:
    marker -> the server time its window closes, or None if the run finished."""
    runs: dict[str, float] = {}
    done: set[str] = set()
    with outage("gc marker listing"):
        for i in bucket.meta.list_info("gc/"):
            if i.name.endswith(".done"):
                done.add(i.name.removesuffix(".done"))
            else:
                runs[i.name] = i.last_modified + bucket.sweep_window + CLOCK_SLACK
    return {m: (None if m in done else end) for m, end in runs.items() if end >= since}


def wait_for_gc_runs(bucket: Bucket, since: float) -> bool:
    """Wait until every GC run whose window was open at or after ``since`` has
    finished or its window has closed; True if there was any such run."""
    overlapped = False
    while True:
        runs = gc_runs_since(bucket, since)
        overlapped = overlapped or bool(runs)
        running = [end for end in runs.values() if end is not None]
        if not running:
            return overlapped
        now = bucket.server_now()
        if now > max(running):
            return True
        time.sleep(min(0.25, max(running) - now))
