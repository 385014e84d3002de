"""A pool in an S3-compatible bucket: one object per name under a key prefix.

``S3Pool("s3://bucket/prefix", layout)`` keeps ``name`` at
``prefix/<layout location>``, the same relative path ``LocalPool`` uses under
its directory. Creation is a conditional PUT (``If-None-Match: *``): of racing
writers the server lets exactly one create and answers 412 to the others, which
for a content-addressed block is the dedup. The client is obstore (Rust
``object_store``); every request has a bounded timeout and bounded retries.
The bucket is untrusted: the pool returns bytes and the caller verifies them.

Endpoint and credentials come from ``options`` or else the standard AWS
environment variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``); a plain
``http://`` endpoint is allowed (a server on the local network or loopback).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from urllib.parse import urlparse

from blockkv.errors import BlockKVError, BlockMissingError, OversizedError
from blockkv.format.layout import BLOCK_LAYOUT, Layout
from blockkv.fs import Buffer
from blockkv.pool.protocol import BlockFile, check_range

try:
    import obstore
    from obstore.exceptions import AlreadyExistsError, PreconditionError
    from obstore.store import S3Store
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError("blockkv.pool.s3 needs obstore: pip install 'blockkv[s3]'") from exc

# options key -> environment variable read when the key is absent
OPTION_ENV = {
    "endpoint_url": "AWS_ENDPOINT_URL",
    "access_key_id": "AWS_ACCESS_KEY_ID",
    "secret_access_key": "AWS_SECRET_ACCESS_KEY",
    "session_token": "AWS_SESSION_TOKEN",
    "region": "AWS_REGION",
}
_CONFLICT_RETRIES = 3  # AWS answers 409 to a create racing another write of the key: retry
_NO_SUCH_BUCKET = "<Code>NoSuchBucket</Code>"  # the S3 error code, in the body obstore quotes


class NoSuchBucketError(BlockKVError):
    """The bucket itself does not exist: a configuration mistake, never a
    missing object (S3 answers 404 to both; the body names which)."""


def parse_url(url: str) -> tuple[str, str]:
    """(bucket, key prefix) of ``s3://bucket/prefix``."""
    parts = urlparse(url)
    if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
        raise ValueError(f"{url!r} is not an s3://bucket/prefix URL")
    return parts.netloc, parts.path.strip("/")


def resolve_options(options: Mapping[str, str] | None) -> dict[str, str]:
    """``options`` over the AWS environment variables; unknown keys are a ValueError."""
    options = dict(options or {})
    unknown = options.keys() - OPTION_ENV.keys()
    if unknown:
        raise ValueError(f"unknown S3 options {sorted(unknown)}; expected some of {sorted(OPTION_ENV)}")
    resolved = {key: options.get(key) or os.environ.get(env, "") for key, env in OPTION_ENV.items()}
    return {key: value for key, value in resolved.items() if value}


def put_body(parts: Sequence[Buffer]) -> Buffer:
    """One PUT's body: a single part as it is (a block's frame, a MANIFEST: not
    copied), several joined."""
    return parts[0] if len(parts) == 1 else b"".join(parts)


