"""The agent workload, the case blockkv's deduplication is for: sessions of
growing history over one shared system prompt, every turn stored. blockkv's
disk footprint and bytes written against a file-per-entry mlx-lm baseline and
the ideal (the bytes of the distinct prefixes), after each session; store
latency."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from mlx_lm.models.cache import save_prompt_cache

from blockkv.local.prefix_index import common_prefix_length

from .config import Config
from .harness import io_delta, open_store, percentile
from .sources import KVSource


def bench_agent(cfg: Config, work: Path) -> dict[str, Any]:
    """Store every turn of every session in blockkv and, whole as mlx-lm files, in a
    file-per-entry baseline; footprint and bytes written after each session.

    blockkv lets a turn supersede the previous turn of its session (an entry
    that is a prefix of a newer trimmable one), so the baseline is charged only
    for the files of the entries blockkv still holds, and for writing every
    turn. The store runs with ``gc_grace=0`` and is gc'd before each
    measurement: the footprint is the steady state (before gc is recorded too)."""
    shape, bpt = cfg.shape, cfg.shape.bytes_per_token
    rng = np.random.default_rng(5)
    system = KVSource.random(shape, cfg.agent_system_tokens, seed=1000)
    root, fpe_file = work / "agent", work / "fpe.safetensors"
    fpe_size: dict[
        tuple[int, ...], int
    ] = {}  # tokens -> allocated bytes of its whole file
    fpe_io = bk_io = bk_written = 0
    points: list[dict[str, int]] = []
    t_store: list[float] = []
    with open_store(root, cfg.block_tokens, gc_grace=0.0) as store:
        for s in range(cfg.agent_sessions):
            turns = rng.integers(
                cfg.agent_turn_tokens[0], cfg.agent_turn_tokens[1] + 1, cfg.agent_turns
            )
            session = system.extended(
                KVSource.random(shape, int(turns.sum()), seed=2000 + s)
            )
            for n in (cfg.agent_system_tokens + np.cumsum(turns)).tolist():
                caches = session.caches(n)
                io: dict[str, int] = {}
                written = store.stats["bytes_written"]
                with io_delta(io):
                    t0 = time.perf_counter()
                    assert store.store(session.tokens[:n], caches), (
                        "agent store refused"
                    )
                    t_store.append(time.perf_counter() - t0)
                bk_written += int(store.stats["bytes_written"] - written)
                bk_io += io["write_bytes"]
                io = {}
                with io_delta(io):
                    save_prompt_cache(str(fpe_file), caches)
                fpe_io += io["write_bytes"]
                fpe_size[tuple(session.tokens[:n])] = fpe_file.stat().st_blocks * 512
                fpe_file.unlink()  # its size is counted; keep the disk free
            before_gc = disk_usage(root)
            store.gc()
            live = list(store.token_prefixes())
            points.append(
                {
                    "sessions": s + 1,
                    "entries_stored": len(fpe_size),
                    "entries_live": len(live),
                    "ideal_bytes": unique_tokens(live) * bpt,
                    "blockkv_footprint_before_gc": before_gc,
                    "blockkv_footprint": disk_usage(root),
                    "blockkv_total_bytes": store.total_bytes,
                    "blockkv_bytes_written": bk_written,
                    "blockkv_proc_write_bytes": bk_io,
                    "fpe_footprint": sum(fpe_size[t] for t in live),
                    "fpe_footprint_every_turn": sum(fpe_size.values()),
                    "fpe_proc_write_bytes": fpe_io,
                }
            )
            del session
    shutil.rmtree(root)
    last = points[-1]
    return {
        "points": points,
        "store_p50_s": percentile(t_store, 50),
        "store_p99_s": percentile(t_store, 99),
        "footprint_vs_ideal": last["blockkv_footprint"] / last["ideal_bytes"],
        "footprint_vs_fpe": last["blockkv_footprint"] / last["fpe_footprint"],
        "ideal_vs_fpe": last["ideal_bytes"] / last["fpe_footprint"],
        "written_vs_fpe": last["blockkv_bytes_written"] / last["fpe_proc_write_bytes"],
        "written_vs_ideal": last["blockkv_bytes_written"] / last["ideal_bytes"],
    }


def unique_tokens(entries: Sequence[Sequence[int]]) -> int:
    """Token positions with distinct prefixes across ``entries`` (nodes of their trie):
    the KV a perfect prefix-sharing store would hold."""
    ordered = [np.asarray(t, dtype=np.int64) for t in sorted(map(tuple, entries))]
    total = 0
    for prev, cur in zip([None, *ordered], ordered):
        total += len(cur) - (0 if prev is None else common_prefix_length(prev, cur))
    return total


def disk_usage(root: Path) -> int:
    """Bytes allocated on disk under ``root`` (st_blocks, like ``du``)."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except FileNotFoundError:
                continue
    return total
