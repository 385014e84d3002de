"""Store and restore speed by entry size, to show how the costs scale: fresh
store against mlx-lm's save + fsync, warm restore against mlx-lm's load in the
same process, and cold restore (page cache dropped) against a plain sequential
read of the same bytes, the disk's limit."""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from blockkv.format.header import SUFFIX as HEADER_SUFFIX
from blockkv.format.layout import is_block_name
from blockkv.fs import FileLayer

from .baselines import mlx_save_fsync
from .config import Config
from .harness import MIB, open_store
from .restore_speed import same_process
from .sources import KVSource, eval_caches


def drop_cache(paths: Sequence[Path]) -> None:
    """Evict these files' pages from the page cache (clean pages: every file here was fsync'd)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def store_files(root: Path) -> list[Path]:
    """Every header and block file under a store root."""
    return [p for p in root.rglob("*") if p.is_file() and (is_block_name(p.name) or p.name.endswith(HEADER_SUFFIX))]


def sequential_read(path: Path, buf: bytearray) -> None:
    """A plain sequential read of a whole file, 8 MiB at a time (the cold-read limit)."""
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(view):
            pass


def bench_sizes(cfg: Config, work: Path) -> dict[str, Any]:
    """Per entry size: fresh store vs mlx-lm save + fsync (interleaved reps),
    warm full restore vs mlx-lm load in this process (alternating reps), and cold
    restore vs a plain sequential read of the same bytes (page cache dropped with
    posix_fadvise before each, interleaved). At most 3 reps per size: the
    32k-token entry is 1 GiB."""
    out: dict[str, Any] = {}
    reps = min(cfg.reps, 3)
    for n in cfg.size_tokens:
        src = KVSource.random(cfg.shape, n, seed=n)
        nbytes, root, mlx_path = n * cfg.shape.bytes_per_token, work / f"size-{n}", work / f"size-{n}.safetensors"
        runs: dict[str, list[float]] = {k: [] for k in ("mlx_save", "store", "seq_read", "cold_restore")}
        for _ in range(reps):
            t0 = time.perf_counter()
            mlx_save_fsync(mlx_path, src.caches())
            runs["mlx_save"].append(time.perf_counter() - t0)
            mlx_path.unlink()
            shutil.rmtree(root, ignore_errors=True)
            with open_store(root, cfg.block_tokens) as store:
                t0 = time.perf_counter()
                assert store.store(src.tokens, src.caches()), "store refused"
                runs["store"].append(time.perf_counter() - t0)
        raw = work / f"size-{n}.raw"
        FileLayer().write_atomic(raw, [src.raw_bytes()])
        buf = bytearray(8 * MIB)
        with open_store(root, cfg.block_tokens) as store:
            match = store.find_exact(src.tokens)
            assert match is not None

            def restore() -> None:
                loaded = store.restore(match.entry)
                assert loaded is not None, "restore failed"
                eval_caches(loaded.caches)

            same = same_process({"blockkv": restore}, src.caches(), work, reps)
            files = store_files(root)
            for _ in range(reps):
                drop_cache([raw])
                t0 = time.perf_counter()
                sequential_read(raw, buf)
                runs["seq_read"].append(time.perf_counter() - t0)
                drop_cache(files)
                t0 = time.perf_counter()
                restore()
                runs["cold_restore"].append(time.perf_counter() - t0)
        raw.unlink()
        shutil.rmtree(root)
        med = {k: statistics.median(v) for k, v in runs.items()}
        out[str(n)] = {"tokens": n, "bytes": nbytes, "runs_s": runs, "mlx_save_fsync_s": med["mlx_save"],
                       "store_s": med["store"], "mlx_load_s": same["mlx_s"], "restore_s": same["blockkv_s"],
                       "seq_read_cold_s": med["seq_read"], "restore_cold_s": med["cold_restore"]}
        del src
    return out
