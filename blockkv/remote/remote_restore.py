"""A restore of an entry only the bucket holds (issue #23).

Only the blocks the prefix needs are read: those the local pool lacks
fetched concurrently, each bounded and verified against its name as it
arrives (fetch.py; a copy proven bad is healed, a lying header convicts only
itself), the rest read from the local pool and verified. The caches are
rebuilt straight from those frames: nothing is written and read back first.

The node keeps what it fetched (``adoption``: local/adoptions.py writes it
by the local write order of a store once the restore returned, from the
verified frames in memory). The header is the bucket's, byte for byte under
its own id, when the restore needed every block; otherwise a header of its own for the prefix the
fetched blocks cover (``prefix_header``), so the local invariant holds: a
header in ``entries/`` has all its blocks in the local pool. The bucket's
entry stays remote-only then, for a longer prefix later.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, as_completed
from typing import Any

from blockkv.bucket.bucket_verdicts import verified_frame
from blockkv.errors import BlockMissingError, CorruptError
from blockkv.format.descriptor import blocks_for_prefix, prefix_descriptor
from blockkv.format.frame import decode_block
from blockkv.format.header import Header, encode_header
from blockkv.format.rebuild import ParsedEntry, Target, rebuild
from blockkv.local.adoptions import Adoption
from blockkv.local.restore import evaluate
from blockkv.pool.local import LocalPool

Fetch = Callable[[str, int], "bytes | memoryview"]  # (block, raw bytes its header declares) -> verified frame
Submit = Callable[..., Future]


class RemoteRead:
    """The blocks one restore needs, each a future of its verified frame, and
    the caches rebuilt from them as they arrive."""

    def __init__(self, parsed: ParsedEntry, cut: int | None, pool: LocalPool, key: bytes | None,
                 fetch: Fetch, submit: Submit) -> None:
        self.parsed, self.cut = parsed, cut
        self.refs = blocks_for_prefix(parsed.descriptor, cut)
        self._pool, self._key, self._fetch = pool, key, fetch
        self.fetched: set[str] = set()
        self._frames: dict[str, Future] = {}
        sizes = {ref.raw_bytes: ref for ref in reversed(self.refs)}  # the first block of each size ...
        first = [r for r in self.refs if sizes[r.raw_bytes] is r]
        for ref in first + [r for r in self.refs if sizes[r.raw_bytes] is not r]:  # ... asked for first
            if pool.exists(ref.name):
                self._frames[ref.name] = submit(self._local, ref.name, ref.raw_bytes)
            else:
                self.fetched.add(ref.name)
                self._frames[ref.name] = submit(fetch, ref.name, ref.raw_bytes)

    def _local(self, name: str, raw_bytes: int) -> bytes | memoryview:
        """A block the local pool holds, verified; if it is gone or does not
        verify, the bucket's copy (a local copy's damage is the local restore's to judge)."""
        try:
            return verified_frame(name, self._pool.read(name), self._key)
        except (OSError, CorruptError, BlockMissingError):
            self.fetched.add(name)
            return self._fetch(name, raw_bytes)

    def frame(self, name: str) -> bytes | memoryview:
        """The verified frame of a block the restore needs (waits for it)."""
        return self._frames[name].result()

    def rebuild(self) -> tuple[list[Any], dict[str, Any]]:
        """The caches at the cut, each block copied into them as it arrives.

        The arrays are allocated once a verified frame of every payload size the
        needed blocks declare has arrived (those blocks are asked for first):
        each block's declared size is then one a real block has, never only a
        number in a header, and a block that then fails makes the restore a
        miss. So a planted header cannot make a node allocate more than a real
        entry of the prefix asked for takes."""
        sizes = {ref.raw_bytes for ref in self.refs}
        by_future = {f: name for name, f in self._frames.items()}
        raw = {ref.name: ref.raw_bytes for ref in self.refs}
        for future in as_completed(by_future):
            future.result()  # raises what the fetch proved
            sizes.discard(raw[by_future[future]])
            if not sizes:
                break
        caches, attachments = rebuild(self.parsed.descriptor, None, self.cut, self._fill)
        evaluate(caches, attachments)
        return caches, attachments

    def _fill(self, targets: Iterator[Target]) -> Iterator[Target]:
        """Each target filled from its block's frame as the frame arrives."""
        waiting: dict[str, list[Target]] = {}
        for target in targets:
            waiting.setdefault(target.ref.name, []).append(target)
        by_future = {self._frames[name]: name for name in waiting}
        for future in as_completed(by_future):
            name = by_future[future]
            payload = decode_block(name, future.result(), verify=False)  # verified as it arrived
            for target in waiting[name]:
                target.scatter(payload)
                yield target

    def failure(self) -> BaseException | None:
        """What a finished fetch raised, if one failed."""
        return next((f.exception() for f in self._frames.values() if f.done() and not f.cancelled()
                     and f.exception() is not None), None)

    def cancel(self) -> None:
        for f in self._frames.values():
            f.cancel()

    def adoption(self, entry_id: str, copy_data: bytes) -> Adoption | None:
        """What to keep: the bucket's entry under its own id if the restore
        needs every block; else, if it fetched any, a prefix entry of this node's
        own over the blocks it read (None if the entry cannot be cut there)."""
        header = self.parsed.header
        if {r.name for r in self.refs} == {r.name for r in blocks_for_prefix(self.parsed.descriptor, None)}:
            return Adoption(entry_id, header, copy_data, True, self.frame)
        if not self.fetched:
            return None
        prefix = prefix_header(header, max(r.stop for r in self.refs if r.start >= 0))
        return None if prefix is None else Adoption(None, prefix, encode_header(prefix), False, self.frame)


def prefix_header(header: Header, length: int) -> Header | None:
    """A header for the first ``length`` tokens of ``header``'s entry (ending a
    token block), over the same blocks; None if the entry cannot be cut there."""
    try:
        descriptor = prefix_descriptor(header.descriptor, length)
    except (ValueError, CorruptError):
        return None
    checks = header.block_xxh3
    if checks is not None:
        kept = len(descriptor["token_blocks"])
        checks = checks[:kept] + checks[len(header.descriptor["token_blocks"]):]
    return Header(header.identity, header.ns, header.tokens[:length], descriptor, None, checks)
