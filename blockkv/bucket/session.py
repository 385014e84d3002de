"""One store's uploads to a bucket, in the write order: every block made
present and fresh, then the header (the commit point). The writer's half of
the fleet's GC (docs/scale-out.md, "Write order").

Every body sent is the local copy verified against its name in the same pass
(bucket_verdicts.py); a local copy that is not its block is never sent: a fresh
bucket copy needs no body, an old one is refreshed with the bucket's own
bytes once they verify (and the local copy is healed from them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from blockkv.bucket.bucket_dir import BucketDir
from blockkv.bucket.bucket_verdicts import verified_frame
from blockkv.bucket.clock import CLOCK_SLACK, Reading, no_forward_step, read_clock
from blockkv.bucket.fetch import fetch_block
from blockkv.bucket.gc import wait_for_gc_runs
from blockkv.bucket.objects import BucketError, ObjectInfo, outage
from blockkv.errors import BlockMissingError, CorruptBlockError
from blockkv.format.blocks import BlockRef
from blockkv.format.header import decode_header
from blockkv.format.layout import BLOCK_LAYOUT, HEADER_LAYOUT

Load = Callable[[], bytes]  # the local copy of a block's frame (verified before it is sent)


class StoreTooSlow(BucketError):
    """A store outlasted its deadline under the grace period: its header was not written."""


class StoreSession:
    """One store's uploads, in the write order: ``put_block`` for every block of
    the entry (new or reused, from any thread), then ``commit`` (the header).

    Freshness rule (the writer's half of GC): every block the header will name
    exists with Last-Modified no more than ``grace/2`` before ``start`` (an
    older one is re-uploaded with verified bytes: refreshed), so no GC run
    that misses the header can find it older than ``grace``. docs/scale-out.md
    has the proof. ``key``: the namespace key the entry's blocks are named
    with. ``heal_local(name, frame)``, if set, is given the bucket's verified
    bytes of a block whose local copy did not verify."""

    def __init__(self, bucket: BucketDir, start: Reading, key: bytes | None = None) -> None:
        self.bucket = bucket
        self.reading = start
        self.key = key
        self.heal_local: Callable[[str, bytes], None] | None = None
        self.created: set[str] = set()  # blocks this session uploaded (for stats)
        self.refreshed: set[str] = set()
        self._blocks: dict[str, tuple[BlockRef, Load]] = {}
        self._lock = threading.Lock()

    @property
    def start(self) -> float:
        return self.reading.server

    def _fresh_after(self) -> float:
        return self.start - self.bucket.grace / 2 + CLOCK_SLACK

    def put_block(self, ref: BlockRef, load: Load, new: bool = False) -> bool:
        """Make block ``ref.name`` (``ref.raw_bytes`` of payload, as the entry's
        header says) present and fresh in the bucket; True if this call uploaded it.

        ``new``: a block the bucket likely lacks (one conditional PUT with its
        body, a 412 is the dedup); otherwise a HEAD first, and the body only if
        the block is missing or old. CorruptBlockError if a body was needed and
        no verified one could be had."""
        name, raw_bytes = BLOCK_LAYOUT.check(ref.name), ref.raw_bytes
        with self._lock:
            self._blocks[name] = (ref, load)
        pool = self.bucket.blocks
        with outage(f"upload of block {name}"):
            if new and pool.put_if_absent(name, [verified_frame(name, load(), self.key)]):
                self._note(self.created, name)
                return True
            try:
                modified = pool.info(name).last_modified
            except BlockMissingError:
                if pool.put_if_absent(name, [verified_frame(name, load(), self.key)]):
                    self._note(self.created, name)
                    return True
                modified = pool.info(name).last_modified
            if modified < self._fresh_after():  # a GC may condemn it: refresh, with verified bytes only
                pool.put_overwrite(name, [self._good_frame(name, raw_bytes, load)])
                self._note(self.refreshed, name)
                return True
        return False

    def _good_frame(self, name: str, raw_bytes: int, load: Load) -> bytes:
        """The local copy verified; if it is not the block, the bucket's copy verified
        (and handed to ``heal_local``). CorruptBlockError if neither is."""
        try:
            return verified_frame(name, load(), self.key)
        except CorruptBlockError:
            good = fetch_block(self.bucket, name, raw_bytes, self.key)
            if self.heal_local is not None:
                self.heal_local(name, good)
            return good

    def _note(self, where: set[str], name: str) -> None:
        with self._lock:
            where.add(name)

    def commit(self, header_name: str, header: bytes, exists_ok: bool = False) -> ObjectInfo:
        """Write the header once every block it names is safe; return only once it is in the bucket.
        (``exists_ok``: an earlier attempt may have written these very bytes, which then count.)

        Waits out any GC run whose sweep window overlaps this store and then
        checks every block again (uploading again, from its ``load``, a block a
        sweep deleted); re-checks freshness once if the store ran past its
        deadline, then refuses (StoreTooSlow). If the server's clock may have
        stepped forward while the header was written, a GC run could have
        judged the blocks' ages by it: the runs are waited out and every block
        checked again before this returns. Returns the header's object as the bucket holds it."""
        HEADER_LAYOUT.check(header_name)
        decode_header(header)  # never commit garbage
        bucket = self.bucket
        for attempt in range(2):
            if wait_for_gc_runs(bucket, self.start):  # a sweep may have deleted a block after we checked it
                self._recheck()
            checked = bucket.clock_reading()
            if checked.server - self.start + CLOCK_SLACK <= bucket.grace / 2 - bucket.request_bound - CLOCK_SLACK:
                break
            if attempt == 1:
                raise StoreTooSlow(f"store took {checked.server - self.start:.0f} s of server time; "
                                   f"grace is {bucket.grace} s")
            self.reading = checked  # measure freshness afresh and check every block against it
            self._recheck()

        info: list[ObjectInfo] = []

        def put_header() -> float:
            if not bucket.headers.put_if_absent(header_name, [header]) and not (
                    exists_ok and bucket.headers.get_limited(header_name, len(header))[0] == header):
                raise BucketError(f"header {header_name} already exists (uuid collision?)")
            info.append(bucket.headers.info(header_name))
            return info[0].last_modified

        with outage(f"header {header_name}"):
            landed = read_clock(put_header)
        if not no_forward_step(checked, landed):  # a GC run may have dated our blocks by a clock that jumped
            wait_for_gc_runs(bucket, self.start)
            self._recheck()
        return info[0]

    def _recheck(self) -> None:
        with self._lock:
            blocks = sorted(self._blocks.items())
        list(self.bucket.map(lambda item: self.put_block(*item[1]), blocks))
