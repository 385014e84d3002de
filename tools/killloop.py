"""kill -9 loop: a child process runs a random store/remove/evict/gc workload
and reports every acknowledged store; the parent SIGKILLs it at a random
moment, reopens the root and verifies that every acknowledged entry (not
removed, superseded or evicted) is found and restores bit-exact, nothing
dangles, and ``check(repair=True)`` leaves a clean report.

    python tools/killloop.py --kills 200            # the full run (docs/reliability.md)
    python tools/killloop.py --kills 3 --seed 1     # what CI runs
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
from dataclasses import dataclass, field
from pathlib import Path

from blockkv.store import BlockStore
from blockkv.testing.reference import ModelEntry, ReferenceStore
from blockkv.testing.stateful import live_bits
from blockkv.testing.strategies import make_caches

KINDS = ("llama", "gemma3", "mamba", "chunked")
NAMESPACES = ("", "adapter:a")
PARAMS = dict(model_id="tiny", config_fingerprint="fp-kill", tokenizer_hash="tok", max_bytes=1 << 40, block_tokens=4,
              gc_grace=0.0)


def _open(root: Path) -> BlockStore:
    return BlockStore(root, **PARAMS)  # type: ignore[arg-type]


def _emit(msg: dict) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def child(root: Path, seed: int) -> None:
    """The workload. Each line on stdout is a fact the parent may rely on."""
    logging.disable(logging.WARNING)
    rng = random.Random(seed)
    store = _open(root)
    systems = [[rng.randrange(256) for _ in range(rng.randint(2, 9))] for _ in range(3)]
    _emit({"op": "ready"})
    while True:
        op = rng.choices(("store", "remove", "evict", "gc"), (8, 2, 1, 1))[0]
        entries = store.entries()
        if op == "store":
            base = list(rng.choice(entries).tokens) if entries and rng.random() < 0.6 else rng.choice(systems)
            tokens = base[: rng.randint(1, len(base))] + [rng.randrange(256) for _ in range(rng.randint(1, 8))]
            spec = {"tokens": tokens, "ns": rng.choice(NAMESPACES), "kind": rng.choice(KINDS),
                    "seed": rng.randrange(2)}
            _emit({"op": "storing", **spec})
            ok = store.store(tokens, make_caches(spec["kind"], tokens, spec["seed"]), spec["ns"])
            if ok:
                e = store.find_exact(tokens, spec["ns"]).entry  # type: ignore[union-attr]
                _emit({"op": "stored", "id": e.id, "trimmable": e.trimmable,
                       "mro": e.minimum_reusable_offset, **spec})
        elif op == "remove" and entries:
            e = rng.choice(entries)
            _emit({"op": "removing", "id": e.id})
            store.remove(e)
        elif op == "evict" and entries:
            target = int(store.total_bytes * rng.uniform(0.3, 0.9))
            _emit({"op": "evicting", "ids": [e.id for e in store.evict_plan(target)]})
            store.evict_to(target)
        else:
            store.gc()


@dataclass
class Figures:
    iterations: int = 0
    kills: int = 0
    acknowledged: int = 0
    verified: int = 0
    lost: int = 0
    wrong: int = 0
    problems: list[str] = field(default_factory=list)


def _apply(model: ReferenceStore, specs: dict[str, dict], maybe_gone: set[str], msg: dict) -> None:
    """Replay one reported fact into the model."""
    if msg["op"] == "stored":
        entry = ModelEntry(id=msg["id"], ns=msg["ns"], tokens=tuple(msg["tokens"]), trimmable=msg["trimmable"],
                           minimum_reusable_offset=msg["mro"])
        model.store(entry, 1 << 62)
        specs[msg["id"]] = msg
    elif msg["op"] == "removing":
        maybe_gone.add(msg["id"])
    elif msg["op"] == "evicting":
        maybe_gone.update(msg["ids"])


def _in_flight_victims(model: ReferenceStore, msg: dict) -> set[str]:
    """Entries an unacknowledged store may have replaced or superseded before the kill."""
    tokens = tuple(msg["tokens"])
    trimmable = all(c.is_trimmable() for c in make_caches(msg["kind"], tokens, msg["seed"]))
    return {e.id for e in model.entries() if e.ns == msg["ns"] and len(e.tokens) <= len(tokens)
            and tokens[: len(e.tokens)] == e.tokens and (trimmable or e.tokens == tokens)}


def verify(root: Path, model: ReferenceStore, specs: dict[str, dict], maybe_gone: set[str], fig: Figures) -> None:
    """Reopen after a kill and check every acknowledged entry."""
    with _open(root) as store:
        report = store.check()
        if report.dangling or any(idx < truth for _, idx, truth in report.refcount_mismatches):
            fig.problems.append(f"check after kill: dangling={report.dangling} refs={report.refcount_mismatches}")
        for e in list(model.entries()):
            m = store.find_exact(e.tokens, e.ns)
            if m is None or m.entry.id != e.id:
                model.remove(e.id)
                if e.id not in maybe_gone:
                    fig.lost += 1
                    fig.problems.append(f"lost acknowledged entry {e.id}")
                continue
            spec = specs[e.id]
            loaded = store.restore(m.entry)
            want = tuple(live_bits(c) for c in make_caches(spec["kind"], e.tokens, spec["seed"]))
            if loaded is None or tuple(live_bits(c) for c in loaded.caches) != want:
                fig.wrong += loaded is not None
                fig.lost += loaded is None
                fig.problems.append(f"entry {e.id} restored {'wrong' if loaded else 'nothing'}")
            else:
                fig.verified += 1
        store.check(repair=True)
        after = store.check()
        if not after.clean:
            fig.problems.append(f"check(repair=True) left findings: {after.to_json()}")
        live = {e.id for e in store.entries()}
    for e in list(model.entries()):  # forget what the store legitimately dropped
        if e.id not in live:
            model.remove(e.id)
    maybe_gone.clear()


def run(kills: int, seed: int, root: Path, max_delay: float) -> Figures:
    rng = random.Random(seed)
    model = ReferenceStore()
    specs: dict[str, dict] = {}
    maybe_gone: set[str] = set()
    fig = Figures()
    while fig.kills < kills:
        fig.iterations += 1
        proc = subprocess.Popen([sys.executable, __file__, "--child", str(root), "--seed", str(rng.randrange(1 << 30))],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        ready = proc.stdout.readline()
        if not ready:
            fig.problems.append(f"child died before ready (rc={proc.wait()})")
            break
        time.sleep(rng.uniform(0.0, max_delay))
        os.kill(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        fig.kills += proc.returncode == -signal.SIGKILL
        in_flight = None
        for line in out.splitlines():
            if not line.endswith("}"):
                continue  # a line torn by the kill was never a fact
            msg = json.loads(line)
            in_flight = msg if msg["op"] == "storing" else None if msg["op"] == "stored" else in_flight
            if msg["op"] == "stored":
                fig.acknowledged += 1
            _apply(model, specs, maybe_gone, msg)
        if in_flight is not None:
            maybe_gone |= _in_flight_victims(model, in_flight)
        verify(root, model, specs, maybe_gone, fig)
    return fig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-delay", type=float, default=1.5, help="longest run before a kill, seconds")
    ap.add_argument("--root", type=Path, help="cache root (default: a fresh temporary directory)")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.seed)
        return 0
    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="blockkv-kill-") as tmp:
        fig = run(args.kills, args.seed, args.root or Path(tmp), args.max_delay)
    print(f"iterations {fig.iterations}  kills {fig.kills}  acknowledged {fig.acknowledged}  "
          f"verified {fig.verified}  lost {fig.lost}  wrong {fig.wrong}")
    for p in fig.problems[:20]:
        print("  problem:", p)
    return 0 if not (fig.lost or fig.wrong or fig.problems) else 1


if __name__ == "__main__":
    sys.exit(main())
