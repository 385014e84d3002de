"""Scanning readers against a writer: processes loop the entry scan that
``blockkv ls`` and ``stats`` run (``read_directory``) on a root of many
entries while one more process stores, and every store's latency is taken.

    python tools/scan_starvation.py --entries 3000 --scanners 8 --stores 20

Prints how many stores landed, their latency (p50, p99, max) and how many
scans the scanners completed meanwhile (docs/benchmarks.md, "Scanners
against a writer", has the runs).
Real caches from a tiny random-weight llama (``blockkv.testing``), real
processes; nothing is mocked.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from blockkv import BlockStore
from blockkv.testing.models import prefill, random_tokens, tiny_model

IDENT = dict(model_id="m", config_fingerprint="fp-scan", tokenizer_hash="t", max_bytes=1 << 40, block_tokens=16)

_SCANNER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from blockkv.local.reader import read_directory
    directory, stop = Path(sys.argv[1]), Path(sys.argv[2])
    scans = 0
    while not stop.exists():
        read_directory(directory)
        scans += 1
        if scans == 1:
            print("scanning", flush=True)
    print(scans, flush=True)
""")


def build(root: Path, entries: int) -> None:
    """``entries`` small entries sharing one 16-token prefix (quick to store, many rows to scan)."""
    model = tiny_model("llama")
    with BlockStore(root, **IDENT) as store:
        for seed in range(entries):
            tokens = random_tokens(16, seed=0) + random_tokens(8, seed=10_000 + seed)
            if not store.store(tokens, prefill(model, tokens)[0]):
                raise SystemExit(f"building the root: store {seed} failed")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=3000)
    parser.add_argument("--scanners", type=int, default=8)
    parser.add_argument("--stores", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.monotonic()
        build(root, args.entries)
        print(f"built {args.entries} entries in {time.monotonic() - t0:.0f} s", flush=True)
        model = tiny_model("llama")
        with BlockStore(root, **IDENT) as store:
            stop = root / "stop"
            scanners = [subprocess.Popen([sys.executable, "-c", _SCANNER, str(store.directory), str(stop)],
                                         stdout=subprocess.PIPE, text=True) for _ in range(args.scanners)]
            try:
                for p in scanners:
                    assert p.stdout is not None and p.stdout.readline().strip() == "scanning"
                took, landed = [], 0
                for i in range(args.stores):
                    tokens = random_tokens(40, seed=50_000 + i)
                    caches = prefill(model, tokens)[0]
                    t = time.monotonic()
                    landed += store.store(tokens, caches)
                    took.append(time.monotonic() - t)
                stop.touch()
                scans = [int(p.stdout.readline()) for p in scanners if p.stdout is not None]
            finally:
                for p in scanners:
                    p.kill()
                    p.wait()
    took.sort()
    p99 = took[min(len(took) - 1, round(0.99 * (len(took) - 1)))]
    print(f"{landed}/{args.stores} stores landed beside {args.scanners} scanners on {args.entries} entries; "
          f"latency p50 {statistics.median(took):.3f} s, p99 {p99:.3f} s, max {took[-1]:.3f} s; "
          f"{sum(scans)} scans meanwhile")
    return 0 if landed == args.stores else 1


if __name__ == "__main__":
    raise SystemExit(main())
