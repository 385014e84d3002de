"""A fingerprint directory's objects in a bucket, as the protocol sees them:
pools whose listings carry size and server time, and what counts as an
outage (the objects' names are ``format/layout.py``'s).

Every bucket request has a bounded timeout; any failure that is not a
definite answer (missing, corrupt, bad argument) is raised as
``BucketError``, so the store has one exception to turn into "not stored" /
"no hit".
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

try:
    import obstore
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError("blockkv.bucket needs obstore: pip install 'blockkv[s3]'") from exc

from blockkv.errors import BlockKVError, BlockMissingError, CorruptError, OversizedError
from blockkv.fs import Buffer
from blockkv.pool.s3 import NoSuchBucketError, S3Pool, put_body

MAX_IDENTITY_BYTES = 64 << 10  # an IDENTITY is a few hundred bytes of JSON
MAX_MARKER_BYTES = 64  # a protocol mark is empty, or holds its 64-hex seal


class BucketError(BlockKVError):
    """The bucket is unreachable, slow or refusing requests (not a definite answer)."""


class BucketMissingError(BucketError):
    """The bucket does not exist: at open a configuration mistake (the store
    raises FileNotFoundError), while running an outage like any other."""


@contextmanager
def outage(what: str) -> Iterator[None]:
    """Definite answers pass through; everything else the client raises is an outage."""
    try:
        yield
    except NoSuchBucketError as exc:
        raise BucketMissingError(str(exc)) from None
    except (BlockMissingError, FileNotFoundError, CorruptError, ValueError, TypeError, BucketError):
        raise
    except Exception as exc:  # noqa: BLE001 - obstore raises many types for one meaning
        first_line = str(exc).strip().partition("\n")[0]  # obstore appends pages of debug detail
        raise BucketError(f"bucket {what} failed: {first_line}") from exc


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    name: str
    size: int
    last_modified: float  # server time, seconds since the epoch
    etag: str = ""  # the server's entity tag, quotes stripped ("" where it gave none)


def _etag(meta: dict) -> str:
    return (meta.get("e_tag") or "").strip('"')


class BucketPool(S3Pool):
    """S3Pool plus what only the bucket protocol needs: overwrite (a refresh of
    verified bytes resets Last-Modified; a clock probe) and listings that carry
    size, Last-Modified and ETag."""

    def put_overwrite(self, name: str, parts: Sequence[Buffer]) -> str:
        """An unconditional PUT; returns the new object's ETag."""
        key = self.layout.location(self.layout.check(name))
        with self._bucket_must_exist():
            result = obstore.put(self._store, key, put_body(parts), mode="overwrite", use_multipart=False)
        return _etag(result)

    def info(self, name: str) -> ObjectInfo:
        """A HEAD: size, Last-Modified and ETag (BlockMissingError if absent)."""
        meta = self._head(name)
        return ObjectInfo(name, meta["size"], meta["last_modified"].timestamp(), _etag(meta))

    def stream_limited(self, name: str, limit: int, chunk: int = 1 << 20) -> Iterator[bytes]:
        """The object's bytes in chunks of about ``chunk``, if it has at most
        ``limit`` bytes (OversizedError, before any of its bytes, if it has more)."""
        try:
            with self._bucket_must_exist():
                result = obstore.get(self._store, self.layout.location(self.layout.check(name)))
        except FileNotFoundError:
            raise BlockMissingError(f"{name} is not in {self.url}") from None
        if result.meta["size"] > limit:
            raise OversizedError(f"{name} in {self.url} has {result.meta['size']} bytes, more than {limit}: not read")
        for part in result.stream(min_chunk_size=chunk):
            yield bytes(part)

    def list_info(self, prefix: str = "") -> Iterator[ObjectInfo]:
        for name, meta in self._listed(prefix):
            yield ObjectInfo(name, meta["size"], meta["last_modified"].timestamp(), _etag(meta))

    def last_modified(self, name: str) -> float:
        return self.stat(name).mtime

    def delete_many(self, names: Sequence[str]) -> None:
        if names:
            with self._bucket_must_exist():
                obstore.delete(self._store, [self.layout.location(n) for n in names])
