"""Large entries, in one fresh child process: the peak RSS growth of a store
and of a restore against the entry's bytes (memory must not hold a second
copy), and their throughput against a smaller reference entry's (speed must
not fall with size)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import mlx.core as mx

from .config import Config, Shape
from .fresh_process import child_restore, status_kib
from .harness import open_store
from .sources import KVSource, eval_caches


def bench_large(cfg: Config, work: Path) -> dict[str, Any]:
    """Store and restore of the large entry, then of the reference entry, of
    ``cfg.large_shape`` in one fresh child process: peak RSS growth of each step
    (the large entry's first, before anything else ran) and throughput."""
    root = work / "large"
    out = child_restore({"kind": "large", "root": str(root), "block_tokens": cfg.block_tokens,
                         "shape": asdict(cfg.large_shape), "tokens": sorted(cfg.large_tokens, reverse=True)})
    shutil.rmtree(root, ignore_errors=True)
    return out


def large_child(spec: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The child side of ``bench_large``: each entry is made here, so RSS before
    each step already holds it; what a step adds is its own."""
    shape = Shape(**spec["shape"])
    return {str(n): large_entry(shape, n, Path(spec["root"]) / str(n), spec["block_tokens"])
            for n in spec["tokens"]}


def large_entry(shape: Shape, n: int, root: Path, block_tokens: int) -> dict[str, float]:
    src = KVSource.random(shape, n, seed=7)
    out: dict[str, float] = {"bytes": n * shape.bytes_per_token}
    with open_store(root, block_tokens) as store:
        def step(key: str, fn: Callable[[], Any]) -> Any:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            before = status_kib("VmRSS")
            t0 = time.perf_counter()
            result = fn()
            out[f"{key}_s"] = time.perf_counter() - t0
            out[f"{key}_peak_delta"] = (status_kib("VmHWM") - before) * 1024
            return result

        assert step("store", lambda: store.store(src.tokens, src.caches())), "large store refused"
        match = store.find_exact(src.tokens)
        assert match is not None
        del src  # the restore's growth is measured against a process without the source arrays
        mx.clear_cache()  # nor MLX's cache of their freed buffers

        def restore() -> Any:
            loaded = store.restore(match.entry)
            assert loaded is not None, "large restore failed"
            eval_caches(loaded.caches)
            return loaded

        loaded = step("restore", restore)
        del loaded
    mx.clear_cache()
    return out
