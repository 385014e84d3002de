"""Restore speed of the next-turn entry, what a prompt-cache hit waits for: a
full restore against mlx-lm's load in one long-lived warm process (verify with
xxh3-128, and with blake3) and in a fresh process (with peak RSS growth); a
partial restore, which must read only the block files of its prefix."""

from __future__ import annotations

import math
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

from blockkv.fs import FileLayer
from blockkv.pool.protocol import is_block_name

from .config import Config
from .fresh_process import child_restore
from .harness import io_delta, median_time, open_store
from .sources import KVSource, check_restored, eval_caches


def same_process(restore: Callable[[], Any], caches: list[KVCache], work: Path, reps: int) -> dict[str, float]:
    """blockkv's full restore and mlx-lm's load of the same cache in this one
    long-lived process, both warmed, alternating rep by rep: where a server runs
    them, with MLX's buffer cache warm for both."""
    path = work / "same-process.safetensors"
    save_prompt_cache(str(path), caches)

    def load() -> None:
        eval_caches(load_prompt_cache(str(path)))

    for fn in (load, restore, load, restore):  # warm: page cache and MLX's buffer cache
        fn()
    runs: dict[str, list[float]] = {"mlx": [], "blockkv": []}
    for _ in range(3 * max(reps, 3)):  # cheap reps on a noisy VM: 5 gave 68 and 82 ms for the same code
        for key, fn in (("mlx", load), ("blockkv", restore)):
            t0 = time.perf_counter()
            fn()
            runs[key].append(time.perf_counter() - t0)
    path.unlink()
    return {"mlx_s": statistics.median(runs["mlx"]), "blockkv_s": statistics.median(runs["blockkv"])}


class CountingFileLayer(FileLayer):
    """The store's file layer, counting the block files it reads (by either read primitive)."""

    def __init__(self) -> None:
        self.block_reads: list[str] = []

    def _count(self, path: Path) -> None:
        if is_block_name(path.name):
            self.block_reads.append(path.name)

    def read(self, path: Path) -> bytes:
        self._count(path)
        return super().read(path)

    def read_exact(self, path: Path, buffers: Sequence[memoryview], on_read: Any = None) -> bool:
        self._count(path)
        return super().read_exact(path, buffers, on_read)


def bench_restore(cfg: Config, src: KVSource, work: Path) -> dict[str, Any]:
    """Full and partial restore of the next-turn entry ``bench_writes`` left, block files
    a partial restore reads, peak RSS of a full restore."""
    n1 = cfg.prefix_tokens + cfg.new_tokens
    root = work / "entry"
    out: dict[str, Any] = {}
    with open_store(root, cfg.block_tokens) as store:
        match = store.find_exact(src.tokens[:n1])
        assert match is not None, "stored entry not found"
        entry = match.entry
        out["entry_nbytes"] = entry.nbytes

        def restore(prefix: int | None = None) -> list[Any]:
            loaded = store.restore(entry, prefix)
            assert loaded is not None, "restore failed"
            eval_caches(loaded.caches)
            return loaded.caches

        check_restored(restore(), src, n1)  # also warms the page cache
        same = same_process(restore, src.caches(), work, cfg.reps)
        out["full_restore_s"], out["same_process_mlx_load_s"] = same["blockkv_s"], same["mlx_s"]
        out["partial_restore_s"] = median_time(
            lambda: restore(cfg.partial_tokens), cfg.reps
        )

    with open_store(root, cfg.block_tokens, verify="full") as store:
        match = store.find_exact(src.tokens[:n1])
        assert match is not None

        def restore_full() -> None:
            loaded = store.restore(match.entry)
            assert loaded is not None, "restore failed"
            eval_caches(loaded.caches)

        same = same_process(restore_full, src.caches(), work, cfg.reps)
        out["full_restore_blake3_s"], out["same_process_mlx_load_blake3_s"] = same["blockkv_s"], same["mlx_s"]

    counting = CountingFileLayer()
    with open_store(root, cfg.block_tokens, fs=counting) as store:
        match = store.find_exact(src.tokens[:n1])
        assert match is not None
        io = {}
        with io_delta(io):
            loaded = store.restore(match.entry, cfg.partial_tokens)
            assert loaded is not None
            eval_caches(loaded.caches)
        check_restored(loaded.caches, src, cfg.partial_tokens)
    out["partial_blocks_read"] = len(counting.block_reads)
    out["partial_blocks_expected"] = math.ceil(cfg.partial_tokens / cfg.block_tokens)
    out["partial_rchar"] = io["rchar"]

    child = child_restore(
        {
            "kind": "blockkv",
            "root": str(root),
            "block_tokens": cfg.block_tokens,
            "tokens": src.tokens[:n1],
            "reps": cfg.reps,
        }
    )
    out["restore_peak_rss_delta"] = child["peak_delta"]
    out["full_restore_child_s"] = child["seconds"]
    shutil.rmtree(root)
    return out
