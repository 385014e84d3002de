"""A store's remote tier: its fingerprint directory in an S3-compatible bucket,
shared by a fleet of nodes (issue #14, docs/scale-out.md).

The local directory keeps every invariant it has without a bucket: a header
in ``entries/`` has all its blocks in the local pool, so recovery, check and
gc never ask the network. What the bucket adds lives here and below:

- the **remote catalog** of entries other nodes committed that this node has
  not made local (remote_catalog.py: a small record and a digest per block, no
  tokens), learned by listing headers at open, on a timer and on a miss
  (learn.py: only from a copy proven to be the object its name lists, and
  with a fleet key only if sealed), so that ``find`` stays a lookup on this
  node, settled by the candidates' headers (lookup.py);
- **restoring** one (remote_restore.py): only the blocks the prefix needs,
  fetched concurrently and verified, the caches rebuilt from them, and what
  to keep of what was fetched (the whole entry, or a prefix entry of the
  node's own) handed back to the store, which keeps it in the background
  (local/adoptions.py);
- **healing**: a local block that fails its hash is replaced from a verified
  bucket copy (``heal_block``), and the fleet's requests for good copies of
  blocks proven bad in the bucket are answered from verified local ones;
- uploads and the backlog (uploads.py), the bucket's MANIFEST (manifest.py),
  a header cache (local_state.py) and a **circuit breaker** (breaker.py): an outage
  costs one warning, not a timeout per request.

Nothing here raises into the serving path: an outage is "not uploaded" /
"no hit" and a warning (one per kind); only proof of damage forgets an entry.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from blockkv.bucket import heal
from blockkv.bucket.bucket import Bucket
from blockkv.bucket.bucket_dir import HeaderCopy
from blockkv.bucket.bucket_verdicts import verified_frame
from blockkv.bucket.fetch import fetch_block
from blockkv.bucket.objects import BucketError, BucketMissingError
from blockkv.errors import (
    BlockKVError,
    BlockMissingError,
    CorruptError,
    NewerFormatError,
    OversizedError,
)
from blockkv.format.blocks import DEFAULT_BLOCK_TOKENS, BlockRef, block_naming_key
from blockkv.format.descriptor import blocks_for_prefix, with_xxh3
from blockkv.format.header import Header, Identity, decode_header
from blockkv.format.layout import entry_id_of, fingerprint_dirname, header_name
from blockkv.format.rebuild import ParsedEntry
from blockkv.local.directory import Directory
from blockkv.local.disk_tier import Restored
from blockkv.records import Entry, Match
from blockkv.remote.breaker import Breaker
from blockkv.remote.learn import Learner
from blockkv.remote.listing import Listing
from blockkv.remote.local_state import HeaderCache
from blockkv.remote.lookup import Lookup, RecentHeaders
from blockkv.remote.options import split_options
from blockkv.remote.remote_catalog import RemoteCatalog, RemoteEntry
from blockkv.remote.remote_restore import RemoteRead
from blockkv.remote.uploads import Uploader

MISS_SYNC_INTERVAL = 1.0  # a miss lists the bucket at most this often


class RemoteTier:
    """One store handle's view of the bucket (the store's ``Tier``, tiers.py).
    ``open(local_entries)`` hands it the local catalog (every identity): the
    tier is made before the local pieces, so a wrong argument raises before
    anything is written."""

    def __init__(self, url: str, options: Mapping[str, object] | None, identity: Identity, directory: Directory,
                 warn: Callable[[str, str], None], block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        if not isinstance(url, str):
            raise TypeError(f"remote must be an s3://bucket/prefix string, got {type(url).__name__}")
        opts = split_options(options)
        self.sync_interval = opts.sync_interval
        self.bucket = Bucket(url, fingerprint_dirname(identity.config_fingerprint), opts.s3, key=opts.key,
                             **opts.settings)
        self.identity = identity
        self.dir = directory
        self.warn = warn
        self._local: Callable[[], list[Entry]] | None = None  # the local catalog, from open()
        self.cache = HeaderCache(directory.path / "remote-headers", directory.fs, warn)
        self.catalog = RemoteCatalog(block_tokens)  # remote-only entries: served, never indexed
        self.listing = Listing()
        self.breaker = Breaker()
        self.mutex = threading.Lock()
        self._recent = RecentHeaders()
        self._lookup = Lookup(self.catalog, self._header, self._unusable)
        self._identity_checked = False
        self._sync_lock = threading.Lock()  # one sync at a time
        self._next_sync = 0.0
        self._last_sync = -MISS_SYNC_INTERVAL
        self._sync_queued = False
        self.uploads = Uploader(self.bucket, directory, identity, self.cache, self.listing, self.catalog,
                                self.breaker, warn, self.outage, self.local_entries)
        self._learner = Learner(self.bucket, identity, directory, self.catalog, self.cache, self.listing, warn,
                                self.uploads.submit)

    def close(self) -> None:
        self.uploads.close()
        self.bucket.close()

    # -- learning what the fleet wrote -------------------------------------------------
    def open(self, local_entries: Callable[[], list[Entry]]) -> None:
        """Take the local catalog, check the bucket's IDENTITY and learn every
        header. A missing bucket is a FileNotFoundError, another model's
        IDENTITY a ValueError (one line each); an outage is a warning (the next
        sync retries)."""
        self._local = local_entries
        try:
            self._check_identity()
        except BucketMissingError as exc:
            raise FileNotFoundError(str(exc)) from None
        except BucketError as exc:
            self.outage("bucket unreachable at open", exc)
            return
        self.sync()

    def local_entries(self) -> list[Entry]:
        """The local catalog now (none before ``open``)."""
        return self._local() if self._local is not None else []

    def _check_identity(self) -> None:
        note = self.bucket.ensure_identity(self.identity)
        if note:
            self.warn("remote-identity", note)
        self._identity_checked = True

    def sync(self) -> int:
        """List the bucket now: learn new headers, forget the ones gone, answer
        the fleet's requests for good copies, send the backlog. Returns how
        many entries were learned (0 on an outage)."""
        with self._sync_lock:
            self._last_sync = time.monotonic()
            self._next_sync = self._last_sync + self.sync_interval
            try:
                if not self._identity_checked:
                    try:
                        self._check_identity()
                    except ValueError as exc:  # another model's IDENTITY: nothing there is ours to serve
                        self.warn("remote-identity", f"{exc}; remote entries are not served")
                        self.breaker.failed()
                        return 0
                listed = self.bucket.list_headers()
                learned = self._learner.learn(listed, {header_name(e.ns, e.id) for e in self.local_entries()})
                self.cache.prune(listed)
                heal.answer_wanted(self.bucket, self.local_copy)
                self.uploads.send_backlog(listed)
            except BucketError as exc:
                self.outage("bucket listing failed", exc)
                return 0
        self.breaker.succeeded()
        return learned

    def poke(self, miss: bool = False) -> None:
        """A find or restore happened: list in the background if the interval has
        passed, or (on a miss) if the last listing is older than MISS_SYNC_INTERVAL."""
        now = time.monotonic()
        with self.mutex:
            due = now >= self._next_sync or (miss and now - self._last_sync >= MISS_SYNC_INTERVAL)
            if not due or self._sync_queued or self.breaker.is_open():
                return
            self._sync_queued = True
            self._last_sync = now
        self.uploads.background(self._background_sync)

    def _background_sync(self) -> None:
        try:
            self.sync()
        except Exception as exc:  # noqa: BLE001 - a background job must never die silently
            self.warn("remote-sync", f"remote sync failed: {exc!r}")
        finally:
            with self.mutex:
                self._sync_queued = False

    def _forget(self, entry_id: str, name: str) -> None:
        """A remote entry proven unusable: out of the catalog, and not learned
        again while its header is listed."""
        self.catalog.drop(entry_id)
        self._recent.drop(name)
        self.listing.ignore([name])

    # -- lookups ---------------------------------------------------------------------------
    def is_remote_only(self, entry_id: str) -> bool:
        return entry_id in self.catalog

    def entry(self, entry_id: str) -> Entry | None:
        """A remote-only entry as ``find`` hands it out (its tokens read from its header)."""
        record = self.catalog.get(entry_id)
        return None if record is None or self.breaker.is_open() else self._lookup.entry(record)

    def find(self, tokens: np.ndarray, ns: str, local: Match | None, exact: bool = False) -> Match | None:
        """The better of the local match and the remote catalog's (a tie stays
        local: no fetch). During an outage the remote catalog is not consulted:
        its entries could not be restored."""
        if self.breaker.is_open():
            return local
        remote = None
        if len(self.catalog):
            try:
                if exact:
                    remote = self._lookup.find_exact(tokens, ns)
                else:
                    remote = self._lookup.find(tokens, ns, local.prefix_len if local is not None else 0)
            except BucketError as exc:  # a candidate's header had no copy on disk, and the bucket did not answer
                self.outage("bucket header fetch failed", exc)
        self.poke(miss=local is None and remote is None)
        if remote is not None and (local is None or remote.prefix_len > local.prefix_len):
            return remote
        return local

    def has_durable_prefix(self, tokens: np.ndarray, ns: str) -> bool:
        if self.breaker.is_open() or not len(self.catalog):
            return False
        try:
            return self._lookup.has_durable_prefix(tokens, ns)
        except BucketError as exc:
            self.outage("bucket header fetch failed", exc)
            return False

    def _copy(self, name: str) -> HeaderCopy:
        """A verified copy of header ``name``: the last ones read are in memory,
        the rest in the header cache on disk (a copy of an object the listing
        no longer shows is dropped). One missing there is fetched and cached:
        the only case where a lookup waits for the bucket (a cache directory
        that cannot be written, or a copy removed since it was learned)."""
        copy = self._recent.get(name)
        if copy is not None:
            return copy
        info = self.listing.get(name)
        copy = self.cache.get([name], self.bucket.header_copy).get(name)
        if copy is not None and info is not None and copy.etag != info.etag:
            self.cache.drop([name])
            copy = None
        if copy is None:
            copy = self.bucket.fetch_header(name, info.size if info is not None else None)
            self.cache.keep({name: copy})
        self._recent.put(name, copy)
        return copy

    def _header(self, name: str) -> Header:
        """Header ``name`` for a lookup: its checksum verified, its descriptor
        not yet (a restore verifies the whole header before it uses any of it).
        From memory or the header cache, else as ``_copy``."""
        copy = self._recent.get(name)
        if copy is not None:
            return copy.header
        info = self.listing.get(name)
        cached = self.cache.read(name)
        if cached is not None and (info is None or cached[1] == info.etag):
            try:
                header = decode_header(cached[0])
            except (CorruptError, NewerFormatError):
                self.cache.drop([name])
            else:
                if header_name(header.ns, entry_id_of(name)) == name:
                    return header
        return self._copy(name).header

    def _unusable(self, record: RemoteEntry, exc: Exception) -> None:
        self.warn("remote-gone", f"remote entry {record.id} is a miss and forgotten: {exc}")
        self._forget(record.id, header_name(record.ns, record.id))

    # -- restore -----------------------------------------------------------------------------
    def restore(self, entry: Entry, cut: int | None) -> Restored | None:
        """A remote-only entry's caches (cut to ``cut`` tokens when given), from
        the blocks the cut needs (remote_restore.py): ((header, caches,
        attachments, block bytes read), what to keep of what it fetched), or
        None (a miss). A header or block missing or damaged also forgets the
        entry; an outage keeps it."""
        name = header_name(entry.ns, entry.id)
        if self.breaker.is_open():
            self.warn("remote-miss", "bucket unreachable: entries only it holds are misses for now")
            return None
        key = block_naming_key(self.identity, entry.ns)
        read: RemoteRead | None = None
        try:
            copy = self._copy(name)
            header = copy.header
            blocks = tuple(dict.fromkeys(r.name for r in blocks_for_prefix(copy.descriptor, None)))
            if (header.identity != self.identity or header.ns != entry.ns or blocks != entry.blocks
                    or not np.array_equal(header.tokens, entry.token_array)
                    or (self.bucket.key is not None and not copy.sealed)):
                raise CorruptError(f"remote header {name} changed since it was listed")
            proof = {"vouched": self.listing.vouches(copy.sealed, key), "other_keys": self._keys_naming,
                     "local": self.local_copy}
            parsed = ParsedEntry(header, with_xxh3(copy.descriptor, header.block_xxh3))
            read = RemoteRead(parsed, cut, self.dir.pool, key,
                              lambda block, raw: fetch_block(self.bucket, block, raw, key, **proof), self.bucket.submit)
            caches, attachments = read.rebuild()
            adoption = read.adoption(entry.id, copy.data)  # kept once the caches are filled: sooner slowed the fetches
        except (BlockMissingError, CorruptError, OversizedError) as exc:
            self.warn("remote-gone", f"remote entry {entry.id} is a miss and forgotten: {exc}")
            self._forget(entry.id, name)
            return None
        except BucketError as exc:
            self.outage("bucket fetch failed", exc)
            return None
        except Exception as exc:  # noqa: BLE001 - MemoryError, a local OSError: a miss that proves nothing
            self.warn("remote-miss", f"remote entry {entry.id} not fetched ({exc!r}); kept, served as a miss")
            return None
        finally:
            if read is not None and read.failure() is not None:
                read.cancel()
        self.breaker.succeeded()
        nbytes = sum(memoryview(read.frame(r.name)).nbytes for r in read.refs)
        return (header, caches, attachments, nbytes), adoption

    def adopted(self, entry_id: str) -> None:
        """The bucket's entry ``entry_id`` is local now: an ordinary local entry from here on."""
        self.catalog.drop(entry_id)

    def _keys_naming(self) -> list[bytes | None]:
        """The namespace keys of the entries this node knows (a block that fails
        under its header's key may be another namespace's: then the header lies)."""
        if block_naming_key(self.identity, "") is None:
            return []
        namespaces = {e.ns for e in self.local_entries()} | set(self.catalog.namespaces())
        return [block_naming_key(self.identity, ns) for ns in sorted(namespaces)]

    def used(self, entry: Entry) -> None:
        """Record a restore where the fleet's LRU sees it (at most once per
        ``touch_interval`` per entry; in the background)."""
        self.poke()
        name = header_name(entry.ns, entry.id)
        if name not in self.listing or self.breaker.is_open():
            return

        def touch() -> None:
            try:
                self.bucket.touch(name)
            except BucketError as exc:
                self.outage("bucket touch failed", exc)

        self.uploads.submit(touch)

    # -- uploads ------------------------------------------------------------------------------
    def upload(self, entry_id: str, ns: str, encoded: bytes, blocks: Iterable[BlockRef], new: set[str],
               replaced: Iterable[Entry]) -> bool:
        """A local store's bucket half (``Uploader.upload``)."""
        return self.uploads.upload(entry_id, ns, encoded, blocks, new, replaced)

    def remove_replaced(self, replaced: Iterable[Entry]) -> None:
        self.uploads.remove_replaced(replaced)

    @property
    def uploaded_bytes(self) -> int:
        return self.uploads.uploaded_bytes

    # -- healing ------------------------------------------------------------------------------
    def local_copy(self, block: str) -> bytes | None:
        """A verified copy of ``block`` from the local pool, or None: under the
        key of any local entry that names it."""
        try:
            data = self.dir.pool.read(block)
        except OSError:
            return None
        for key in dict.fromkeys([None, *self._keys_naming()]):
            try:
                return verified_frame(block, data, key)
            except CorruptError:
                continue
        return None

    def heal_block(self, entry: Entry, block: str) -> bool:
        """A local entry's block failed its hash: replace the local copy with a
        verified one from the bucket. True if it was replaced (the caller may
        restore again); False proves nothing."""
        if self.breaker.is_open():
            return False
        try:
            header = self.dir.read_header(self.dir.header_path(entry.ns, entry.id))
            raw = {r.name: r.raw_bytes for r in blocks_for_prefix(header.descriptor, None)}[block]
            good = self.bucket.fetch_block(block, raw, block_naming_key(self.identity, entry.ns))
            self.dir.pool.write(block, [good])
        except BucketError as exc:
            self.outage("bucket fetch failed", exc)
            return False
        except (BlockKVError, OSError, KeyError) as exc:
            self.warn("remote-heal", f"block {block} of entry {entry.id} could not be healed from the bucket: {exc}")
            return False
        self.warn("healed-from-bucket", f"block {block} failed its hash locally: replaced by the bucket's verified copy")
        return True

    def outage(self, what: str, exc: BaseException) -> None:
        self.breaker.failed()
        self.warn("remote", f"{what} ({exc}): serving from the local cache only; "
                            f"stores are kept locally and uploaded when the bucket answers")
