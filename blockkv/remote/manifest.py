"""The bucket's MANIFEST: every header packed into one object, so that a
fresh node learns the fleet's entries with one GET instead of one per header.

An accelerator, never truth. Each record names a header, the ETag that
header's object had when the record was written, and its bytes. A reader
uses a record only if its name is listed now with that ETag and size, and
its bytes are proven to be that object's: with a fleet key, the header's own
seal binds its name and bytes; without one, the ETag must be the MD5 of the
bytes (what S3 computes for a single-part PUT; a server whose ETags are not
MD5s gets no use of the MANIFEST without a key). The object is read as a
stream with a limit the listing implies, and a record that is not wanted is
skipped without being held.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Iterable, Iterator, Mapping

from blockkv.errors import BlockMissingError
from blockkv.remote.objects import BucketPool, ObjectInfo

MANIFEST_MIN = 32  # this many headers to fetch one by one: read the MANIFEST first, and write one after
_MAGIC = b"BKVMANIFEST2\n"  # version 1 records held no ETag: its objects are not read
_RECORD = struct.Struct("<HHI")  # name length, ETag length, header length; then name, ETag (UTF-8), header
_MD5 = re.compile(r"[0-9a-f]{32}")


def pack_manifest(records: Iterable[tuple[str, str, bytes]]) -> bytes:
    """(header name, its object's ETag, its bytes) records, packed into one object."""
    parts = [_MAGIC]
    for name, etag, data in records:
        raw_name, raw_etag = name.encode(), etag.encode()
        parts += [_RECORD.pack(len(raw_name), len(raw_etag), len(data)), raw_name, raw_etag, data]
    return b"".join(parts)


def manifest_limit(listed: Mapping[str, ObjectInfo]) -> int:
    """The most bytes of a MANIFEST a node reads: twice what one of the headers
    ``listed`` would take, and 1 MiB (it may hold entries evicted since)."""
    exact = len(_MAGIC) + sum(_RECORD.size + len(n.encode()) + len(i.etag.encode()) + i.size for n, i in listed.items())
    return 2 * exact + (1 << 20)


def etag_is_md5_of(etag: str, data: bytes) -> bool:
    """Is ``etag`` a plain MD5 (single-part PUT) and the MD5 of ``data``? False
    where the server's ETags are something else: then it proves nothing."""
    return bool(_MD5.fullmatch(etag)) and hashlib.md5(data, usedforsecurity=False).hexdigest() == etag


class _Stream:
    """``read``/``skip`` over an iterator of chunks, holding at most one read."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._buf = b""

    def _fill(self) -> bool:
        chunk = next(self._chunks, None)
        if chunk is None:
            return False
        self._buf = self._buf + chunk if self._buf else chunk
        return True

    def read(self, n: int) -> bytes | None:
        parts, need = [], n
        while need:
            if not self._buf and not self._fill():
                return None
            take, self._buf = self._buf[:need], self._buf[need:]
            parts.append(take)
            need -= len(take)
        return b"".join(parts)

    def skip(self, n: int) -> bool:
        while n:
            if not self._buf and not self._fill():
                return False
            drop = min(n, len(self._buf))
            self._buf, n = self._buf[drop:], n - drop
        return True


def read_manifest(chunks: Iterator[bytes], listed: Mapping[str, ObjectInfo], wanted: Iterable[str]
                  ) -> dict[str, bytes]:
    """The records of ``wanted`` names whose ETag and size are the ones
    ``listed`` shows, up to the first record that does not fit (a torn or
    foreign object yields what precedes it). Not yet proven: the caller checks
    each (seal or MD5) and verifies it as a header."""
    want = set(wanted)
    out: dict[str, bytes] = {}
    stream = _Stream(chunks)
    if stream.read(len(_MAGIC)) != _MAGIC:
        return out
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
            out[name] = data
            want.discard(name)
        elif not stream.skip(size):
            break
    return out


def manifest_records(pool: BucketPool, listed: Mapping[str, ObjectInfo], wanted: Iterable[str]) -> dict[str, bytes]:
    """``read_manifest`` of the MANIFEST object (empty if there is none), read
    with the limit ``listed`` implies: a larger one is OversizedError, unread."""
    try:
        return read_manifest(pool.stream_limited("MANIFEST", manifest_limit(listed)), listed, wanted)
    except BlockMissingError:
        return {}
