"""The fleet's mark-and-sweep GC over one bucket, with no coordinator
(docs/scale-out.md, "GC across nodes").

A run's marker object dates it by the server's clock; headers listed after
the marker are its roots; it condemns blocks no root references that are
older than the grace period, and deletes only inside its sweep window. Every
other deletion of blocks (a copy proven damaged, heal.py) opens the same kind
of window, so writers treat it exactly like a run. The writer's half is
``wait_for_gc_runs`` (a store's commit, session.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Container, Iterable
from dataclasses import dataclass, field

from blockkv.bucket.bucket_dir import BucketDir
from blockkv.bucket.clock import CLOCK_SLACK, Reading, no_backward_step, read_clock
from blockkv.bucket.objects import MAX_MARKER_BYTES, BucketError, outage
from blockkv.format.descriptor import blocks_for_prefix

_BATCH = 100


@dataclass
class GcReport:
    headers: int = 0  # roots seen
    blocks: int = 0  # blocks listed
    deleted: list[str] = field(default_factory=list)
    young: int = 0  # unreferenced but kept (inside the grace period, or nothing swept)
    stopped_early: bool = False  # the sweep window closed (or the server's clock stepped) first
    clock_stepped: bool = False  # the server's clock ran backward during the run: it stopped deleting
    unreadable_headers: list[str] = field(default_factory=list)  # while any exists, nothing is swept
    unsealed_ignored: list[str] = field(default_factory=list)  # unreadable and not sealed (fleet key): not roots


class Window:
    """One deleter's window: a ``gc/<uuid>`` marker whose Last-Modified ``start``
    opens it; deletes only while the server's clock is inside ``sweep_window``
    of it and has not stepped back since; ``close`` writes ``.done``. A writer
    whose store overlaps a window waits for it and checks its blocks again."""

    def __init__(self, bucket: BucketDir) -> None:
        self._bucket = bucket
        self.marker = f"gc/{uuid.uuid4().hex}"
        with outage("gc marker"):
            self.opened: Reading = read_clock(self._create)
        self.start = self.opened.server
        self.stopped = False
        self.stepped = False

    def _create(self) -> float:
        meta = self._bucket.meta
        meta.put_if_absent(self.marker, [self._bucket.marker_body(self.marker)])
        return meta.last_modified(self.marker)

    def delete(self, names: list[str]) -> list[str]:
        """Delete ``names`` in batches while the window is open; what went."""
        bucket, deleted = self._bucket, []
        for at in range(0, len(names), _BATCH):
            now = bucket.clock_reading()
            if not no_backward_step(self.opened, now):  # the window could reopen: writers think it closed
                self.stopped = self.stepped = True
                break
            if now.server + bucket.request_bound + CLOCK_SLACK >= self.start + bucket.sweep_window:
                self.stopped = True  # the rest waits for the next run
                break
            batch = names[at : at + _BATCH]
            with outage("gc delete"):
                bucket.blocks.delete_many(batch)
            deleted += batch
        return deleted

    def close(self) -> None:
        done = f"{self.marker}.done"
        with outage("gc"):
            self._bucket.meta.put_if_absent(done, [self._bucket.marker_body(done)])


@dataclass
class GcPlan:
    """What a GC run's mark phase condemned, for its sweep."""

    window: Window
    doomed: list[str]
    roots: set[str]  # header names listed after the marker
    report: GcReport

    @property
    def start(self) -> float:
        return self.window.start


