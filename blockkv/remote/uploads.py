"""A store's uploads to the bucket (tier.py's other job): every block of a
local store, verified as it is sent, then its header (sealed with the fleet
key when there is one) as the commit point; the backlog of stores the bucket
has not acknowledged; and the entries the store rules replaced, removed from
the bucket too (docs/scale-out.md, "Store, and what its return value means").
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

from blockkv.bucket.bucket import Bucket
from blockkv.bucket.objects import BucketError, ObjectInfo, outage
from blockkv.bucket.session import StoreTooSlow
from blockkv.errors import BlockKVError
from blockkv.format.blocks import BlockRef, block_naming_key
from blockkv.format.descriptor import blocks_for_prefix
from blockkv.format.header import Identity
from blockkv.format.layout import header_name
from blockkv.local.directory import Directory
from blockkv.records import Entry
from blockkv.remote.breaker import Breaker
from blockkv.remote.listing import Listing
from blockkv.remote.local_state import Backlog, HeaderCache
from blockkv.remote.remote_catalog import RemoteCatalog

_UPLOAD_THREADS = 8

Outage = Callable[[str, BaseException], None]  # an outage met: the breaker opens, one warning


class Uploader:
    """The upload side of one tier: ``upload`` (a store's bucket half),
    ``remove_replaced``, the backlog, and the tier's background threads."""

    def __init__(self, bucket: Bucket, directory: Directory, identity: Identity, cache: HeaderCache,
                 listing: Listing, catalog: RemoteCatalog, breaker: Breaker, warn: Callable[[str, str], None],
                 outage: Outage, local_entries: Callable[[], list[Entry]]) -> None:
        self._bucket, self._dir, self._identity = bucket, directory, identity
        self._cache, self._listing, self._catalog = cache, listing, catalog
        self._breaker, self._warn, self._outage, self._local_entries = breaker, warn, outage, local_entries
        self._backlog = Backlog(directory.path / "backlog", warn)
        self._lock = threading.Lock()
        self._uploading: set[str] = set()  # entry ids this handle is uploading now
        self.uploaded_bytes = 0  # headers and block bodies this handle PUT
        self._io = ThreadPoolExecutor(_UPLOAD_THREADS, thread_name_prefix="blockkv-remote")
        self._background = ThreadPoolExecutor(1, thread_name_prefix="blockkv-remote-sync")

    def close(self) -> None:
        self._background.shutdown(wait=True, cancel_futures=True)
        self._io.shutdown(wait=True, cancel_futures=True)

    def submit(self, job: Callable[..., object], *args: object) -> None:
        """Run ``job`` on an upload thread (not at all once closing)."""
        try:
            self._io.submit(job, *args)
        except RuntimeError:  # closing
            pass

    def background(self, job: Callable[[], object]) -> None:
        """Run ``job`` on the sync thread (not at all once closing)."""
        try:
            self._background.submit(job)
        except RuntimeError:  # closing
            pass

    # -- store ------------------------------------------------------------------------------
    def upload(self, entry_id: str, ns: str, encoded: bytes, blocks: Iterable[BlockRef], new: set[str],
               replaced: Iterable[Entry] = ()) -> bool:
        """A local store's bucket half: True once its header is in the bucket.
        Otherwise the entry stays local and in the backlog, for a later sync.
        The entries the store's rules ``replaced`` (identical, or superseded
        prefixes) are then removed from the bucket too (in the background)."""
        key = self._bucket.key
        self._backlog.mark(entry_id, key.backlog_body(header_name(ns, entry_id), encoded) if key is not None else b"")
        if self._breaker.is_open():
            self._warn("remote", "bucket unreachable: storing locally only; uploads resume when it answers")
            return False
        if not self._upload(entry_id, ns, header_name(ns, entry_id), encoded, blocks, new):
            return False
        self._backlog.unmark(entry_id)
        self.remove_replaced(replaced)
        return True

    def remove_replaced(self, replaced: Iterable[Entry]) -> None:
        """Entries the store rules removed locally (identical to, or a shorter
        prefix of, an entry now in the bucket) leave the bucket too, in the background."""
        doomed = self._listing.take(header_name(e.ns, e.id) for e in replaced)
        if doomed:
            self.submit(self._remove_headers, doomed)

    def _remove_headers(self, names: list[str]) -> None:
        """Delete headers of entries this node replaced, each only if the bucket's
        object is still the copy this node holds (its ETag): what a node learned
        can never make it delete another object."""
        copies = self._cache.get(names, self._bucket.header_copy)
        try:
            for name in names:
                copy = copies.get(name)
                with outage("removing replaced entries"):
                    if copy is not None and copy.etag and self._bucket.headers.info(name).etag == copy.etag:
                        self._bucket.headers.delete(name)
        except Exception as exc:  # noqa: BLE001 - they stay, harmless: shadowed wherever they are found
            self._outage("removing replaced entries failed", exc)

    def _upload(self, entry_id: str, ns: str, name: str, encoded: bytes, blocks: Iterable[BlockRef],
                new: set[str], exists_ok: bool = False) -> bool:
        pool = self._dir.pool
        with self._lock:
            if entry_id in self._uploading:
                return False
            self._uploading.add(entry_id)
        key = self._bucket.key
        sealed = key.seal_header(name, encoded) if key is not None else encoded
        committing = False
        try:
            session = self._bucket.begin_store(block_naming_key(self._identity, ns))
            session.heal_local = lambda block, frame: pool.write(block, [frame])
            # a block new to the local pool and to every entry this node knows in the bucket is likely
            # new there too: one conditional PUT with its body; any other (a local dedup hit, a block
            # of another node's entry) a HEAD first, the body only if the bucket lacks it or it is old
            refs = {ref.name: ref for ref in blocks}
            fresh = self._catalog.unknown_blocks([b for b in refs if b in new])
            list(self._io.map(lambda r: session.put_block(r, lambda: pool.read(r.name), r.name in fresh), refs.values()))
            committing = True
            landed = session.commit(name, sealed, exists_ok)
        except StoreTooSlow as exc:  # the bucket answers, slowly: not an outage
            self._warn("remote-slow", f"entry {entry_id} not uploaded: {exc}")
            return False
        except BucketError as exc:
            # a header PUT that failed may still have landed, or another handle on this root sent it
            landed = self._header_there(name, sealed) if committing else None
            if landed is None:
                self._outage("upload failed", exc)
                return False
        except (OSError, BlockKVError) as exc:  # a local block gone (evicted) or rotten meanwhile: not uploaded
            self._warn("remote-upload", f"entry {entry_id} not uploaded: {exc}")
            return False
        finally:
            with self._lock:
                self._uploading.discard(entry_id)
        self._breaker.succeeded()
        with contextlib.suppress(OSError):  # a block evicted meanwhile: uploaded all the same, not counted
            self.uploaded_bytes += len(sealed) + sum(pool.path(b).stat().st_size for b in session.created)
        self._listing.landed(name, landed)
        self._cache.keep({name: self._bucket.header_copy(name, sealed, landed.etag)})  # for the MANIFEST
        return True

    def _header_there(self, name: str, sealed: bytes) -> ObjectInfo | None:
        """After a failed header PUT: did it land anyway (or did another handle upload it)?"""
        try:
            with outage(f"header {name}"):
                data, meta = self._bucket.headers.get_limited(name, len(sealed))
            return ObjectInfo(name, meta["size"], meta["last_modified"].timestamp(),
                              (meta.get("e_tag") or "").strip('"')) if data == sealed else None
        except Exception:  # noqa: BLE001 - an outage, or another object: it is not known to be there
            return None

    # -- the backlog --------------------------------------------------------------------------
    def backlog(self) -> list[str]:
        """Entry ids stored locally whose upload has not been acknowledged."""
        return self._backlog.pending()

    def send_backlog(self, listed: Mapping[str, ObjectInfo]) -> None:
        """Upload what the bucket missed, oldest marker first; stop at the first
        outage. An entry whose header is listed already (an upload killed after
        its header landed) has its blocks checked again before it counts."""
        pending = self._backlog.pending()
        if not pending:
            return
        local = {e.id: e for e in self._local_entries()}
        for entry_id in pending:
            entry = local.get(entry_id)
            if entry is None or entry.checkpoint is not None:  # evicted or removed locally: nothing to send
                self._backlog.unmark(entry_id)
                continue
            try:
                encoded = self._dir.fs.read(self._dir.header_path(entry.ns, entry_id))
                header = self._dir.read_header(self._dir.header_path(entry.ns, entry_id))
            except (OSError, BlockKVError):
                self._backlog.unmark(entry_id)  # its header is gone: removed meanwhile
                continue
            name = header_name(entry.ns, entry_id)
            key = self._bucket.key
            if key is not None and not key.backlog_sealed(name, encoded, self._backlog.body(entry_id)):
                # not a store of this node's with the key: a header planted in the root, or a mark an
                # older blockkv or a keyless run left. Sealing it would make every keyed node serve it.
                self._warn("remote-backlog-mark", f"entry {entry_id} not uploaded: its backlog mark is not this "
                           "node's own under the fleet key; it stays local")
                self._backlog.unmark(entry_id)
                continue
            if self._upload(entry_id, entry.ns, name, encoded, blocks_for_prefix(header.descriptor, None), set(),
                            exists_ok=name in listed):
                self._backlog.unmark(entry_id)
            elif self._breaker.is_open():
                return

