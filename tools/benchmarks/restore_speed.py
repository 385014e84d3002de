"""Restore speed of the next-turn entry, what a prompt-cache hit waits for: a
full restore against mlx-lm's load in one long-lived warm process (verify with
xxh3-128, and with blake3), beside its floors: the same restore with no check
in the same alternation, and the block reads alone into allocated
destination arrays in an alternation of their own against the restore (see
below why); and in a fresh process (with peak RSS growth);
a partial restore, which must read only the block files of its prefix."""

from __future__ import annotations

import math
import shutil
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

from blockkv import BlockStore, Entry
from blockkv.format.layout import is_block_name
from blockkv.format.rebuild import ParsedEntry, Target
from blockkv.fs import FileLayer

from .config import Config
from .fresh_process import child_restore, first_runs
from .harness import io_delta, median_time, open_store
from .sources import KVSource, check_restored, eval_caches


def same_process(variants: Mapping[str, Callable[[], Any]], caches: list[KVCache], work: Path,
                 reps: int) -> dict[str, float]:
    """blockkv's ``variants`` (name → a restore) and mlx-lm's load of the same
    cache in this one long-lived process, all warmed, alternating rep by rep:
    where a server runs them, with MLX's buffer cache warm for all. Returns
    ``{"mlx_s": ..., "<name>_s": ...}``, medians."""
    path = work / "same-process.safetensors"
    save_prompt_cache(str(path), caches)

    def load() -> None:
        eval_caches(load_prompt_cache(str(path)))

    fns = {"mlx": load, **variants}
    for _ in range(2):  # warm: page cache and MLX's buffer cache
        for fn in fns.values():
            fn()
    runs: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(3 * max(reps, 3)):  # cheap reps on a noisy VM: 5 gave 68 and 82 ms for the same code
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            runs[key].append(time.perf_counter() - t0)
    path.unlink()
    return {f"{k}_s": statistics.median(v) for k, v in runs.items()}


def entry_targets(store: BlockStore, entry: Entry) -> list[Target]:
    """``entry``'s targets over destination arrays allocated once, as a restore makes them."""
    parsed = ParsedEntry.parse(store._dir.header_bytes(entry.ns, entry.id))
    targets: list[Target] = []

    def keep(made: Iterator[Target]) -> Iterator[Target]:
        for target in made:
            targets.append(target)
            yield target

    parsed.rebuild(None, keep, lambda name: store._dir.pool.stat(name).size)
    return targets


def reads_alone(store: BlockStore, entry: Entry) -> Callable[[], None]:
    """The floor of any restore of ``entry`` that reads its blocks into mlx
    arrays: the scatter reads alone (on the store's own reading threads, as a restore's), every rep
    into the same destination arrays, allocated once; no header, no check, no
    cache objects. What it returns times one pass."""
    targets = entry_targets(store, entry)
    pool, io = store._dir.pool, store._executor("read")
    heads = {t.ref.name: memoryview(bytearray(len(t.frame_prefix))) for t in targets}

    def run() -> None:
        assert all(io.map(lambda t: pool.read_exact(t.ref.name, [heads[t.ref.name], *t.pieces]), targets))

    return run


class CountingFileLayer(FileLayer):
    """The store's file layer, counting the block files it reads (by either read primitive)."""

    def __init__(self) -> None:
        self.block_reads: list[str] = []

    def _count(self, path: Path) -> None:
        if is_block_name(path.name):
            self.block_reads.append(path.name)

    def read(self, path: Path, limit: int | None = None) -> bytes:
        self._count(path)
        return super().read(path, limit)

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
        with open_store(root, cfg.block_tokens, verify=False) as unverified:

            def restore_unverified() -> None:
                loaded = unverified.restore(entry)
                assert loaded is not None, "restore failed"
                eval_caches(loaded.caches)

            same = same_process({"blockkv": restore, "noverify": restore_unverified}, src.caches(), work, cfg.reps)
        out["full_restore_s"], out["same_process_mlx_load_s"] = same["blockkv_s"], same["mlx_s"]
        out["full_restore_noverify_s"] = same["noverify_s"]
        # The reads alone hold their destination arrays throughout, which sends every mlx-lm load
        # beside them into fresh 4 KiB pages (65,000 faults and ~100 ms a load, against 13,000 and
        # ~38 ms): so they are timed in an alternation of their own, against the restore.
        floor = same_process({"reads": reads_alone(store, entry), "blockkv": restore}, src.caches(), work, cfg.reps)
        out["reads_alone_s"], out["full_restore_beside_reads_s"] = floor["reads_s"], floor["blockkv_s"]
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

        same = same_process({"blockkv": restore_full}, src.caches(), work, cfg.reps)
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

    ours = {"kind": "blockkv", "root": str(root), "block_tokens": cfg.block_tokens, "tokens": src.tokens[:n1]}
    child = child_restore({**ours, "reps": cfg.reps})
    out["restore_peak_rss_delta"] = child["peak_delta"]
    out["full_restore_child_s"] = child["seconds"]
    mlx_file = work / "first-load.safetensors"
    save_prompt_cache(str(mlx_file), src.caches(n1))
    first, mlx_first = first_runs(ours, {"kind": "mlx", "path": str(mlx_file)}, cfg.first_pairs)
    mlx_file.unlink()
    out["first_restore_child_s"], out["first_restore_samples_s"] = statistics.median(first), first
    out["mlx_first_load_child_s"], out["mlx_first_load_samples_s"] = statistics.median(mlx_first), mlx_first
    shutil.rmtree(root)
    return out
