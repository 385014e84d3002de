"""The index at many small entries, where per-entry costs show: ``find``
latency (hits, and prompts that share only a head), the store of a tiny entry,
and a store's open time with a valid LMDB index against a forced rebuild from
the files (what keeping the index saves), and after a reboot: with the index
settled (its last handle closed or went idle) and not (a handle was writing)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from blockkv import BlockStore
from blockkv.local.index import SETTLED

from .config import Config
from .harness import median_time, open_store, percentile
from .sources import VOCAB, KVSource, kv_cache

INDEX_IDENTITY = {
    "model_id": "bench/index",
    "config_fingerprint": "bench-index-bf16",
    "tokenizer_hash": "bench-tokenizer",
}


def bench_index(cfg: Config, work: Path) -> dict[str, Any]:
    """``find`` latency at each of ``cfg.index_sizes`` entries; open time at the largest
    with a valid index and with a forced rebuild. Entries share 1 of 64 prompt heads."""
    rng = np.random.default_rng(7)
    heads = [rng.integers(0, VOCAB, 32).tolist() for _ in range(64)]
    total = cfg.index_sizes[-1]
    lo, hi = cfg.index_tokens
    pool = KVSource.random(
        cfg.index_shape, total * hi, seed=3
    )  # each entry slices its own bytes
    root = work / "index"
    out: dict[str, Any] = {}
    stored: list[list[int]] = []
    t_store: list[float] = []
    with open_store(root, cfg.block_tokens, **INDEX_IDENTITY) as store:
        for size in cfg.index_sizes:
            while len(stored) < size:
                i = len(stored)
                n = int(rng.integers(lo, hi + 1))
                tokens = heads[i % len(heads)] + rng.integers(0, VOCAB, n - 32).tolist()
                caches = [
                    kv_cache(k[:, :, i * hi : i * hi + n], v[:, :, i * hi : i * hi + n])
                    for k, v in zip(pool.keys, pool.values)
                ]
                t0 = time.perf_counter()
                assert store.store(tokens, caches), "index store refused"
                t_store.append(time.perf_counter() - t0)
                stored.append(tokens)
            out[f"find_{size}"] = time_finds(
                store, stored, heads, cfg.find_queries, rng
            )
    out["tiny_store_p50_s"] = percentile(t_store, 50)
    out["entries"] = total

    def reopen() -> None:
        with open_store(root, cfg.block_tokens, **INDEX_IDENTITY) as store:
            assert len(store) == total, f"open indexed {len(store)} of {total} entries"

    out["open_valid_s"] = median_time(reopen, cfg.reps)
    out["open_rebuild_s"] = median_time(
        reopen, cfg.reps, setup=lambda: drop_index(root)
    )
    out["open_reboot_settled_s"] = median_time(reopen, cfg.reps, setup=lambda: reboot(root, settled=True))
    out["open_reboot_unsettled_s"] = median_time(reopen, cfg.reps, setup=lambda: reboot(root, settled=False))
    shutil.rmtree(root)
    return out


def time_finds(
    store: BlockStore,
    stored: list[list[int]],
    heads: list[list[int]],
    queries: int,
    rng: np.random.Generator,
) -> dict[str, float]:
    """Latency of ``find``: half hits (a stored entry plus new tokens), half prompts that
    share only a head (the match is shorter than any entry, or none)."""
    times: list[float] = []
    hits = 0
    for q in range(queries):
        if q % 2 == 0:
            prompt = (
                stored[int(rng.integers(len(stored)))]
                + rng.integers(0, VOCAB, 64).tolist()
            )
        else:
            prompt = (
                heads[int(rng.integers(len(heads)))]
                + rng.integers(0, VOCAB, 96).tolist()
            )
        t0 = time.perf_counter()
        match = store.find(prompt)
        times.append(time.perf_counter() - t0)
        hits += q % 2 == 0 and match is not None
    assert hits == (queries + 1) // 2, "a stored entry was not found"
    return {
        "p50_ms": percentile(times, 50) * 1e3,
        "p99_ms": percentile(times, 99) * 1e3,
    }


def reboot(root: Path, *, settled: bool) -> None:
    """What a reboot leaves of every index under ``root``: the tables stamped by a
    boot that has ended (``/proc/sys/kernel/random/boot_id`` changes), and
    ``index.settled`` only if the last handle settled them (closing does)."""
    for data in list(root.rglob("data.mdb")):
        env = lmdb.open(str(data.parent), max_dbs=16, map_size=2 * data.stat().st_size + (1 << 20))
        with env.begin(write=True) as txn:
            txn.put(b"boot", b"a boot that has ended", db=env.open_db(b"meta", txn=txn))
        env.close()
        marker = data.parent.with_name(SETTLED)
        assert marker.exists(), "the closing handle did not settle the index"
        if not settled:
            marker.unlink()


def drop_index(root: Path) -> None:
    """Delete the LMDB accelerator so the next open rebuilds it from the files."""
    for data in list(root.rglob("data.mdb")):
        shutil.rmtree(data.parent)
