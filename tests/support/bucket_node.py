"""A node of tests/bucket/test_bucket.py: entries built from real mlx-lm KVCache
objects, uploaded and read through blockkv.bucket.bucket. Imported by the tests, and
run as its own process where concurrency matters:

    python tests/support/bucket_node.py fetch   ENDPOINT BUCKET OUT.npz
    python tests/support/bucket_node.py store   ENDPOINT BUCKET SECONDS OUT.json
    python tests/support/bucket_node.py gc      ENDPOINT BUCKET SECONDS OUT.json
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Callable, Iterator

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from blockkv.bucket.bucket import Bucket
from blockkv.bucket.objects import BucketError
from blockkv.bucket.session import StoreSession, StoreTooSlow
from blockkv.format.blocks import CODEC_ID, Block, EntryLayout, block_naming_key, modes, namespace_key, split_entry
from blockkv.format.descriptor import blocks_for_prefix, parse_descriptor
from blockkv.format.frame import decode_block, encode_block
from blockkv.format.header import Header, Identity, encode_header
from blockkv.format.layout import fingerprint_dirname, ns_dirname
from blockkv.format.rebuild import rebuild

CREDENTIALS = {"access_key_id": "testing", "secret_access_key": "testing", "region": "us-east-1"}
IDENTITY = Identity("tiny", "fp-test", "tok", CODEC_ID)
FP_DIR = fingerprint_dirname(IDENTITY.config_fingerprint)  # where a store with this identity keeps it
BLOCK_TOKENS = 16
# short enough that a test sees blocks age past it; every bound scales from `timeout`
TEST_TIMING = dict(grace=12.0, sweep_window=5.0, timeout=2.0, connect_timeout=1.0, max_retries=0)


def open_bucket(endpoint: str, bucket: str, **timing: float) -> Bucket:
    options = {"endpoint_url": endpoint, **CREDENTIALS}
    return Bucket(f"s3://{bucket}/fleet", FP_DIR, options, **{**TEST_TIMING, **timing})


def make_caches(n_tokens: int, seed: int, shared: int = 0) -> list[KVCache]:
    """Two layers of KV for ``n_tokens``; the first ``shared`` tokens are the same for every seed
    (a system prompt), the rest are the seed's own."""
    caches = []
    for layer in range(2):
        common = np.random.default_rng(1000 + layer).standard_normal((2, 1, 2, n_tokens, 8)).astype(np.float16)
        own = np.random.default_rng(seed * 10 + layer).standard_normal((2, 1, 2, n_tokens, 8)).astype(np.float16)
        data = np.concatenate([common[..., :shared, :], own[..., shared:, :]], axis=3)
        cache = KVCache()
        cache.update_and_fetch(mx.array(data[0]), mx.array(data[1]))
        caches.append(cache)
    return caches


def entry(n_tokens: int, seed: int, shared: int = 0, ns: str = "",
          keyed: bool = False) -> tuple[str, bytes, EntryLayout, list]:
    """(header name, header bytes, block layout, caches) of one entry; ``keyed``: as an
    ``isolate_namespaces`` store (``blockkv serve --per-key-cache``) names its blocks."""
    caches = make_caches(n_tokens, seed, shared)
    layout = split_entry(caches, BLOCK_TOKENS, key=namespace_key(ns) if keyed else None)
    tokens = np.arange(n_tokens, dtype=np.uint32) + (0 if shared >= n_tokens else seed)
    identity = modes(IDENTITY)[1] if keyed else IDENTITY
    header = encode_header(Header(identity, ns, tokens, layout.descriptor))
    return f"{ns_dirname(ns)}/{uuid.uuid4().hex}.bkv", header, layout, caches


def frame_of(block: Block, compression: str | None = "zstd") -> Callable[[], bytes]:
    """A block's frame, as a store's local copy hands it to an upload."""
    return lambda: b"".join(encode_block(block, compression))


