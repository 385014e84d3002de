"""A store's remote tier: its fingerprint directory in an S3-compatible bucket,
shared by a fleet of nodes (issue #14, docs/scale-out.md).

The local directory keeps every invariant it has without a bucket: a header
in ``entries/`` has all its blocks in the local pool, so recovery, check and
gc never ask the network. What the bucket adds lives here:

- the **remote catalog**: entries other nodes committed that this node has
  not materialised, learned by listing headers (at open, on a timer, on a
  miss), so that ``find`` stays a lookup in memory. A header is learned only
  from a copy proven to be the object its name lists (a direct GET, a cached
  copy of the listed ETag, a MANIFEST record with a seal or an MD5 ETag), and
  with a fleet key only if it is sealed;
- **materialising** one on restore: its missing blocks fetched and verified,
  then blocks and header written locally by the write order of a store
  (``BlockStore._adopt``), after which it is an ordinary local entry;
- **healing**: a local block that fails its hash is replaced from a verified
  bucket copy (``heal_block``), and the fleet's requests for good copies of
  blocks proven bad in the bucket are answered from verified local ones;
- the bucket's **MANIFEST** (manifest.py) and a **header cache** (files.py);
- uploads and the backlog (uploads.py), and a **circuit breaker** (breaker.py):
  an outage costs one warning, not a timeout per request.

Nothing here raises into the serving path: an outage is "not uploaded" /
"no hit" and a warning (one per kind); only proof of damage forgets an entry.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping

import numpy as np

from blockkv.errors import BlockKVError, BlockMissingError, CorruptError, OversizedError
from blockkv.format.blocks import block_key
from blockkv.format.descriptor import blocks_for_prefix
from blockkv.format.header import SUFFIX, Header, Identity
from blockkv.local.catalog import Catalog
from blockkv.local.directory import Directory, fingerprint_dirname
from blockkv.records import CHECKPOINT_NS, Entry, Match
from blockkv.remote import heal
from blockkv.remote.breaker import Breaker
from blockkv.remote.bucket import Bucket, HeaderCopy
from blockkv.remote.files import HeaderCache
from blockkv.remote.manifest import (
    MANIFEST_MIN,
    etag_is_md5_of,
    manifest_records,
    pack_manifest,
)
from blockkv.remote.objects import (
    BucketError,
    BucketMissingError,
    ObjectInfo,
    header_name,
    outage,
)
from blockkv.remote.options import split_options
from blockkv.remote.uploads import Uploader
from blockkv.remote.verify import verified_frame

MISS_SYNC_INTERVAL = 1.0  # a miss lists the bucket at most this often


class RemoteTier:
    """One store handle's view of the bucket. ``local_entries()`` is the store's
    current catalog (every identity); ``adopt(entry_id, header, encoded,
    frame_of)`` writes a fetched entry locally and says whether it could."""

    def __init__(self, url: str, options: Mapping[str, object] | None, identity: Identity, directory: Directory,
                 warn: Callable[[str, str], None], local_entries: Callable[[], list[Entry]],
                 adopt: Callable[[str, Header, bytes, Callable[[str], bytes]], bool]) -> None:
        if not isinstance(url, str):
            raise TypeError(f"remote must be an s3://bucket/prefix string, got {type(url).__name__}")
        opts = split_options(options)
        self.sync_interval = opts.sync_interval
        self.bucket = Bucket(url, fingerprint_dirname(identity.config_fingerprint), opts.s3, key=opts.key,
                             **opts.settings)
        self.identity = identity
        self.dir = directory
        self.warn = warn
        self.local_entries = local_entries
        self._adopt = adopt
        self.cache = HeaderCache(directory.path / "remote-headers", directory.fs, warn)
        self.catalog = Catalog(identity.digest(), time.time)  # remote-only entries: served, never indexed
        self._remote_only: dict[str, str] = {}  # entry id -> header name, for the catalog's entries
        self.remote_blocks: Counter[str] = Counter()  # blocks the catalog's entries reference: in the bucket
        self.listed: dict[str, ObjectInfo] = {}  # headers in the bucket at the last listing (plus our uploads)
        self._ignored: set[str] = set()  # headers not to learn: damaged, unsealed, another identity, a checkpoint
        self._unsure: set[str] = set()  # listed headers that name blocks with a key, or do not read
        self._identity_checked = False
        self.breaker = Breaker()
        self.mutex = threading.Lock()
        self._sync_lock = threading.Lock()  # one sync at a time
        self._next_sync = 0.0
        self._last_sync = -MISS_SYNC_INTERVAL
        self._sync_queued = False
        self.uploads = Uploader(self)

    def close(self) -> None:
        self.uploads.close()
        self.bucket.close()

    # -- learning what the fleet wrote -------------------------------------------------
    def open(self) -> None:
        """Check the bucket's IDENTITY and learn every header. A missing bucket is
        a FileNotFoundError, another model's IDENTITY a ValueError (one line
        each); an outage is a warning (the next sync retries)."""
        try:
            self._check_identity()
        except BucketMissingError as exc:
            raise FileNotFoundError(str(exc)) from None
        except BucketError as exc:
            self.outage("bucket unreachable at open", exc)
            return
        self.sync()

    def _check_identity(self) -> None:
        note = self.bucket.ensure_identity(self.identity)
        if note:
            self.warn("remote-identity", note)
        self._identity_checked = True

    def sync(self) -> int:
        """List the bucket now: learn new headers, forget the ones gone, answer the
        fleet's requests for good copies, send the backlog. Returns how many
        entries were learned (0 on an outage)."""
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
                learned = self._learn(listed)
                self.cache.prune(listed)
                heal.answer_wanted(self.bucket, self.local_copy)
                self.uploads.send_backlog(listed)
            except BucketError as exc:
                self.outage("bucket listing failed", exc)
                return 0
        self.breaker.succeeded()
        return learned

    def _learn(self, listed: Mapping[str, ObjectInfo]) -> int:
        local = {header_name(e.ns, e.id) for e in self.local_entries()}
        with self.mutex:
            self.listed = dict(listed)
            self._ignored &= set(listed)  # what left the bucket needs no remembering
            self._unsure &= set(listed)
            for entry_id, name in list(self._remote_only.items()):
                if name not in listed or name in local:  # evicted fleet-wide, or local now
                    self._forget(entry_id)
            known = local | set(self._remote_only.values()) | self._ignored
        new = [n for n in sorted(listed, key=lambda n: (listed[n].last_modified, n)) if n not in known]
        found = self.cache.get(new, self.bucket.header_copy)
        stale = [n for n, c in found.items() if c.etag != listed[n].etag]  # a copy of another object
        self.cache.drop(stale)
        for name in stale:
            del found[name]
        if len(new) - len(found) >= MANIFEST_MIN:  # one GET may hold most of them
            found.update(self._from_manifest(listed, [n for n in new if n not in found]))
        fetched = self.bucket.fetch_headers((n for n in new if n not in found), {n: listed[n].size for n in new})
        self.cache.keep(fetched.found)
        found.update(fetched.found)
        if len(fetched.found) >= MANIFEST_MIN:  # the next fresh node should not have to do that
            self.uploads.submit(self._write_manifest, dict(listed))
        if fetched.damaged:
            self.warn("remote-damaged", f"{len(fetched.damaged)} header(s) in {self.bucket.url} do not verify "
                                        f"(damaged, oversized, or a newer format): not served, e.g. "
                                        f"{next(iter(fetched.damaged))}")
        unsealed = [n for n, c in found.items() if self.bucket.key is not None and not c.sealed]
        if unsealed:
            self.warn("remote-unsealed", f"{len(unsealed)} header(s) in {self.bucket.url} are not sealed with "
                                         f"the fleet key: not served, e.g. {unsealed[0]}")
        learned = 0
        with self.mutex:
            self._ignored.update(fetched.damaged)
            self._unsure.update(fetched.damaged)
            self._unsure.update(n for n, c in found.items() if block_key(c.header.identity, "") is not None)
            for name in new:
                copy = found.get(name)
                if copy is not None and name not in unsealed and self._add(name, copy, listed[name].last_modified):
                    learned += 1
                elif copy is not None:
                    self._ignored.add(name)
        return learned

    def _add(self, name: str, copy: HeaderCopy, last_modified: float) -> bool:
        """Add a verified header to the remote catalog if it is an entry this handle serves."""
        header = copy.header
        if header.identity != self.identity or header.ns.startswith(CHECKPOINT_NS):
            return False
        entry_id = name.rpartition("/")[2].removesuffix(SUFFIX)
        record = self.dir.record(entry_id, self.dir.header_path(header.ns, entry_id), header, len(copy.data))
        refs = blocks_for_prefix(header.descriptor, None)
        self.catalog.add(record, last_modified, {r.name: r.raw_bytes for r in refs})  # raw: stored sizes unknown
        self._remote_only[entry_id] = name
        self.remote_blocks.update(record.blocks)
        return True

    def _from_manifest(self, listed: Mapping[str, ObjectInfo], names: list[str]) -> dict[str, HeaderCopy]:
        """Headers of ``names`` from the bucket's MANIFEST, each proven to be the
        listed object (its seal with a fleet key, else an MD5 ETag) and verified;
        kept in the cache. Any other record is fetched on its own."""
        try:
            with outage("manifest"):
                records = manifest_records(self.bucket.meta, listed, names)
        except OversizedError as exc:
            self.warn("remote-manifest", f"the bucket's MANIFEST is not read: {exc}")
            return {}
        found = {}
        for name, data in records.items():
            try:
                copy = self.bucket.header_copy(name, data, listed[name].etag)
            except (CorruptError, BlockKVError):
                continue
            if copy.sealed if self.bucket.key is not None else etag_is_md5_of(copy.etag, data):
                found[name] = copy
        self.cache.keep(found)
        return found

    def _write_manifest(self, listed: dict[str, ObjectInfo]) -> None:
        """Pack every listed header this node holds a cached copy of, of the
        listed ETag, into the bucket's MANIFEST (an unconditional PUT: the last
        writer wins)."""
        copies = self.cache.get(sorted(listed), self.bucket.header_copy)
        records = [(n, c.etag, c.data) for n, c in copies.items() if c.etag == listed[n].etag]
        try:
            with outage("manifest"):
                self.bucket.meta.put_overwrite("MANIFEST", [pack_manifest(records)])
        except BucketError as exc:
            self.warn("remote-manifest", f"could not write the bucket's MANIFEST ({exc}); nodes fetch headers one by one")

    def _forget(self, entry_id: str) -> None:
        entry = self.catalog.get(entry_id)
        for block in entry.blocks if entry is not None else ():
            self.remote_blocks[block] -= 1
            if self.remote_blocks[block] <= 0:
                del self.remote_blocks[block]
        self._remote_only.pop(entry_id, None)
        self.catalog.drop(entry_id)

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

    # -- lookups ---------------------------------------------------------------------------
    def is_remote_only(self, entry_id: str) -> bool:
        return entry_id in self._remote_only

    def find(self, tokens: np.ndarray, ns: str, local: Match | None, exact: bool = False) -> Match | None:
        """The better of the local match and the remote catalog's (a tie stays
        local: no fetch). During an outage the remote catalog is not consulted:
        its entries could not be restored."""
        if self.breaker.is_open():
            return local
        remote = self.catalog.find_exact(tokens, ns) if exact else self.catalog.find(tokens, ns)
        self.poke(miss=local is None and remote is None)
        if remote is not None and (local is None or remote.prefix_len > local.prefix_len):
            return remote
        return local

    def has_durable_prefix(self, tokens: np.ndarray, ns: str) -> bool:
        return not self.breaker.is_open() and self.catalog.has_durable_prefix(tokens, ns)

    # -- restore -----------------------------------------------------------------------------
    def materialise(self, entry: Entry) -> bool:
        """Make a remote-only entry local: the blocks the local pool lacks are
        fetched concurrently, each verified, and written through ``adopt`` as
        they arrive, under its header (the cached copy, else fetched).
        False is a miss; a header or block missing or damaged also forgets it."""
        name = header_name(entry.ns, entry.id)
        if self.breaker.is_open():
            self.warn("remote-miss", "bucket unreachable: entries only it holds are misses for now")
            return False
        key = block_key(self.identity, entry.ns)
        fetches: dict = {}
        try:
            copy = self.cache.get([name], self.bucket.header_copy).get(name) or self.bucket.fetch_header(name)
            header = copy.header
            record = self.dir.record(entry.id, self.dir.header_path(header.ns, entry.id), header, len(copy.data))
            if header.identity != self.identity or header.ns != entry.ns or record.blocks != entry.blocks \
                    or not np.array_equal(record.tokens, entry.token_array) \
                    or (self.bucket.key is not None and not copy.sealed):
                raise CorruptError(f"remote header {name} changed since it was listed")
            sizes = {r.name: r.raw_bytes for r in blocks_for_prefix(header.descriptor, None)}
            proof = {"vouched": self._vouched(copy, key), "other_keys": self._keys_naming, "local": self.local_copy}
            fetches = self.bucket.submit_fetches({b: s for b, s in sizes.items() if not self.dir.pool.exists(b)},
                                                 key, **proof)

            def frame_of(block: str) -> bytes:  # waits for its fetch; one a local gc took since: fetched now
                return fetches[block].result() if block in fetches else \
                    self.bucket.fetch_block(block, sizes[block], key, **proof)

            adopted = self._adopt(entry.id, header, copy.data, frame_of)
            failure = None if adopted else next(  # what a failed fetch proves, if one made it fail
                (f.exception() for f in fetches.values() if f.done() and not f.cancelled() and f.exception()), None)
            if failure is not None:
                raise failure
        except (BlockMissingError, CorruptError, OversizedError) as exc:
            self.warn("remote-gone", f"remote entry {entry.id} is a miss and forgotten: {exc}")
            with self.mutex:
                self._forget(entry.id)
                self._ignored.add(name)  # if its header is still listed, do not learn it again
            return False
        except BucketError as exc:
            self.outage("bucket fetch failed", exc)
            return False
        except Exception as exc:  # noqa: BLE001 - MemoryError, a local OSError: a miss that proves nothing
            self.warn("remote-miss", f"remote entry {entry.id} not fetched ({exc!r}); kept, served as a miss")
            return False
        finally:
            for f in fetches.values():
                f.cancel()
        if not adopted:
            return False
        self.breaker.succeeded()
        with self.mutex:
            self._forget(entry.id)
        return True

    def _vouched(self, copy: HeaderCopy, key: bytes | None) -> bool:
        """Is the key ``copy``'s blocks were named with known for sure (verify.py)?
        Sealed with the fleet key; or unkeyed, in a directory where every listed
        header reads and none names blocks with a key (so none can be another
        key's block that a lying header claims)."""
        with self.mutex:
            return copy.sealed or (key is None and not self._unsure)

    def _keys_naming(self) -> list[bytes | None]:
        """The namespace keys of the entries this node knows (a block that fails
        under its header's key may be another namespace's: then the header lies)."""
        if block_key(self.identity, "") is None:
            return []
        namespaces = {e.ns for e in self.local_entries()} | {e.ns for e in self.catalog.entries()}
        return [block_key(self.identity, ns) for ns in sorted(namespaces)]

    def used(self, entry: Entry) -> None:
        """Record a restore where the fleet's LRU sees it (at most once per
        ``touch_interval`` per entry; in the background)."""
        self.poke()
        name = header_name(entry.ns, entry.id)
        if name not in self.listed or self.breaker.is_open():
            return

        def touch() -> None:
            try:
                self.bucket.touch(name)
            except BucketError as exc:
                self.outage("bucket touch failed", exc)

        self.uploads.submit(touch)

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
            good = self.bucket.fetch_block(block, raw, block_key(self.identity, entry.ns))
            self.write_local(block, good)
        except BucketError as exc:
            self.outage("bucket fetch failed", exc)
            return False
        except (BlockKVError, OSError, KeyError) as exc:
            self.warn("remote-heal", f"block {block} of entry {entry.id} could not be healed from the bucket: {exc}")
            return False
        self.warn("healed-from-bucket", f"block {block} failed its hash locally: replaced by the bucket's verified copy")
        return True

    def write_local(self, block: str, frame: bytes) -> None:
        """Verified bytes over the local copy of ``block`` (tmp, fsync, rename)."""
        self.dir.pool.write(block, [frame])

    def outage(self, what: str, exc: BaseException) -> None:
        self.breaker.failed()
        self.warn("remote", f"{what} ({exc}): serving from the local cache only; "
                            f"stores are kept locally and uploaded when the bucket answers")
