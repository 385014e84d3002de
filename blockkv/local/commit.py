"""The write and delete order of one fingerprint directory's entries.

Write order of a store (docs/design.md says why each step is where it is):
blocks (tmp → fsync → rename → fsync dir) → references (LMDB, recorded as
pending) → header (tmp → fsync → rename → fsync dir) → entry visible → success.
Delete order: unlink header → fsync dir → drop references; a block whose
count reaches zero is deleted by ``gc`` after a grace period.

``Commits.store`` runs that order for one entry: ``BlockWriter`` writes its
blocks outside the directory lock, ``Commits.publish`` does the rest under
it; a store refused or failed is undone. A crash at any point leaves
references too high (a leak recovery gives back), never a header whose
blocks are gone. The store decides the cap, the rules once an entry is
visible, and what to remove.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import lmdb
import numpy as np

from blockkv.errors import BlockKVError, CorruptError, LockTimeout
from blockkv.format.blocks import Block, EntryLayout, Snapshot, block_naming_key, split_entry
from blockkv.format.descriptor import blocks_for_prefix
from blockkv.format.frame import encode_block
from blockkv.format.header import Header, Identity, encode_header
from blockkv.fs import FileLayer, refuse_linked
from blockkv.local import writers
from blockkv.local.directory import Directory, new_entry_id
from blockkv.local.index import Index
from blockkv.local.index_keeper import IndexKeeper
from blockkv.local.writers import IntentFile
from blockkv.pool.local import LocalPool
from blockkv.pool.protocol import Staged
from blockkv.records import Entry, GenerationCheckpoint


@dataclass
class Stored:
    """A store that landed: what the facade counts and uploads."""

    entry_id: str
    encoded: bytes  # its header
    layout: EntryLayout
    new: set[str]  # the blocks it wrote (the others were deduplicated)
    written: int  # bytes
    replaced: list[Entry]  # what the rules removed for it

    @property
    def deduplicated(self) -> int:
        return sum(b.ref.raw_bytes for b in self.layout.blocks if b.ref.name not in self.new)


class Commits:
    def __init__(self, directory: Directory, identity: Identity, intents: IntentFile, fs: FileLayer,
                 clock: Callable[[], float], warn: Callable[..., None], *, keeper: IndexKeeper,
                 locked: Callable[[], AbstractContextManager[object]],
                 executor: Callable[[str], ThreadPoolExecutor], block_tokens: int, compression: str | None) -> None:
        """``keeper``: the handle's index (``keeper.index``, reopened when replaced); ``locked``: the directory lock."""
        self._dir = directory
        self._pool = directory.pool
        self._identity = identity
        self._intents = intents
        self._fs = fs
        self._clock = clock
        self._warn = warn
        self._keeper = keeper
        self._locked = locked
        self._executor = executor
        self._block_tokens = block_tokens
        self._compression = compression

    def store(self, tokens: np.ndarray, ns: str, snap: Snapshot, checkpoint: GenerationCheckpoint | None,
              cap: int, landed: Callable[[str], list[Entry]]) -> Stored | None:
        """One entry in write order: blocks, then (refused past ``cap`` bytes)
        under the lock ``publish`` and ``landed(entry_id)``, the store's rules
        (returns the entries they removed). None, with a warning and its traces
        undone, if it was refused or failed."""
        entry_id = new_entry_id(self._clock())
        path = self._dir.header_path(ns, entry_id)
        writer = BlockWriter(self._pool, self._keeper.index, self._intents, self._executor("io"), self._compression)
        try:
            # each new block is written (outside the lock: the slow part) while the next is hashed
            layout = split_entry(snap, self._block_tokens, on_block=writer.submit,
                                     key=block_naming_key(self._identity, ns), hashers=self._executor("hash"))
            header = Header(self._identity, ns, tokens, layout.descriptor,
                            checkpoint.to_json() if checkpoint else None, layout.block_xxh3)
            encoded = encode_header(header)
            entry_bytes = len(encoded) + sum(writer.sizes.values())
            if entry_bytes > cap:
                self._warn("cap", f"entry not stored: {entry_bytes} bytes exceeds the {cap}-byte cap", once=False)
                self.discard(writer)
                return None
            writer.stage_header(path, encoded)  # its tmp file is written and fsync'd beside the blocks
            written = writer.wait()
            self._fs.crash_point("store:blocks-written")
            with self._locked():
                written += self.publish(self._keeper.index, writer, layout, header, encoded, entry_id, path)
                replaced = landed(entry_id)
        except Exception as exc:  # noqa: BLE001 - a failed store must never take serving down
            if writer.referenced:
                self.undo(entry_id, path)
            elif isinstance(exc, LockTimeout):
                writer.abandon()  # what it wrote is garbage for the next gc: waiting again to delete it helps nobody
            else:
                self.discard(writer)
            reason = "the directory lock is busy" if isinstance(exc, LockTimeout) else "disk full or unwritable?"
            self._warn("store", f"store failed ({reason}); entry not stored: {exc}")
            return None
        finally:
            writer.release()
        return Stored(entry_id, encoded, layout, writer.new, written, replaced)

    def adopt(self, entry_id: str | None, header: Header, encoded: bytes, frame_of: Callable[[str], bytes], cap: int,
              landed: Callable[[str], object]) -> bool:
        """A remote entry made local by a store's write order: the blocks the pool
        lacks (``frame_of``: verified frames from the bucket), then its header,
        byte for byte under its own id (None: a new entry's id, as a store's), and
        ``landed(entry_id)`` under the lock; nothing if another handle adopted it
        meanwhile. False (with a warning) if it could not be."""
        entry_id = entry_id or new_entry_id(self._clock())
        path = self._dir.header_path(header.ns, entry_id)
        layout = adopted_layout(header)
        writer = AdoptedBlocks(frame_of, self._pool, self._keeper.index, self._intents, self._executor("io"))
        try:
            for block in layout.blocks:
                writer.submit(block)
            writer.wait()
            if len(encoded) + sum(writer.sizes.values()) > cap:
                raise BlockKVError(f"the entry exceeds the {cap}-byte local cap")
            with self._locked():
                if self._keeper.index.entry(entry_id) is None:
                    self.publish(self._keeper.index, writer, layout, header, encoded, entry_id, path)
                    landed(entry_id)
        except Exception as exc:  # noqa: BLE001 - a restore must never take serving down
            if writer.referenced:
                self.undo(entry_id, path)
            else:
                self.discard(writer)
            self._warn("remote-adopt", f"remote entry {entry_id} not restored: {exc!r}")
            return False
        finally:
            writer.release()
        return True

    def discard(self, writer: BlockWriter) -> None:
        """A refused or failed store: delete the blocks it wrote that nothing
        references and no live writer (of any handle) may still reference."""
        writer.abandon()
        try:
            with self._locked():
                self.delete_unreferenced(self._keeper.index, writer.new)
        except (OSError, lmdb.Error, BlockKVError):
            pass  # left as garbage: the next gc reclaims it

    def publish(self, index: Index, writer: BlockWriter, layout: EntryLayout, header: Header, encoded: bytes,
                entry_id: str, path: Path) -> int:
        """Under the lock, once ``writer``'s blocks are durable: references, then
        the header (``encoded``), then the entry in the index, recorded from
        ``header`` as recovery would record it. Returns the bytes written."""
        written = writer.ensure_present(layout)  # a deleter may have taken any block since we saw it
        index.take_refs(entry_id, self._dir.rel(path), writer.sizes)
        writer.referenced = True
        writer.release()  # referenced now: the refcounts protect them
        try:
            self._fs.crash_point("store:refs-taken")
            written += writer.publish_header(path, encoded)
        except BaseException:
            writer.drop_header()
            raise
        self._fs.crash_point("store:header-written")
        now = self._clock()
        self._dir.mark_used(path, now)  # stored counts as used, in the file as in the index
        index.add_entry(self._dir.record(entry_id, path, header, len(encoded)), now)
        writer.referenced = False
        return written

    def delete_unreferenced(self, index: Index, names: Iterable[str]) -> None:
        """Under the lock: delete the blocks of ``names`` that nothing references
        and no live writer (of any handle) may still reference (none at all while
        a live writer's intents are unread)."""
        live = writers.survey(self._intents.directory)
        for name in names if live.complete else ():
            if name not in live.names and index.block(name) is None:
                self._pool.delete(name)

    def undo(self, entry_id: str, path: Path) -> None:
        """Give back the references of a store that failed after taking them.
        Under the lock, or not at all: its ``pending`` record lets recovery do it."""
        try:
            with self._locked():
                self._dir.unlink_quietly(path)
                self._keeper.index.rollback_pending(entry_id, self._clock())
        except (OSError, lmdb.Error, BlockKVError) as exc:
            self._warn("undo", f"could not undo a failed store ({exc}); check(repair=True) reclaims it")


