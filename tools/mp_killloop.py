"""Multi-process kill -9 loop: several worker processes share one cache root
and run a random store/restore/remove/evict/gc workload (``gc_grace=0``)
while one more process loops ``check(repair=True)``; the parent SIGKILLs a
random worker at random moments and restarts it, and verifies — while the
workers run and once more at the end — that every acknowledged entry (store
returned True, not removed or evicted since) is found by a fresh handle and
restores bit-exact.

Each worker appends what it does to its own journal file, one fsync'd JSON
line per fact: ``storing`` before a store, ``stored`` after it returned True
(so a line is never a lie: a store acknowledged but killed before its line is
merely not checked), ``removing``/``evicting`` before a removal (so the
verifier never counts a legitimate removal as a loss) and ``evicted`` with
what ``evict_to`` returned. Entries are synthetic ``KVCache`` objects whose
tensors are regenerated from the seeds in the journal. Workers share a few
prompt prefixes (the blocks of a shared prefix are written by whichever
worker gets there first and reused by the others) and store each entry in
their own namespace with a unique suffix, so no worker's store replaces or
supersedes another's entry.

    python tools/mp_killloop.py --kills 200                   # the full run (docs/reliability.md)
    python tools/mp_killloop.py --kills 4 --seconds 40        # about what CI runs
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from blockkv.store import BlockStore
from blockkv.testing.stateful import live_bits

BLOCK_TOKENS = 16
PREFIX_MAX = 256  # a shared prefix is generated at this length and cut, so every cut shares its rows
PREFIXES = 6  # how many shared prompt prefixes the workers draw from
BUDGET = 24 << 20  # workers evict down to this: verification stays quick however long the run
PARAMS = dict(model_id="tiny-mp", config_fingerprint="fp-mp-kill", tokenizer_hash="tok", max_bytes=1 << 40,
              block_tokens=BLOCK_TOKENS, gc_grace=0.0)


# -- synthetic caches, regenerated from seeds -----------------------------------------


def _rows(seed: int, n: int, layers: int, heads: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` tokens and their key/value rows (float32), all from ``seed``."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 1 << 31, n, dtype=np.int64)
    return tokens, rng.standard_normal((layers, 2, heads, n, dim), dtype=np.float32)


def synthetic_entry(prefix_seed: int, prefix_len: int, suffix_seed: int, suffix_len: int, *,
                    layers: int = 2, heads: int = 2, dim: int = 32) -> tuple[list[int], list[KVCache]]:
    """Tokens and bf16 ``KVCache`` layers of a prompt made of the first
    ``prefix_len`` tokens of shared prefix ``prefix_seed`` and ``suffix_len``
    tokens of its own (``suffix_seed``). Entries cut from one prefix share its
    rows bit for bit, so they share its blocks; no forward pass is needed."""
    if not 0 <= prefix_len <= PREFIX_MAX:
        raise ValueError(f"prefix_len must be in [0, {PREFIX_MAX}], got {prefix_len}")
    p_tok, p_kv = _rows(prefix_seed, PREFIX_MAX, layers, heads, dim)
    s_tok, s_kv = _rows(suffix_seed, suffix_len, layers, heads, dim)
    tokens = np.concatenate([p_tok[:prefix_len], s_tok]).tolist()
    kv = np.concatenate([p_kv[..., :prefix_len, :], s_kv], axis=-2)
    caches = []
    for layer in range(layers):
        cache = KVCache()
        cache.update_and_fetch(mx.array(kv[layer, 0][None]).astype(mx.bfloat16),
                               mx.array(kv[layer, 1][None]).astype(mx.bfloat16))
        caches.append(cache)
    mx.eval([c.keys for c in caches] + [c.values for c in caches])
    return tokens, caches


def spec_entry(spec: dict[str, Any]) -> tuple[list[int], list[KVCache]]:
    return synthetic_entry(spec["prefix"], spec["plen"], spec["suffix"], spec["slen"])


def same_bits(caches: list[Any], expected: list[Any]) -> bool:
    return len(caches) == len(expected) and all(live_bits(a) == live_bits(b) for a, b in zip(caches, expected))


# -- the journal -------------------------------------------------------------------------------


class Journal:
    """Append-only facts of one worker incarnation, each line fsync'd before
    the worker goes on (a kill can tear only the last line, never lose one)."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def write(self, **fact: Any) -> None:
        os.write(self._fd, (json.dumps({**fact, "t": time.time()}) + "\n").encode())
        os.fsync(self._fd)


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    for line in path.read_text().splitlines():
        if line.endswith("}"):  # a line torn by the kill was never a fact
            yield json.loads(line)


@dataclass
class Facts:
    """What the journals say so far."""

    acknowledged: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> spec and ack time
    gone: set[str] = field(default_factory=set)  # removed or (maybe) evicted by a worker
    open_evicts: list[float] = field(default_factory=list)  # start times of evicts with no result (killed or running)
    wrong: list[str] = field(default_factory=list)  # workers' own restores that came back with other bits


