"""Look at the fingerprint directories in a bucket without changing them.

What ``blockkv ls`` and ``stats`` show with ``--remote``, as ``reader.py``
does for a local directory (``check --remote`` is check.py). Only LISTs and
GETs, each read bounded: no clock probe, no last-use mark. The bucket is
untrusted: headers are decoded and verified like local ones, and with a
fleet key only sealed ones count.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import obstore

from blockkv.bucket.bucket_dir import BucketDir, HeaderCopy
from blockkv.bucket.fleet_key import FleetKey
from blockkv.bucket.objects import MAX_IDENTITY_BYTES, ObjectInfo, outage
from blockkv.errors import BlockMissingError, CorruptError, OversizedError
from blockkv.format.blocks import CODEC_ID, modes
from blockkv.format.header import Identity
from blockkv.format.layout import Layout, entry_id_of, entry_record, fingerprint_dirname
from blockkv.pool.s3 import S3Pool
from blockkv.records import Entry, EntryRecord

_IDENTITY_LAYOUT = Layout(re.compile(r"[A-Za-z0-9._-]+/IDENTITY"), sharded=False)


@dataclass(frozen=True)
class BucketFingerprint:
    """A fingerprint directory in a bucket, as its IDENTITY object names it."""

    name: str  # the directory's name under the prefix (as locally)
    url: str  # s3://bucket/prefix/<name>
    model_id: str
    config_fingerprint: str
    tokenizer_hash: str

    @property
    def identity(self) -> Identity:
        return Identity(self.model_id, self.config_fingerprint, self.tokenizer_hash, CODEC_ID)


class _Identities(S3Pool):
    """The prefix's ``<fingerprint dir>/IDENTITY`` objects, found by one
    delimited listing (not a walk over every block in the bucket)."""

    def directories(self) -> list[str]:
        with self._bucket_must_exist():
            listing = obstore.list_with_delimiter(self._store)
        return sorted(p.rstrip("/").rpartition("/")[2] for p in listing["common_prefixes"])


def list_bucket_fingerprints(url: str, options: Mapping[str, str] | None = None, *, timeout: float = 10.0,
                             connect_timeout: float = 3.0, max_retries: int = 1, key: FleetKey | None = None
                             ) -> tuple[list[BucketFingerprint], list[str]]:
    """The fingerprint directories under ``s3://bucket/prefix``, and the names of
    directories whose IDENTITY does not read, or (with a fleet key) is not
    sealed with it (left alone). An outage raises BucketError."""
    identities = _Identities(url, _IDENTITY_LAYOUT, options, timeout=timeout, connect_timeout=connect_timeout,
                             max_retries=max_retries)
    found, unreadable = [], []
    with outage("fingerprint listing"):
        names = identities.directories()
    for name in names:
        try:
            with outage(f"{name}/IDENTITY"):
                data, _ = identities.get_limited(f"{name}/IDENTITY", MAX_IDENTITY_BYTES)
            meta = json.loads(data)
            if key is not None and not key.identity_sealed(name, meta):
                raise ValueError("not sealed with the fleet key")
            fp = BucketFingerprint(name, f"{url.rstrip('/')}/{name}", meta["model_id"],
                                   meta["config_fingerprint"], meta["tokenizer_hash"])
            if fingerprint_dirname(fp.config_fingerprint) != name:
                raise ValueError("names the fingerprint of another directory")
        except BlockMissingError:
            continue  # a prefix without IDENTITY is not ours (or not yet)
        except (OversizedError, ValueError, KeyError, TypeError):
            unreadable.append(name)
            continue
        found.append(fp)
    return found, unreadable


@dataclass(frozen=True)
class BucketView:
    """What one fingerprint directory in a bucket holds, as its objects say."""

    entries: list[Entry]  # this identity's servable entries (last use: store or last restore, fleet-wide)
    foreign: Counter[Identity]  # entries of other identities sharing the directory
    corrupt_headers: list[str]  # header names (``<ns dir>/<uuid>.bkv``) that do not read
    dangling: list[str]  # entry ids missing a block
    disk_bytes: int  # headers plus each referenced block once (what evict_to counts)
    blocks: int  # distinct blocks referenced
    unreferenced_blocks: int  # blocks no header names: stores in progress, or garbage for gc
    unreferenced_bytes: int

    @property
    def logical_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


@dataclass(frozen=True)
class Listed:
    """One pass over a directory in a bucket: headers read, blocks listed."""

    records: dict[str, tuple[EntryRecord, HeaderCopy] | None]  # header name -> what it says (None: does not read)
    headers: dict[str, ObjectInfo]
    blocks: dict[str, ObjectInfo]
    used: dict[str, float]  # header name -> last restore anywhere (Last-Modified of used/<name>)
    unsealed: list[str]  # with a fleet key: headers without a valid seal (not in records: nobody's)
    sealed_damaged: list[str]  # with a fleet key: headers that do not read but carry a valid seal


def list_directory(bucket: BucketDir) -> Listed:
    """Headers (each read, bounded, and verified), blocks and last-use marks."""
    headers = bucket.list_headers()
    with outage("listing"):
        blocks = {i.name: i for i in bucket.blocks.list_info()}
        used = {i.name.removeprefix("used/"): i.last_modified for i in bucket.meta.list_info("used/")}
    fetched = bucket.fetch_headers(headers, {n: i.size for n, i in headers.items()})
    keyed = bucket.key is not None
    records: dict[str, tuple[EntryRecord, HeaderCopy] | None] = {
        n: None for n, sealed in fetched.damaged.items() if not keyed or sealed}
    unsealed = [n for n, sealed in fetched.damaged.items() if keyed and not sealed]
    for name, copy in fetched.found.items():
        if keyed and not copy.sealed:
            unsealed.append(name)
            continue
        entry_id = entry_id_of(name)
        try:
            records[name] = entry_record(entry_id, f"entries/{name}", copy.header, len(copy.data)), copy
        except (CorruptError, ValueError, KeyError, TypeError):
            records[name] = None
    return Listed(records, {n: headers[n] for n in records}, blocks, used, sorted(unsealed),
                  sorted(n for n, sealed in fetched.damaged.items() if keyed and sealed))


def read_bucket(bucket: BucketDir, identity: Identity) -> BucketView:
    """A read-only view of ``bucket``'s fingerprint directory, for ``identity``."""
    listed = list_directory(bucket)
    own = {mode.digest() for mode in modes(identity)}  # a --per-key-cache node's entries are ours too
    entries: list[Entry] = []
    foreign: Counter[Identity] = Counter()
    corrupt, dangling = [], []
    referenced: set[str] = set()
    header_bytes = 0
    for name, read in sorted(listed.records.items()):
        if read is None:
            corrupt.append(name)
            continue
        record, copy = read
        if any(b not in listed.blocks for b in record.blocks):
            if record.owner in own:
                dangling.append(record.id)
            continue
        header_bytes += record.header_bytes
        referenced.update(record.blocks)
        if record.owner not in own:
            foreign[copy.header.identity] += 1
            continue
        last_use = max(listed.headers[name].last_modified, listed.used.get(name, 0.0))
        entries.append(Entry.of(record, record.header_bytes + sum(listed.blocks[b].size for b in record.blocks),
                                last_use))
    unreferenced = [i for n, i in listed.blocks.items() if n not in referenced]
    return BucketView(
        entries=entries, foreign=foreign, corrupt_headers=corrupt, dangling=dangling,
        disk_bytes=header_bytes + sum(listed.blocks[b].size for b in referenced), blocks=len(referenced),
        unreferenced_blocks=len(unreferenced), unreferenced_bytes=sum(i.size for i in unreferenced),
    )