def put_blocks(session: StoreSession, layout: EntryLayout, compression: str | None = "zstd") -> None:
    for b in layout.blocks:
        session.put_block(b.ref, frame_of(b, compression), new=True)


def upload(bucket: Bucket, name: str, header: bytes, layout: EntryLayout, key: bytes | None = None) -> StoreSession:
    """A store's bucket half, in the write order: blocks (named with ``key``), then the header."""
    session = bucket.begin_store(key)
    put_blocks(session, layout)
    session.commit(name, header)
    return session


def restore(bucket: Bucket, name: str, vouched: bool = False) -> list:
    """A node's restore from the bucket alone: header, then every block, verified."""
    header = bucket.fetch_header(name).header
    parsed = parse_descriptor(header.descriptor)
    sizes = {r.name: r.raw_bytes for r in blocks_for_prefix(parsed, None)}
    key = block_naming_key(header.identity, header.ns)
    frames = bucket.fetch_blocks(sizes, key, vouched=vouched)
    caches, _ = rebuild(parsed, {n: decode_block(n, f, key=key) for n, f in frames.items()})
    return caches


def raw_state(caches: list) -> Iterator[bytes]:
    """The raw bits of every live key and value row."""
    for cache in caches:
        for array in (cache.keys, cache.values):
            yield np.array(array[..., : cache.offset, :].view(mx.uint8)).tobytes()


def _fetch(endpoint: str, bucket_name: str, out: str) -> None:
    bucket = open_bucket(endpoint, bucket_name)
    (name,) = bucket.list_headers()
    np.savez(out, *[np.frombuffer(b, np.uint8) for b in raw_state(restore(bucket, name))])


def _store_loop(endpoint: str, bucket_name: str, seconds: float, out: str) -> None:
    """Store entries sharing a system prompt; also leave garbage (blocks of
    abandoned stores, evicted entries) for the GC runs to find. Reports what it committed."""
    bucket = open_bucket(endpoint, bucket_name)
    committed, refused, seed, refreshed = [], 0, 0, 0
    for garbage in range(1000, 1004):  # abandoned at once: old enough for the GC runs to sweep
        put_blocks(bucket.begin_store(), entry(48, garbage)[2])
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        seed += 1
        # every other store repeats the content of a much earlier one, whose blocks
        # may by now be garbage past the grace period: a dedup hit on a condemned block
        name, header, layout, _ = entry(48, seed if seed % 2 else (seed // 4) | 1, shared=32)
        try:
            if seed % 3 == 0:  # an abandoned store: blocks without a header
                put_blocks(bucket.begin_store(), layout)
                continue
            refreshed += len(upload(bucket, name, header, layout).refreshed)
        except (StoreTooSlow, BucketError):
            refused += 1
            continue
        committed.append(name)
        if seed % 4 == 0:  # an evicted entry: its blocks become garbage
            bucket.headers.delete(committed.pop())
    with open(out, "w") as f:
        json.dump({"committed": committed, "refused": refused, "attempts": seed,
                   "refreshed": refreshed}, f)


def _gc_loop(endpoint: str, bucket_name: str, seconds: float, out: str) -> None:
    bucket = open_bucket(endpoint, bucket_name)
    deleted, runs = [], 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        deleted += bucket.gc().deleted
        runs += 1
        time.sleep(0.5)
    with open(out, "w") as f:
        json.dump({"deleted": deleted, "runs": runs}, f)


if __name__ == "__main__":
    command, endpoint, bucket_name, *rest = sys.argv[1:]
    if command == "fetch":
        _fetch(endpoint, bucket_name, *rest)
    elif command == "store":
        _store_loop(endpoint, bucket_name, float(rest[0]), rest[1])
    elif command == "gc":
        _gc_loop(endpoint, bucket_name, float(rest[0]), rest[1])
    else:
        raise SystemExit(f"unknown command {command}")
