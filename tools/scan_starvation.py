"""Scanning readers against a writer: processes loop the entry scan that
``blockkv ls`` and ``stats`` run (``read_directory``) on a root of many
entries while one more process stores, and every store's latency is taken.

    python tools/scan_starvation.py --entries 3000 --scanners 8 --stores 20
    python tools/scan_starvation.py --entries 3000 --scanners 8 --stores 20 --serve

The writer is the tool's own ``BlockStore``, or with ``--serve`` a ``blockkv
serve`` (re)started behind the scanners on that root, driven by the
``openai`` client: whether its disk tier opened, and for each chat, the
time from its answer to its entry on disk (``/metrics``' spills, polled
every 20 ms: serve stores write-behind). Prints how many stores landed,
their latency (p50, p99, max) and how many scans the scanners completed
meanwhile (docs/benchmarks.md, "Scanners against a writer", has the runs).
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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from blockkv import BlockStore
from blockkv.testing.models import prefill, random_tokens, tiny_model

IDENT = dict(model_id="m", config_fingerprint="fp-scan", tokenizer_hash="t", max_bytes=1 << 40, block_tokens=16)
BOUND = 300.0  # a safety bound on a served store (not a timing claim)

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


def build(root: Path, entries: int, options: dict[str, Any]) -> Path:
    """``entries`` small entries sharing one 16-token prefix (quick to store,
    many rows to scan), in a store opened with ``options``; its directory."""
    model = tiny_model("llama")
    with BlockStore(root, **options) as store:
        for seed in range(entries):
            tokens = random_tokens(16, seed=0) + random_tokens(8, seed=10_000 + seed)
            if not store.store(tokens, prefill(model, tokens)[0]):
                raise SystemExit(f"building the root: store {seed} failed")
        return store.directory


@contextmanager
def scanning(directory: Path, count: int) -> Iterator[list[int]]:
    """``count`` scanner processes looping over ``directory`` (all scanning on
    entry); the list is filled with each one's scans on exit."""
    stop = directory.parent / "stop"
    scanners = [subprocess.Popen([sys.executable, "-c", _SCANNER, str(directory), str(stop)],
                                 stdout=subprocess.PIPE, text=True) for _ in range(count)]
    scans: list[int] = []
    try:
        for p in scanners:
            assert p.stdout is not None and p.stdout.readline().strip() == "scanning"
        yield scans
        stop.touch()
        scans += [int(p.stdout.readline()) for p in scanners if p.stdout is not None]
    finally:
        for p in scanners:
            p.kill()
            p.wait()


def library_stores(root: Path, count: int) -> list[float | None]:
    """``count`` stores by this process's own handle: each one's seconds (None: not stored)."""
    model = tiny_model("llama")
    took: list[float | None] = []
    with BlockStore(root, **IDENT) as store:
        for i in range(count):
            tokens = random_tokens(40, seed=50_000 + i)
            caches = prefill(model, tokens)[0]
            t = time.monotonic()
            landed = store.store(tokens, caches)
            took.append(time.monotonic() - t if landed else None)
    return took


def served_stores(model: Path, root: Path, count: int) -> list[float | None]:
    """``blockkv serve`` started on ``root``, then ``count`` chats: for each, the
    seconds from its answer to its entry on disk (None: the spill failed)."""
    from blockkv.model_dir import sample_text
    from blockkv.testing.fleet_processes import Process
    from blockkv.testing.stopped import scrape
    from blockkv.testing.streams import no_eos_bias, stream_chat

    node = Process(["serve", "--model", str(model), "--cache-dir", str(root)], root.parent / "serve.log")
    try:
        node.wait_ready()
        print(f"serve's disk tier: {node.get('/blockkv/health')['disk_tier']}", flush=True)
        took: list[float | None] = []
        for i in range(count):
            before = scrape(node.url, BOUND)
            stream_chat(node.url, "none", [{"role": "user", "content": sample_text(300, seed=i)}], 4,
                        no_eos_bias(model))
            answered, deadline = time.monotonic(), time.monotonic() + BOUND
            while (now := scrape(node.url, BOUND))["blockkv_spills_total"] == before["blockkv_spills_total"]:
                if now["blockkv_spill_failures_total"] > before["blockkv_spill_failures_total"]:
                    break
                assert time.monotonic() < deadline, "a spill neither landed nor failed"
                time.sleep(0.02)
            landed = now["blockkv_spills_total"] > before["blockkv_spills_total"]
            took.append(time.monotonic() - answered if landed else None)
        return took
    finally:
        node.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=3000)
    parser.add_argument("--scanners", type=int, default=8)
    parser.add_argument("--stores", type=int, default=20)
    parser.add_argument("--serve", action="store_true", help="the writer is a blockkv serve started behind them")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root, options, model = Path(tmp) / "root", IDENT, None
        if args.serve:
            from blockkv.model_dir import build_model_dir
            from blockkv.testing.stopped import serve_store_options

            model = build_model_dir(Path(tmp) / "model", "llama")
            options = serve_store_options(model)
        t0 = time.monotonic()
        directory = build(root, args.entries, options)
        print(f"built {args.entries} entries in {time.monotonic() - t0:.0f} s", flush=True)
        with scanning(directory, args.scanners) as scans:
            took = served_stores(model, root, args.stores) if model else library_stores(root, args.stores)
    landed = sorted(t for t in took if t is not None)
    if landed:
        p99 = landed[min(len(landed) - 1, round(0.99 * (len(landed) - 1)))]
        print(f"{len(landed)}/{args.stores} stores landed beside {args.scanners} scanners on {args.entries} "
              f"entries; latency p50 {statistics.median(landed):.3f} s, p99 {p99:.3f} s, max {landed[-1]:.3f} s; "
              f"{sum(scans)} scans meanwhile")
    else:
        print(f"0/{args.stores} stores landed")
    return 0 if len(landed) == args.stores else 1


if __name__ == "__main__":
    raise SystemExit(main())
