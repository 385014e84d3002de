"""Durable store speed, what keeping a turn costs: blockkv's fresh store and
next-turn store against a raw fsync'd write and mlx-lm's save + fsync of the
same bytes, interleaved rep by rep (this disk's speed depends on what was
written before); and the bytes a next-turn store writes, which should be its
new tokens' blocks and a header, not the whole cache again."""

from __future__ import annotations

import shutil
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from blockkv.format.header import SUFFIX as HEADER_SUFFIX
from blockkv.fs import FileLayer

from .baselines import mlx_save_fsync
from .config import Config
from .harness import io_delta, open_store
from .sources import KVSource


def bench_writes(cfg: Config, src: KVSource, work: Path) -> dict[str, Any]:
    """Durable writes, interleaved rep by rep so each side sees the same disk state
    (this disk's speed depends on whether blocks were written before and trimmed):
    raw write of the fresh entry's bytes, mlx-lm save + fsync of it, blockkv fresh
    store of it, blockkv next-turn store on top, mlx-lm save + fsync of the whole
    next-turn cache. Leaves the last store (holding both entries) at ``work/"entry"``."""
    n0, n1 = cfg.prefix_tokens, cfg.prefix_tokens + cfg.new_tokens
    data, fs = src.raw_bytes(n0), FileLayer()
    raw_path, mlx_path, root = (
        work / "raw.bin",
        work / "mlx.safetensors",
        work / "entry",
    )
    runs: dict[str, list[float]] = {
        k: [] for k in ("raw", "mlx_fresh", "fresh", "next", "mlx_whole")
    }

    def timed(key: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        result = fn()
        runs[key].append(time.perf_counter() - t0)
        return result

    io: dict[str, int] = {}
    for _ in range(cfg.reps):
        shutil.rmtree(root, ignore_errors=True)
        timed("raw", lambda: fs.write_atomic(raw_path, [data]))
        raw_path.unlink()
        timed("mlx_fresh", lambda: mlx_save_fsync(mlx_path, src.caches(n0)))
        mlx_path.unlink()
        with open_store(root, cfg.block_tokens) as store:
            assert timed(
                "fresh", partial(store.store, src.tokens[:n0], src.caches(n0))
            ), "fresh store refused"
            written = store.stats["bytes_written"]
            io = {}
            with io_delta(io):
                assert timed(
                    "next", partial(store.store, src.tokens[:n1], src.caches(n1))
                ), "next-turn store refused"
            written = int(store.stats["bytes_written"] - written)
        timed("mlx_whole", lambda: mlx_save_fsync(mlx_path, src.caches()))
        mlx_path.unlink()
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "runs_s": runs,
        "raw_write_fsync_s": med["raw"],
        "mlx_save_fsync_fresh_s": med["mlx_fresh"],
        "mlx_save_fsync_whole_s": med["mlx_whole"],
        "fresh_store_s": med["fresh"],
        "next_turn_store_s": med["next"],
        "next_turn_bytes_written": written,
        "next_turn_proc_write_bytes": io["write_bytes"],
        "header_bytes": max(p.stat().st_size for p in header_files(root)),
    }


def header_files(root: Path) -> list[Path]:
    """Every header file under a store root."""
    return list(root.rglob(f"*{HEADER_SUFFIX}"))
