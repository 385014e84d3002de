"""A store's remote tier: its fingerprint directory in an S3-compatible bucket,
shared by a fleet of nodes (issue #14, docs/scale-out.md).

The local directory keeps every invariant it has without a bucket: a header
in ``entries/`` has all its blocks in the local pool, so recovery, check and
gc never ask the network. What the bucket adds lives here:

- the **remote catalog**: entries other nodes committed that this node has
  not materialised, learned by listing headers (at open, on a timer, on a
  miss), so that ``find`` stays a lookup in memory;
- **materialising** one on restore: its missing blocks fetched and verified,
  then blocks and header written locally by the write order of a store
  (``BlockStore._adopt``), after which it is an ordinary local entry;
- **uploads**: every store's blocks, then its header (the commit point);
- the **backlog**: stores the bucket did not acknowledge, uploaded by a
  later sync, and a **header cache** of the bucket's headers, so a node that
  restarts fetches only headers new to it (their files: files.py);
- the bucket's **MANIFEST** (manifest.py), read when many headers are new and
  written after fetching them one by one, so the next fresh node needs one GET;
- a **circuit breaker** (breaker.py): an outage costs one warning, not a
  timeout per request.

Nothing here raises into the serving path: an outage is "not uploaded" /
"no hit" and a warning (one per kind); only proof of damage forgets an entry.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from blockkv.errors import BlockKVError, BlockMissingError, CorruptError
from blockkv.format.blocks import block_key
from blockkv.format.descriptor import blocks_for_prefix
from blockkv.format.header import SUFFIX, Header, Identity
from blockkv.local.catalog import Catalog
from blockkv.local.directory import Directory, fingerprint_dirname
from blockkv.records import CHECKPOINT_NS, Entry, Match
from blockkv.remote.breaker import Breaker
from blockkv.remote.bucket import Bucket
from blockkv.remote.files import Backlog, HeaderCache
from blockkv.remote.manifest import MANIFEST_MIN, headers_from_manifest, pack_manifest
from blockkv.remote.objects import BucketError, header_name
from blockkv.remote.options import split_options
from blockkv.remote.session import StoreTooSlow

MISS_SYNC_INTERVAL = 1.0  # a miss lists the bucket at most this often
_UPLOAD_THREADS = 8


class RemoteTier:
    """One store handle's view of the bucket. ``local_entries()`` is the store's
    current catalog (every identity); ``adopt(entry_id, header, encoded,
    frame_of)`` writes a fetched entry locally and says whether it could."""

    def __init__(self, url: str, options: Mapping[str, object] | None, identity: Identity, directory: Directory,
                 warn: Callable[[str, str], None], local_entries: Callable[[], list[Entry]],
                 adopt: Callable[[str, Header, bytes, Callable[[str], bytes]], bool]) -> None:
        if not isinstance(url, str):
            raise TypeError(f"remote must be an s3://bucket/prefix string, got {type(url).__name__}")
        s3, settings, self.sync_interval = split_options(options)
        self.bucket = Bucket(url, fingerprint_dirname(identity.config_fingerprint), s3, **settings)
        self._identity = identity
        self._dir = directory
        self._warn = warn
        self._local_entries = local_entries
        self._adopt = adopt
        self._backlog = Backlog(directory.path / "backlog", warn)
        self._cache = HeaderCache(directory.path / "remote-headers", directory.fs, warn)
        self.catalog = Catalog(identity.digest(), time.time)  # remote-only entries: served, never indexed
        self._remote_only: dict[str, str] = {}  # entry id -> header name, for the catalog's entries
        self._remote_blocks: Counter[str] = Counter()  # blocks the catalog's entries reference: in the bucket
        self._listed: set[str] = set()  # header names in the bucket at the last listing (plus our uploads)
        self._ignored: set[str] = set()  # headers not to learn: damaged, another identity, a checkpoint
        self._uploading: set[str] = set()  # entry ids this handle is uploading now
        self._identity_checked = False
        self.breaker = Breaker()
        self._mutex = threading.Lock()
        self._sync_lock = threading.Lock()  # one sync at a time
        self._next_sync = 0.0
        self._last_sync = -MISS_SYNC_INTERVAL
        self._sync_queued = False
        self._io = ThreadPoolExecutor(_UPLOAD_THREADS, thread_name_prefix="blockkv-remote")
        self._background = ThreadPoolExecutor(1, thread_name_prefix="blockkv-remote-sync")

    def close(self) -> None:
        self._background.shutdown(wait=True, cancel_futures=True)
        self._io.shutdown(wait=True, cancel_futures=True)
        self.bucket.close()

    # -- learning what the fleet wrote -------------------------------------------------
    def open(self) -> None:
        """Check the bucket's IDENTITY and learn every header. Another model's
        IDENTITY is a ValueError; an outage is a warning (the next sync retries)."""
        try:
            self.bucket.ensure_identity(self._identity)
            self._identity_checked = True
        except BucketError as exc:
            self._outage("bucket unreachable at open", exc)
            return
        self.sync()

    def sync(self) -> int:
        """List the bucket now: learn new headers, forget the ones gone, send the
        backlog. Returns how many entries were learned (0 on an outage)."""
        with self._sync_lock:
            self._last_sync = time.monotonic()
            self._next_sync = self._last_sync + self.sync_interval
            try:
                if not self._identity_checked:
                    try:
                        self.bucket.ensure_identity(self._identity)
                    except ValueError as exc:  # another model's IDENTITY: nothing there is ours to serve
                        self._warn("remote-identity", f"{exc}; remote entries are not served")
                        self.breaker.failed()
                        return 0
                    self._identity_checked = True
                listed = self.bucket.list_headers()
                learned = self._learn(listed)
                self._cache.prune(listed)
                self._send_backlog(listed)
            except BucketError as exc:
                self._outage("bucket listing failed", exc)
                return 0
        self.breaker.succeeded()
        return learned

    def _learn(self, listed: Mapping[str, object]) -> int:
        local = {header_name(e.ns, e.id) for e in self._local_entries()}
        with self._mutex:
            self._listed = set(listed)
            self._ignored &= self._listed  # what left the bucket needs no remembering
            for entry_id, name in list(self._remote_only.items()):
                if name not in listed or name in local:  # evicted fleet-wide, or local now
                    self._forget(entry_id)
            known = local | set(self._remote_only.values()) | self._ignored
        new = [n for n in sorted(listed, key=lambda n: (listed[n].last_modified, n)) if n not in known]
        found = self._cache.get(new)
        many = len(new) - len(found) >= MANIFEST_MIN
        if many:  # one GET may hold most of them
            found.update(self._from_manifest([n for n in new if n not in found]))
        fetched, damaged = self.bucket.fetch_headers(n for n in new if n not in found)
        self._cache.keep(fetched)
        found.update(fetched)
        if len(fetched) >= MANIFEST_MIN:  # the next fresh node should not have to do that
            try:
                self._io.submit(self._write_manifest, set(listed))
            except RuntimeError:  # closing
                pass
        if damaged:
            self._warn("remote-damaged", f"{len(damaged)} header(s) in {self.bucket.url} do not verify "
                                         f"(damaged, or a newer format): not served, e.g. {damaged[0]}")
        learned = 0
        with self._mutex:
            self._ignored.update(damaged)
            for name in new:
                if name in found and self._add(name, *found[name], listed[name].last_modified):
                    learned += 1
                elif name in found:
                    self._ignored.add(name)
        return learned

    def _add(self, name: str, data: bytes, header: Header, last_modified: float) -> bool:
        """Add a verified header to the remote catalog if it is an entry this handle serves."""
        entry_id = name.rpartition("/")[2].removesuffix(SUFFIX)
        if (header.identity != self._identity or header.ns.startswith(CHECKPOINT_NS)
                or name != header_name(header.ns, entry_id)):
            return False
        record = self._dir.record(entry_id, self._dir.header_path(header.ns, entry_id), header, len(data))
        refs = blocks_for_prefix(header.descriptor, None)
        self.catalog.add(record, last_modified, {r.name: r.raw_bytes for r in refs})  # raw: stored sizes unknown
        self._remote_only[entry_id] = name
        self._remote_blocks.update(record.blocks)
        return True

    def _from_manifest(self, names: list[str]) -> dict[str, tuple[bytes, Header]]:
        """Verified headers of ``names`` found in the bucket's MANIFEST (kept in the cache)."""
        found = headers_from_manifest(self.bucket.get_manifest(), names)
        self._cache.keep(found)
        return found

    def _write_manifest(self, listed: set[str]) -> None:
        """Pack every listed header this node has a copy of (cached, or its own
        local header file) into the bucket's MANIFEST."""
        headers = []
        for name in sorted(listed):
            for path in (self._cache.directory / name, self._dir.entries_dir / name):
                try:
                    headers.append((name, self._dir.fs.read(path)))
                    break
                except OSError:
                    continue
        try:
            self.bucket.put_manifest(pack_manifest(headers))
        except BucketError as exc:
            self._warn("remote-manifest", f"could not write the bucket's MANIFEST ({exc}); nodes fetch headers one by one")

    def _forget(self, entry_id: str) -> None:
        entry = self.catalog.get(entry_id)
        for block in entry.blocks if entry is not None else ():
            self._remote_blocks[block] -= 1
            if self._remote_blocks[block] <= 0:
                del self._remote_blocks[block]
        self._remote_only.pop(entry_id, None)
        self.catalog.drop(entry_id)

    def poke(self, miss: bool = False) -> None:
        """A find or restore happened: list in the background if the interval has
        passed, or (on a miss) if the last listing is older than MISS_SYNC_INTERVAL."""
        now = time.monotonic()
        with self._mutex:
            due = now >= self._next_sync or (miss and now - self._last_sync >= MISS_SYNC_INTERVAL)
            if not due or self._sync_queued or self.breaker.is_open():
                return
            self._sync_queued = True
            self._last_sync = now
        try:
            self._background.submit(self._background_sync)
        except RuntimeError:  # closing
            pass

    def _background_sync(self) -> None:
        try:
            self.sync()
        except Exception as exc:  # noqa: BLE001 - a background job must never die silently
            self._warn("remote-sync", f"remote sync failed: {exc!r}")
        finally:
            with self._mutex:
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
            self._warn("remote-miss", "bucket unreachable: entries only it holds are misses for now")
            return False
        key = block_key(self._identity, entry.ns)
        fetches = self.bucket.submit_fetches((n for n in entry.blocks if not self._dir.pool.exists(n)), key)

        def frame_of(block: str) -> bytes:  # waits for its fetch; one a local gc took since we looked: fetched now
            return fetches[block].result() if block in fetches else self.bucket.fetch_block(block, key)

        try:
            data, header = self._cache.get([name]).get(name) or self.bucket.fetch_header(name)
            record = self._dir.record(entry.id, self._dir.header_path(header.ns, entry.id), header, len(data))
            if header.identity != self._identity or header.ns != entry.ns or record.blocks != entry.blocks \
                    or not np.array_equal(record.tokens, entry.token_array):
                raise CorruptError(f"remote header {name} changed since it was listed")
            adopted = self._adopt(entry.id, header, data, frame_of)
            failure = None if adopted else next(  # what a failed fetch proves, if one made it fail
                (f.exception() for f in fetches.values() if f.done() and not f.cancelled() and f.exception()), None)
            if failure is not None:
                raise failure
        except (BlockMissingError, CorruptError) as exc:
            self._warn("remote-gone", f"remote entry {entry.id} is a miss and forgotten: {exc}")
            with self._mutex:
                self._forget(entry.id)
                self._ignored.add(name)  # if its header is still listed, do not learn it again
            return False
        except BucketError as exc:
            self._outage("bucket fetch failed", exc)
            return False
        except Exception as exc:  # noqa: BLE001 - MemoryError, a local OSError: a miss that proves nothing
            self._warn("remote-miss", f"remote entry {entry.id} not fetched ({exc!r}); kept, served as a miss")
            return False
        finally:
            for f in fetches.values():
                f.cancel()
        if not adopted:
            return False
        self.breaker.succeeded()
        with self._mutex:
            self._forget(entry.id)
        return True

    def used(self, entry: Entry) -> None:
        """Record a restore where the fleet's LRU sees it (at most once per
        ``touch_interval`` per entry; in the background)."""
        self.poke()
        name = header_name(entry.ns, entry.id)
        if name not in self._listed or self.breaker.is_open():
            return

        def touch() -> None:
            try:
                self.bucket.touch(name)
            except BucketError as exc:
                self._outage("bucket touch failed", exc)

        try:
            self._io.submit(touch)
        except RuntimeError:  # closing
            pass

    # -- store ------------------------------------------------------------------------------
    uploaded_bytes = 0  # headers and block bodies this handle PUT

    def upload(self, entry_id: str, ns: str, encoded: bytes, names: Iterable[str], new: set[str],
               replaced: Iterable[Entry] = ()) -> bool:
        """A local store's bucket half: True once its header is in the bucket.
        Otherwise the entry stays local and in the backlog, for a later sync.
        The entries the store's rules ``replaced`` (identical, or superseded
        prefixes) are then removed from the bucket too (in the background)."""
        self._backlog.mark(entry_id)
        if self.breaker.is_open():
            self._warn("remote", "bucket unreachable: storing locally only; uploads resume when it answers")
            return False
        if not self._upload(entry_id, header_name(ns, entry_id), encoded, list(dict.fromkeys(names)), new):
            return False
        self._backlog.unmark(entry_id)
        self.remove_replaced(replaced)
        return True

    def remove_replaced(self, replaced: Iterable[Entry]) -> None:
        """Entries the store rules removed locally (identical to, or a shorter
        prefix of, an entry now in the bucket) leave the bucket too, in the background."""
        with self._mutex:
            doomed = [n for n in (header_name(e.ns, e.id) for e in replaced) if n in self._listed]
            self._listed.difference_update(doomed)
        if doomed:
            try:
                self._io.submit(self._remove_headers, doomed)
            except RuntimeError:  # closing: the entries stay in the bucket, harmless duplicates
                pass

    def _remove_headers(self, names: list[str]) -> None:
        try:
            for name in names:
                self.bucket.headers.delete(name)
        except Exception as exc:  # noqa: BLE001 - they stay, harmless: shadowed wherever they are found
            self._outage("removing replaced entries failed", exc)

    def _upload(self, entry_id: str, name: str, encoded: bytes, names: list[str], new: set[str]) -> bool:
        pool = self._dir.pool

        def frame(block: str) -> list[bytes]:
            return [pool.read(block)]

        with self._mutex:
            if entry_id in self._uploading:
                return False
            self._uploading.add(entry_id)
        committing = False
        try:
            session = self.bucket.begin_store()
            # a block new to the local pool and to every entry this node knows in the bucket is likely
            # new there too: one conditional PUT with its body; any other (a local dedup hit, a block
            # of another node's entry) a HEAD first, the body only if the bucket lacks it or it is old
            with self._mutex:
                fresh = {b for b in new if b not in self._remote_blocks}
            list(self._io.map(lambda b: session.put_block(b, frame(b) if b in fresh else lambda: frame(b)), names))
            committing = True
            session.commit(name, encoded, frame)
        except StoreTooSlow as exc:  # the bucket answers, slowly: not an outage
            self._warn("remote-slow", f"entry {entry_id} not uploaded: {exc}")
            return False
        except BucketError as exc:
            # a header PUT that failed may still have landed, or another handle on this root sent it
            if not (committing and self._header_there(name)):
                self._outage("upload failed", exc)
                return False
        except (OSError, BlockKVError) as exc:  # a local block gone meanwhile (evicted): not uploaded
            self._warn("remote-upload", f"entry {entry_id} not uploaded: {exc}")
            return False
        finally:
            with self._mutex:
                self._uploading.discard(entry_id)
        self.breaker.succeeded()
        with contextlib.suppress(OSError):  # a block evicted meanwhile: uploaded all the same, not counted
            self.uploaded_bytes += len(encoded) + sum(pool.path(b).stat().st_size for b in session.created)
        with self._mutex:
            self._listed.add(name)
        return True

    def _header_there(self, name: str) -> bool:
        """After a failed header PUT: did it land anyway (or did another handle upload it)?"""
        try:
            return self.bucket.headers.exists(name)
        except Exception:  # noqa: BLE001 - an outage: it is not known to be there
            return False

    def _outage(self, what: str, exc: BaseException) -> None:
        self.breaker.failed()
        self._warn("remote", f"{what} ({exc}): serving from the local cache only; "
                             f"stores are kept locally and uploaded when the bucket answers")

    # -- the backlog --------------------------------------------------------------------------
    def backlog(self) -> list[str]:
        """Entry ids stored locally whose upload has not been acknowledged."""
        return self._backlog.pending()

    def _send_backlog(self, listed: Mapping[str, object]) -> None:
        """Upload what the bucket missed, oldest marker first; stop at the first outage."""
        pending = self._backlog.pending()
        if not pending:
            return
        local = {e.id: e for e in self._local_entries()}
        for entry_id in pending:
            entry = local.get(entry_id)
            if entry is None or entry.checkpoint is not None:  # evicted or removed locally: nothing to send
                self._backlog.unmark(entry_id)
                continue
            name = header_name(entry.ns, entry_id)
            if name in listed:
                self._backlog.unmark(entry_id)
                continue
            try:
                encoded = self._dir.fs.read(self._dir.header_path(entry.ns, entry_id))
            except OSError:
                self._backlog.unmark(entry_id)  # its header is gone: removed meanwhile
                continue
            if self._upload(entry_id, name, encoded, list(entry.blocks), set()):
                self._backlog.unmark(entry_id)
            elif self.breaker.is_open():
                return
