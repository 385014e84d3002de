"""Look at the fingerprint directories in a bucket without changing them.

What ``blockkv ls``, ``stats`` and ``check`` show with ``--remote``, as
``reader.py`` and ``check.inspect`` do for a local directory. Only LISTs and
GETs: no clock probe, no last-use mark, and a damaged block is reported, not
quarantined (``Bucket.fetch_block`` deletes it; a tool that only looks must
not) — unless ``check --remote --repair`` asks for exactly that.
The bucket is untrusted: headers are decoded and verified like local ones, and
``check_bucket`` hashes every block against its name.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import obstore

from blockkv.errors import BlockMissingError, CorruptBlockError, CorruptError
from blockkv.format.blocks import CODEC_ID, block_key
from blockkv.format.frame import decode_block
from blockkv.format.header import SUFFIX, Header, Identity
from blockkv.local.check import CheckReport
from blockkv.local.directory import entry_record, fingerprint_dirname
from blockkv.pool.protocol import Layout
from blockkv.pool.s3 import S3Pool
from blockkv.records import Entry, EntryRecord
from blockkv.remote.bucket import Bucket
from blockkv.remote.objects import BucketError, ObjectInfo, outage

_MAX_IDENTITY_BYTES = 1 << 20
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
        listing = obstore.list_with_delimiter(self._store)
        return sorted(p.rstrip("/").rpartition("/")[2] for p in listing["common_prefixes"])


def list_bucket_fingerprints(url: str, options: Mapping[str, str] | None = None, *, timeout: float = 10.0,
                             connect_timeout: float = 3.0, max_retries: int = 1) -> tuple[
        list[BucketFingerprint], list[str]]:
    """The fingerprint directories under ``s3://bucket/prefix``, and the names of
    directories whose IDENTITY does not read (left alone). An outage raises BucketError."""
    identities = _Identities(url, _IDENTITY_LAYOUT, options, timeout=timeout, connect_timeout=connect_timeout,
                             max_retries=max_retries)
    found, unreadable = [], []
    with outage("fingerprint listing"):
        names = identities.directories()
    for name in names:
        try:
            with outage(f"{name}/IDENTITY"):
                data = identities.get(f"{name}/IDENTITY")
            if len(data) > _MAX_IDENTITY_BYTES:
                raise ValueError("too large")
            meta = json.loads(data)
            fp = BucketFingerprint(name, f"{url.rstrip('/')}/{name}", meta["model_id"],
                                   meta["config_fingerprint"], meta["tokenizer_hash"])
            if fingerprint_dirname(fp.config_fingerprint) != name:
                raise ValueError("names the fingerprint of another directory")
        except BlockMissingError:
            continue  # a prefix without IDENTITY is not ours (or not yet)
        except (ValueError, KeyError, TypeError):
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
class _Listed:
    """One pass over a directory in a bucket: headers read, blocks listed."""

    records: dict[str, tuple[EntryRecord, Header] | None]  # header name -> what it says (None: does not read)
    headers: dict[str, ObjectInfo]
    blocks: dict[str, ObjectInfo]
    used: dict[str, float]  # header name -> last restore anywhere (Last-Modified of used/<name>)


def _list(bucket: Bucket) -> _Listed:
    headers = bucket.list_headers()
    with outage("listing"):
        blocks = {i.name: i for i in bucket.blocks.list_info()}
        used = {i.name.removeprefix("used/"): i.last_modified for i in bucket.meta.list_info("used/")}
    found, damaged = bucket.fetch_headers(headers)
    records: dict[str, tuple[EntryRecord, Header] | None] = dict.fromkeys(damaged)
    for name, (data, header) in found.items():
        entry_id = name.rpartition("/")[2].removesuffix(SUFFIX)
        try:
            records[name] = entry_record(entry_id, f"entries/{name}", header, len(data)), header
        except (CorruptError, ValueError, KeyError, TypeError):
            records[name] = None
    return _Listed(records, {n: headers[n] for n in records}, blocks, used)


def read_bucket(bucket: Bucket, identity: Identity) -> BucketView:
    """A read-only view of ``bucket``'s fingerprint directory, for ``identity``."""
    listed = _list(bucket)
    own = identity.digest()
    entries: list[Entry] = []
    foreign: Counter[Identity] = Counter()
    corrupt, dangling = [], []
    referenced: set[str] = set()
    header_bytes = 0
    for name, read in sorted(listed.records.items()):
        if read is None:
            corrupt.append(name)
            continue
        record, header = read
        if any(b not in listed.blocks for b in record.blocks):
            if record.owner == own:
                dangling.append(record.id)
            continue
        header_bytes += record.header_bytes
        referenced.update(record.blocks)
        if record.owner != own:
            foreign[header.identity] += 1
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


