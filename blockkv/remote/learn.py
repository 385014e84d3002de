"""How a node learns what the fleet wrote (docs/scale-out.md, "Learning what
the fleet wrote"): every header a listing shows and the node does not know
is taken from a proven copy — its cached copy of the listed ETag, a MANIFEST
record proven to be the listed object (a seal, or an MD5 ETag), else a GET —
verified, kept in the header cache, and recorded in the remote catalog
(remote_catalog.py: a small record and a digest per block, never the tokens).

Headers are handled ``BATCH`` at a time and each is dropped once recorded,
so what learning holds in memory is a batch, not the fleet: a MANIFEST is
read as a stream, and a fresh node's first open against 10,000 entries of
8k tokens holds a few MiB of headers at a time, not 400 MiB.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import islice

from blockkv.bucket.bucket_dir import BucketDir, HeaderCopy
from blockkv.bucket.manifest import MANIFEST_MIN, manifest_stream, pack_manifest, record_proven
from blockkv.bucket.objects import BucketError, ObjectInfo, outage
from blockkv.errors import BlockKVError, CorruptError, OversizedError
from blockkv.format.blocks import block_naming_key
from blockkv.format.descriptor import blocks_for_prefix
from blockkv.format.header import Identity
from blockkv.format.layout import entry_id_of, entry_record, header_name
from blockkv.local.directory import Directory
from blockkv.records import CHECKPOINT_NS
from blockkv.remote.listing import Listing
from blockkv.remote.local_state import HeaderCache
from blockkv.remote.remote_catalog import RemoteCatalog

BATCH = 64  # headers handled at a time


def _batches(names: Iterable[str]) -> Iterator[list[str]]:
    it = iter(names)
    while batch := list(islice(it, BATCH)):
        yield batch


class Learner:
    """One tier's learning: ``learn(listed, local)`` after every listing."""

    def __init__(self, bucket: BucketDir, identity: Identity, directory: Directory, catalog: RemoteCatalog,
                 cache: HeaderCache, listing: Listing, warn: Callable[[str, str], None],
                 background: Callable[..., None]) -> None:
        self._bucket, self._identity, self._dir = bucket, identity, directory
        self._catalog, self._cache, self._listing = catalog, cache, listing
        self._warn, self._background = warn, background

    def learn(self, listed: Mapping[str, ObjectInfo], local: set[str]) -> int:
        """Forget catalog entries gone from the bucket or local now, and learn
        the headers ``listed`` shows that no entry of the node's is (``local``:
        header names of its local entries). Returns how many entries were learned."""
        self._listing.replace(listed)
        known = set(local) | self._listing.ignored()
        for entry in self._catalog.entries():
            name = header_name(entry.ns, entry.id)
            if name not in listed or name in local:  # evicted fleet-wide, or local now
                self._catalog.drop(entry.id)
            known.add(name)
        new = [n for n in sorted(listed, key=lambda n: (listed[n].last_modified, n)) if n not in known]
        learned, damaged, unsealed = 0, [], []
        missing = []
        for batch in _batches(new):
            found = self._cache.get(batch, self._bucket.header_copy)
            stale = [n for n, c in found.items() if c.etag != listed[n].etag]  # a copy of another object
            self._cache.drop(stale)
            learned += self._record({n: c for n, c in found.items() if n not in stale}, listed, unsealed)
            missing += [n for n in batch if n not in found or n in stale]
            self._catalog.flush()
        if len(missing) >= MANIFEST_MIN:  # one GET may hold most of them
            got, from_manifest = self._from_manifest(listed, missing, unsealed)
            learned += from_manifest
            missing = [n for n in missing if n not in got]
        fetched = 0
        for batch in _batches(missing):
            result = self._bucket.fetch_headers(batch, {n: listed[n].size for n in batch})
            self._cache.keep(result.found)
            fetched += len(result.found)
            damaged += list(result.damaged)
            self._listing.ignore(result.damaged)
            self._listing.doubt(result.damaged)
            learned += self._record(result.found, listed, unsealed)
            self._catalog.flush()
        self._catalog.flush()
        if fetched >= MANIFEST_MIN:  # the next fresh node should not have to do that
            self._background(self.write_manifest, dict(listed))
        if damaged:
            self._warn("remote-damaged", f"{len(damaged)} header(s) in {self._bucket.url} do not verify "
                                         f"(damaged, oversized, or a newer format): not served, e.g. {damaged[0]}")
        if unsealed:
            self._warn("remote-unsealed", f"{len(unsealed)} header(s) in {self._bucket.url} are not sealed with "
                                          f"the fleet key: not served, e.g. {unsealed[0]}")
        return learned

    def _record(self, copies: Mapping[str, HeaderCopy], listed: Mapping[str, ObjectInfo], unsealed: list[str]) -> int:
        """Record verified copies in the catalog if they are entries this handle serves."""
        learned = 0
        for name, copy in copies.items():
            if block_naming_key(copy.header.identity, "") is not None:
                self._listing.doubt([name])
            if self._bucket.key is not None and not copy.sealed:
                unsealed.append(name)
            elif self.record(name, copy, listed[name].last_modified):
                learned += 1
                continue
            self._listing.ignore([name])
        return learned

    def record(self, name: str, copy: HeaderCopy, last_modified: float) -> bool:
        """Add a verified header to the catalog if it is an entry this handle serves."""
        header = copy.header
        if header.identity != self._identity or header.ns.startswith(CHECKPOINT_NS):
            return False
        entry_id = entry_id_of(name)
        record = entry_record(entry_id, self._dir.rel(self._dir.header_path(header.ns, entry_id)), header,
                              len(copy.data), copy.descriptor)
        payload = sum(r.raw_bytes for r in blocks_for_prefix(copy.descriptor, None))
        self._catalog.add(entry_id, header.ns, header.tokens, record.blocks, trimmable=record.trimmable,
                          minimum_reusable_offset=record.minimum_reusable_offset, header_bytes=len(copy.data),
                          nbytes=len(copy.data) + payload, last_modified=last_modified)
        return True

    def _from_manifest(self, listed: Mapping[str, ObjectInfo], names: list[str], unsealed: list[str]
                       ) -> tuple[set[str], int]:
        """Learn what the bucket's MANIFEST holds of ``names``: each record
        proven to be the listed object (``record_proven``: its MD5 ETag, else
        its seal with a fleet key) and verified, then kept in the cache and recorded. Any other
        record is fetched on its own. Returns the names taken from it and how
        many entries they made."""
        taken: set[str] = set()
        learned = 0
        batch: dict[str, HeaderCopy] = {}

        def take() -> None:
            nonlocal learned
            self._cache.keep(batch)
            learned += self._record(batch, listed, unsealed)
            taken.update(batch)
            batch.clear()
            self._catalog.flush()

        try:
            with outage("manifest"):
                for name, data in manifest_stream(self._bucket.meta, listed, names, self._cache.spool()):
                    try:
                        copy = self._bucket.header_copy(name, data, listed[name].etag)
                    except (CorruptError, BlockKVError):
                        continue
                    if record_proven(copy.etag, data, copy.sealed):
                        batch[name] = copy
                        if len(batch) >= BATCH:
                            take()
        except OversizedError as exc:
            self._warn("remote-manifest", f"the bucket's MANIFEST is not read: {exc}")
        take()
        return taken, learned

    def write_manifest(self, listed: dict[str, ObjectInfo]) -> None:
        """Pack every listed header this node holds a cached copy of, of the
        listed ETag, into the bucket's MANIFEST (an unconditional PUT: the last
        writer wins). Copies are read a batch at a time."""
        def records() -> Iterator[tuple[str, str, bytes]]:
            for batch in _batches(sorted(listed)):
                for name, copy in self._cache.get(batch, self._bucket.header_copy).items():
                    if copy.etag == listed[name].etag:
                        yield name, copy.etag, copy.data

        try:
            with outage("manifest"):
                self._bucket.meta.put_overwrite("MANIFEST", [pack_manifest(records())])
        except BucketError as exc:
            self._warn("remote-manifest", f"could not write the bucket's MANIFEST ({exc}); "
                                          "nodes fetch headers one by one")
