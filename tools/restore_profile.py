"""Where a verified restore's CPU goes, part by part, next to mlx-lm's load of
the same cache (issue #45): each part run alone on this one thread and timed
in thread CPU time (least of the reps: the figure that holds up when other
work shares the cores, as wall time does not), and how much of it holds the
GIL, which decides what two reading threads can overlap.

- rebuild, no reads: header parse, destination arrays, one ``Target`` per
  block, the caches made; every block declared filled without a read.
- scatter reads: each block's ``read_exact`` into its destination pieces (the
  kernel's copy; ``preadv`` drops the GIL).
- reads + check, fused: the restore's own ``_fill`` path (reads, then
  xxh3-128 of each 512 KiB run of pieces while it is in cache).
- check alone: the same xxh3-128 over every piece, from memory.
- whole restores (verified, unverified) and mlx-lm's load: process CPU, on
  the store's own reading threads, alternated.
- a verified restore's timeline: wall time before its first block read
  (header, allocation, targets), while the reads run, after the last.
- ``--fills``: only that timeline, with wall and CPU, for today's fill (every
  target made before the first read, one future per block) alternating with
  the one tried and reverted in 996ada9 (one job per reading thread, each
  making its next target just before reading it): which one a quiet machine
  favours (docs/benchmarks.md, "Verified restore").
- ``--levers``: mlx-lm's load alternating with today's verified restore and
  with the same restore through two reading threads instead of four, 1 MiB
  read runs instead of 512 KiB, and both (fewer GIL hand-overs, each a chance
  for a core to idle): median wall, least CPU, minor faults, and mlx-lm's
  wall over each. Inconclusive at load 3-5 (docs/benchmarks.md): one for a
  quiet machine.

    python tools/restore_profile.py                    # 4,096 and 8,704 tokens, 9 reps
    python tools/restore_profile.py --tokens 8704 --reps 21
    python tools/restore_profile.py --tokens 8704 --reps 21 --fills
    python tools/restore_profile.py --tokens 8704 --reps 21 --levers
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/, for benchmarks/

from benchmarks.config import FULL
from benchmarks.harness import open_store
from benchmarks.restore_speed import entry_targets
from benchmarks.sources import KVSource, eval_caches
from cpu_budget import alternate, cpu_s
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from blockkv import BlockStore, Entry, fs
from blockkv.format.rebuild import ParsedEntry, Target
from blockkv.fs import FileLayer
from blockkv.local.restore import EntryRead, _feeder


def thread_cpu(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """Least thread CPU seconds of ``fn`` over ``reps`` runs after one warm run,
    and the share of its CPU spent in user space over all the reps: the part
    that holds the GIL here (the kernel's copies inside ``preadv`` drop it)."""
    fn()
    best, user, total = float("inf"), 0.0, 0.0
    for _ in range(reps):
        r0, t0 = resource.getrusage(resource.RUSAGE_THREAD), time.thread_time()
        fn()
        t, r1 = time.thread_time() - t0, resource.getrusage(resource.RUSAGE_THREAD)
        best, user, total = min(best, t), user + r1.ru_utime - r0.ru_utime, total + t
    return best, user / total


class TimedReads(FileLayer):
    """The store's file layer, noting when each block read starts and ends."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []

    def read_exact(self, path: Path, buffers: Sequence[memoryview], on_read: Any = None) -> bool:
        start = time.perf_counter()
        try:
            return super().read_exact(path, buffers, on_read)
        finally:
            self.spans.append((start, time.perf_counter()))


def timeline(store: BlockStore, entry: Entry, timed: TimedReads, reps: int) -> list[str]:
    """Wall time of a verified restore before its first block read, while its
    reads run, and after the last: the serial start is what a small entry waits for."""
    got: list[tuple[float, float, float]] = []
    for _ in range(reps):
        timed.spans.clear()
        start = time.perf_counter()
        eval_caches(store.restore(entry).caches)
        end = time.perf_counter()
        first, last = min(a for a, _ in timed.spans), max(b for _, b in timed.spans)
        got.append((first - start, last - first, end - last))
    names = ("start to first block read", "first read to last", "last read to return")
    return [f"| verified restore: {name}, wall | | | {statistics.median(g[i] for g in got) * 1e3:.1f} ms "
            f"(least {min(g[i] for g in got) * 1e3:.1f}) |" for i, name in enumerate(names)]


class _Shared:
    """Targets several threads take from, one at a time, until it runs out or is closed."""

    def __init__(self, targets: Iterator[Target]) -> None:
        self._targets, self._lock, self._closed = targets, threading.Lock(), False

    def take(self) -> Target | None:
        with self._lock:
            return None if self._closed else next(self._targets, None)

    def close(self) -> None:
        with self._lock:
            self._closed = True


def per_thread_fill(read: EntryRead, targets: Iterator[Target]) -> Iterator[Target]:
    """The fill of 996ada9 (reverted): one job per reading thread, each making
    its next target just before reading it, so the first read waits for one target, not all."""
    shared = _Shared(targets)

    def job() -> list[Target]:
        filled = []
        try:
            while (target := shared.take()) is not None:
                filled.append(read._fill(target))
        except BaseException:
            shared.close()
            raise
        return filled

    jobs = [read._io.submit(job) for _ in range(read._io._max_workers)]
    try:
        for j in jobs:
            yield from j.result()
    finally:
        shared.close()


def fills(store: BlockStore, entry: Entry, timed: TimedReads, reps: int) -> list[str]:
    """Today's fill and ``per_thread_fill``, alternating after two warm rounds:
    median wall, least CPU, and the timeline's start and span, median (least)."""
    todays = EntryRead._fill_all
    got: dict[str, list[tuple[float, float, float, float]]] = {"today's fill": [], "per-thread fill (996ada9)": []}
    try:
        for rep in range(reps + 2):
            for name, fill in zip(got, (todays, per_thread_fill)):
                EntryRead._fill_all = fill  # type: ignore[method-assign,assignment]
                timed.spans.clear()
                c0, start = cpu_s(), time.perf_counter()
                eval_caches(store.restore(entry).caches)
                end, cpu = time.perf_counter(), cpu_s() - c0
                first, last = min(a for a, _ in timed.spans), max(b for _, b in timed.spans)
                if rep >= 2:
                    got[name].append((end - start, cpu, first - start, last - first))
    finally:
        EntryRead._fill_all = todays  # type: ignore[method-assign]
    rows = []
    for name, runs in got.items():
        med = [statistics.median(r[i] for r in runs) * 1e3 for i in range(4)]
        least = [min(r[i] for r in runs) * 1e3 for i in range(4)]
        rows.append(f"| {name} | {least[1]:.1f} ms | | {med[0]:.1f} ms (start {med[2]:.1f}, least {least[2]:.1f}; "
                    f"reads {med[3]:.1f}, least {least[3]:.1f}) |")
    today, per_thread = (statistics.median(r[0] for r in runs) for runs in got.values())
    return rows + [f"| wall, today's / per-thread (> 1: per-thread faster) | {today / per_thread:.2f} | | |"]


def levers(store: BlockStore, entry: Entry, load: Callable[[], object], reps: int) -> list[str]:
    """Today's verified restore against two reading threads, 1 MiB read runs
    and both, each alternating with mlx-lm's ``load`` in this one handle."""
    four, run = store._executor("read"), fs._READ_RUN
    two = ThreadPoolExecutor(max_workers=2, thread_name_prefix="blockkv-read2")
    ways = {"today: 4 reading threads, 512 KiB runs": (four, run), "2 reading threads": (two, run),
            "1 MiB runs": (four, 1 << 20), "2 reading threads, 1 MiB runs": (two, 1 << 20)}

    def restore(pool: ThreadPoolExecutor, size: int) -> Callable[[], None]:
        def go() -> None:
            store._executor._pools["read"], fs._READ_RUN = pool, size
            eval_caches(store.restore(entry).caches)
        return go

    try:
        got = alternate({"mlx-lm load": load, **{k: restore(*v) for k, v in ways.items()}}, reps)
    finally:
        store._executor._pools["read"], fs._READ_RUN = four, run
        two.shutdown()
    load_wall = got["mlx-lm load"][0]
    return [f"| {k} | {least * 1e3:.1f} ms | | {wall * 1e3:.1f} ms (mlx-lm's / this: {load_wall / wall:.2f}; "
            f"{flt:.0f} minor faults) |" for k, (wall, _, least, flt) in got.items()]


def parts(store: BlockStore, entry: Entry) -> dict[str, Callable[[], object]]:
    """Each part of a verified restore, as a function run on this thread."""
    pool, key = store._dir.pool, None
    targets = entry_targets(store, entry)
    heads = {t.ref.name: memoryview(bytearray(len(t.frame_prefix))) for t in targets}
    data = store._dir.header_bytes(entry.ns, entry.id)

    def rebuild_only() -> None:
        ParsedEntry.parse(data).rebuild(None, lambda made: list(made), lambda name: pool.stat(name).size)

    def reads() -> None:
        for t in targets:
            assert pool.read_exact(t.ref.name, [heads[t.ref.name], *t.pieces])

    def fused() -> None:
        for t in targets:
            check, head = t.check(key=key), heads[t.ref.name]
            assert pool.read_exact(t.ref.name, [head, *t.pieces], _feeder(check, head))
            check.finish()

    def check_alone() -> None:
        for t in targets:
            check = t.check(key=key)
            for piece in t.pieces:
                check.update(piece)
            check.finish()

    return {"rebuild, no reads": rebuild_only, "scatter reads": reads,
            "reads + check, fused": fused, "check alone": check_alone}


def profile(tokens: int, reps: int, work: Path, only: str = "") -> list[str]:
    src = KVSource.random(FULL.shape, tokens, seed=1)
    path = work / f"mlx-{tokens}.safetensors"
    save_prompt_cache(str(path), src.caches())
    rows = []
    timed = TimedReads()
    with (open_store(work / f"root-{tokens}", FULL.block_tokens, fs=timed) as store,
          open_store(work / f"root-{tokens}", FULL.block_tokens, verify=False) as unverified):
        assert store.store(src.tokens, src.caches()), "store refused"
        entry = store.find_exact(src.tokens).entry
        load = lambda: eval_caches(load_prompt_cache(str(path)))
        if only == "fills":
            return [f"| {tokens} tokens | | | |", *fills(store, entry, timed, reps)]
        if only == "levers":
            return [f"| {tokens} tokens | | | |", *levers(store, entry, load, reps)]
        targets = entry_targets(store, entry)
        pieces = sum(len(t.pieces) for t in targets)
        rows.append(f"| {tokens} tokens: {len(targets)} blocks, {pieces} pieces, "
                    f"{sum(p.nbytes for t in targets for p in t.pieces) / 2**20:.0f} MiB | | | |")
        del targets
        for name, fn in parts(store, entry).items():
            cpu, user = thread_cpu(fn, reps)
            rows.append(f"| {name}, one thread | {cpu * 1e3:.1f} ms | {user:.0%} | |")
        del fn  # it holds the parts' destination arrays: beside them every mlx-lm load faults in fresh pages
        for name, other in (("verified restore", store), ("unverified restore", unverified)):
            got = alternate({"mlx-lm load": load, name: lambda s=other: eval_caches(s.restore(entry).caches)}, reps)
            rows += [f"| {k}, process CPU{' (alternating with the next row)' if k == 'mlx-lm load' else ''} "
                     f"| {least * 1e3:.1f} ms | | {wall * 1e3:.1f} ms |" for k, (wall, _, least, _) in got.items()]
        rows += timeline(store, entry, timed, reps)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8704])
    parser.add_argument("--fills", action="store_true", help="only today's fill against the per-thread one, alternating")
    parser.add_argument("--levers", action="store_true",
                        help="only today's restore against 2 reading threads and 1 MiB runs, alternating")
    args = parser.parse_args()
    rows = ["| part | CPU (least) | user share | wall (median) |", "|---|---|---|---|"]
    with tempfile.TemporaryDirectory(prefix="blockkv-profile-") as work:
        for tokens in args.tokens:
            rows += profile(tokens, args.reps, Path(work), "fills" if args.fills else "levers" if args.levers else "")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
