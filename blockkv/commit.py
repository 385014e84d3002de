"""The write and delete order of one fingerprint directory's entries.

Write order of a store (docs/design.md says why each step is where it is):
blocks (tmp → fsync → rename → fsync dir) → references (LMDB, recorded as
pending) → header (tmp → fsync → rename → fsync dir) → entry visible → success.
Delete order: unlink header → fsync dir → drop references; a block whose
count reaches zero is deleted by ``gc`` after a grace period.

``BlockWriter`` writes a store's blocks outside the directory lock;
``Commits.publish`` does the rest under it. A crash at any point leaves
references too high (a leak recovery gives back), never a header whose
blocks are gone. Each step is told which index to work on; the store decides
when to write, what to refuse and what to remove.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from . import blocks as blk
from . import writers
from .directory import Directory
from .errors import CorruptError
from .fs import FileLayer, refuse_linked
from .header import Header
from .index import Index
from .pool import LocalPool, Staged
from .writers import IntentFile


class Commits:
    def __init__(self, directory: Directory, intents: IntentFile, fs: FileLayer, clock: Callable[[], float],
                 warn: Callable[[str, str], None]) -> None:
        self._dir = directory
        self._pool = directory.pool
        self._intents = intents
        self._fs = fs
        self._clock = clock
        self._warn = warn

    def publish(self, index: Index, writer: BlockWriter, layout: blk.EntryLayout, header: Header, encoded: bytes,
                entry_id: str, path: Path) -> int:
        """Under the lock, once ``writer``'s blocks are durable: references, then
        the header (``encoded``), then the entry in the index, recorded from
        ``header`` as recovery would record it. Returns the bytes written."""
        written = writer.ensure_present(layout)  # a deleter may have taken any block since we saw it
        index.take_refs(entry_id, self._dir.rel(path), writer.sizes)
        writer.referenced = True
        writer.release()  # referenced now: the refcounts protect them
        self._fs.crash_point("store:refs-taken")
        refuse_linked(path.parent)
        self._fs.makedirs(path.parent)
        written += self._fs.write_atomic(path, [encoded], tag=self._intents.token)
        self._fs.crash_point("store:header-written")
        index.add_entry(self._dir.record(entry_id, path, header, len(encoded)), self._clock())
        writer.referenced = False
        return written

    def delete_unreferenced(self, index: Index, names: Iterable[str]) -> None:
        """Under the lock: delete the blocks of ``names`` that nothing references
        and no live writer (of any handle) may still reference."""
        live = writers.survey(self._intents.directory)
        for name in names:
            if name not in live.names and index.block(name) is None:
                self._pool.delete(name)

    def undo(self, index: Index, entry_id: str, path: Path) -> None:
        """Under the lock: give back the references of a store that failed after taking them."""
        self._dir.unlink_quietly(path)
        index.rollback_pending(entry_id, self._clock())

    def remove(self, index: Index, entry_id: str) -> None:
        """Under the lock: unlink the header first, then drop its references (a crash between leaks, never dangles)."""
        record = index.entry(entry_id)
        if record is not None:
            try:  # derived from (ns, id), never the record's path: the index is not trusted as a path
                path: Path | None = self._dir.header_path(record.ns, entry_id)
            except CorruptError as exc:
                self._warn("index-path", f"index row {entry_id[:80]!r} is not ours ({exc}); dropping the row only")
                path = None
            if path is not None and path.parent.is_symlink():
                path = None  # what is behind a linked namespace directory is not ours
            if path is not None:
                try:
                    self._fs.unlink(path)
                except FileNotFoundError:
                    pass
                self._fs.fsync_dir(path.parent)
            self._fs.crash_point("remove:header-unlinked")
            index.remove_entry(entry_id, self._clock())


class BlockWriter:
    """The blocks of one store: which the pool lacks, written in the background.

    Every block it touches is declared in the handle's intent file before it
    looks for it, and stays declared until the store references it or gives
    up (writers.py): deleters spare it meanwhile."""

    def __init__(self, pool: LocalPool, index: Index, intents: IntentFile, io: ThreadPoolExecutor,
                 compression: str | None) -> None:
        self._pool, self._index, self._intents, self._io = pool, index, intents, io
        self._compression = compression
        self.sizes: dict[str, int] = {}  # stored bytes of every block the entry references
        self.new: set[str] = set()  # blocks this store wrote
        self.referenced = False  # its references are taken and its entry not yet added: undo, not discard
        self._declared: list[str] = []
        self._writes: list[Future[Staged]] = []

    def submit(self, block: blk.Block) -> None:
        name = block.ref.name
        self._intents.add([name])
        self._declared.append(name)
        row = self._index.block(name)
        if row is not None and self._pool.exists(name):  # a dedup hit
            self.sizes[name] = row.size
            return
        self._writes.append(self._io.submit(self._pool.stage, name, self._frame(block), tag=self._intents.token))

    def wait(self) -> int:
        """Bytes written, once every block is durable under its name (re-raises
        the first failure). Blocks are published as one batch: one fsync per
        shard directory rather than one per block."""
        staged, failure = [], None
        for f in self._writes:
            try:
                staged.append(f.result())
            except BaseException as exc:  # noqa: BLE001 - re-raised once every write has settled
                failure = failure or exc
        if failure is not None:
            self._pool.unstage(staged)
            raise failure
        return self._pool.publish(staged)

    def ensure_present(self, layout: blk.EntryLayout) -> int:
        """Under the lock, right before taking references: every block of the
        entry, new or reused, is in the pool; any that a deleter took since
        ``submit`` is written again. Returns the bytes that took."""
        written = 0
        for block in layout.blocks:
            name = block.ref.name
            if not self._pool.exists(name):
                written += self._pool.write(name, self._frame(block), tag=self._intents.token)
        return written

    def _frame(self, block: blk.Block) -> list[bytes | memoryview]:
        """The block's stored bytes; it counts as written by this store, at that size."""
        frame = blk.encode_block(block, self._compression)
        self.sizes[block.ref.name] = sum(memoryview(p).nbytes for p in frame)
        self.new.add(block.ref.name)
        return frame

    def abandon(self) -> None:
        """Stop: cancel queued writes, wait for running ones, release the names."""
        for f in self._writes:
            f.cancel()
        for f in self._writes:
            try:
                self._pool.unstage([f.result()])  # a tmp file wait() never published
            except BaseException:  # noqa: BLE001 - the failure is reported by the caller
                pass
        self.release()

    def release(self) -> None:
        """Take this store's names out of the intent file (once; later calls do nothing)."""
        names, self._declared = self._declared, []
        if names:
            try:
                self._intents.release(names)
            except OSError:
                pass  # stale names only delay a deletion


class AdoptedBlocks(BlockWriter):
    """The blocks of an entry another node stored (remote.py): each frame the
    pool lacks comes verified from ``frame_of(name)`` (the bucket) instead of
    being encoded, and is written byte for byte, intents and re-checks as for
    any store. Submit ``adopted_layout(header).blocks``."""

    def __init__(self, frame_of: Callable[[str], bytes], pool: LocalPool, index: Index, intents: IntentFile,
                 io: ThreadPoolExecutor) -> None:
        super().__init__(pool, index, intents, io, None)
        self._frame_of = frame_of

    def _frame(self, block: blk.Block) -> list[bytes | memoryview]:
        name = block.ref.name
        frame = self._frame_of(name)
        self.sizes[name] = len(frame)
        self.new.add(name)
        return [frame]


def adopted_layout(header: Header) -> blk.EntryLayout:
    """An entry's layout as its header states it: the block names without their
    bytes (``AdoptedBlocks`` fetches those), for ``Commits.publish``."""
    refs = blk.blocks_for_prefix(blk.parse_descriptor(header.descriptor), None)
    unique = {r.name: r for r in refs}
    return blk.EntryLayout(header.descriptor, [blk.Block(r, [], []) for r in unique.values()])
