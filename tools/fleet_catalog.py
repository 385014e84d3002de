"""What a node holds of a large fleet (issue #23): one bucket of ``--entries``
entries of ``--tokens`` tokens each, on moto's S3 server (its own process,
on 127.0.0.1), and fresh nodes opening against it, each in a child process:

- a fresh node's first open (every header fetched, one GET each; it leaves a
  MANIFEST) and the next one's (the MANIFEST read as a stream);
- the node's resident memory once it holds every entry in its remote
  catalog, against the same node opened on a bucket of ``--entries / 10``
  (the difference, per entry, is what an entry costs: the figure to hold
  against 1 KiB + 40 B per block);
- ``find`` latency at that size: prompts that continue an entry (each
  settled from the entry's cached header) and prompts that share only a
  system prompt.

The entries are real headers (one real entry's blocks, of a tiny KV shape)
under distinct token sequences: ``--prompts`` system prompts of a quarter of
the tokens, each entry one of them plus a conversation of its own. Only
public API is used, so the same command measures an older tree too
(``PYTHONPATH=<its checkout>``).

    python tools/fleet_catalog.py                          # 10,000 entries of 8k tokens
    python tools/fleet_catalog.py --entries 500 --tokens 2048  # a quick look
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.config import Shape
from benchmarks.remote import moto_bucket
from benchmarks.sources import VOCAB, KVSource

from blockkv import BlockStore
from blockkv.format.header import Header, encode_header
from blockkv.format.layout import ns_dirname

IDENTITY = {"model_id": "bench/catalog", "config_fingerprint": "bench-catalog", "tokenizer_hash": "bench-tokenizer"}
SHAPE = Shape(layers=1, kv_heads=1, head_dim=8)  # 32 bytes a token: the headers are what is measured
BLOCK_TOKENS = 256


def node(root: Path, url: str, options: dict[str, str]) -> BlockStore:
    return BlockStore(root, max_bytes=1 << 50, block_tokens=BLOCK_TOKENS, remote=url,
                      remote_options={**options, "sync_interval": "3600"}, **IDENTITY)


def token_sequences(entries: int, tokens: int, prompts: int, seed: int = 0) -> list[np.ndarray]:
    """``entries`` sequences: one of ``prompts`` system prompts (a quarter of
    the tokens), then a conversation of its own."""
    rng = np.random.default_rng(seed)
    heads = [rng.integers(0, VOCAB, tokens // 4, dtype=np.uint32) for _ in range(prompts)]
    return [np.concatenate([heads[i % prompts], rng.integers(0, VOCAB, tokens - tokens // 4, dtype=np.uint32)])
            for i in range(entries)]


def fill(work: Path, url: str, options: dict[str, str], sequences: list[np.ndarray]) -> None:
    """One real entry stored through a node, then a header per sequence over its
    blocks, uploaded concurrently (the bucket is what the fleet would leave)."""
    source = KVSource.random(SHAPE, len(sequences[0]), seed=1)
    with node(work / "writer", url, options) as writer:
        assert writer.store(sequences[0].tolist(), source.caches()), "the first entry was not acknowledged"
        bucket = writer.remote
        assert bucket is not None
        (name, _), = bucket.list_headers().items()
        first = bucket.fetch_header(name).header

        def put(tokens: np.ndarray) -> None:
            header = Header(first.identity, "", tokens, first.descriptor, None, first.block_xxh3)
            bucket.headers.put_if_absent(f"{ns_dirname('')}/{uuid.uuid4().hex}.bkv", [encode_header(header)])

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(put, sequences[1:]))
    shutil.rmtree(work / "writer")


def rss() -> int:
    """This process's resident set (VmRSS), bytes."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS"))
    return int(line.split()[1]) * 1024


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """A fresh node: open (timed), resident memory after, and find latencies."""
    root = Path(spec["root"])
    shutil.rmtree(root, ignore_errors=True)
    gc.collect()
    before = rss()
    t0 = time.perf_counter()
    store = node(root, spec["url"], spec["options"])
    opened = time.perf_counter() - t0
    gc.collect()
    out: dict[str, Any] = {"open_s": opened, "rss_before": before, "rss_after": rss()}
    if spec.get("finds"):
        sequences = token_sequences(spec["entries"], spec["tokens"], spec["prompts"])
        rng = np.random.default_rng(3)
        hits, heads = [], []
        for i in rng.integers(0, len(sequences), spec["finds"]):
            prompt = np.concatenate([sequences[i], rng.integers(0, VOCAB, 64, dtype=np.uint32)]).tolist()
            t0 = time.perf_counter()
            match = store.find(prompt)
            hits.append(time.perf_counter() - t0)
            assert match is not None and match.prefix_len == spec["tokens"], "a continuation was not found whole"
            head = np.concatenate([sequences[i][: spec["tokens"] // 4], rng.integers(0, VOCAB, 64, dtype=np.uint32)])
            t0 = time.perf_counter()
            match = store.find(head.tolist())
            heads.append(time.perf_counter() - t0)
            assert match is not None and match.prefix_len >= spec["tokens"] // 4
        out["find_hit_s"], out["find_head_s"] = hits, heads
    store.close()
    return out


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=10_000)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--finds", type=int, default=500)
    parser.add_argument("--out", type=Path, help="write the figures as JSON here too")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    small = max(args.entries // 10, 1)
    work = Path(tempfile.mkdtemp(prefix="blockkv-catalog-"))
    report: dict[str, Any] = {"entries": args.entries, "tokens": args.tokens, "block_tokens": BLOCK_TOKENS,
                              "prompts": args.prompts}
    try:
        with moto_bucket() as (url, options, _):
            base = url.rpartition("/")[0]
            sequences = token_sequences(args.entries, args.tokens, args.prompts)
            t0 = time.perf_counter()
            fill(work, f"{base}/large", options, sequences)
            fill(work, f"{base}/small", options, sequences[:small])
            report["fill_s"] = time.perf_counter() - t0
            spec = {"root": str(work / "fresh"), "options": options, "entries": args.entries,
                    "tokens": args.tokens, "prompts": args.prompts}
            first = run_child({**spec, "url": f"{base}/large"})  # fetches every header, leaves a MANIFEST
            later = run_child({**spec, "url": f"{base}/large", "finds": args.finds})
            run_child({**spec, "url": f"{base}/small", "entries": small})
            few = run_child({**spec, "url": f"{base}/small", "entries": small})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    per_entry = (later["rss_after"] - few["rss_after"]) / (args.entries - small)
    blocks = args.tokens // BLOCK_TOKENS
    report.update({
        "first_open_s": first["open_s"], "manifest_open_s": later["open_s"], "small_open_s": few["open_s"],
        "rss_after_large": later["rss_after"], "rss_after_small": few["rss_after"],
        "rss_after_first_open": first["rss_after"],
        "rss_before": later["rss_before"], "bytes_per_entry": per_entry,
        "bound_per_entry": 1024 + 40 * blocks,
        "find_hit_p50_ms": 1000 * statistics.median(later["find_hit_s"]),
        "find_hit_p99_ms": 1000 * float(np.percentile(later["find_hit_s"], 99)),
        "find_head_p50_ms": 1000 * statistics.median(later["find_head_s"]),
        "find_head_p99_ms": 1000 * float(np.percentile(later["find_head_s"], 99)),
        "loadavg": os.getloadavg(),
    })
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
