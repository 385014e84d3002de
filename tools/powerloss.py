"""Power-loss crash states: every crash point of small workloads, random ones of longer ones.

Each workload sets a store up (the durable starting point), then records one
or more operations through ``blockkv.testing.powerloss.RecordingFileLayer``.
For every crash point (or a random sample, for the long workloads) it writes
crash states to disk (un-synced data lost, torn or zeroed, un-synced names
undone, the LMDB index lost, from a previous boot or synced; the model is in
that module's docstring), opens a ``BlockStore`` on each and checks:

- every entry acknowledged (``store()`` returned True) before the cut, and
  not being removed, replaced, superseded or evicted by an operation already
  started, is there and restores bit-exact (raw bits);
- every entry that is there restores to the bits of the store that wrote it
  (nothing restores wrong), and none is one whose store had not begun;
- ``check(repair=True)`` then leaves a clean ``check()``, and removes no
  acknowledged entry.

    python tools/powerloss.py                       # the full run (docs/reliability.md)
    python tools/powerloss.py --quick               # what tests/system/test_powerloss.py runs
    python tools/powerloss.py --platform darwin     # macOS's barrier path (F_FULLFSYNC), on any machine
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blockkv.fs import FileLayer
from blockkv.store import BlockStore, GenerationCheckpoint
from blockkv.testing.powerloss import CrashState, RecordingFileLayer
from blockkv.testing.stateful import FakeClock, live_bits
from blockkv.testing.strategies import make_caches

PARAMS: dict[str, Any] = dict(model_id="tiny", config_fingerprint="fp-powerloss", tokenizer_hash="tok",
                              max_bytes=1 << 40, block_tokens=4, gc_grace=60.0)
SYSTEM = tuple(range(3, 13))  # a shared system prompt: stores after the first are dedup hits


@dataclass
class Journal:
    """What a workload did, by log position: a cut at ``k`` saw operations
    ``0..k-1``; -1 stands for the set-up (the durable starting point)."""

    bits: dict[str, tuple] = field(default_factory=dict)  # entry id -> raw bits its store wrote
    issued: dict[str, int] = field(default_factory=dict)  # entry id -> position its store() began
    acked: dict[str, int] = field(default_factory=dict)  # entry id -> position store() returned True
    doomed: dict[str, int] = field(default_factory=dict)  # entry id -> position an op removing it began
    successor: dict[str, str] = field(default_factory=dict)  # entry id -> the store that replaced/superseded it

    def owed(self, k: int) -> set[str]:
        """Entries a cut at ``k`` must keep: acknowledged, and no op removing them had begun
        (an op beginning at ``k`` has not written anything yet)."""
        return {i for i, at in self.acked.items() if at <= k <= self.doomed.get(i, 1 << 62)}

    def line(self, entry_id: str, k: int) -> set[str] | None:
        """An acknowledged entry and the entries that, in turn, replaced or
        superseded it by cut ``k``: a store removes nothing before its own entry
        is durable, so one of them must be there. None if the line was removed
        outright (remove, evict, gc, repair) before ``k``."""
        line = {entry_id}
        while self.doomed.get(entry_id, 1 << 62) < k:
            if entry_id not in self.successor:
                return None
            entry_id = self.successor[entry_id]
            line.add(entry_id)
        return line


class Driver:
    """Runs a workload on ``root``: set-up with a plain file layer, then the
    recorded part with a RecordingFileLayer, journaling every entry."""

    def __init__(self, root: Path, base: Path, fs_class: type[RecordingFileLayer] = RecordingFileLayer,
                 platform: str = sys.platform) -> None:
        self.root, self.base, self.fs_class, self.platform = root, base, fs_class, platform
        self.journal = Journal()
        self.clock = FakeClock()
        self.recorder: RecordingFileLayer | None = None
        self._store: BlockStore | None = None
        self.by_tokens: dict[tuple[str, tuple[int, ...]], str] = {}

    @property
    def store(self) -> BlockStore:
        """The handle: during set-up opened on first use, with a plain file layer."""
        if self._store is None:
            self._store = BlockStore(self.root, fs=FileLayer(), clock=self.clock, **PARAMS)
        return self._store

    def open_empty(self) -> None:
        """Set-up that only opens the store: a root with its skeleton and no entry."""
        self.store.close()  # the property opened it
        self._store = None

    def pos(self) -> int:
        return len(self.recorder.log) if self.recorder else -1

    def ids(self) -> set[str]:
        return {e.id for e in self.store.entries()} if self._store is not None else set()

    def step(self, fn: Callable[[], Any]) -> Any:
        """Run one operation; entries it removed are doomed from its first log position."""
        before, start = self.ids(), self.pos()
        result = fn()
        for entry_id in before - self.ids():
            self.journal.doomed.setdefault(entry_id, start)
        return result

    def record(self) -> None:
        """End of set-up: close, keep the directory as the durable base, reopen recording."""
        before = self.ids()
        if self._store is not None:
            self._store.close()
        self.recorder = self.fs_class(self.root, self.base, platform=self.platform)
        self._store = BlockStore(self.root, fs=self.recorder, clock=self.clock, **PARAMS)
        for entry_id in before - self.ids():  # recovery at open removed it
            self.journal.doomed.setdefault(entry_id, -1)

    def finish(self) -> RecordingFileLayer:
        self.store.close()
        assert self.recorder is not None
        self.recorder.finish()
        return self.recorder

    # -- operations --------------------------------------------------------------
    def store_(self, tokens: tuple[int, ...], kind: str = "llama", seed: int = 0, ns: str = "",
               checkpoint: GenerationCheckpoint | None = None) -> str | None:
        caches = make_caches(kind, tokens, seed)
        bits = tuple(live_bits(c) for c in caches)
        before, start = self.ids(), self.pos()
        if checkpoint is None:
            ok = self.store.store(tokens, caches, ns)
        else:
            ok = self.store.store_generation_checkpoint(tokens, caches, checkpoint)
        after = self.ids()
        new = after - before
        if not ok:
            return None
        (entry_id,) = new
        for old in before - after:
            self.journal.doomed.setdefault(old, start)
            self.journal.successor[old] = entry_id
        self.journal.bits[entry_id] = bits
        self.journal.issued[entry_id] = start
        self.journal.acked[entry_id] = self.pos()
        if checkpoint is None:
            self.by_tokens[(ns, tokens)] = entry_id
        return entry_id

    def remove(self, tokens: tuple[int, ...], ns: str = "") -> None:
        entry = self.store.find_exact(tokens, ns)
        assert entry is not None
        self.step(lambda: self.store.remove(entry.entry))

    def evict(self, fraction: float) -> None:
        self.step(lambda: self.store.evict_to(int(self.store.total_bytes * fraction)))

    def gc(self, after_grace: bool = True) -> None:
        if after_grace:
            self.clock.advance(2 * PARAMS["gc_grace"])
        self.step(self.store.gc)

    def repair(self) -> None:
        self.step(lambda: self.store.check(repair=True))

    def damage_block(self, entry_id: str) -> None:
        """Flip a byte of a block only ``entry_id`` uses (set-up only): that entry is no longer owed."""
        entries = {e.id: e for e in self.store.entries()}
        shared = {n for e in entries.values() if e.id != entry_id for n in e.blocks}
        name = next(n for n in entries[entry_id].blocks if n not in shared)
        path = self.store.directory / "blobs" / name[:2] / name
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(bytes(raw))
        self.journal.doomed[entry_id] = -1


def _turn(i: int) -> tuple[int, ...]:
    return tuple((i * 37 + j * 11) % 256 for j in range(5))


# -- the small workloads: (set-up, recorded part) -------------------------------------------
def w_store(d: Driver) -> None:
    d.open_empty()
    d.record()
    d.store_(SYSTEM + _turn(1))


def w_dedup_store(d: Driver) -> None:
    d.store_(SYSTEM + _turn(1))
    d.record()
    d.store_(SYSTEM + _turn(2))  # shares the system prompt's blocks


def w_replace(d: Driver) -> None:
    d.store_(SYSTEM + _turn(1), seed=0)
    d.record()
    d.store_(SYSTEM + _turn(1), seed=1)  # identical tokens: replaces the first


def w_supersede(d: Driver) -> None:
    d.store_(SYSTEM + _turn(1))
    d.record()
    d.store_(SYSTEM + _turn(1) + _turn(2))  # trimmable: supersedes its prefix


def w_remove(d: Driver) -> None:
    d.store_(SYSTEM + _turn(1))
    d.store_(SYSTEM + _turn(2))
    d.record()
    d.remove(SYSTEM + _turn(1))


def w_evict(d: Driver) -> None:
    for i in range(3):
        d.store_(SYSTEM + _turn(i), kind=("llama", "mamba", "gemma3")[i])
    d.record()
    d.evict(0.5)


def w_gc(d: Driver) -> None:
    d.store_(SYSTEM + _turn(1))
    d.store_(SYSTEM + _turn(2), kind="mamba")
    d.remove(SYSTEM + _turn(2))
    d.record()
    d.gc()


def w_repair(d: Driver) -> None:
    d.store_(SYSTEM + _turn(1))
    victim = d.store_(SYSTEM + _turn(2))
    assert victim is not None
    d.damage_block(victim)
    d.record()
    d.repair()


def w_checkpoint(d: Driver) -> None:
    prompt = SYSTEM + _turn(1)
    d.store_(prompt + _turn(2), checkpoint=GenerationCheckpoint("req-1", len(prompt)))
    d.record()
    d.store_(prompt + _turn(2) + _turn(3), checkpoint=GenerationCheckpoint("req-1", len(prompt)))


def w_first_open(d: Driver) -> None:
    """The first open of an empty root and a store (every directory created on the way)."""
    d.record()
    d.store_(SYSTEM + _turn(1))


SMALL: dict[str, Callable[[Driver], None]] = {
    "store": w_store, "first open+store": w_first_open, "dedup store": w_dedup_store, "replace": w_replace,
    "supersede": w_supersede, "remove": w_remove, "evict": w_evict, "gc": w_gc, "repair": w_repair,
    "checkpoint": w_checkpoint,
}


def long_workload(seed: int, steps: int) -> Callable[[Driver], None]:
    """A random agent-shaped sequence of stores (mostly dedup hits), removes, evictions, gc and checkpoints."""

    def run(d: Driver) -> None:
        rng = random.Random(seed)
        d.store_(SYSTEM + _turn(0))
        d.record()
        for i in range(steps):
            op = rng.choices(("store", "checkpoint", "remove", "evict", "gc"), (6, 1, 2, 1, 1))[0]
            known = [k for k, v in d.by_tokens.items() if v in d.ids()]
            if op == "store" or not known:
                ns = rng.choice(("", "adapter:a"))
                base = rng.choice([t for n, t in known if n == ns] or [SYSTEM])
                tokens = base[: rng.randint(1, len(base))] + _turn(rng.randrange(1000))
                d.store_(tokens, kind=rng.choice(("llama", "mamba", "gemma3", "chunked")), seed=rng.randrange(2),
                         ns=ns)
            elif op == "checkpoint":
                prompt = SYSTEM + _turn(i)
                d.store_(prompt + _turn(rng.randrange(1000)), checkpoint=GenerationCheckpoint("k", len(prompt)))
            elif op == "remove":
                ns, tokens = rng.choice(known)
                d.remove(tokens, ns)
            elif op == "evict":
                d.evict(rng.uniform(0.4, 0.9))
            else:
                d.gc(after_grace=rng.random() < 0.7)

    return run


# -- checking one crash state -------------------------------------------------------------------
@dataclass
class Figures:
    workloads: int = 0
    operations: int = 0
    crash_points: int = 0
    states: int = 0
    verified: int = 0  # acknowledged entries found and restored bit-exact, summed over states
    successions: int = 0  # entries being replaced/superseded whose successor was there instead
    extra: int = 0  # entries not owed (in flight or being removed) found and restored bit-exact
    lost: int = 0
    wrong: int = 0
    problems: list[str] = field(default_factory=list)
    rows: list[tuple[str, int, str, int, int, int]] = field(default_factory=list)  # per workload

    def table(self) -> str:
        out = ["| workload | operations | crash points | crash states | entries verified | successors |",
               "|---|---|---|---|---|---|"]
        out += ["| " + " | ".join(map(str, row)) + " |" for row in self.rows]
        return "\n".join(out)

    def line(self) -> str:
        return (f"workloads {self.workloads}  operations {self.operations}  crash points {self.crash_points}  "
                f"crash states {self.states}  entries verified {self.verified}  successors {self.successions}  "
                f"also restored {self.extra}  "
                f"lost {self.lost}  wrong {self.wrong}  problems {len(self.problems)}")


def check_state(dest: Path, state: CrashState, journal: Journal, fig: Figures, where: str) -> None:
    k = state.point.ops
    owed = journal.owed(k)
    fig.states += 1
    problem = fig.problems.append
    with BlockStore(dest, **{**PARAMS, "gc_grace": 0.0}) as store:  # type: ignore[arg-type]
        found = {e.id: e for e in store.entries()}
        for entry_id in owed - found.keys():
            fig.lost += 1
            problem(f"{where}: acknowledged entry {entry_id} missing")
        restored: set[str] = set()
        for entry_id, entry in found.items():
            if entry_id not in journal.bits or journal.issued[entry_id] >= k:
                fig.wrong += 1
                problem(f"{where}: entry {entry_id} no store had begun to write")
                continue
            loaded = store.restore(entry)
            if loaded is None:
                if entry_id in owed:
                    fig.lost += 1
                    problem(f"{where}: acknowledged entry {entry_id} does not restore")
                continue
            if tuple(live_bits(c) for c in loaded.caches) != journal.bits[entry_id]:
                fig.wrong += 1
                problem(f"{where}: entry {entry_id} restores wrong bits")
                continue
            restored.add(entry_id)
            if entry_id in owed:
                fig.verified += 1
            else:
                fig.extra += 1
        for entry_id in {i for i, at in journal.acked.items() if at <= k} - owed:
            line = journal.line(entry_id, k)
            if line is None:
                continue
            if line & restored:
                fig.successions += 1
            else:
                fig.lost += 1
                problem(f"{where}: neither {entry_id} nor the store that replaced it is there")
        first = store.check(repair=True)
        if (first.dangling or first.corrupt_headers or first.corrupt_blocks
                or any(idx < truth for _, idx, truth in first.refcount_mismatches)):
            problem(f"{where}: after open, check found {first.to_json()}")
        second = store.check()
        if not second.clean:
            problem(f"{where}: check(repair=True) left {second.to_json()}")
        kept = {e.id for e in store.entries()}
        for entry_id in owed - kept:
            if entry_id in found:
                problem(f"{where}: check(repair=True) removed acknowledged entry {entry_id}")


def run_workload(name: str, workload: Callable[[Driver], None], work: Path, fig: Figures, rng: random.Random, *,
                 sample: int | None, n_random: int, exhaustive_upto: int, per_point: int | None = None,
                 fs_class: type[RecordingFileLayer] = RecordingFileLayer, platform: str = sys.platform) -> None:
    """Record ``workload`` and check its crash states: at every crash point (or
    ``sample`` random ones), all its states, or ``per_point`` of them taken in
    turn (the quick form: successive points get different kinds of state).
    ``platform``: whose barrier path the store runs and the model follows."""
    shutil.rmtree(work, ignore_errors=True)
    (work / "live").mkdir(parents=True)
    driver = Driver(work / "live", work / "base", fs_class, platform)
    workload(driver)
    recorder = driver.finish()
    points = all_points = recorder.crash_points()
    if sample is not None and sample < len(points):
        points = sorted(rng.sample(points, sample), key=lambda p: (p.ops, p.lmdb_version))
    fig.workloads += 1
    fig.operations += len(recorder.log)
    fig.crash_points += len(points)
    states_before, verified_before, successions_before = fig.states, fig.verified, fig.successions
    for j, point in enumerate(points):
        states = recorder.states(point, rng, n_random, exhaustive_upto)
        if per_point is not None:
            states = [states[(j + i) % len(states)] for i in range(min(per_point, len(states)))]
        for n, state in enumerate(states):
            dest = work / f"crash-{point.ops}-{point.lmdb_version}-{n}"
            recorder.materialize(state, dest)
            check_state(dest, state, driver.journal, fig,
                        f"{name} @{point.ops}/{len(recorder.log)} ({state.label}, index {state.index})")
            shutil.rmtree(dest)
    checked = f"{len(points)}" if points is all_points else f"{len(points)} of {len(all_points)}"
    fig.rows.append((name, len(recorder.log), checked, fig.states - states_before, fig.verified - verified_before,
                     fig.successions - successions_before))
    print(f"{name}: {checked} crash points, {fig.states - states_before} states, "
          f"lost {fig.lost} wrong {fig.wrong} so far", file=sys.stderr, flush=True)


def run(work: Path, *, quick: bool, seed: int, long_runs: int, long_steps: int, sample: int,
        platform: str = sys.platform) -> Figures:
    fig = Figures()
    rng = random.Random(seed)
    for name, workload in SMALL.items():
        run_workload(name, workload, work / "w", fig, rng, sample=None, n_random=1 if quick else 2,
                     exhaustive_upto=0 if quick else 3, per_point=1 if quick else None, platform=platform)
    for i in range(long_runs):
        run_workload(f"long#{i}", long_workload(seed * 1000 + i, long_steps), work / "w", fig, rng,
                     sample=sample, n_random=2, exhaustive_upto=0, per_point=2 if quick else None,
                     platform=platform)
    return fig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="the default suite's form: every crash point of the small workloads with one state each "
                         "(taken in turn), one short long workload")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--long-runs", type=int, help="random long workloads (default 4, quick 1)")
    ap.add_argument("--long-steps", type=int, help="operations per long workload (default 16, quick 8)")
    ap.add_argument("--sample", type=int, help="crash points sampled per long workload (default 40, quick 8)")
    ap.add_argument("--platform", default=sys.platform,
                    help="whose barrier path to run and model: darwin (plain fsyncs in the drive's cache until an "
                         "F_FULLFSYNC) or any other (every fsync a barrier); default this machine's")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    t0 = time.perf_counter()
    # crash states are files this tool writes and opens, never needing to survive a crash:
    # on tmpfs, materialising one (a root's 256 shard directories) costs a tenth of a disk's
    shm = Path("/dev/shm")
    scratch = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="blockkv-powerloss-", dir=scratch) as tmp:
        fig = run(Path(tmp), quick=args.quick, seed=args.seed,
                  long_runs=args.long_runs if args.long_runs is not None else (1 if args.quick else 4),
                  long_steps=args.long_steps or (8 if args.quick else 16),
                  sample=args.sample or (8 if args.quick else 40), platform=args.platform)
    print(fig.table())
    print(fig.line() + f"  ({time.perf_counter() - t0:.0f} s)")
    for p in fig.problems[:20]:
        print("  problem:", p)
    return 0 if not (fig.lost or fig.wrong or fig.problems) else 1


if __name__ == "__main__":
    sys.exit(main())
