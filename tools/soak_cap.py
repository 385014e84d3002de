"""Soak the byte cap: agent sessions stored as fast as the store takes them,
from several threads, into one store with a small ``--cache-bytes``-style cap,
while a sampler measures what the fingerprint directory holds on disk
(headers and blocks, blocks waiting out their gc grace included).

    python tools/soak_cap.py --seconds 120 --cap 24M --writers 3

Prints the peak and mean of held bytes against the cap, the entries evicted,
and what is left unreferenced at the end (no gc run). Real caches
from a tiny random-weight llama (``blockkv.testing``); nothing is mocked.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

from blockkv import BlockStore
from blockkv.human import format_size, parse_cap
from blockkv.testing.models import prefill, random_tokens, tiny_model


def held_bytes(directory: Path) -> int:
    """Headers and block files, as the file system says (what --cache-bytes bounds)."""
    total = 0
    for p in directory.rglob("*"):
        try:
            if p.is_file() and ("blobs" in p.parts or p.suffix == ".bkv"):
                total += p.stat().st_size
        except FileNotFoundError:
            continue  # deleted while we looked
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--cap", type=parse_cap, default=parse_cap("24M"))
    parser.add_argument("--writers", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=512, help="a system prompt every session shares")
    parser.add_argument("--turn-tokens", type=int, default=256, help="tokens each turn adds")
    args = parser.parse_args()
    model = tiny_model("llama")
    system = random_tokens(args.system_tokens, seed=1)
    samples: list[int] = []
    stop = threading.Event()
    with tempfile.TemporaryDirectory() as tmp, BlockStore(
        tmp, model_id="soak", config_fingerprint="soak", tokenizer_hash="t", max_bytes=args.cap
    ) as store:
        directory = store.directory
        lock = threading.Lock()
        stored = [0]

        def writer(w: int) -> None:
            session, turn = 0, 0
            tokens = list(system)
            while not stop.is_set():
                tokens += random_tokens(args.turn_tokens, seed=w * 1_000_003 + session * 1009 + turn)
                with lock:  # one forward pass at a time: mlx on 2 cores
                    caches, _ = prefill(model, tokens)
                if store.store(tokens, caches, ns=f"writer-{w}"):
                    stored[0] += 1
                turn += 1
                if turn == 6:  # a new session: back to the shared system prompt
                    session, turn, tokens = session + 1, 0, list(system)

        def sampler() -> None:
            while not stop.is_set():
                samples.append(held_bytes(directory))
                time.sleep(0.2)

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(args.writers)]
        threads.append(threading.Thread(target=sampler))
        for t in threads:
            t.start()
        time.sleep(args.seconds)
        stop.set()
        for t in threads:
            t.join()
        counters = store.counters()
        entries = len(store)
        left = held_bytes(directory) - store.total_bytes  # blocks no entry references, after the last store
    peak, mean = max(samples), statistics.fmean(samples)
    print(f"{args.seconds:g} s, {args.writers} writers, cap {format_size(args.cap)}: {stored[0]} entries stored "
          f"({format_size(int(counters['bytes_written']))} written), {int(counters['evictions'])} evicted, "
          f"{entries} kept")
    print(f"held on disk: peak {format_size(peak)} ({peak / args.cap:.2f}x the cap), "
          f"mean {format_size(int(mean))} ({mean / args.cap:.2f}x), {len(samples)} samples; "
          f"unreferenced at the end: {format_size(left)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