class S3Pool:
    def __init__(
        self,
        url: str,
        layout: Layout = BLOCK_LAYOUT,
        options: Mapping[str, str] | None = None,
        *,
        timeout: float = 30.0,
        connect_timeout: float = 5.0,
        max_retries: int = 2,
    ) -> None:
        if timeout <= 0 or connect_timeout <= 0 or max_retries < 0:
            raise ValueError("timeouts must be positive and max_retries at least 0")
        self.url = url
        self.layout = layout
        bucket, prefix = parse_url(url)
        config = resolve_options(options)
        endpoint = config.pop("endpoint_url", None)
        self.bucket = bucket
        self._where = f" at {endpoint}" if endpoint else ""
        self._store = S3Store(
            bucket,
            prefix=prefix or None,
            **({"endpoint": endpoint} if endpoint else {}),
            **config,
            client_options={
                "timeout": f"{timeout}s",
                "connect_timeout": f"{connect_timeout}s",
                "allow_http": bool(endpoint and endpoint.startswith("http://")),
            },
            retry_config={"max_retries": max_retries, "retry_timeout": timedelta(seconds=timeout)},
        )

    def __repr__(self) -> str:
        return f"S3Pool({self.url!r})"

    @contextmanager
    def _bucket_must_exist(self) -> Iterator[None]:
        """A 404 whose body says NoSuchBucket is the bucket missing, not an
        object: NoSuchBucketError, one line naming it (obstore's message is pages)."""
        try:
            yield
        except Exception as exc:
            if _NO_SUCH_BUCKET in str(exc):
                raise NoSuchBucketError(f"bucket {self.bucket!r} does not exist{self._where}: "
                                        "create it first (docs/scale-out.md)") from None
            raise

    def check_bucket(self) -> None:
        """One LIST of at most one key: NoSuchBucketError if the bucket does not exist."""
        with self._bucket_must_exist():
            next(iter(obstore.list(self._store, chunk_size=1)), None)

    def put_if_absent(self, name: str, parts: Sequence[Buffer]) -> bool:
        """One conditional PUT; the body goes whole (a multipart upload cannot be conditional)."""
        return self._put_conditional(name, parts, "create")

    def put_if_match(self, name: str, parts: Sequence[Buffer], etag: str) -> bool:
        """Replace ``name`` only if it still has ``etag`` (``If-Match``): False if
        it changed or went since. For replacing a copy proven bad, never another."""
        return self._put_conditional(name, parts, {"e_tag": f'"{etag.strip(chr(34))}"'})

    def _put_conditional(self, name: str, parts: Sequence[Buffer], mode: object) -> bool:
        key = self.layout.location(self.layout.check(name))
        data = put_body(parts)
        for attempt in range(_CONFLICT_RETRIES + 1):
            try:
                with self._bucket_must_exist():
                    obstore.put(self._store, key, data, mode=mode, use_multipart=False)
                return True
            except (AlreadyExistsError, PreconditionError):
                return False
            except FileNotFoundError:  # If-Match on a name that went: nothing to replace
                return False
            except Exception as exc:
                if " 409 " not in str(exc) or attempt == _CONFLICT_RETRIES:
                    raise
                time.sleep(0.05 * (attempt + 1))
        raise AssertionError("unreachable")

    def get_limited(self, name: str, limit: int) -> tuple[bytes, dict]:
        """(the whole object, its metadata: size, last_modified, e_tag) if it has
        at most ``limit`` bytes: one GET of the range ``[0, limit + 1)``, so
        nothing larger is ever received or allocated; OversizedError if it is larger."""
        data, meta = self.read_limited(name, limit)
        return bytes(data), meta

    def read_limited(self, name: str, limit: int) -> tuple[memoryview, dict]:
        """``get_limited`` without copying the body out of the client's buffer
        (a block restore reads it once, into its destination)."""
        key = self.layout.location(self.layout.check(name))
        try:
            with self._bucket_must_exist():
                result = obstore.get(self._store, key, options={"range": (0, limit + 1)})
                meta = result.meta
                if meta["size"] > limit:
                    raise OversizedError(f"{name} in {self.url} has {meta['size']} bytes, more than "
                                         f"{limit}: not read", (meta.get("e_tag") or "").strip('"'))
                data = memoryview(result.bytes())
        except FileNotFoundError:
            raise BlockMissingError(f"{name} is not in {self.url}") from None
        except (NoSuchBucketError, OversizedError):
            raise
        except Exception as exc:
            if " 416 " not in str(exc):
                raise
            meta, data = self._head(name), memoryview(b"")  # no byte to range over: an empty object
        if data.nbytes != meta["size"]:  # a cut response: an outage, proof of nothing about the object
            raise ConnectionError(f"{name} in {self.url}: {data.nbytes} of its {meta['size']} bytes received")
        return data, meta

    def get(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        check_range(start, end)
        key = self.layout.location(self.layout.check(name))
        try:
            with self._bucket_must_exist():
                return self._get(name, key, start, end)
        except FileNotFoundError:
            raise BlockMissingError(f"{name} is not in {self.url}") from None
        except NoSuchBucketError:
            raise
        except Exception:
            if start >= self._head(name)["size"]:  # 416: a range past the end is an empty slice
                return b""
            raise

    def _get(self, name: str, key: str, start: int, end: int | None) -> bytes:
        if start == 0 and end is None:
            return bytes(obstore.get(self._store, key).bytes())
        if end is not None and end == start:
            self._head(name)  # an empty slice of a missing name is still missing
            return b""
        if end is None:
            return bytes(obstore.get(self._store, key, options={"range": {"offset": start}}).bytes())
        return bytes(obstore.get_range(self._store, key, start=start, end=end))

    def read_into(self, name: str, buffer: bytearray) -> memoryview:
        key = self.layout.location(name)
        try:
            with self._bucket_must_exist():
                result = obstore.get(self._store, key)
        except FileNotFoundError:
            raise BlockMissingError(f"{name} is not in {self.url}") from None
        size = result.meta["size"]
        if len(buffer) < size:
            return memoryview(result.bytes())
        view = memoryview(buffer)[:size]
        n = 0
        for chunk in result.stream(min_chunk_size=1 << 20):
            chunk = memoryview(chunk)
            view[n : n + len(chunk)] = chunk
            n += len(chunk)
        return view[:n]

    def _head(self, name: str) -> dict:
        try:
            with self._bucket_must_exist():
                return obstore.head(self._store, self.layout.location(name))
        except FileNotFoundError:
            raise BlockMissingError(f"{name} is not in {self.url}") from None

    def exists(self, name: str) -> bool:
        try:
            self._head(name)
            return True
        except BlockMissingError:
            return False

    def stat(self, name: str) -> BlockFile:
        meta = self._head(name)
        etag = meta.get("e_tag")
        return BlockFile(name, meta["size"], meta["last_modified"].timestamp(), etag.strip('"') if etag else None)

    def delete(self, name: str) -> None:
        with self._bucket_must_exist():
            obstore.delete(self._store, self.layout.location(name))  # S3 deletes of a missing key succeed

    def list_prefix(self, prefix: str = "") -> Iterator[str]:
        """One listing of the deepest directory that holds every match (object_store
        lists whole path segments), filtered by the exact location prefix."""
        for name, _ in self._listed(prefix):
            yield name

    def _listed(self, prefix: str) -> Iterator[tuple[str, dict]]:
        """(name, object metadata) of every object of the layout's shape under ``prefix``."""
        wanted = self.layout.location_prefix(prefix)
        directory = wanted.rpartition("/")[0]
        batches = iter(obstore.list(self._store, prefix=directory or None, chunk_size=1000))
        while True:
            with self._bucket_must_exist():
                batch = next(batches, None)
            if batch is None:
                return
            for meta in batch:
                location = meta["path"]
                name = self.layout.name_of(location)
                if name is not None and location.startswith(wanted):
                    yield name, meta
