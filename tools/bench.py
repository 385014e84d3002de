"""blockkv benchmark: limits, mlx-lm baselines, blockkv, agent workload.

Every figure is measured in this run and every ratio is against a baseline
measured in this run. Caches are real mlx-lm ``KVCache`` objects of realistic
shapes holding random bf16 contents; prefixes share the exact same bytes so
deduplication is real.

    python tools/bench.py            # full mode: writes docs/benchmarks.{md,png,json}
    python tools/bench.py --quick --out DIR   # CI smoke run (< 1 min), writes only to DIR

Each measured concern is a module of ``tools/benchmarks/``; this file is the one
entry point: it runs them in order, checks the targets and writes the report,
and it is what the child processes of a run start (``--rss-child``,
``--moto-child``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

# tools/, for its benchmarks/ package: this file is run as a script, loaded by
# path (blockkv bench, the tests) and run again by the child processes it starts
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.agent_workload import bench_agent
from benchmarks.baselines import bench_limits, bench_mlx_load
from benchmarks.cli_start import bench_cli_start
from benchmarks.config import FULL, QUICK, Config
from benchmarks.entry_sizes import bench_sizes
from benchmarks.fresh_process import rss_child
from benchmarks.harness import REPO
from benchmarks.index import bench_index
from benchmarks.large_entries import bench_large, large_child
from benchmarks.remote import bench_remote, moto_child, remote_available
from benchmarks.report import machine, plot, remote_markdown, render_markdown
from benchmarks.restore_speed import bench_restore
from benchmarks.sources import KVSource
from benchmarks.store_speed import bench_writes
from benchmarks.targets import targets


def run(cfg: Config, out: Path, workdir: Path | None) -> dict[str, Any]:
    """Every section of one benchmark run; writes benchmarks.{json,md,png} into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="blockkv-bench-", dir=workdir))
    t_start = time.perf_counter()
    try:
        src = KVSource.random(cfg.shape, cfg.prefix_tokens + cfg.new_tokens, seed=0)
        r: dict[str, Any] = {
            "mode": cfg.mode,
            "config": asdict(cfg),
            "machine": machine(),
        }
        sections: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            (
                "limits",
                lambda: bench_limits(src.raw_bytes(cfg.prefix_tokens), work, cfg.reps),
            ),
            ("writes", lambda: bench_writes(cfg, src, work)),
            ("mlx", lambda: bench_mlx_load(src, work, cfg.reps)),
            ("restore", lambda: bench_restore(cfg, src, work)),
            ("sizes", lambda: bench_sizes(cfg, work)),
            ("large", lambda: bench_large(cfg, work)),
            ("agent", lambda: bench_agent(cfg, work)),
            ("index", lambda: bench_index(cfg, work)),
            ("start", lambda: bench_cli_start(cfg, work)),
            ("remote", lambda: bench_remote(cfg, work)),
        ]
        for name, fn in sections:
            t0 = time.perf_counter()
            r[name] = fn()
            print(
                f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    r["targets"] = [{**asdict(t), "met": t.met} for t in targets(cfg, r)]
    r["wall_s"] = time.perf_counter() - t_start
    (out / "benchmarks.json").write_text(json.dumps(r, indent=2) + "\n")
    md = out / "benchmarks.md"
    md.write_text(render_markdown(cfg, r, md.read_text() if md.exists() else ""))
    plot(r, out / "benchmarks.png")
    return r


def run_remote_only(cfg: Config, out: Path, workdir: Path | None) -> int:
    """The scale-out section alone (it needs none of the others): its JSON, and
    its markdown on stdout to place in benchmarks.md where a full run puts it."""
    if not remote_available():
        print("needs obstore and moto: pip install 'blockkv[test]'", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="blockkv-bench-", dir=workdir))
    try:
        rm = bench_remote(cfg, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    report = {"mode": cfg.mode, "machine": machine(), "remote": rm}
    (out / "benchmarks-remote.json").write_text(json.dumps(report, indent=2) + "\n")
    print("\n".join(remote_markdown(cfg, rm)))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python tools/bench.py [--quick] [--out DIR] [--workdir DIR]``; also ``blockkv bench``."""
    parser = argparse.ArgumentParser(
        prog="blockkv bench", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes, < 1 min (CI); needs --out"
    )
    parser.add_argument(
        "--out", type=Path, help="output directory (full mode default: docs/)"
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        help="where the scratch stores live (default: system temp)",
    )
    parser.add_argument(
        "--only-remote",
        action="store_true",
        help="run only the scale-out section: writes benchmarks-remote.json to --out and prints its "
        "markdown section (benchmarks.md is left alone)",
    )
    parser.add_argument("--rss-child", help=argparse.SUPPRESS)
    parser.add_argument("--moto-child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rss_child:
        spec = json.loads(args.rss_child)
        print(json.dumps(large_child(spec) if spec["kind"] == "large" else rss_child(spec)))
        return 0
    if args.moto_child:
        return moto_child(args.moto_child)
    if args.only_remote:
        return run_remote_only(QUICK if args.quick else FULL, args.out or REPO / "docs", args.workdir)
    if args.quick and args.out is None:
        parser.error("--quick writes only to --out DIR")
    cfg = QUICK if args.quick else FULL
    r = run(cfg, args.out or REPO / "docs", args.workdir)
    for t in r["targets"]:
        print(
            f"{'ok  ' if t['met'] else 'MISS'} {t['name']}: {t['value']:.3f} {t['unit']} ({t['op']} {t['bound']:g})"
        )
    print(
        f"wall {r['wall_s']:.0f} s; wrote {args.out or REPO / 'docs'}/benchmarks.{{md,json,png}}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
