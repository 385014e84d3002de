"""Names and where they live: the rules the local disk and the bucket share.

One fingerprint directory has the same shape on a disk and under a bucket
prefix: its directory name (``fingerprint_dirname``), a namespace's directory
(``ns_dirname``), a header's name ``<ns dir>/<entry id>.bkv`` (``header_name``,
``HEADER_LAYOUT``), a block's ``<2 hex>/<64 hex>`` (``BLOCK_LAYOUT``) and, in a
bucket, the directory's own objects (``META_LAYOUT``). A header's bytes become
the record an index or catalog keeps the same way wherever they were read
(``parsed_header``, ``entry_record``). Nothing here touches a file or a bucket.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import blake3
import numpy as np

from blockkv.errors import CorruptError
from blockkv.format.descriptor import (
    ParsedDescriptor,
    blocks_for_prefix,
    descriptor_min_offset,
    descriptor_trimmable,
    parse_descriptor,
)
from blockkv.format.header import MAX_HEADER_BYTES, SUFFIX, Header, decode_header
from blockkv.records import EntryRecord

_NAME = re.compile(r"[0-9a-f]{64}")
ENTRY_ID = re.compile(r"[0-9a-f]{32}")
NS_DIR = re.compile(r"[0-9a-f]{16}")


def is_block_name(name: str) -> bool:
    return _NAME.fullmatch(name) is not None


@dataclass(frozen=True)
class Layout:
    """How a pool's names map to relative locations, ``<shard>/<leaf>``.

    Blocks shard by their first two hex digits (``ab/ab12…``); headers already
    carry their namespace directory (``<ns dir>/<uuid>.bkv``). The same
    location is a path under a local directory and a key under a bucket prefix,
    so every backend lays a pool out alike."""

    pattern: re.Pattern[str]
    sharded: bool

    def check(self, name: str) -> str:
        if not isinstance(name, str) or self.pattern.fullmatch(name) is None:
            raise ValueError(f"{name!r} is not a name of this pool ({self.pattern.pattern})")
        return name

    def location(self, name: str) -> str:
        return f"{name[:2]}/{name}" if self.sharded else name

    def location_prefix(self, prefix: str) -> str:
        """The location prefix under which every name starting with ``prefix`` lies."""
        return f"{prefix[:2]}/{prefix}" if self.sharded and len(prefix) >= 2 else prefix

    def name_of(self, location: str) -> str | None:
        """The name stored at ``location``, or None for anything not of our shape."""
        shard, _, leaf = location.partition("/")
        name = leaf if self.sharded else location
        if self.sharded and leaf[:2] != shard:
            return None
        return name if self.pattern.fullmatch(name) else None


BLOCK_LAYOUT = Layout(_NAME, sharded=True)
# headers as pool names (``<ns dir>/<uuid>.bkv``), for a pool protocol backend
HEADER_LAYOUT = Layout(re.compile(rf"{NS_DIR.pattern}/{ENTRY_ID.pattern}{re.escape(SUFFIX)}"), sharded=False)

_HEX32 = r"[0-9a-f]{32}"
# the fingerprint directory's own objects: IDENTITY, MANIFEST (headers packed in one
# object: an accelerator for a node's open, manifest.py), a node's clock probe, GC
# run markers, per-entry last-use marks (``used/<header name>``) and requests for a
# good copy of a block proven damaged (``wanted/<block name>``, heal.py)
META_LAYOUT = Layout(re.compile(rf"IDENTITY|MANIFEST|clock/{_HEX32}|gc/{_HEX32}(\.done)?"
                                rf"|used/{HEADER_LAYOUT.pattern.pattern}|wanted/[0-9a-f]{{64}}"), sharded=False)


def fingerprint_dirname(config_fingerprint: str) -> str:
    """A safe, stable directory name for the caller's fingerprint string."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", config_fingerprint).strip("._")[:40]
    digest = blake3.blake3(config_fingerprint.encode()).hexdigest()[:16]
    return f"{readable}-{digest}" if readable else digest


def ns_dirname(ns: str) -> str:
    # surrogatepass: an ns read back from a damaged index still names a directory
    return blake3.blake3(ns.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def header_name(ns: str, entry_id: str) -> str:
    """An entry's name in the bucket's header pool: the local path under ``entries/``."""
    return f"{ns_dirname(ns)}/{entry_id}{SUFFIX}"


def entry_id_of(name: str) -> str:
    """The entry id a header name carries (``header_name``'s inverse for the id)."""
    return name.rpartition("/")[2].removesuffix(SUFFIX)


def verified_header(name: str, data: bytes) -> Header:
    """What a header's bytes say, verified (checksum, bounds, descriptor); CorruptError otherwise."""
    return parsed_header(name, data)[0]


def parsed_header(name: str, data: bytes) -> tuple[Header, ParsedDescriptor]:
    """``verified_header``, with the descriptor as the verification parsed it."""
    if len(data) > MAX_HEADER_BYTES:
        raise CorruptError(f"{name}: {len(data)} bytes is not a plausible header")
    header = decode_header(data)
    return header, parse_descriptor(header.descriptor)


def entry_record(entry_id: str, rel: str, header: Header, header_bytes: int,
                 parsed: ParsedDescriptor | None = None) -> EntryRecord:
    """The index record a header implies (``rel``: where the header lives, a
    path under the fingerprint directory or a key under the bucket's;
    ``parsed``: its descriptor, if already parsed)."""
    attachments = tuple(header.descriptor["attachments"])
    parsed = parse_descriptor(parsed or header.descriptor)  # validate once, not once per question
    return EntryRecord(
        id=entry_id, ns=header.ns, path=rel, header_bytes=header_bytes,
        blocks=tuple(dict.fromkeys(r.name for r in blocks_for_prefix(parsed, None))),
        trimmable=not attachments and descriptor_trimmable(parsed),
        minimum_reusable_offset=descriptor_min_offset(parsed),
        checkpoint=header.checkpoint, attachments=attachments,
        owner=header.identity.digest(), tokens=np.array(header.tokens, dtype=np.uint32),
    )
