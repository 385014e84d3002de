"""Verified block fetches from a bucket: each read bounded and judged
(``BucketDir.read_block``), and a copy proven bad healed before anything is
reported (heal.py): replaced by a verified local copy if the node holds one,
else deleted inside a deleter's window with a request for a good copy."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future

from blockkv.bucket import heal
from blockkv.bucket.bucket_dir import BucketDir, ProvenBad
from blockkv.bucket.objects import BucketError
from blockkv.errors import CorruptBlockError

Local = Callable[[str], "bytes | None"]  # a verified local copy of a block, or None


def fetch_block(bucket: BucketDir, name: str, raw_bytes: int, key: bytes | None, *, vouched: bool = False,
                other_keys: Callable[[], Iterable[bytes | None]] = tuple,
                local: Local | None = None) -> bytes | memoryview:
    """``BucketDir.read_block``, healing what it proves bad: the copy is
    replaced by a verified ``local(name)`` copy (which is returned) if the node
    holds one, else deleted inside a window with a request for a good copy
    (CorruptBlockError). A copy that only convicts its header is
    CorruptHeaderError, the block kept."""
    try:
        return bucket.read_block(name, raw_bytes, key, vouched=vouched, other_keys=other_keys)
    except ProvenBad as bad:
        good = local(name) if local is not None else None
        try:
            if good is not None:
                heal.replace_bad_copy(bucket, name, bad.etag, good)
                return good
            heal.quarantine(bucket, {name: bad.etag})
        except BucketError:
            pass  # the next reader finds it bad again
        raise CorruptBlockError(str(bad)) from None


def submit_fetches(bucket: BucketDir, sizes: Mapping[str, int], key: bytes | None,
                   **proof: object) -> dict[str, Future[bytes | memoryview]]:
    """Start fetching the blocks ``sizes`` names (block -> raw bytes its
    header declares) concurrently on the bucket's fetch threads: a future of
    each verified frame."""
    return {n: bucket.submit(fetch_block, bucket, n, raw, key, **proof) for n, raw in sizes.items()}