def remove_entry(directory: Directory, fs: FileLayer, clock: Callable[[], float], warn: Callable[..., None],
                 index: Index, entry_id: str) -> None:
    """Under the lock: unlink the header first, then drop its references (a crash between leaks, never dangles)."""
    record = index.entry(entry_id)
    if record is not None:
        try:  # derived from (ns, id), never the record's path: the index is not trusted as a path
            path: Path | None = directory.header_path(record.ns, entry_id)
        except CorruptError as exc:
            warn("index-path", f"index row {entry_id[:80]!r} is not ours ({exc}); dropping the row only")
            path = None
        if path is not None and path.parent.is_symlink():
            path = None  # what is behind a linked namespace directory is not ours
        if path is not None:
            try:
                fs.unlink(path)
            except FileNotFoundError:
                pass
            fs.fsync_dir(path.parent)
        fs.crash_point("remove:header-unlinked")
        index.remove_entry(entry_id, clock())


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
        self._header: tuple[Path, int] | None = None  # the header's durable tmp file and its size

    def submit(self, block: Block) -> None:
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

    def stage_header(self, path: Path, encoded: bytes) -> None:
        """Write the entry's header to a durable tmp file beside ``path`` (named
        with this writer's token), on the caller's thread while the I/O threads
        write the blocks, so that under the lock ``publish_header`` only renames
        it. Invisible until then: no header names a block before it is durable."""
        refuse_linked(path.parent)
        self._pool.fs.makedirs(path.parent)
        self._header = self._pool.fs.write_tmp(path, [encoded], tag=self._intents.token)

    def publish_header(self, path: Path, encoded: bytes) -> int:
        """Under the lock, after the references: the header under its name,
        durably (rename of the staged tmp, or tmp → fsync → rename without
        one, then fsync of its directory). Returns the bytes written."""
        fs = self._pool.fs
        if self._header is None:
            refuse_linked(path.parent)
            fs.makedirs(path.parent)
            return fs.write_atomic(path, [encoded], tag=self._intents.token)
        tmp, nbytes = self._header
        fs.replace(tmp, path)
        self._header = None
        fs.fsync_dir(path.parent)
        return nbytes

    def drop_header(self) -> None:
        """Remove the staged header's tmp file, if one was staged and not renamed."""
        header, self._header = self._header, None
        if header is not None:
            self._pool.fs.unlink_tmp(header[0])

    def ensure_present(self, layout: EntryLayout) -> int:
        """Under the lock, right before taking references: every block of the
        entry, new or reused, is in the pool; any that a deleter took since
        ``submit`` is written again. Returns the bytes that took."""
        written = 0
        for block in layout.blocks:
            name = block.ref.name
            if not self._pool.exists(name):
                written += self._pool.write(name, self._frame(block), tag=self._intents.token)
        return written

    def _frame(self, block: Block) -> list[bytes | memoryview]:
        """The block's stored bytes; it counts as written by this store, at that size."""
        frame = encode_block(block, self._compression)
        self.sizes[block.ref.name] = sum(memoryview(p).nbytes for p in frame)
        self.new.add(block.ref.name)
        return frame

    def abandon(self) -> None:
        """Stop: cancel queued writes, wait for running ones, remove their tmp
        files (and a staged header's), release the names."""
        self.drop_header()
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
    """The blocks of an entry another node stored (the bucket, remote/tier.py): each frame the
    pool lacks comes verified from ``frame_of(name)`` (the bucket) instead of
    being encoded, and is written byte for byte, intents and re-checks as for
    any store. Submit ``adopted_layout(header).blocks``."""

    def __init__(self, frame_of: Callable[[str], bytes], pool: LocalPool, index: Index, intents: IntentFile,
                 io: ThreadPoolExecutor) -> None:
        super().__init__(pool, index, intents, io, None)
        self._frame_of = frame_of

    def _frame(self, block: Block) -> list[bytes | memoryview]:
        name = block.ref.name
        frame = self._frame_of(name)
        self.sizes[name] = len(frame)
        self.new.add(name)
        return [frame]


def adopted_layout(header: Header) -> EntryLayout:
    """An entry's layout as its header states it: the block names without their
    bytes (``AdoptedBlocks`` fetches those), for ``Commits.publish``."""
    refs = blocks_for_prefix(header.descriptor, None)
    unique = {r.name: r for r in refs}
    return EntryLayout(header.descriptor, [Block(r, [], []) for r in unique.values()])
