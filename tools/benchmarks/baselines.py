"""The limits and the mlx-lm baselines that blockkv's figures are ratios
against, measured in the same run so that a ratio does not depend on the
machine: page-cache read and blake3 throughput of the fresh entry's bytes,
mlx-lm's own save + fsync, and its load + eval of the next-turn cache here and
in a fresh process (with its peak RSS growth)."""

from __future__ import annotations

import os
from pathlib import Path

import blake3
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

from blockkv.fs import FileLayer

from .fresh_process import child_restore
from .harness import median_time
from .sources import KVSource, eval_caches


def bench_limits(data: bytes, work: Path, reps: int) -> dict[str, float]:
    """Page-cache read and blake3 throughput of ``data``, in GB/s (the durable
    write limit is measured interleaved with the stores, in ``bench_writes``)."""
    path = work / "limits.bin"
    FileLayer().write_atomic(path, [data])
    buf = bytearray(len(data))

    def read() -> None:
        with open(path, "rb", buffering=0) as f:
            f.readinto(buf)

    read()  # warm: the figure is a page-cache read
    t_read = median_time(read, reps)
    path.unlink()
    t_b3_1 = median_time(lambda: blake3.blake3(data).digest(), reps)
    t_b3_all = median_time(
        lambda: blake3.blake3(data, max_threads=blake3.blake3.AUTO).digest(), reps
    )
    n = len(data)
    return {
        "bytes": n,
        "read_page_cache_gbps": n / t_read / 1e9,
        "blake3_1thread_gbps": n / t_b3_1 / 1e9,
        "blake3_all_gbps": n / t_b3_all / 1e9,
    }


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def mlx_save_fsync(path: Path, caches: list[KVCache]) -> None:
    """mlx-lm's own save, then fsync the file."""
    save_prompt_cache(str(path), caches)
    fsync_path(path)


def bench_mlx_load(src: KVSource, work: Path, reps: int) -> dict[str, float]:
    """mlx-lm warm load + eval of the whole next-turn cache (here and in a fresh
    process), and its peak RSS."""
    path = work / "mlx.safetensors"
    save_prompt_cache(str(path), src.caches())
    size = path.stat().st_size
    eval_caches(load_prompt_cache(str(path)))  # warm the page cache
    t_load = median_time(lambda: eval_caches(load_prompt_cache(str(path))), reps)
    child = child_restore({"kind": "mlx", "path": str(path), "reps": reps})
    path.unlink()
    return {
        "file_bytes_whole": size,
        "load_eval_s": t_load,
        "load_eval_child_s": child["seconds"],
        "load_peak_rss_delta": child["peak_delta"],
    }
