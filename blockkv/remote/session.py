"""One store's uploads to a bucket, in the write order: every block made
present and fresh, then the header (the commit point). The writer's half of
the fleet's GC (docs/scale-out.md, "Write order").
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from blockkv.errors import BlockMissingError
from blockkv.format.header import decode_header
from blockkv.fs import Buffer
from blockkv.local.directory import HEADER_LAYOUT
from blockkv.pool.protocol import BLOCK_LAYOUT
from blockkv.remote.gc import wait_for_gc_runs
from blockkv.remote.objects import CLOCK_SLACK, BucketError, outage

if TYPE_CHECKING:
    from blockkv.remote.bucket import Bucket


class StoreTooSlow(BucketError):
    """A store outlasted its deadline under the grace period: its header was not written."""


class StoreSession:
    """One store's uploads, in the write order: ``put_block`` for every block of
    the entry (new or reused, from any thread), then ``commit`` (the header).

    Freshness rule (the writer's half of GC): every block the header will name
    exists with Last-Modified no more than ``grace/2`` before ``start`` (an
    older one is re-uploaded: refreshed), so no GC run that misses the header
    can find it older than ``grace``. docs/scale-out.md has the proof."""

    def __init__(self, bucket: Bucket, start: float) -> None:
        self.bucket = bucket
        self.start = start
        self.created: set[str] = set()  # blocks this session uploaded (for stats)
        self.refreshed: set[str] = set()
        self._names: set[str] = set()
        self._lock = threading.Lock()

    def _fresh_after(self) -> float:
        return self.start - self.bucket.grace / 2 + CLOCK_SLACK

    def put_block(self, name: str, parts: Sequence[Buffer] | Callable[[], Sequence[Buffer]]) -> bool:
        """Make block ``name`` present and fresh in the bucket; True if this call uploaded it.

        ``parts`` is the frame (a new block: one conditional PUT, a 412 is the
        dedup) or a function returning it (a block the store expects the bucket
        to hold already: a HEAD first, the body is read and sent only if needed)."""
        BLOCK_LAYOUT.check(name)
        with self._lock:
            self._names.add(name)
        pool = self.bucket.blocks
        with outage(f"upload of block {name}"):
            if not callable(parts):
                if pool.put_if_absent(name, parts):
                    self._note(self.created, name)
                    return True
            try:
                modified = pool.last_modified(name)
            except (BlockMissingError, FileNotFoundError):
                if pool.put_if_absent(name, parts() if callable(parts) else parts):
                    self._note(self.created, name)
                    return True
                modified = pool.last_modified(name)
            if modified < self._fresh_after():  # a GC may condemn it: refresh
                pool.put_overwrite(name, parts() if callable(parts) else parts)
                self._note(self.refreshed, name)
                return True
        return False

    def _note(self, where: set[str], name: str) -> None:
        with self._lock:
            where.add(name)

    def commit(self, header_name: str, header: bytes, load_block: Callable[[str], Sequence[Buffer]]) -> None:
        """Write the header once every block it names is safe; return only once it is in the bucket.

        Waits out any GC run whose sweep window overlaps this store and then
        checks every block again (``load_block(name)`` supplies a frame to
        upload again, from the local pool); re-checks freshness once if the
        store ran past its deadline, then refuses (StoreTooSlow)."""
        HEADER_LAYOUT.check(header_name)
        decode_header(header)  # never commit garbage
        bucket = self.bucket
        for attempt in range(2):
            if wait_for_gc_runs(bucket, self.start):  # a sweep may have deleted a block after we checked it
                self._recheck(load_block)
            now = bucket.server_now()
            if now - self.start + CLOCK_SLACK <= bucket.grace / 2 - bucket.request_bound - CLOCK_SLACK:
                break
            if attempt == 1:
                raise StoreTooSlow(f"store took {now - self.start:.0f} s of server time; grace is {bucket.grace} s")
            self.start = now  # measure freshness afresh and check every block against it
            self._recheck(load_block)
        with outage(f"header {header_name}"):
            if not bucket.headers.put_if_absent(header_name, [header]):
                raise BucketError(f"header {header_name} already exists (uuid collision?)")

    def _recheck(self, load_block: Callable[[str], Sequence[Buffer]]) -> None:
        names = sorted(self._names)
        list(self.bucket._fetchers.map(lambda n: self.put_block(n, lambda: load_block(n)), names))
