"""BlockStore: the SSD cold tier for MLX prompt/KV caches, as policy.

The public facade and its decisions: what a lookup serves, when to recover,
the remote tier's place (``tiers.py``), the stats. Every decision to delete is
``local/retention.py``'s; the mechanisms it drives are in ``local/`` (one job
each) over ``format/`` and ``pool/``. Every mutation holds the directory lock,
so a dedup hit and a gc delete never interleave.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from blockkv.arguments import check_ns, check_options, check_prefix_len, check_size, prepare_store, tokens_array
from blockkv.arguments import open_only as _open_only
from blockkv.errors import LockTimeout, Warnings
from blockkv.format.blocks import CODEC_ID, DEFAULT_BLOCK_TOKENS, KEYED_CODEC_ID, Snapshot
from blockkv.format.header import Identity
from blockkv.format.layout import fingerprint_dirname
from blockkv.fs import FileLayer
from blockkv.local import writers
from blockkv.local.directory import Directory, read_identity
from blockkv.local.disk_tier import Read
from blockkv.local.executors import Executors
from blockkv.local.handle import HandleSettings, LocalHandle, Options
from blockkv.local.index import Index
from blockkv.local.index_keeper import OPEN_WAIT, REFRESH_WAIT
from blockkv.local.locks import waiting_at_most
from blockkv.records import CHECKPOINT_NS, CheckReport, Entry, GenerationCheckpoint, Loaded, LocalChanges, Match
from blockkv.tiers import BackingTier, NoTier, Tier

if TYPE_CHECKING:
    from blockkv.bucket.bucket import Bucket

DEFAULT_GC_GRACE = 60.0  # seconds a block freed by eviction is kept for reuse (policy, not safety)


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
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        compression: str | None = None,
        verify: bool | str = True,
        fs: FileLayer | None = None,
        clock: Callable[[], float] = time.time,
        gc_grace: float = DEFAULT_GC_GRACE,
        tmp_grace: float = writers.DEFAULT_TMP_GRACE,
        index_map_size: int = 256 << 20,
        lock_timeout: float = 10.0,
        isolate_namespaces: bool = False,
        namespace_share: float | None = None,
        remote: str | None = None,
        remote_options: Mapping[str, str] | None = None,
    ) -> None:
        check_options(model_id=model_id, config_fingerprint=config_fingerprint, tokenizer_hash=tokenizer_hash,
                      max_bytes=max_bytes, limit=limit, block_tokens=block_tokens, compression=compression,
                      verify=verify, gc_grace=gc_grace, tmp_grace=tmp_grace, lock_timeout=lock_timeout,
                      isolate_namespaces=isolate_namespaces, namespace_share=namespace_share)
        self.root = Path(root).expanduser()
        self.isolate_namespaces = isolate_namespaces
        # the codec id in every header says how its blocks are named; a handle serves its own mode's entries,
        # and counts and evicts the other mode's with them (kin: ``Catalog``)
        self.identity = Identity(model_id, config_fingerprint, tokenizer_hash,
                                 KEYED_CODEC_ID if isolate_namespaces else CODEC_ID)
        self.directory = self.root / fingerprint_dirname(config_fingerprint)
        self.block_tokens = block_tokens
        self.compression = compression
        self.verify = verify
        self._settings = HandleSettings(max_bytes, limit, float(gc_grace), float(tmp_grace), float(lock_timeout),
                                        None if namespace_share is None else float(namespace_share))
        self._fs = fs or FileLayer()
        self._clock = clock
        self._dir = Directory(self.directory, self.identity, self._fs)
        self.stats: dict[str, float] = dict.fromkeys(
            ("restores", "spills", "restore_ms_last", "bytes_written", "bytes_deduplicated", "bytes_read",
             "verify_failures", "bucket_errors"), 0)
        self._warn = Warnings(self.stats)
        self._executor = Executors()  # store_async, restore_async, block I/O
        self._closed = False
        self._pid = os.getpid()
        # the tier behind the disk first: a wrong remote= raises before anything is written
        self._remote = self._backing_tier(remote, remote_options)
        local = LocalHandle(self.root, self._dir, self._settings,
                            Options(verify, block_tokens, compression, index_map_size), heal=self._remote.heal_block,
                            replaced=self._remote.remove_replaced, executor=self._executor, clock=clock,
                            warn=self._warn, stats=self.stats)
        self._intents, self._recovery, self._catalog = local.intents, local.recovery, local.catalog
        self._keeper, self._retention, self._commits = local.keeper, local.retention, local.commits
        self._disk, self._adoptions = local.disk, local.adoptions
        try:
            with waiting_at_most(OPEN_WAIT):  # a stopped holder delays an open this long at most
                self.scan()
        except LockTimeout:
            self._warn("lock", "index locks busy at open: serving the index as it is, recovering later")
            self._keeper.defer_recovery()
        try:
            self._remote.open(self._retention.every_entry)  # learns every header in the bucket
        except BaseException:  # another model's IDENTITY there, a missing bucket
            self.close()
            raise

    def _backing_tier(self, remote: str | None, remote_options: Mapping[str, str] | None) -> BackingTier:
        """The bucket's tier with ``remote=``; without, the disk alone (local invariants stay as they are)."""
        if remote is None and remote_options is None:
            return NoTier()
        if remote is None:
            raise ValueError("remote_options given without remote")
        from blockkv.remote.tier import RemoteTier  # needs obstore: pip install 'blockkv[s3]'

        return RemoteTier(remote, remote_options, self.identity, self._dir, self._warn, self.block_tokens)

    # -- the handle's options as they are now (a tool may set them on an open handle) ---------
    @property
    def gc_grace(self) -> float:
        return self._settings.gc_grace

    @gc_grace.setter
    def gc_grace(self, seconds: float) -> None:
        self._settings.gc_grace = seconds

    @property
    def tmp_grace(self) -> float:
        return self._settings.tmp_grace

    @tmp_grace.setter
    def tmp_grace(self, seconds: float) -> None:
        self._settings.tmp_grace = seconds

    @property
    def namespace_share(self) -> float | None:
        """The most of the cap one namespace but the default may hold (None: no share)."""
        return self._settings.namespace_share

    @namespace_share.setter
    def namespace_share(self, share: float | None) -> None:
        self._settings.namespace_share = share

    @property
    def lock_timeout(self) -> float:
        return self._settings.lock_timeout

    @lock_timeout.setter
    def lock_timeout(self, seconds: float) -> None:
        self._settings.lock_timeout = seconds

    @classmethod
    def open_dir(cls, directory: str | os.PathLike[str], *, max_bytes: int | None = None,
                 **kwargs: Any) -> BlockStore:
        """Open an existing fingerprint directory with the identity it records (for tools)."""
        d = Path(directory).expanduser()
        ident = read_identity(d, kwargs.get("fs"))
        return cls(d.parent, model_id=ident.model_id, config_fingerprint=ident.config_fingerprint,
                   tokenizer_hash=ident.tokenizer_hash, max_bytes=max_bytes if max_bytes is not None else 1 << 62,
                   **kwargs)

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return (f"<BlockStore{state} {str(self.root)!r} model_id={self.identity.model_id!r} "
                f"config_fingerprint={self.identity.config_fingerprint!r}>")

    # -- lifecycle ------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        if os.getpid() != self._pid:  # a forked child's copy: the parent still owns the environment
            self._closed = True
            return
        self._adoptions.wait_kept()  # restores' adoptions write through the executor's threads
        self._executor.shutdown()  # pending writes finish before the handle closes
        self._adoptions.close()
        self._remote.close()
        self._closed = True
        self._intents.close()
        self._keeper.close()

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
        with self._retention.locked(recover=True):
            pass
        return len(self)

    @_open_only
    def rebuild_index(self) -> int:
        """Throw the LMDB tables away and rebuild them from the header files."""
        self._retention.rebuild()
        return len(self)

    @property
    def recovery(self) -> list[str]:
        """What the last ``scan()`` (and any recovery since) had to fix."""
        return self._recovery.notes

    @property
    def _index(self) -> Index:
        return self._keeper.index

    # -- the bucket (remote=) -----------------------------------------------------------
    @property
    def remote(self) -> Bucket | None:
        """The bucket this store shares with a fleet (``remote=``), or None."""
        return self._remote.bucket

    @_open_only
    def sync_remote(self) -> int:
        """Let restores' adoptions land, then list the bucket now: learn entries
        other nodes stored, forget those evicted fleet-wide, upload the backlog.
        Returns how many entries were learned; an outage is a warning and 0."""
        self._adoptions.wait_kept()
        return self._remote.sync()

    # -- queries (pure index lookups) ------------------------------------------------
    @_open_only
    def __len__(self) -> int:
        self._retention.refresh()
        return len(self._catalog)

    @property
    @_open_only
    def total_bytes(self) -> int:
        """Headers plus every block this identity's entries reference, each
        counted once, those stored in the other ``isolate_namespaces`` mode
        included: what the cap counts (another identity sharing the directory
        counts its own)."""
        return self._retention.footprint()

    @property
    def max_bytes(self) -> int:
        return self._settings.max_bytes

    @property
    @_open_only
    def block_count(self) -> int:
        return sum(1 for row in self._index.blocks().values() if row.refs > 0)

    @property
    @_open_only
    def logical_bytes(self) -> int:
        """What one self-contained file per entry would take (no sharing)."""
        return sum(e.nbytes for e in self._current(None))

    def _current(self, ns: str | None) -> list[Entry]:
        """The catalog's entries brought current (paged: for the handle's own use)."""
        if ns is not None:
            check_ns(ns)
        self._retention.refresh()
        return self._catalog.entries(ns)

    @_open_only
    def entries(self, ns: str | None = None) -> list[Entry]:
        """Every entry, or (``ns`` given) only that namespace's: a tenant sees
        its own. Each holds its tokens and block names (read now: a pass over
        every entry's tokens)."""
        with waiting_at_most(REFRESH_WAIT):  # a stopped writer: read from the headers instead
            return self._catalog.detached(self._current(ns))

    @_open_only
    def count(self, ns: str | None = None) -> int:
        """``len(store)``, or (``ns`` given) the entries of that namespace."""
        return len(self) if ns is None else len(self._current(ns))

    @property
    @_open_only
    def longest_durable_prefix_tokens(self) -> int:
        return self.longest_entry_tokens()

    @_open_only
    def longest_entry_tokens(self, ns: str | None = None) -> int:
        """The longest entry's length, across namespaces or (``ns`` given) in one."""
        return max((e.length for e in self._current(ns)), default=0)

    @_open_only
    def token_prefixes(self, ns: str | None = None) -> Iterator[tuple[int, ...]]:
        return (entry.tokens for entry in self.entries(ns))

    def _lookup(self, tokens: Sequence[int], ns: str) -> np.ndarray:
        """A lookup's arguments checked (the tokens as an array), and the catalog brought current for it."""
        arr = tokens_array(tokens)
        check_ns(ns)
        self._retention.refresh()
        return arr

    @_open_only
    def has_durable_prefix(self, tokens: Sequence[int], ns: str = "") -> bool:
        arr = self._lookup(tokens, ns)
        return self._catalog.has_durable_prefix(arr, ns) or self._remote.has_durable_prefix(arr, ns)

    @_open_only
    def find(self, prompt: Sequence[int], ns: str = "") -> Match | None:
        arr = self._lookup(prompt, ns)
        return self._remote.find(arr, ns, self._handed(self._catalog.find(arr, ns)))

    @_open_only
    def find_exact(self, tokens: Sequence[int], ns: str = "") -> Match | None:
        arr = self._lookup(tokens, ns)
        return self._remote.find(arr, ns, self._handed(self._catalog.find_exact(arr, ns)), exact=True)

    def _handed(self, match: Match | None) -> Match | None:
        """A local match as the caller gets it: its entry holding its tokens and
        block names, read from its header with no lock (the catalog pages
        them), readable once removed or closed (``Catalog.from_header``)."""
        return Match(self._catalog.from_header(match.entry), match.prefix_len) if match is not None else None

    @_open_only
    def changes(self, since: tuple[bytes, int] | None = None) -> LocalChanges:
        """What entered and left the local directory (any handle on this root) since
        position ``since`` of the index's change log; ``None``: everything now.
        A read of the log, not a scan: cheap enough to poll. Records of every
        identity and namespace (``EntryRecord.owner``, ``.ns``); a record removed
        again before this call is left out of ``added`` (its removal is in ``removed``)."""
        return self._index.changes(since)

    @_open_only
    def find_generation_checkpoint(self, prompt: Sequence[int], key: str, cache_ns: str = "") -> Entry | None:
        arr = tokens_array(prompt)
        self._retention.refresh()
        found = self._catalog.generation_checkpoint(arr, key, cache_ns)
        return self._catalog.from_header(found) if found is not None else None

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
        read = self._read(entry, cut)
        if read is None:
            return None
        header, caches, attachments, nbytes = read
        self.stats["restores"] += 1
        self.stats["bytes_read"] += nbytes
        self.stats["restore_ms_last"] = (time.perf_counter() - t0) * 1000
        self._remote.used(entry)
        return Loaded(caches, tuple(header.tokens[:p].tolist()), attachments, entry.checkpoint)

    def _read(self, entry: Entry, cut: int | None) -> Read | None:
        """From the disk, or from the tier behind it if only that holds the
        entry (what it fetched is kept in the background: ``Adoptions``)."""
        tier: Tier = self._disk
        if self._remote.is_remote_only(entry.id):
            self._adoptions.wait_kept(entry.id)  # a restore of it may be making it local right now
            self._retention.refresh()  # this handle or another may have made it local
            if entry.id not in self._catalog and self._remote.is_remote_only(entry.id):
                tier = self._remote
        restored = tier.restore(entry, cut)
        if restored is not None and restored[1] is not None:
            self._adoptions.submit(entry.id, restored[1], self._remote.adopted)
        return None if restored is None else restored[0]

    @_open_only
    def restore_async(self, entry: Entry, prefix_len: int | None = None) -> Future[Loaded | None]:
        check_prefix_len(entry, prefix_len)
        return self._executor("restore").submit(self.restore, entry, prefix_len)

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
        self._retention.remove_checkpoints(key)

    def _commit(self, tokens: np.ndarray, ns: str, snap: Snapshot,
                checkpoint: GenerationCheckpoint | None) -> bool:
        """One store (``Commits.store``), the seed's rules applied once it is visible (``Retention.landed``)."""
        self._adoptions.wait_kept()  # an entry restored from the bucket that this one continues: local, superseded
        stored = self._commits.store(tokens, ns, snap, checkpoint, self.max_bytes, self._retention.landed)
        if stored is None:
            return False
        self.stats["spills"] += 1
        self.stats["bytes_written"] += stored.written
        self.stats["bytes_deduplicated"] += stored.deduplicated
        if checkpoint is not None:  # checkpoints stay local (docs/scale-out.md)
            return True
        return self._remote.upload(stored.entry_id, ns, stored.encoded, (b.ref for b in stored.layout.blocks),
                                   stored.new, stored.replaced)

    # -- remove, evict, gc (retention.py) ---------------------------------------------------------
    @_open_only
    def remove(self, entry: Entry) -> None:
        if not isinstance(entry, Entry):
            raise TypeError(f"remove takes an Entry, got {type(entry).__name__}")
        self._retention.remove(entry.id)

    @_open_only
    def evict_plan(self, target_bytes: int) -> list[Entry]:
        """The entries eviction down to ``target_bytes`` would remove, LRU first. Changes nothing."""
        check_size("target_bytes", target_bytes)
        return self._retention.plan(target_bytes)

    @_open_only
    def evict_to(self, target_bytes: int) -> list[Entry]:
        """Remove least recently used entries until ``total_bytes <= target_bytes``."""
        check_size("target_bytes", target_bytes)
        return self._retention.evict_to(target_bytes)

    @_open_only
    def evict_to_cap(self) -> None:
        self.evict_to(self.max_bytes)

    @_open_only
    def gc(self) -> int:
        """Give back the references of stores whose writer died, then delete
        blocks nothing references and no live writer may, and dead writers'
        temp files; returns how many blocks (``Retention.gc``)."""
        return self._retention.gc()

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
        return self._retention.check(repair, progress)

    def counters(self) -> dict[str, float]:
        """``stats`` plus the entries eviction removed, the bytes uploaded to the
        bucket, and the catalog refreshes that found the index's transaction
        lock busy (another process inside a transaction: what the handle knew
        was served) and of those the ones that first waited for it (a short
        wait, once per busy spell), since the handle opened (what ``blockkv
        serve``'s /metrics shows)."""
        return {**self.stats, "evictions": self._retention.evicted, "bytes_uploaded": self._remote.uploaded_bytes,
                "busy_refreshes": self._keeper.busy_refreshes, "busy_waits": self._keeper.busy_waits}

    def tier_of(self, entry: Entry) -> str:
        """Where a restore of ``entry`` reads it from: "disk", or "bucket" while only the bucket holds it."""
        return "bucket" if self._remote.is_remote_only(entry.id) else "disk"
