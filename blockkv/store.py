"""BlockStore: the SSD cold tier for MLX prompt/KV caches, as policy.

The public facade and its decisions: the seed's find/trim/supersede rules,
the byte cap and LRU eviction, what a failure proves, when to recover, the
stats. The mechanisms are below it, each with one job: arguments.py (caller
mistakes), catalog.py (the in-memory lookups), commit.py (write and delete
order), restore.py (reading an entry back), recovery.py (what ``scan``
repairs), check.py (check/repair), over directory.py, pool.py, index.py.
Every mutation holds the directory lock, so a dedup hit and a gc delete
never interleave.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import lmdb
import numpy as np

from . import blocks as blk
from . import writers
from .arguments import check_ns, check_options, check_prefix_len, check_size, prepare_store, tokens_array
from .catalog import Catalog
from .check import CheckReport, inspect, verify_blocks
from .check import repair as repair_directory
from .commit import AdoptedBlocks, BlockWriter, Commits, adopted_layout
from .directory import CODEC_ID, KEYED_CODEC_ID, Directory, block_key, fingerprint_dirname, read_identity
from .directory import ROOT_MARKER, FingerprintDir, list_fingerprints  # noqa: F401 - public names of blockkv.store
from .errors import BlockKVError, BlockMissingError, CorruptBlockError, CorruptError, LockTimeout
from .fs import FileLayer
from .header import Header, Identity, encode_header
from .index import BROKEN_INDEX, Index
from .locks import DirLock
from .records import CHECKPOINT_NS, Entry, EntryRecord, GenerationCheckpoint, Loaded, Match
from .recovery import Recovery
from .restore import EntryRead
from .writers import IntentFile

if TYPE_CHECKING:
    from .bucket import Bucket
    from .remote import RemoteTier

log = logging.getLogger("blockkv")
_T = TypeVar("_T")

DEFAULT_GC_GRACE = 60.0  # seconds a block freed by eviction is kept for reuse (policy, not safety)
_IO_THREADS = 2  # fsyncs of different files overlap; more did not help on 2 cores
_SERVING_WAIT = 0.2  # the longest a restore waits for the lock (to drop a failed entry)


def _open_only(method: Callable[..., _T]) -> Callable[..., _T]:
    """Refuse a call on a closed handle, or on one inherited through fork (LMDB
    and flock state do not survive fork: the child must open its own)."""

    @functools.wraps(method)
    def guarded(self: BlockStore, *args: Any, **kwargs: Any) -> _T:
        if self._closed:
            raise ValueError("store is closed")
        if os.getpid() != self._pid:
            raise RuntimeError(f"this BlockStore was opened in process {self._pid} and used in a child "
                               f"created by fork ({os.getpid()}): open a new BlockStore in the child")
        return method(self, *args, **kwargs)

    return guarded


class BlockStore:
    """Prompt/KV caches on disk as header files over a deduplicated block pool.

    Safe across threads and across processes sharing one root. Every failure
    on the serving path degrades to "no hit" or "not stored" with a warning;
    only wrong arguments raise.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        model_id: str,
        config_fingerprint: str,
        tokenizer_hash: str,
        max_bytes: int,
        limit: Callable[[], int] | None = None,
        block_tokens: int = blk.DEFAULT_BLOCK_TOKENS,
        compression: str | None = None,
        verify: bool | str = True,
        fs: FileLayer | None = None,
        clock: Callable[[], float] = time.time,
        gc_grace: float = DEFAULT_GC_GRACE,
        tmp_grace: float = writers.DEFAULT_TMP_GRACE,
        index_map_size: int = 256 << 20,
        lock_timeout: float = 10.0,
        isolate_namespaces: bool = False,
        remote: str | None = None,
        remote_options: Mapping[str, str] | None = None,
    ) -> None:
        check_options(model_id=model_id, config_fingerprint=config_fingerprint, tokenizer_hash=tokenizer_hash,
                      max_bytes=max_bytes, limit=limit, block_tokens=block_tokens, compression=compression,
                      verify=verify, gc_grace=gc_grace, tmp_grace=tmp_grace, lock_timeout=lock_timeout,
                      isolate_namespaces=isolate_namespaces)
        self.root = Path(root).expanduser()
        self.isolate_namespaces = isolate_namespaces
        # the codec id in every header says how its blocks are named; the two modes' entries are foreign to each other
        self.identity = Identity(model_id, config_fingerprint, tokenizer_hash,
                                 KEYED_CODEC_ID if isolate_namespaces else CODEC_ID)
        self._owner = self.identity.digest()
        self.directory = self.root / fingerprint_dirname(config_fingerprint)
        self.block_tokens = block_tokens
        self.compression = compression
        self.verify = verify
        self.gc_grace = float(gc_grace)
        self.tmp_grace = float(tmp_grace)
        self.lock_timeout = float(lock_timeout)
        self._max_bytes = max_bytes
        self._limit = limit
        self._fs = fs or FileLayer()
        self._clock = clock
        self._map_size = index_map_size
        self._dir = Directory(self.directory, self.identity, self._fs)
        self._pool = self._dir.pool
        self._warned: set[str] = set()
        self.stats: dict[str, float] = dict.fromkeys(
            ("restores", "spills", "restore_ms_last", "bytes_written", "bytes_deduplicated"), 0)
        self._mutex = threading.Lock()  # the executors of this handle
        self._executors: dict[str, ThreadPoolExecutor] = {}  # store_async, restore_async, block I/O
        self._closed = False
        self._pid = os.getpid()
        self._remote: RemoteTier | None = None  # the bucket tier (remote.py); local invariants stay as they are
        if remote is not None or remote_options is not None:
            if remote is None:
                raise ValueError("remote_options given without remote")
            from .remote import RemoteTier  # needs obstore: pip install 'blockkv[s3]'
            self._remote = RemoteTier(remote, remote_options, self.identity, self._dir, self._warn,
                                      self._every_entry, self._adopt)
        self._dir.create(self.root)
        self._lock = DirLock(self.directory / "LOCK")
        self._intents = IntentFile(self.directory / "writers")
        self._commits = Commits(self._dir, self._intents, self._fs, clock, self._warn)
        self._recovery = Recovery(self._dir, self._intents.directory, self._fs, clock, self._owner,
                                  tmp_grace=self.tmp_grace, map_size=index_map_size, warn=self._warn)
        self._needs_recovery = False  # open could not take the lock: recover at the first mutation
        self._catalog = Catalog(self._owner, clock)
        try:
            self._index = Index(self._dir.index_dir, map_size=index_map_size)
        except BROKEN_INDEX as exc:
            with self._lock.held(self.lock_timeout):
                self._warn("index", f"LMDB index unusable ({exc}); rebuilding from headers")
                self._index = self._recovery.fresh_index()
        try:
            self.scan()
        except LockTimeout:
            self._warn("lock", "directory lock busy at open: serving the index as it is, recovering later")
            self._needs_recovery = True
            if self._index.is_trusted():
                self._catalog.load(self._index)
        if self._remote is not None:
            try:
                self._remote.open()  # learns every header in the bucket; another model's IDENTITY raises
            except BaseException:
                self.close()
                raise

    @classmethod
    def open_dir(cls, directory: str | os.PathLike[str], *, max_bytes: int | None = None,
                 **kwargs: Any) -> BlockStore:
        """Open an existing fingerprint directory with the identity it records (for tools)."""
        d = Path(directory).expanduser()
        ident = read_identity(d, kwargs.get("fs"))
        return cls(d.parent, model_id=ident.model_id, config_fingerprint=ident.config_fingerprint,
                   tokenizer_hash=ident.tokenizer_hash, max_bytes=max_bytes if max_bytes is not None else 1 << 62,
                   **kwargs)

    # -- lifecycle ------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        if os.getpid() != self._pid:  # a forked child's copy: the parent still owns the environment
            self._closed = True
            return
        for pool in self._executors.values():  # pending writes finish before the handle closes
            pool.shutdown(wait=True)
        if self._remote is not None:
            self._remote.close()
        self._closed = True
        self._intents.close()
        self._index.close()
        self._lock.close()

    def __enter__(self) -> BlockStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- recovery ---------------------------------------------------------------
    @_open_only
    def scan(self) -> int:
        """Recover and index: reap stale tmp files, trust or rebuild the LMDB
        tables, reconcile them with a directory listing, reclaim unreferenced
        blocks. What had to be fixed is left in ``self.recovery``. Returns the
        number of entries indexed."""
        self._recovery.notes = []
        with self._lock.held(self.lock_timeout):
            if self._needs_recovery or self._index.replaced():
                self._reopen_index()  # recovers too
            else:
                self._recover_locked()
        return len(self)

    @contextmanager
    def _locked(self, timeout: float | None = None) -> Iterator[None]:
        """The directory lock for a mutation (``LockTimeout`` after ``timeout``,
        default ``lock_timeout``), with the index checked current first: one
        replaced under us (deleted by an operator, moved aside by another
        process's rebuild) is reopened and recovered before anything trusts it."""
        with self._lock.held(self.lock_timeout if timeout is None else timeout):
            if self._needs_recovery or self._index.replaced():
                self._reopen_index()
            yield

    def _reopen_index(self) -> None:
        """Under the lock: drop our environment, open what is on disk now, recover."""
        try:
            self._index.close()
        except lmdb.Error:
            pass
        try:
            self._index = Index(self._dir.index_dir, map_size=self._map_size)
        except BROKEN_INDEX as exc:
            self._warn("index", f"LMDB index unusable ({exc}); rebuilding from headers")
            self._index = self._recovery.fresh_index()
        self._recover_locked()
        self._needs_recovery = False

    def _recover_locked(self) -> None:
        """The body of ``scan``; the caller holds the directory lock."""
        finished: list[str] = []
        records: list[EntryRecord] | None = None
        listing = self._dir.listing()  # one listing serves every step below
        live = writers.survey(self._intents.directory)
        self._recovery.reap_tmp(listing.tmp, live)
        files = listing.blocks
        try:
            if self._index.is_trusted():
                records = self._index.entries()
                finished = self._recovery.roll_back_pending(self._index, records)
                if finished:
                    records = self._index.entries()
                if self._recovery.reconcile(self._index, records, listing.headers, files) or finished:
                    records = None  # changed: reload below
            else:
                self._note("index missing, from another format or from before an OS restart: rebuilt")
                self._recovery.rebuild(self._index)
        except (CorruptError, *BROKEN_INDEX) as exc:
            # a record that does not parse: the tables are garbage but the environment works;
            # liblmdb's proof that the environment itself is broken: it is moved aside first
            self._warn("index", f"LMDB index unusable ({exc}); rebuilding from headers")
            self._note(f"index unreadable ({exc}): rebuilt")
            records = None
            if isinstance(exc, BROKEN_INDEX):
                self._index.close()
                self._index = self._recovery.fresh_index()
            self._recovery.rebuild(self._index)
        self._recovery.sweep_orphans(self._index, self.gc_grace, files, live)
        self._catalog.load(self._index, records)
        self._finish_dead_stores(finished)

    def _finish_dead_stores(self, finished: list[str]) -> None:
        """Stores that died after their header landed, indexed now by the
        roll-back of their pending references: apply the rules and the cap
        their store would have applied."""
        for entry_id in finished:
            entry = self._catalog.get(entry_id)
            if entry is not None:
                self._apply_store_rules(entry)
        if finished:
            self.evict_to_cap()

    @_open_only
    def rebuild_index(self) -> int:
        """Throw the LMDB tables away and rebuild them from the header files."""
        with self._locked():
            self._recovery.rebuild(self._index)
            self._catalog.load(self._index)
        return len(self)

    def _note(self, finding: str) -> None:
        self._recovery.notes.append(finding)

    @property
    def recovery(self) -> list[str]:
        """What the last ``scan()`` (and any recovery since) had to fix."""
        return self._recovery.notes

    # -- the in-memory catalog ------------------------------------------------------
    def _refresh(self) -> None:
        """Replay what other handles changed since we last looked (cheap when
        nothing did). An index replaced under us is reopened and recovered; if
        that cannot happen now, serve the last known state and retry next call."""
        try:
            if self._needs_recovery or self._index.replaced():
                raise lmdb.Error("the index was replaced on disk")
            self._catalog.apply_changes(self._index)
        except lmdb.Error as exc:
            self._warn("index", f"LMDB index lost ({exc}); reopening and recovering")
            self._needs_recovery = True
            try:
                with self._locked(timeout=0):  # a query never waits for the lock
                    pass
            except (lmdb.Error, OSError, CorruptError) as exc2:
                self._warn("index-reopen", f"could not reopen the LMDB index ({exc2}); serving the last known state")

    # -- the bucket (remote=) -----------------------------------------------------------
    @property
    def remote(self) -> Bucket | None:
        """The bucket this store shares with a fleet (``remote=``), or None."""
        return self._remote.bucket if self._remote is not None else None

    @_open_only
    def sync_remote(self) -> int:
        """List the bucket now: learn entries other nodes stored, forget those
        evicted fleet-wide, upload the backlog. Returns how many entries were
        learned; an outage is a warning and 0, never an exception."""
        return self._remote.sync() if self._remote is not None else 0

    def _every_entry(self) -> list[Entry]:
        self._refresh()
        return self._catalog.every_identity()

    # -- queries (pure index lookups) ------------------------------------------------
    @_open_only
    def __len__(self) -> int:
        self._refresh()
        return len(self._catalog)

    @property
    @_open_only
    def total_bytes(self) -> int:
        """Headers plus every referenced block, each counted once."""
        return self._index.total_bytes()

    @property
    def max_bytes(self) -> int:
        return self._limit() if self._limit is not None else self._max_bytes

    @property
    @_open_only
    def block_count(self) -> int:
        return sum(1 for row in self._index.blocks().values() if row.refs > 0)

    @property
    @_open_only
    def logical_bytes(self) -> int:
        """What one self-contained file per entry would take (no sharing)."""
        return sum(e.nbytes for e in self.entries())

    @_open_only
    def entries(self, ns: str | None = None) -> list[Entry]:
        """Every entry, or (``ns`` given) only that namespace's: a tenant sees its own."""
        if ns is not None:
            check_ns(ns)
        self._refresh()
        return self._catalog.entries(ns)

    @_open_only
    def count(self, ns: str | None = None) -> int:
        """``len(store)``, or (``ns`` given) the entries of that namespace."""
        return len(self) if ns is None else len(self.entries(ns))

    @property
    @_open_only
    def longest_durable_prefix_tokens(self) -> int:
        return self.longest_entry_tokens()

    @_open_only
    def longest_entry_tokens(self, ns: str | None = None) -> int:
        """The longest entry's length, across namespaces or (``ns`` given) in one."""
        return max((e.length for e in self.entries(ns)), default=0)

    @_open_only
    def token_prefixes(self, ns: str | None = None) -> Iterator[tuple[int, ...]]:
        for entry in self.entries(ns):
            yield entry.tokens

    @_open_only
    def has_durable_prefix(self, tokens: Sequence[int], ns: str = "") -> bool:
        arr = tokens_array(tokens)
        check_ns(ns)
        self._refresh()
        return self._catalog.has_durable_prefix(arr, ns) or (
            self._remote is not None and self._remote.has_durable_prefix(arr, ns))

    @_open_only
    def find(self, prompt: Sequence[int], ns: str = "") -> Match | None:
        arr = tokens_array(prompt)
        check_ns(ns)
        self._refresh()
        match = self._catalog.find(arr, ns)
        return match if self._remote is None else self._remote.find(arr, ns, match)

    @_open_only
    def find_exact(self, tokens: Sequence[int], ns: str = "") -> Match | None:
        arr = tokens_array(tokens)
        check_ns(ns)
        self._refresh()
        match = self._catalog.find_exact(arr, ns)
        return match if self._remote is None else self._remote.find(arr, ns, match, exact=True)

    @_open_only
    def find_generation_checkpoint(self, prompt: Sequence[int], key: str, cache_ns: str = "") -> Entry | None:
        arr = tokens_array(prompt)
        self._refresh()
        return self._catalog.generation_checkpoint(arr, key, cache_ns)

    # -- restore ---------------------------------------------------------------------
    @_open_only
    def restore(self, entry: Entry, prefix_len: int | None = None) -> Loaded | None:
        """Rebuild an entry's caches (cut to ``prefix_len`` tokens when given).

        Reads only the blocks that cover the prefix. Any failure warns and
        returns None, never wrong tensors; only proof of corruption (a block
        gone, a hash mismatch, a damaged header) also drops the entry."""
        if not isinstance(entry, Entry):
            raise TypeError(f"restore takes an Entry from find/find_exact, got {type(entry).__name__}")
        p = check_prefix_len(entry, prefix_len)
        cut = None if p == entry.length else p
        t0 = time.perf_counter()
        if self._remote is not None and self._remote.is_remote_only(entry.id):
            self._refresh()  # another handle may have materialised it
            if entry.id not in self._catalog and not self._remote.materialise(entry):
                return None
        read = EntryRead(self._dir, self.identity, entry, self.verify, self._executor("read"))
        try:
            header, caches, attachments = read.run(cut)
        except Exception as exc:  # noqa: BLE001 - a restore must never take serving down
            self._restore_failed(entry, exc, read.culprit(exc))
            return None
        try:
            self._index.touch(entry.id, self._clock())
        except lmdb.Error:
            pass
        self.stats["restores"] += 1
        self.stats["restore_ms_last"] = (time.perf_counter() - t0) * 1000
        if self._remote is not None:
            self._remote.used(entry)
        return Loaded(caches, tuple(header.tokens[:p].tolist()), attachments, entry.checkpoint)

    @_open_only
    def restore_async(self, entry: Entry, prefix_len: int | None = None) -> Future[Loaded | None]:
        check_prefix_len(entry, prefix_len)
        return self._executor("restore").submit(self.restore, entry, prefix_len)

    def _restore_failed(self, entry: Entry, exc: BaseException, reading: str) -> None:
        """Only proof of corruption deletes: a corrupt header or block, or the
        entry's own header or block file gone. Anything else (EMFILE, EIO,
        MemoryError, an exception from mlx or mlx-lm) is a miss that keeps the
        entry, its header and its index row as they were."""
        proof = (isinstance(exc, (CorruptError, BlockMissingError))
                 or (reading == "header" and isinstance(exc, FileNotFoundError)))
        if not proof:
            self._warn("restore-miss", f"restore of entry {entry.id} failed ({exc!r}); kept, served as a miss")
            return
        corrupt_block = reading if isinstance(exc, CorruptBlockError) and reading != "header" else ""
        self._warn("restore", f"restore failed, dropping entry {entry.id}: {exc}")
        try:
            with self._locked(timeout=_SERVING_WAIT):
                self._refresh()
                doomed = {entry.id} if entry.id in self._catalog else set()
                if corrupt_block:  # quarantine: every entry that needs it is damaged too;
                    # the next store of this block writes a good copy
                    self._pool.delete(corrupt_block)
                    doomed |= {e.id for e in self._catalog.entries() if corrupt_block in e.blocks}
                for entry_id in doomed:
                    self._remove_locked(entry_id)
        except (OSError, lmdb.Error, BlockKVError) as exc2:  # LockTimeout included: the next restore retries
            self._warn("remove", f"could not drop entry {entry.id}: {exc2}")

    # -- store --------------------------------------------------------------------------
    @_open_only
    def store(self, tokens: Sequence[int], caches: Sequence[Any], ns: str = "",
              attachments: Mapping[str, Any] | None = None) -> bool:
        """Persist a prompt cache. Returns False (with one warning) on any disk failure;
        with ``remote=``, also while the bucket has not acknowledged it (kept locally, uploaded later)."""
        job = prepare_store(tokens, caches, ns, attachments, None)
        return self._commit(*job)

    @_open_only
    def store_async(self, tokens: Sequence[int], caches: Sequence[Any], ns: str = "",
                    attachments: Mapping[str, Any] | None = None) -> Future[bool]:
        """Snapshot the caches now (the caller may keep using them), write in the background."""
        job = prepare_store(tokens, caches, ns, attachments, None)
        return self._executor("store").submit(self._commit, *job)

    @_open_only
    def store_generation_checkpoint(self, tokens: Sequence[int], caches: Sequence[Any],
                                    checkpoint: GenerationCheckpoint) -> bool:
        """Persist an in-flight generation; older checkpoints of its key go only once it is durable."""
        if not isinstance(checkpoint, GenerationCheckpoint):
            raise TypeError("checkpoint must be a GenerationCheckpoint")
        job = prepare_store(tokens, caches, CHECKPOINT_NS + checkpoint.key, None, checkpoint)
        return self._commit(*job)

    @_open_only
    def remove_generation_checkpoints(self, key: str) -> None:
        try:
            with self._locked():
                self._refresh()
                for entry in self._catalog.entries():
                    if entry.checkpoint is not None and entry.checkpoint.key == key:
                        self._remove_quietly(entry.id)
        except LockTimeout as exc:
            self._warn("lock", f"checkpoints of {key!r} not removed: {exc}")

    def _executor(self, job: str) -> ThreadPoolExecutor:
        """Workers per kind of job, so a restore never queues behind a store:
        "store" and "restore" (the async calls), "io" (a store's block writes)
        and "read" (a restore's block reads and checks), two threads each."""
        with self._mutex:
            pool = self._executors.get(job)
            if pool is None:
                workers = _IO_THREADS if job in ("io", "read") else 1
                pool = self._executors[job] = ThreadPoolExecutor(max_workers=workers,
                                                                 thread_name_prefix=f"blockkv-{job}")
            return pool

    def _commit(self, tokens: np.ndarray, ns: str, snap: blk.Snapshot,
                checkpoint: GenerationCheckpoint | None) -> bool:
        entry_id = uuid.uuid4().hex
        path = self._dir.header_path(ns, entry_id)
        writer = BlockWriter(self._pool, self._index, self._intents, self._executor("io"), self.compression)
        try:
            # each new block is written (outside the lock: the slow part) while the next is hashed
            layout = blk.split_entry(snap, self.block_tokens, on_block=writer.submit,
                                     key=block_key(self.identity, ns))
            written = writer.wait()
            header = Header(self.identity, ns, tokens, layout.descriptor,
                            checkpoint.to_json() if checkpoint else None, layout.block_xxh3)
            encoded = encode_header(header)
            entry_bytes = len(encoded) + sum(writer.sizes.values())
            if entry_bytes > self.max_bytes:
                self._warn("cap", f"entry not stored: {entry_bytes} bytes exceeds the {self.max_bytes}-byte cap",
                           once=False)
                self._discard(writer)
                return False
            self._fs.crash_point("store:blocks-written")
            with self._locked():
                written += self._commits.publish(self._index, writer, layout, header, encoded, entry_id, path)
                self._refresh()
                replaced = self._apply_store_rules(self._catalog.get(entry_id))
                self.evict_to_cap()
        except Exception as exc:  # noqa: BLE001 - a failed store must never take serving down
            if writer.referenced:
                self._undo_store(entry_id, path)
            elif isinstance(exc, LockTimeout):
                writer.abandon()  # what it wrote is garbage for the next gc: waiting again to delete it helps nobody
            else:
                self._discard(writer)
            reason = "the directory lock is busy" if isinstance(exc, LockTimeout) else "disk full or unwritable?"
            self._warn("store", f"store failed ({reason}); entry not stored: {exc}")
            return False
        finally:
            writer.release()
        self.stats["spills"] += 1
        self.stats["bytes_written"] += written
        self.stats["bytes_deduplicated"] += sum(b.ref.raw_bytes for b in layout.blocks if b.ref.name not in writer.new)
        if self._remote is not None and checkpoint is None:  # checkpoints stay local (docs/scale-out.md)
            return self._remote.upload(entry_id, ns, encoded, (b.ref.name for b in layout.blocks), writer.new,
                                       replaced)
        return True

    def _adopt(self, entry_id: str, header: Header, encoded: bytes, frame_of: Callable[[str], bytes]) -> bool:
        """A remote entry made local by a store's write order: the blocks the pool
        lacks (``frame_of``: verified frames from the bucket), then its header,
        byte for byte under its own id. False (with a warning) if it could not be."""
        path = self._dir.header_path(header.ns, entry_id)
        layout = adopted_layout(header)
        writer = AdoptedBlocks(frame_of, self._pool, self._index, self._intents, self._executor("io"))
        try:
            for block in layout.blocks:
                writer.submit(block)
            writer.wait()
            if len(encoded) + sum(writer.sizes.values()) > self.max_bytes:
                raise BlockKVError(f"the entry exceeds the {self.max_bytes}-byte local cap")
            with self._locked():
                self._refresh()
                if entry_id not in self._catalog:  # not adopted meanwhile by another handle
                    self._commits.publish(self._index, writer, layout, header, encoded, entry_id, path)
                    self._refresh()
                    self._remote.remove_replaced(self._apply_store_rules(self._catalog.get(entry_id)))
            self.evict_to_cap()
        except Exception as exc:  # noqa: BLE001 - a restore must never take serving down
            if writer.referenced:
                self._undo_store(entry_id, path)
            else:
                self._discard(writer)
            self._warn("remote-adopt", f"remote entry {entry_id} not restored: {exc!r}")
            return False
        finally:
            writer.release()
        return True

    def _discard(self, writer: BlockWriter) -> None:
        """A refused or failed store: delete the blocks it wrote that nothing
        references and no live writer (of any handle) may still reference."""
        writer.abandon()
        try:
            with self._locked():
                self._commits.delete_unreferenced(self._index, writer.new)
        except (OSError, lmdb.Error, BlockKVError):
            pass  # left as garbage: the next gc reclaims it

    def _undo_store(self, entry_id: str, path: Path) -> None:
        """Give back the references of a store that failed after taking them.
        Under the lock, or not at all: its ``pending`` record lets recovery do it."""
        try:
            with self._locked():
                self._commits.undo(self._index, entry_id, path)
        except (OSError, lmdb.Error, BlockKVError) as exc:
            self._warn("undo", f"could not undo a failed store ({exc}); check(repair=True) reclaims it")

    def _apply_store_rules(self, new: Entry) -> list[Entry]:
        """Replace an identical entry; let a trimmable entry supersede its prefixes;
        a checkpoint supersedes older checkpoints of its key (all after it is durable).
        Returns the entries removed."""
        doomed = [e for e in self._catalog.prefixes_of(new.ns, new.token_array)  # same ns, tokens a prefix of the new ones
                  if e is not new and (e.length == new.length  # identical: replaced
                                       or (new.trimmable and e.length >= new.minimum_reusable_offset))]
        if new.checkpoint is not None:  # its namespace holds only this key's checkpoints
            doomed += [e for e in self._catalog.in_namespace(new.ns) if e is not new and e.checkpoint is not None
                       and e.checkpoint.key == new.checkpoint.key]
        for entry in dict.fromkeys(doomed):
            self._remove_quietly(entry.id)
        return list(dict.fromkeys(doomed))

    # -- remove, evict, gc --------------------------------------------------------------------
    @_open_only
    def remove(self, entry: Entry) -> None:
        if not isinstance(entry, Entry):
            raise TypeError(f"remove takes an Entry, got {type(entry).__name__}")
        try:
            with self._locked():
                self._refresh()
                self._remove_quietly(entry.id)
        except LockTimeout as exc:
            self._warn("lock", f"entry {entry.id} not removed: {exc}")

    def _remove_quietly(self, entry_id: str) -> None:
        try:
            self._remove_locked(entry_id)
        except (OSError, lmdb.Error, BlockKVError) as exc:
            self._warn("remove", f"could not remove entry {entry_id}: {exc}")

    def _remove_locked(self, entry_id: str) -> None:
        """Remove an entry from the files and the index (``Commits.remove``), then from the catalog."""
        self._commits.remove(self._index, entry_id)
        self._refresh()
        self._catalog.drop(entry_id)

    @_open_only
    def evict_plan(self, target_bytes: int) -> list[Entry]:
        """The entries eviction down to ``target_bytes`` would remove, LRU first. Changes nothing."""
        check_size("target_bytes", target_bytes)
        return self._plan(target_bytes)

    def _plan(self, target_bytes: int) -> list[Entry]:
        total = self.total_bytes
        if total <= target_bytes:  # the common case: every store checks the cap
            return []
        self._refresh()
        last_use = self._index.last_use()
        entries = sorted(self._catalog.every_identity(), key=lambda e: last_use.get(e.id, 0.0))
        rows = self._index.blocks()
        refs = {n: row.refs for n, row in rows.items()}
        plan = []
        for entry in entries:
            if total <= target_bytes:
                break
            plan.append(entry)
            total -= entry.header_bytes
            for name in dict.fromkeys(entry.blocks):
                if name in refs:
                    refs[name] -= 1
                    if refs[name] == 0:
                        total -= rows[name].size
        return plan

    @_open_only
    def evict_to(self, target_bytes: int) -> list[Entry]:
        """Remove least recently used entries until ``total_bytes <= target_bytes``."""
        check_size("target_bytes", target_bytes)
        try:
            with self._locked():
                plan = self._plan(target_bytes)
                for entry in plan:
                    self._remove_quietly(entry.id)
                if plan:
                    self._sweep_quietly()
        except LockTimeout as exc:
            self._warn("lock", f"eviction skipped: {exc}")
            return []
        return plan

    @_open_only
    def evict_to_cap(self) -> None:
        self.evict_to(self.max_bytes)

    @_open_only
    def gc(self) -> int:
        """Give back the references of stores whose writer died, then delete
        blocks nothing references and no live writer may (see
        ``Recovery.sweep_orphans``) and dead writers' temp files; returns how many blocks.

        A ``pending`` record seen under the lock is a dead writer's: a live
        store holds the lock from taking its references to making its entry
        visible, so recovery's roll-back is safe here too."""
        try:
            with self._locked():
                if self._index.pending():
                    finished = self._recovery.roll_back_pending(self._index, self._index.entries())
                    self._refresh()
                    self._finish_dead_stores(finished)
                n = self._recovery.sweep_orphans(self._index, self.gc_grace)
                self._index.trim_log()
        except LockTimeout as exc:
            self._warn("lock", f"gc skipped: {exc}")
            return 0
        return n

    def _sweep_quietly(self) -> None:
        try:
            self._recovery.sweep_orphans(self._index, self.gc_grace)
        except (OSError, lmdb.Error, BlockKVError) as exc:
            self._warn("gc", f"gc failed: {exc}")

    @_open_only
    def check(self, repair: bool = False,
              progress: Callable[[int, int], None] | None = None) -> CheckReport:
        """Compare the index with the files and verify every block hash.

        Returns findings rather than raising. ``repair=True`` fixes refcounts,
        removes dangling and corrupt entries, and deletes unreferenced blocks
        no live writer may still reference. The block hashes, the slow part,
        are checked without the directory lock; the comparison of files and
        index runs under it, so a busy, healthy root reports clean.
        ``LockTimeout`` if the lock is not had within ``lock_timeout``."""
        verified = verify_blocks(self._dir, progress)
        with self._locked():
            report = inspect(self._dir, self._index.blocks(), verified=verified,
                             tmp_cutoff=self._clock() - self.tmp_grace)
            if repair and not report.clean:
                repair_directory(self._dir, report)
                self._recovery.rebuild(self._index)
                report.actions.append("rebuilt the index from the headers")
                self._catalog.load(self._index)
        return report

    # -- helpers ---------------------------------------------------------------------------------
    def _warn(self, kind: str, message: str, *, once: bool = True) -> None:
        """One warning per kind of failure: a full disk must not flood the log."""
        if once and kind in self._warned:
            log.debug("blockkv: %s", message)
            return
        self._warned.add(kind)
        log.warning("blockkv: %s", message)
