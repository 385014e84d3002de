"""The bucket's MANIFEST: every header packed into one object, so that a
fresh node learns the fleet's entries with one GET instead of one per header.

An accelerator, never needed for correctness: a node that had to fetch many
headers one by one writes it; a reader verifies each header in it and uses
only names its own listing shows.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

from blockkv.errors import CorruptError
from blockkv.format.header import Header
from blockkv.local.directory import verified_header

MANIFEST_MIN = 32  # this many headers to fetch one by one: read the MANIFEST first, and write one after
_MANIFEST_MAGIC = b"BKVMANIFEST1\n"
_RECORD = struct.Struct("<HI")  # name length, header length; then the name (UTF-8) and the header bytes


def pack_manifest(headers: Iterable[tuple[str, bytes]]) -> bytes:
    """Header names and bytes, packed into one object."""
    parts = [_MANIFEST_MAGIC]
    for name, data in headers:
        raw = name.encode()
        parts += [_RECORD.pack(len(raw), len(data)), raw, data]
    return b"".join(parts)


def unpack_manifest(data: bytes) -> dict[str, bytes]:
    """The records of a MANIFEST, up to the first that does not fit (a torn or
    foreign object yields what precedes it). Nothing here is verified: the
    caller checks every header and uses only names its listing shows."""
    out: dict[str, bytes] = {}
    if not data.startswith(_MANIFEST_MAGIC):
        return out
    at = len(_MANIFEST_MAGIC)
    while at + _RECORD.size <= len(data):
        name_len, size = _RECORD.unpack_from(data, at)
        start = at + _RECORD.size + name_len
        if start + size > len(data):
            break
        try:
            out[data[at + _RECORD.size : start].decode()] = data[start : start + size]
        except UnicodeDecodeError:
            break
        at = start + size
    return out


def headers_from_manifest(data: bytes | None, names: Iterable[str]) -> dict[str, tuple[bytes, Header]]:
    """The headers of ``names`` a MANIFEST holds, each verified; one that does
    not verify is left out (its reader fetches it on its own)."""
    packed = unpack_manifest(data or b"")
    found = {}
    for name in names:
        if name in packed:
            try:
                found[name] = (packed[name], verified_header(name, packed[name]))
            except CorruptError:
                continue
    return found
