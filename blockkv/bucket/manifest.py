"""The bucket's MANIFEST: every header packed into one object, so that a
fresh node learns the fleet's entries with one GET instead of one per header.

An accelerator, never truth. Each record names a header, the ETag that
header's object had when the record was written, and its bytes. A reader
uses a record only if its name is listed now with that ETag and size, and
its bytes are proven to be that object's: a plain MD5 ETag (what S3 computes
for a single-part PUT) must be the MD5 of the bytes, with a fleet key too (a
seal binds a name, not the object under it now); where ETags are not MD5s,
the header's own seal is the proof (a server whose ETags are not MD5s gets no
use of the MANIFEST without a key). The object is read as a
stream with a limit the listing implies, and a record that is not wanted is
skipped without being held.
"""

from __future__ import annotations

import hashlib
import logging
import re
import struct
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from blockkv.bucket.objects import BucketPool, ObjectInfo
from blockkv.errors import BlockMissingError

MANIFEST_MIN = 32  # this many headers to fetch one by one: read the MANIFEST first, and write one after
_MAGIC = b"BKVMANIFEST2\n"  # version 1 records held no ETag: its objects are not read
_RECORD = struct.Struct("<HHI")  # name length, ETag length, header length; then name, ETag (UTF-8), header
_MD5 = re.compile(r"[0-9a-f]{32}")

log = logging.getLogger("blockkv")


def pack_manifest(records: Iterable[tuple[str, str, bytes]]) -> bytearray:
    """(header name, its object's ETag, its bytes) records, packed into one
    object (built in place: only one record is held besides it)."""
    out = bytearray(_MAGIC)
    for name, etag, data in records:
        raw_name, raw_etag = name.encode(), etag.encode()
        out += _RECORD.pack(len(raw_name), len(raw_etag), len(data))
        out += raw_name
        out += raw_etag
        out += data
    return out


def manifest_limit(listed: Mapping[str, ObjectInfo]) -> int:
    """The most bytes of a MANIFEST a node reads: twice what one of the headers
    ``listed`` would take, and 1 MiB (it may hold entries evicted since)."""
    exact = len(_MAGIC) + sum(_RECORD.size + len(n.encode()) + len(i.etag.encode()) + i.size for n, i in listed.items())
    return 2 * exact + (1 << 20)


def etag_is_md5_of(etag: str, data: bytes) -> bool:
    """Is ``etag`` a plain MD5 (single-part PUT) and the MD5 of ``data``? False
    where the server's ETags are something else: then it proves nothing."""
    return bool(_MD5.fullmatch(etag)) and hashlib.md5(data, usedforsecurity=False).hexdigest() == etag


def record_proven(etag: str, data: bytes, sealed: bool) -> bool:
    """Are a record's bytes proven to be the object listed with ``etag``? A plain
    MD5 ETag (S3, MinIO, R2, Ceph and moto give one to a single-part PUT) must be
    the bytes' MD5, fleet key or not: a seal proves that a key holder wrote the
    bytes for the record's name, not that they are what the bucket holds under
    it now (another entry's header sealed under this name would hide this
    entry). Only where ETags are something else is the seal (``sealed``: valid
    for the name, with a fleet key) the proof."""
    if _MD5.fullmatch(etag):
        return etag_is_md5_of(etag, data)
    return sealed


class _Stream:
    """``read``/``skip`` over an iterator of chunks, holding at most one read
    and the chunk it is in (a position in it, not a copy of its rest)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._buf = memoryview(b"")
        self._at = 0

    def _fill(self) -> bool:
        chunk = next(self._chunks, None)
        if chunk is None:
            return False
        self._buf, self._at = memoryview(chunk), 0
        return True

    def read(self, n: int) -> bytes | None:
        parts, need = [], n
        while need:
            if self._at == len(self._buf) and not self._fill():
                return None
            take = self._buf[self._at : self._at + need]
            self._at += len(take)
            parts.append(take)
            need -= len(take)
        return b"".join(parts)

    def skip(self, n: int) -> bool:
        while n:
            if self._at == len(self._buf) and not self._fill():
                return False
            drop = min(n, len(self._buf) - self._at)
            self._at, n = self._at + drop, n - drop
        return True


def read_manifest(chunks: Iterator[bytes], listed: Mapping[str, ObjectInfo], wanted: Iterable[str]
                  ) -> Iterator[tuple[str, bytes]]:
    """The records of ``wanted`` names whose ETag and size are the ones
    ``listed`` shows, as (name, header bytes), one at a time, up to the first
    record that does not fit (a torn or foreign object yields what precedes
    it). Not yet proven: the caller checks each (seal or MD5) and verifies it
    as a header."""
    want = set(wanted)
    stream = _Stream(chunks)
    if stream.read(len(_MAGIC)) != _MAGIC:
        return
    while want:
        fixed = stream.read(_RECORD.size)
        if fixed is None:
            break
        name_len, etag_len, size = _RECORD.unpack(fixed)
        names = stream.read(name_len + etag_len)
        if names is None:
            break
        try:
            name, etag = names[:name_len].decode(), names[name_len:].decode()
        except UnicodeDecodeError:
            break
        info = listed.get(name)
        if name in want and info is not None and info.etag == etag and info.size == size:
            data = stream.read(size)
            if data is None:
                break
            want.discard(name)
            yield name, data
        elif not stream.skip(size):
            break


def manifest_stream(pool: BucketPool, listed: Mapping[str, ObjectInfo], wanted: Iterable[str],
                    spool: Path | None = None) -> Iterator[tuple[str, bytes]]:
    """``read_manifest`` of the MANIFEST object (nothing if there is none), read
    with the limit ``listed`` implies: a larger one is OversizedError, unread.
    The object is copied into an unnamed file in ``spool`` (a directory; the
    system's temporary one by default) as fast as it arrives, and the records
    are read from there: the request ends however long the caller takes over
    each record, and memory holds one record at a time.
    A spool that cannot be made or written (a full disk) is a MANIFEST not
    read, with one warning: the headers are fetched one by one, and no local
    error passes for the bucket's."""
    try:
        chunks = pool.stream_limited("MANIFEST", manifest_limit(listed))
        try:
            spooled = tempfile.TemporaryFile(dir=spool)
        except OSError as exc:
            log.warning("blockkv: the bucket's MANIFEST is not read: no spool for it (%s)", exc)
            return
        with spooled as f:
            for chunk in chunks:
                try:
                    f.write(chunk)
                except OSError as exc:
                    log.warning("blockkv: the bucket's MANIFEST is not read: its spool failed (%s)", exc)
                    return
            f.seek(0)
            yield from read_manifest(iter(lambda: f.read(1 << 20), b""), listed, wanted)
    except BlockMissingError:
        return