def read_journals(directory: Path) -> Facts:
    facts = Facts()
    for path in sorted(directory.glob("*.jsonl")):
        evicting: float | None = None
        for fact in _lines(path):
            op = fact["op"]
            if op == "stored":
                facts.acknowledged[fact["id"]] = fact
            elif op == "removing":
                facts.gone.add(fact["id"])
            elif op == "evicting":
                facts.gone.update(fact["ids"])
                evicting = fact["t"]
            elif op == "evicted":
                facts.gone.update(fact["ids"])
                evicting = None
            elif op == "wrong":
                facts.wrong.append(fact["id"])
        if evicting is not None:
            facts.open_evicts.append(evicting)
    return facts


# -- the processes ----------------------------------------------------------------------------------


def _open(root: Path) -> BlockStore:
    return BlockStore(root, **PARAMS)  # type: ignore[arg-type]


def store_one(store: BlockStore, journal: Journal, rng: random.Random, ns: str) -> tuple[str, dict[str, Any]] | None:
    """Store a new entry in ``ns`` on one of the shared prefixes, journalled
    (``storing`` before, ``stored`` once acknowledged); its id and spec, or None."""
    spec = {"ns": ns, "prefix": rng.randrange(PREFIXES),
            "plen": BLOCK_TOKENS * rng.randint(0, PREFIX_MAX // BLOCK_TOKENS),
            "suffix": rng.randrange(1 << 62), "slen": rng.randint(1, 3 * BLOCK_TOKENS)}
    tokens, caches = spec_entry(spec)
    journal.write(op="storing", **spec)
    if store.store(tokens, caches, ns):
        match = store.find_exact(tokens, ns)
        if match is not None:
            journal.write(op="stored", id=match.entry.id, **spec)
            return match.entry.id, spec
    return None


def worker(root: Path, journal_path: Path, slot: int, seed: int) -> None:
    """The workload of one worker; its entries live in namespace ``w<slot>``."""
    logging.disable(logging.WARNING)
    rng = random.Random(seed)
    journal = Journal(journal_path)
    ns = f"w{slot}"
    mine: dict[str, dict[str, Any]] = {}  # this incarnation's acknowledged entries
    store = _open(root)
    journal.write(op="ready")
    while True:
        op = rng.choices(("store", "restore", "remove", "evict", "gc"), (6, 3, 1, 0.4, 1))[0]
        if op == "store":
            stored = store_one(store, journal, rng, ns)
            if stored is not None:
                mine[stored[0]] = stored[1]
        elif op == "restore" and mine:
            entry_id, spec = rng.choice(list(mine.items()))
            tokens, expected = spec_entry(spec)
            match = store.find_exact(tokens, ns)
            if match is not None and match.entry.id == entry_id:
                loaded = store.restore(match.entry)
                if loaded is not None and not same_bits(loaded.caches, expected):
                    journal.write(op="wrong", id=entry_id)
        elif op == "remove":
            own = [e for e in store.entries() if e.ns == ns]
            if own:
                victim = rng.choice(own)
                journal.write(op="removing", id=victim.id)
                store.remove(victim)
                mine.pop(victim.id, None)
        elif op == "evict":
            target = min(int(store.total_bytes * rng.uniform(0.5, 0.95)), BUDGET)
            journal.write(op="evicting", ids=[e.id for e in store.evict_plan(target)])
            journal.write(op="evicted", ids=[e.id for e in store.evict_to(target)])
        elif op == "gc":
            store.gc()


def repairer(root: Path) -> None:
    """check(repair=True) in a loop, as an operator's cron job might (too often)."""
    logging.disable(logging.WARNING)
    store = _open(root)
    while True:
        store.check(repair=True)
        time.sleep(0.05)


# -- the parent ------------------------------------------------------------------------------------


@dataclass
class Figures:
    kills: int = 0
    restarts: int = 0
    acknowledged: int = 0
    verified: int = 0  # restores checked bit-exact (summed over every verification round)
    rounds: int = 0
    excused: int = 0  # missing, but a removal, an eviction or an interrupted evict accounts for it
    lost: int = 0
    wrong: int = 0
    problems: list[str] = field(default_factory=list)


def verify(root: Path, journals: Path, fig: Figures, checked: set[str]) -> None:
    """Every acknowledged entry not removed or evicted must be found and restore
    bit-exact. Safe while workers run: the journals are read again before a
    missing entry counts as lost, and a removal is journalled before it happens."""
    facts = read_journals(journals)
    missing = []
    with _open(root) as store:
        for entry_id, spec in facts.acknowledged.items():
            if entry_id in facts.gone:
                continue
            tokens, expected = spec_entry(spec)
            match = store.find_exact(tokens, spec["ns"])
            loaded = store.restore(match.entry) if match is not None and match.entry.id == entry_id else None
            if loaded is None:
                missing.append(entry_id)
            elif not same_bits(loaded.caches, expected):
                fig.wrong += 1
                fig.problems.append(f"entry {entry_id} restored wrong bits")
            else:
                fig.verified += 1
    after = read_journals(journals)
    for entry_id in missing:
        ack = after.acknowledged[entry_id]["t"]
        if entry_id in after.gone or any(t >= ack for t in after.open_evicts):
            fig.excused += 1
        else:
            fig.lost += 1
            fig.problems.append(f"lost acknowledged entry {entry_id}")
    for entry_id in set(after.wrong) - checked:
        fig.wrong += 1
        fig.problems.append(f"a worker restored entry {entry_id} with wrong bits")
    checked.update(after.wrong)
    fig.acknowledged = len(after.acknowledged)
    fig.rounds += 1


def _spawn(args: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, __file__, *args], stdin=subprocess.DEVNULL)


