"""A fingerprint directory's objects in a bucket, as the protocol sees them:
their names, pools whose listings carry size and server time, and what
counts as an outage.

Every bucket request has a bounded timeout; any failure that is not a
definite answer (missing, corrupt, bad argument) is raised as
``BucketError``, so the store has one exception to turn into "not stored" /
"no hit".
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

try:
    import obstore
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError("blockkv.remote needs obstore: pip install 'blockkv[s3]'") from exc

from blockkv.errors import BlockKVError, BlockMissingError, CorruptError
from blockkv.format.header import SUFFIX
from blockkv.fs import Buffer
from blockkv.local.directory import HEADER_LAYOUT, ns_dirname
from blockkv.pool.protocol import Layout
from blockkv.pool.s3 import S3Pool

_HEX32 = r"[0-9a-f]{32}"
# the fingerprint directory's own objects: IDENTITY, MANIFEST (headers packed in one
# object: an accelerator for a node's open, manifest.py), a node's clock probe, GC
# run markers and per-entry last-use marks (``used/<header name>``)
META_LAYOUT = Layout(re.compile(rf"IDENTITY|MANIFEST|clock/{_HEX32}|gc/{_HEX32}(\.done)?|used/{HEADER_LAYOUT.pattern.pattern}"),
                     sharded=False)
# Last-Modified has one-second resolution (an HTTP date): every comparison of
# server times gives this much away, always in the safe direction
CLOCK_SLACK = 1.0


def header_name(ns: str, entry_id: str) -> str:
    """An entry's name in the bucket's header pool: the local path under ``entries/``."""
    return f"{ns_dirname(ns)}/{entry_id}{SUFFIX}"


class BucketError(BlockKVError):
    """The bucket is unreachable, slow or refusing requests (not a definite answer)."""


@contextmanager
def outage(what: str) -> Iterator[None]:
    """Definite answers pass through; everything else the client raises is an outage."""
    try:
        yield
    except (BlockMissingError, FileNotFoundError, CorruptError, ValueError, TypeError, BucketError):
        raise
    except Exception as exc:  # noqa: BLE001 - obstore raises many types for one meaning
        first_line = str(exc).strip().partition("\n")[0]  # obstore appends pages of debug detail
        raise BucketError(f"bucket {what} failed: {first_line}") from exc


@dataclass(frozen=True)
class ObjectInfo:
    name: str
    size: int
    last_modified: float  # server time, seconds since the epoch


class BucketPool(S3Pool):
    """S3Pool plus what only the bucket protocol needs: overwrite (a refresh
    resets Last-Modified) and listings that carry size and Last-Modified."""

    def put_overwrite(self, name: str, parts: Sequence[Buffer]) -> None:
        key = self.layout.location(self.layout.check(name))
        obstore.put(self._store, key, b"".join(parts), mode="overwrite", use_multipart=False)

    def list_info(self, prefix: str = "") -> Iterator[ObjectInfo]:
        wanted = self.layout.location_prefix(prefix)
        directory = wanted.rpartition("/")[0]
        for batch in obstore.list(self._store, prefix=directory or None, chunk_size=1000):
            for meta in batch:
                name = self.layout.name_of(meta["path"])
                if name is not None and meta["path"].startswith(wanted):
                    yield ObjectInfo(name, meta["size"], meta["last_modified"].timestamp())

    def last_modified(self, name: str) -> float:
        return self.stat(name).mtime

    def delete_many(self, names: Sequence[str]) -> None:
        if names:
            obstore.delete(self._store, [self.layout.location(n) for n in names])