def check_bucket(bucket: Bucket, identity: Identity,
                 progress: Callable[[int, int], None] | None = None, *, repair: bool = False) -> CheckReport:
    """Verify a fingerprint directory in a bucket: every header reads, every
    block a header names exists and hashes to its name, every other block's
    frame reads. Blocks no header references are listed in ``in_flight`` (a
    store uploads its blocks before its header; garbage waits for ``gc``): not
    findings. A transient failure on one block is ``unreadable``. Without
    ``repair`` nothing is written; with it, what is proven broken goes
    (``_repair``) and ``actions`` says what."""
    listed = _list(bucket)
    own = identity.digest()
    report = CheckReport(blocks=len(listed.blocks))
    keys: dict[str, bytes | None] = {}
    for name, read in sorted(listed.records.items()):
        if read is None:
            report.corrupt_headers.append(name)
            continue
        record, header = read
        if record.owner != own:
            report.foreign_headers.append(name)
        else:
            report.entries += 1
        key = block_key(header.identity, header.ns)
        keys.update((b, key) for b in record.blocks)
    names = sorted(listed.blocks)
    for done, name in enumerate(names, 1):
        try:
            with outage(f"fetch of block {name}"):
                data = bucket.blocks.get(name)
            if name in keys:
                decode_block(name, data, key=keys[name])
            else:
                decode_block(name, data, verify=False)
        except CorruptBlockError:
            report.corrupt_blocks.append(name)
        except BlockMissingError:
            pass  # deleted by a gc since the listing
        except BucketError:
            report.unreadable.append(name)
        if progress is not None:
            progress(done, len(names))
    bad = set(report.corrupt_blocks)
    report.dangling = sorted(
        r.id for r, _ in filter(None, listed.records.values())
        if r.owner == own and any(b not in listed.blocks or b in bad for b in r.blocks)
    )
    report.in_flight = sorted(n for n in names if n not in keys)
    if repair:
        report.actions = _repair(bucket, report, listed, keys)
    return report


def _repair(bucket: Bucket, report: CheckReport, listed: _Listed, keys: dict[str, bytes | None]) -> list[str]:
    """Remove what is proven broken, as a node would on meeting it: a block that
    still fails verification when fetched again (``Bucket.fetch_block`` deletes
    it unless it changed meanwhile, so the next store uploads a good copy), then
    the headers of this identity's entries that name a block now gone (no node
    can serve them; their last-use marks go too, as in an eviction). A header
    that does not read is left: it may be a newer format."""
    actions = []
    for name in report.corrupt_blocks:
        try:
            bucket.fetch_block(name, keys.get(name))  # a frame that does not parse fails under any key
        except CorruptBlockError:
            actions.append(f"deleted corrupt block {name}")
        except (BlockMissingError, BucketError):
            continue
    dangling = set(report.dangling)
    for name, read in sorted(listed.records.items()):
        if read is None or read[0].id not in dangling:
            continue
        try:
            with outage("repair"):
                if all(bucket.blocks.exists(b) for b in read[0].blocks):
                    continue  # a good copy came back meanwhile: servable again
                bucket.headers.delete(name)
                bucket.meta.delete(f"used/{name}")
        except BucketError:
            continue
        actions.append(f"removed entry {read[0].id} (header {name}): a block it needs is gone")
    return actions
