"""Where a restore's and a store's time goes in CPU, next to mlx-lm's own load
and save of the same cache (issue #24): wall time, process CPU time and the
cores that kept busy, each median of alternating reps in one long-lived
process, as the bench's same-process rows are measured; and the least CPU
time of the reps, the figure that holds up when other work shares the cores
(the medians do not); and the minor page faults of each (median).

- restore: mlx-lm's load alternating with a verified restore, then with an
  unverified one, then the scatter reads alone (after both alternations, so
  its destination arrays are not held while mlx-lm loads: beside them every
  load faulted in fresh pages, docs/benchmarks.md).
- store: mlx-lm's save + fsync alternating with a fresh store (into a new,
  already opened root each rep), at 1k tokens.

    python tools/cpu_budget.py            # 8,704 tokens restored, 1,024 stored, 15 reps
    python tools/cpu_budget.py --reps 5   # a quick look
    python tools/cpu_budget.py --reps 41 --restore-tokens 1024   # a small entry's fixed costs
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/, for benchmarks/

from benchmarks.baselines import mlx_save_fsync
from benchmarks.config import FULL
from benchmarks.harness import open_store
from benchmarks.restore_speed import reads_alone
from benchmarks.sources import KVSource, eval_caches
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from blockkv import BlockStore


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def alternate(fns: dict[str, Callable[[], object]], reps: int,
              before: Callable[[], object] = lambda: None) -> dict[str, tuple[float, float, float, float]]:
    """{name: (median wall s, median CPU s, least CPU s, median minor page faults)} of
    ``fns`` run in turn, ``reps`` times after two warm rounds (``before`` runs untimed
    ahead of each call). The faults say who paid for fresh pages: alternating in one
    process, one side may reuse pages the other just freed (docs/benchmarks.md)."""
    runs: dict[str, list[tuple[float, float, int]]] = {k: [] for k in fns}
    for rep in range(reps + 2):
        for key, fn in fns.items():
            before()
            f0, c0, t0 = faults(), cpu_s(), time.perf_counter()
            fn()
            wall, cpu, flt = time.perf_counter() - t0, cpu_s() - c0, faults() - f0
            if rep >= 2:
                runs[key].append((wall, cpu, flt))
    return {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v), min(r[1] for r in v),
                statistics.median(r[2] for r in v)) for k, v in runs.items()}


def line(name: str, wall: float, cpu: float, least: float, flt: float) -> str:
    return (f"| {name} | {wall * 1e3:.1f} ms | {cpu * 1e3:.1f} ms | {least * 1e3:.1f} ms | {cpu / wall:.2f} "
            f"| {flt:.0f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--restore-tokens", type=int, default=8704)
    parser.add_argument("--store-tokens", type=int, default=1024)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="blockkv-cpu-"))
    rows = ["| what | wall | CPU | least CPU | cores busy | minor faults |", "|---|---|---|---|---|---|"]
    try:
        src = KVSource.random(FULL.shape, args.restore_tokens, seed=1)
        path = work / "mlx.safetensors"
        save_prompt_cache(str(path), src.caches())
        with (open_store(work / "restore", FULL.block_tokens) as store,
              open_store(work / "restore", FULL.block_tokens, verify=False) as unverified):
            assert store.store(src.tokens, src.caches()), "store refused"
            entry = store.find_exact(src.tokens).entry
            load = lambda: eval_caches(load_prompt_cache(str(path)))  # noqa: E731
            for name, other in (("verified restore", store), ("unverified restore", unverified)):
                got = alternate({"mlx-lm load": load, name: lambda s=other: eval_caches(s.restore(entry).caches)},
                                args.reps)
                rows += [line(f"{k} ({args.restore_tokens} tokens, alternating with the next row)" if k == "mlx-lm load"
                              else k, *v) for k, v in got.items()]
            floor = reads_alone(store, entry)
            rows.append(line("scatter reads alone, the restore's reading threads", *alternate({"reads": floor}, args.reps)["reads"]))
        small = KVSource.random(FULL.shape, args.store_tokens, seed=2)
        root, saved = work / "store", work / "saved.safetensors"
        handle: list[BlockStore] = []

        def fresh() -> None:  # untimed: each rep stores into a new root, opened, and saves a new file
            while handle:
                handle.pop().close()
            shutil.rmtree(root, ignore_errors=True)
            saved.unlink(missing_ok=True)
            handle.append(open_store(root, FULL.block_tokens))

        try:
            got = alternate({"mlx-lm save + fsync": lambda: mlx_save_fsync(saved, small.caches()),
                             "fresh store": lambda: handle[0].store(small.tokens, small.caches())},
                            args.reps, fresh)
        finally:
            while handle:
                handle.pop().close()
        rows += [line(f"{k}, {args.store_tokens} tokens", *v) for k, v in got.items()]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
