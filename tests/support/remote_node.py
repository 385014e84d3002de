"""A node of tests/remote/test_remote.py: a BlockStore with its own local root and a
``remote=`` bucket, storing real mlx-lm caches of a tiny random-weight model.
Imported by the tests, and run as its own process where concurrency matters:

    python tests/support/remote_node.py store ROOT ENDPOINT BUCKET SECONDS OUT.json
    python tests/support/remote_node.py gc    ROOT ENDPOINT BUCKET SECONDS OUT.json
    python tests/support/remote_node.py open  ROOT ENDPOINT BUCKET 0       OUT.json   # open, restore, peak RSS
"""

from __future__ import annotations

import copy
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from blockkv import BlockStore
from blockkv.bucket.objects import BucketError
from blockkv.format.layout import header_name
from blockkv.testing.models import prefill, random_tokens, tiny_model  # noqa: F401 - for the tests too

IDENT = dict(model_id="tiny-llama", config_fingerprint="tiny-llama@remote", tokenizer_hash="tok1")
CREDENTIALS = {"access_key_id": "testing", "secret_access_key": "testing", "region": "us-east-1"}
# short enough that a test sees blocks age past the grace period; every bound scales from `timeout`
TIMING = {"grace": "12", "sweep_window": "5", "timeout": "2", "connect_timeout": "1", "max_retries": "0"}
BLOCK_TOKENS = 64
PROMPT = random_tokens(200, seed=7)  # the fleet's system prompt: three whole blocks and a partial one


def open_node(root: str | Path, endpoint: str, bucket: str, **kw: Any) -> BlockStore:
    options = {"endpoint_url": endpoint, **CREDENTIALS, **TIMING, **kw.pop("remote_options", {})}
    args = {**IDENT, "max_bytes": 1 << 30, "block_tokens": BLOCK_TOKENS, **kw}
    return BlockStore(root, remote=f"s3://{bucket}/fleet", remote_options=options, **args)


@functools.cache
def model() -> Any:
    return tiny_model("llama")


@functools.cache
def _prompt_cache() -> list[Any]:
    cache, _ = prefill(model(), PROMPT)
    return cache


def conversation(seed: int, tail: int = 40) -> tuple[list[int], list[Any]]:
    """The system prompt plus a conversation of its own, and its real caches
    (the prompt prefilled once, as a server does, so every node's prompt bits agree)."""
    tokens = PROMPT + random_tokens(tail, seed=1000 + seed)
    cache = copy.deepcopy(_prompt_cache())
    prefill(model(), tokens[len(PROMPT):], cache=cache)
    return tokens, cache


def kv_bits(caches: list[Any], n: int) -> list[bytes]:
    """The raw bits of the first ``n`` rows of every key and value."""
    return [np.array(a[..., :n, :].reshape(-1).view(mx.uint8)).tobytes()
            for c in caches for a in (c.keys, c.values)]


def _store_loop(root: str, endpoint: str, bucket: str, seconds: float, out: str) -> None:
    """Store conversations; every fourth acknowledged one is evicted fleet-wide at
    once (its blocks become garbage for the GC nodes), and every other store
    repeats an earlier conversation, whose blocks may by then be garbage past
    the grace period: a dedup hit on a block a GC run may condemn. A repeat
    replaces the conversation's previous entry, in the bucket too: the report
    names the last acknowledged entry of each conversation still standing."""
    store = open_node(root, endpoint, bucket)
    acknowledged: dict[int, str] = {}
    evicted, superseded, refused, attempts = [], [], 0, 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        attempts += 1
        seed = attempts if attempts % 2 else (attempts // 4) | 1
        tokens, caches = conversation(seed)
        if not store.store(tokens, caches):
            refused += 1
            continue
        match = store.find_exact(tokens)
        name = header_name("", match.entry.id)
        if acknowledged.get(seed, name) != name:  # this store replaced the conversation's entry
            superseded.append(acknowledged.pop(seed))
        if attempts % 4 == 1:
            try:
                store.remote.headers.delete(name)
                evicted.append(name)
                continue
            except BucketError:
                pass
        acknowledged[seed] = name
    store.close()
    with open(out, "w") as f:
        json.dump({"acknowledged": {n: s for s, n in acknowledged.items()}, "evicted": evicted,
                   "superseded": superseded, "refused": refused,
                   "attempts": attempts}, f)


def _gc_loop(root: str, endpoint: str, bucket: str, seconds: float, out: str) -> None:
    store = open_node(root, endpoint, bucket)
    deleted, runs = [], 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            deleted += store.remote.gc().deleted
        except BucketError:
            pass
        runs += 1
        time.sleep(0.3)
    store.close()
    with open(out, "w") as f:
        json.dump({"deleted": deleted, "runs": runs}, f)


def _open(root: str, endpoint: str, bucket: str, seconds: float, out: str) -> None:
    """Open a node (learning every header), restore every entry it learned, and
    report the process's peak resident memory (VmHWM: ru_maxrss would carry the
    parent's over fork and exec): what reading the bucket cost."""
    restored, error = 0, None
    try:
        with open_node(root, endpoint, bucket) as store:
            for record in store._remote.catalog.entries():
                entry = store._remote.entry(record.id)
                restored += entry is not None and store.restore(entry) is not None
    except (ValueError, OSError) as exc:
        error = str(exc)
    with open(out, "w") as f:
        peak = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM"))
        json.dump({"maxrss_mib": int(peak.split()[1]) / 1024,
                   "restored": restored, "error": error}, f)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    root, endpoint, bucket_name, seconds, out = args
    {"store": _store_loop, "gc": _gc_loop, "open": _open}[command](root, endpoint, bucket_name, float(seconds), out)