def _ready(journal: Path) -> bool:
    try:
        return any(f["op"] == "ready" for f in _lines(journal))
    except FileNotFoundError:
        return False


def run(kills: int, workers: int, seed: int, root: Path, seconds: float | None = None,
        kill_every: float = 1.0, verify_every: float = 15.0) -> Figures:
    """Run until ``kills`` SIGKILLs (or ``seconds``, whichever comes first), then verify."""
    rng = random.Random(seed)
    fig = Figures()
    journals = root.parent / f"{root.name}-journals"
    journals.mkdir(exist_ok=True)
    _open(root).close()  # create the directory once, before anyone races to
    incarnation = 0
    procs: dict[int, tuple[subprocess.Popen[bytes], Path]] = {}

    def start(slot: int) -> None:
        nonlocal incarnation
        incarnation += 1
        path = journals / f"w{slot}-{incarnation}.jsonl"
        procs[slot] = (_spawn(["--worker", str(root), "--journal", str(path), "--slot", str(slot),
                               "--seed", str(rng.randrange(1 << 30))]), path)

    checked: set[str] = set()
    fixer = _spawn(["--repairer", str(root)])
    try:
        for slot in range(workers):
            start(slot)
        t0 = last_verify = time.monotonic()
        while fig.kills < kills and (seconds is None or time.monotonic() - t0 < seconds):
            time.sleep(rng.uniform(0.2, 2 * kill_every))
            for slot, (proc, _) in list(procs.items()):
                if proc.poll() is not None:  # a worker must never die on its own
                    fig.problems.append(f"worker {slot} exited with {proc.returncode}")
                    start(slot)
                    fig.restarts += 1
            if fixer.poll() is not None:
                fig.problems.append(f"the repair loop exited with {fixer.returncode}")
                fixer = _spawn(["--repairer", str(root)])
            busy = [slot for slot, (_, path) in procs.items() if _ready(path)]
            if busy:
                slot = rng.choice(busy)
                proc = procs[slot][0]
                proc.send_signal(signal.SIGKILL)
                if proc.wait() != -signal.SIGKILL:  # it had died on its own just before
                    fig.problems.append(f"worker {slot} exited with {proc.returncode}")
                fig.kills += 1
                start(slot)
                fig.restarts += 1
            if time.monotonic() - last_verify > verify_every:
                verify(root, journals, fig, checked)
                last_verify = time.monotonic()
    finally:
        for proc in [fixer, *(p for p, _ in procs.values())]:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    verify(root, journals, fig, checked)
    with _open(root) as store:
        report = store.check()
        if report.dangling:
            fig.problems.append(f"dangling entries after the run: {report.dangling}")
        store.check(repair=True)
        after = store.check()
        if not after.clean:
            fig.problems.append(f"check(repair=True) left findings: {after.to_json()}")
    return fig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=200)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seconds", type=float, help="stop after this long even if fewer kills were made")
    ap.add_argument("--kill-every", type=float, default=1.0, help="mean seconds between kills")
    ap.add_argument("--verify-every", type=float, default=15.0, help="seconds between verifications while running")
    ap.add_argument("--root", type=Path, help="cache root (default: a fresh temporary directory)")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--journal", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--slot", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--repairer", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.journal, args.slot, args.seed)
        return 0
    if args.repairer:
        repairer(args.repairer)
        return 0
    if args.workers < 1 or args.kills < 0:
        ap.error("--workers must be >= 1 and --kills >= 0")
    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="blockkv-mpkill-") as tmp:
        t0 = time.monotonic()
        fig = run(args.kills, args.workers, args.seed, args.root or Path(tmp) / "cache", args.seconds,
                  args.kill_every, args.verify_every)
    print(f"workers {args.workers}  kills {fig.kills}  restarts {fig.restarts}  acknowledged {fig.acknowledged}  "
          f"verified {fig.verified} (in {fig.rounds} rounds)  excused {fig.excused}  lost {fig.lost}  "
          f"wrong {fig.wrong}  ({time.monotonic() - t0:.0f} s)")
    losses = [p for p in fig.problems if p.startswith("lost ")]  # counted above: other problems first
    for p in ([p for p in fig.problems if p not in losses] + losses)[:20]:
        print("  problem:", p)
    return 0 if not (fig.lost or fig.wrong or fig.problems) else 1


if __name__ == "__main__":
    sys.exit(main())