class Collector:
    """GC runs on one bucket (``Bucket.gc``, ``gc_mark``, ``gc_sweep``). Keeps
    the block names each header it read references: headers never change."""

    def __init__(self, bucket: BucketDir) -> None:
        self._bucket = bucket
        self._header_blocks: dict[str, tuple[str, ...] | None] = {}
        self._ignored: set[str] = set()

    def blocks_of(self, names: Iterable[str], sizes: dict[str, int] | None = None
                  ) -> dict[str, tuple[str, ...] | None]:
        """Block names each header references (cached: headers never change).
        A header that is gone is left out; one that cannot be read maps to None
        (damaged, or of a format this version does not know: its blocks are
        unknown), unless a fleet key is set and it carries no valid seal: then
        it is nobody's (planted) and left out too."""
        names = list(names)
        fetched = self._bucket.fetch_headers((n for n in names if n not in self._header_blocks
                                              and n not in self._ignored), sizes)
        for name, sealed in fetched.damaged.items():
            if self._bucket.key is not None and not sealed:
                self._ignored.add(name)
            else:
                self._header_blocks[name] = None
        for name, copy in fetched.found.items():
            refs = blocks_for_prefix(copy.header.descriptor, None)
            self._header_blocks[name] = tuple(dict.fromkeys(r.name for r in refs))
        return {n: self._header_blocks[n] for n in names if n in self._header_blocks}

    def mark(self) -> GcPlan:
        """Mark: write this run's marker (its Last-Modified is the run's start);
        headers listed after it are the roots; condemn blocks no root references
        whose Last-Modified is more than ``grace`` before the start."""
        bucket = self._bucket
        listed = bucket.list_headers()
        self.blocks_of(listed, {n: i.size for n, i in listed.items()})  # the slow part, before the window opens
        window = Window(bucket)
        with outage("gc"):
            listed = bucket.list_headers()
            roots = self.blocks_of(listed, {n: i.size for n, i in listed.items()})
            self._header_blocks = {n: self._header_blocks[n] for n in roots}  # forget removed headers
            self._ignored &= set(listed)
            live = {b for refs in roots.values() if refs for b in refs}
            blocks = list(bucket.blocks.list_info())
        cutoff = window.start - bucket.grace - CLOCK_SLACK
        unreadable = sorted(n for n, refs in roots.items() if refs is None)
        # a header we cannot read may need any block: only proof deletes, so this run deletes nothing
        doomed = [] if unreadable else [i.name for i in blocks if i.name not in live and i.last_modified < cutoff]
        report = GcReport(headers=len(roots), blocks=len(blocks), unreadable_headers=unreadable,
                          unsealed_ignored=sorted(self._ignored))
        report.young = sum(1 for i in blocks if i.name not in live) - len(doomed)
        return GcPlan(window, doomed, set(roots), report)

    def sweep(self, plan: GcPlan) -> GcReport:
        """Sweep: delete the condemned blocks inside the run's window (a writer
        that saw the marker waits that out, or for the ``.done`` mark written
        once every delete returned)."""
        report = plan.report
        report.deleted = plan.window.delete(plan.doomed)
        report.stopped_early, report.clock_stepped = plan.window.stopped, plan.window.stepped
        plan.window.close()
        self._reap_markers(plan.start, plan.roots)
        return report

    def _reap_markers(self, now: float, roots: Container[str]) -> None:
        """The protocol's own objects that tell nobody anything any more: GC
        markers whose window closed long ago, clock probes of handles idle for
        a grace period (a probe re-creates its object), last-use marks of
        entries gone for a grace period, requests for a good copy of a block
        nobody answered in two."""
        bucket = self._bucket
        old = now - bucket.grace - CLOCK_SLACK
        try:
            with outage("marker cleanup"):
                doomed = [i.name for i in bucket.meta.list_info("gc/") if i.last_modified + bucket.sweep_window < old]
                doomed += [i.name for i in bucket.meta.list_info("clock/")
                           if i.last_modified < old and i.name != bucket.clock_probe]
                doomed += [i.name for i in bucket.meta.list_info("used/")
                           if i.last_modified < old and i.name.removeprefix("used/") not in roots]
                doomed += [i.name for i in bucket.meta.list_info("wanted/") if i.last_modified < old - bucket.grace]
                bucket.meta.delete_many(doomed)
        except BucketError:
            pass


def gc_runs_since(bucket: BucketDir, since: float, sealed: dict[str, bool] | None = None) -> dict[str, float | None]:
    """GC runs (and other deleters' windows) whose window was open at or after
    server time ``since``: marker -> the server time its window closes, or None
    if it finished. With a fleet key, only a sealed ``.done`` mark ends a wait
    early (a planted one could otherwise cut it short); every marker is waited
    for. ``sealed`` remembers the marks already read (they never change)."""
    runs: dict[str, float] = {}
    done: dict[str, int] = {}
    with outage("gc marker listing"):
        for i in bucket.meta.list_info("gc/"):
            if i.name.endswith(".done"):
                done[i.name.removesuffix(".done")] = i.size
            else:
                runs[i.name] = i.last_modified + bucket.sweep_window + CLOCK_SLACK
    sealed = {} if sealed is None else sealed
    out: dict[str, float | None] = {}
    for marker, end in runs.items():
        if end < since:
            continue
        finished = marker in done
        if finished and bucket.key is not None:
            if marker not in sealed:
                sealed[marker] = _sealed_mark(bucket, f"{marker}.done", done[marker])
            finished = sealed[marker]
        out[marker] = None if finished else end
    return out


def _sealed_mark(bucket: BucketDir, name: str, size: int) -> bool:
    if size > MAX_MARKER_BYTES:
        return False  # never read: a mark is 64 bytes at most
    try:
        with outage("gc marker"):
            body, _ = bucket.meta.get_limited(name, MAX_MARKER_BYTES)
    except (BucketError, FileNotFoundError, ValueError):
        return False
    return bucket.key.marker_sealed(name, body)


def wait_for_gc_runs(bucket: BucketDir, since: float) -> bool:
    """Wait until every GC run whose window was open at or after ``since`` has
    finished or its window has closed; True if there was any such run. Each
    run is waited for at most a window's length of local time from when it
    is first seen (a run stops deleting at its window's end by the server's
    clock, and at once if that clock steps back: heal.py's Window)."""
    overlapped = False
    first_seen: dict[str, float] = {}
    sealed: dict[str, bool] = {}
    limit = bucket.sweep_window + bucket.request_bound + 2 * CLOCK_SLACK
    while True:
        runs = gc_runs_since(bucket, since, sealed)
        overlapped = overlapped or bool(runs)
        mono = time.monotonic()
        running = {m: end for m, end in runs.items()
                   if end is not None and mono - first_seen.setdefault(m, mono) < limit}
        if not running:
            return overlapped
        now = bucket.server_now()
        if now > max(running.values()):
            return True
        time.sleep(min(0.25, max(running.values()) - now))
