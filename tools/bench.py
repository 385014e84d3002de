"""blockkv benchmark (issue #5): limits, mlx-lm baselines, blockkv, agent workload.

Every figure is measured in this run and every ratio is against a baseline
measured in this run. Caches are real mlx-lm ``KVCache`` objects of realistic
shapes holding random bf16 contents; prefixes share the exact same bytes so
deduplication is real.

    python tools/bench.py            # full mode: writes docs/benchmarks.{md,png,json}
    python tools/bench.py --quick --out DIR   # CI smoke run (< 1 min), writes only to DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

# tools/, for its benchmarks/ package: this file is run as a script, loaded by
# path (blockkv bench, the tests) and run again by the child processes it starts
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.agent_workload import bench_agent
from benchmarks.baselines import bench_limits, bench_mlx_load
from benchmarks.config import FULL, QUICK, Config
from benchmarks.entry_sizes import bench_sizes
from benchmarks.fresh_process import rss_child
from benchmarks.harness import (
    MIB,
    REPO,
)
from benchmarks.index import bench_index
from benchmarks.large_entries import bench_large, large_child
from benchmarks.remote import bench_remote, moto_child, remote_available
from benchmarks.restore_speed import bench_restore
from benchmarks.sources import KVSource
from benchmarks.store_speed import bench_writes

ANALYSIS_MARKER = "<!-- analysis: kept across regenerations -->"


# --------------------------------------------------------------------------
# targets, report, plot


@dataclass(frozen=True)
class Target:
    """One issue-#5 target: ``value`` compared with ``bound``."""

    name: str
    value: float
    op: str  # ">=", "<=", "<" or "=="
    bound: float
    unit: str

    @property
    def met(self) -> bool:
        return {
            ">=": self.value >= self.bound,
            "<=": self.value <= self.bound,
            "<": self.value < self.bound,
            "==": self.value == self.bound,
        }[self.op]


def targets(cfg: Config, r: dict[str, Any]) -> list[Target]:
    """The issue's targets, each a ratio or bound computed from this run's figures."""
    w, bk, ml, ag, ix = r["writes"], r["restore"], r["mlx"], r["agent"], r["index"]
    bpt, big = cfg.shape.bytes_per_token, cfg.index_sizes[-1]
    block = cfg.block_tokens * bpt
    lg, (ref_tokens, big_tokens) = r["large"], cfg.large_tokens
    return [
        Target(
            "fresh store (fsync'd) speed vs mlx-lm save + fsync",
            w["mlx_save_fsync_fresh_s"] / w["fresh_store_s"],
            ">=",
            1.0,
            "x",
        ),
        Target(
            "next-turn store speed vs mlx-lm save + fsync of the whole cache",
            w["mlx_save_fsync_whole_s"] / w["next_turn_store_s"],
            ">=",
            10.0,
            "x",
        ),
        Target(
            "next-turn bytes written / (new tokens' bytes + 2 blocks + header)",
            w["next_turn_bytes_written"]
            / (cfg.new_tokens * bpt + 2 * block + w["header_bytes"]),
            "<=",
            1.0,
            "x",
        ),
        Target(
            "full restore (verify, warm) vs mlx-lm load + eval, same long-lived process",
            bk["same_process_mlx_load_s"] / bk["full_restore_s"],
            ">=",
            1.0,
            "x",
        ),
        Target(
            "full restore (verify, warm, fresh process) speed vs mlx-lm load + eval",
            ml["load_eval_child_s"] / bk["full_restore_child_s"],
            ">=",
            0.5,
            "x",
        ),
        Target(
            f"partial restore of {cfg.partial_tokens} tokens: block files read",
            bk["partial_blocks_read"],
            "==",
            bk["partial_blocks_expected"],
            "blocks",
        ),
        Target(
            "agent footprint vs ideal unique bytes",
            ag["footprint_vs_ideal"],
            "<=",
            1.15,
            "x",
        ),
        Target(
            "agent footprint vs file-per-entry", ag["footprint_vs_fpe"], "<=", 0.2, "x"
        ),
        Target(
            f"find p99 at {big} entries", ix[f"find_{big}"]["p99_ms"], "<", 2.0, "ms"
        ),
        Target(
            f"open at {big} entries, valid index", ix["open_valid_s"], "<", 1.0, "s"
        ),
        Target(
            "open: rebuild time / valid-index time",
            ix["open_rebuild_s"] / ix["open_valid_s"],
            ">=",
            10.0,
            "x",
        ),
        Target(
            "restore peak RSS / (2 x entry bytes + 100 MiB)",
            bk["restore_peak_rss_delta"] / (2 * bk["entry_nbytes"] + 100 * MIB),
            "<=",
            1.0,
            "x",
        ),
        *(
            Target(f"fresh store vs mlx-lm save + fsync, {z['tokens']} tokens",
                   z["mlx_save_fsync_s"] / z["store_s"], ">=", 1.0, "x")
            for z in r["sizes"].values()
        ),
        *(
            Target(f"cold restore vs sequential read of the same bytes, {z['tokens']} tokens",
                   z["seq_read_cold_s"] / z["restore_cold_s"], ">=", 0.8, "x")
            for z in r["sizes"].values()
        ),
        *(
            Target(f"large entry ({big_tokens} tokens): {step} peak RSS growth / entry bytes",
                   lg[str(big_tokens)][f"{step}_peak_delta"] / lg[str(big_tokens)]["bytes"], "<=", 1.1, "x")
            for step in ("store", "restore")
        ),
        *(
            Target(f"large entry ({big_tokens} tokens): {step} throughput / {ref_tokens}-token entry's",
                   speed(lg[str(big_tokens)], step) / speed(lg[str(ref_tokens)], step), ">=", 0.8, "x")
            for step in ("store", "restore")
        ),
        *(
            [Target("restore from the bucket, cold local pool (moto on loopback) vs warm local restore",
                    r["remote"]["restore"]["local_warm_s"] / r["remote"]["restore"]["bucket_cold_s"], ">=", 0.5, "x")]
            if r.get("remote") else []
        ),
    ]


def speed(run: dict[str, float], step: str) -> float:
    """Bytes per second of one step of a large-entry child run."""
    return run["bytes"] / run[f"{step}_s"]


def machine() -> dict[str, Any]:
    """Machine, filesystem and versions of this run."""
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    fstype = subprocess.run(
        ["findmnt", "-n", "-o", "FSTYPE", "-T", tempfile.gettempdir()],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    git = ["git", "-C", str(REPO)]
    commit = subprocess.run(
        [*git, "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    if subprocess.run(
        [*git, "status", "--porcelain", "--", "blockkv"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip():
        commit += " + uncommitted blockkv/ changes"
    versions = {
        p: metadata.version(p)
        for p in ("mlx", "mlx-lm", "numpy", "blake3", "zstandard", "lmdb")
    }
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "platform": platform.platform(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem / (1 << 30), 1),
        "filesystem": fstype,
        "python": platform.python_version(),
        "blockkv_commit": commit,
        **versions,
    }


def gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s"


def render_markdown(cfg: Config, r: dict[str, Any], old: str) -> str:
    """docs/benchmarks.md: machine, workload, figures with their same-run baselines,
    targets; the hand-written analysis after ``ANALYSIS_MARKER`` in ``old`` is kept."""
    m, lim, w, ml, bk, ag, ix = (
        r["machine"],
        r["limits"],
        r["writes"],
        r["mlx"],
        r["restore"],
        r["agent"],
        r["index"],
    )
    sh, bpt = cfg.shape, cfg.shape.bytes_per_token
    n0, n1 = cfg.prefix_tokens, cfg.prefix_tokens + cfg.new_tokens
    b0, b1 = n0 * bpt, n1 * bpt
    small, big = cfg.index_sizes
    lines = [
        "# blockkv benchmarks",
        "",
        (
            f"Generated by `python tools/bench.py{' --quick' if cfg.mode == 'quick' else ''}` ({cfg.mode} mode) on {m['date']}; "
            "raw figures in `benchmarks.json`. Every ratio is against a baseline measured in the same run."
        ),
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in m.items()),
        "",
        "## Workload",
        "",
        (
            f"Real mlx-lm `KVCache` objects, random bf16 contents: {sh.layers} layers x {sh.kv_heads} KV heads x "
            f"head_dim {sh.head_dim} ({bpt // 1024} KiB per token). Fresh entry {n0} tokens ({b0 / MIB:.0f} MiB); "
            f"next turn {n0} shared + {cfg.new_tokens} new tokens ({b1 / MIB:.0f} MiB); block_tokens {cfg.block_tokens}, "
            f"verify on (xxh3-128 per read unless a row says blake3), no compression. Median of {cfg.reps} runs. Agent workload: {cfg.agent_sessions} sessions x "
            f"{cfg.agent_turns} turns over a {cfg.agent_system_tokens}-token system prompt, {cfg.agent_turn_tokens[0]}-"
            f"{cfg.agent_turn_tokens[1]} new tokens per turn (every turn stored). Index: {big} entries of "
            f"{cfg.index_tokens[0]}-{cfg.index_tokens[1]} tokens with tiny caches."
        ),
        "",
        "## Figures",
        "",
        "| figure | value | same-run baseline | ratio |",
        "|---|---|---|---|",
        f"| raw durable write of the fresh entry's bytes (one file) | {w['raw_write_fsync_s'] * 1e3:.0f} ms ({gbps(b0, w['raw_write_fsync_s'])}) | | |",
        f"| raw read, page cache | {lim['read_page_cache_gbps']:.2f} GB/s | | |",
        f"| blake3, 1 thread / all | {lim['blake3_1thread_gbps']:.2f} / {lim['blake3_all_gbps']:.2f} GB/s | | |",
        (
            f"| mlx-lm save + fsync, {n0} tokens | {w['mlx_save_fsync_fresh_s'] * 1e3:.0f} ms ({gbps(b0, w['mlx_save_fsync_fresh_s'])}) "
            f"| raw durable write {w['raw_write_fsync_s'] * 1e3:.0f} ms | {w['raw_write_fsync_s'] / w['mlx_save_fsync_fresh_s']:.2f}x of limit |"
        ),
        f"| mlx-lm load + eval, {n1} tokens (warm) | {ml['load_eval_s'] * 1e3:.0f} ms ({gbps(b1, ml['load_eval_s'])}) | | |",
        (
            f"| **blockkv fresh store**, {n0} tokens, fsync'd | {w['fresh_store_s'] * 1e3:.0f} ms ({gbps(b0, w['fresh_store_s'])}) "
            f"| mlx-lm save + fsync {w['mlx_save_fsync_fresh_s'] * 1e3:.0f} ms | {w['mlx_save_fsync_fresh_s'] / w['fresh_store_s']:.2f}x |"
        ),
        (
            f"| **blockkv next-turn store**, +{cfg.new_tokens} tokens | {w['next_turn_store_s'] * 1e3:.0f} ms "
            f"| mlx-lm save + fsync of {n1} tokens {w['mlx_save_fsync_whole_s'] * 1e3:.0f} ms | {w['mlx_save_fsync_whole_s'] / w['next_turn_store_s']:.2f}x |"
        ),
        (
            f"| next-turn bytes written (store stats / /proc write_bytes) | {w['next_turn_bytes_written'] / MIB:.2f} / "
            f"{w['next_turn_proc_write_bytes'] / MIB:.2f} MiB | new tokens {cfg.new_tokens * bpt / MIB:.2f} MiB | "
            f"{w['next_turn_bytes_written'] / (cfg.new_tokens * bpt):.2f}x |"
        ),
        (
            f"| **blockkv full restore**, {n1} tokens, verify, warm, same long-lived process as mlx-lm's load "
            f"(alternating, median of {3 * max(cfg.reps, 3)}) | {bk['full_restore_s'] * 1e3:.0f} ms ({gbps(b1, bk['full_restore_s'])}) | mlx-lm load "
            f"{bk['same_process_mlx_load_s'] * 1e3:.0f} ms ({gbps(b1, bk['same_process_mlx_load_s'])}) | "
            f"{bk['same_process_mlx_load_s'] / bk['full_restore_s']:.2f}x |"
        ),
        (
            f"| blockkv full restore, same, `verify=\"full\"` (blake3 per read) | {bk['full_restore_blake3_s'] * 1e3:.0f} ms "
            f"({gbps(b1, bk['full_restore_blake3_s'])}) | mlx-lm load {bk['same_process_mlx_load_blake3_s'] * 1e3:.0f} ms | "
            f"{bk['same_process_mlx_load_blake3_s'] / bk['full_restore_blake3_s']:.2f}x |"
        ),
        (
            f"| blockkv full restore, {n1} tokens, verify, warm, each in a fresh process | {bk['full_restore_child_s'] * 1e3:.0f} ms "
            f"({gbps(b1, bk['full_restore_child_s'])}) | mlx-lm load {ml['load_eval_child_s'] * 1e3:.0f} ms | "
            f"{ml['load_eval_child_s'] / bk['full_restore_child_s']:.2f}x |"
        ),
        (
            f"| **blockkv partial restore**, {cfg.partial_tokens} tokens | {bk['partial_restore_s'] * 1e3:.0f} ms, "
            f"{bk['partial_blocks_read']} block files read, {bk['partial_rchar'] / MIB:.1f} MiB read | "
            f"ceil({cfg.partial_tokens}/{cfg.block_tokens}) = {bk['partial_blocks_expected']} blocks | |"
        ),
        (
            f"| restore peak RSS growth ({n1} tokens) | {bk['restore_peak_rss_delta'] / MIB:.0f} MiB | mlx-lm load "
            f"{ml['load_peak_rss_delta'] / MIB:.0f} MiB; entry {bk['entry_nbytes'] / MIB:.0f} MiB | "
            f"{bk['restore_peak_rss_delta'] / bk['entry_nbytes']:.2f}x entry |"
        ),
        f"| find p50 / p99, {small} entries | {ix[f'find_{small}']['p50_ms']:.3f} / {ix[f'find_{small}']['p99_ms']:.3f} ms | | |",
        f"| find p50 / p99, {big} entries | {ix[f'find_{big}']['p50_ms']:.3f} / {ix[f'find_{big}']['p99_ms']:.3f} ms | | |",
        f"| store of a tiny entry (p50, into {big}) | {ix['tiny_store_p50_s'] * 1e3:.2f} ms | | |",
        (
            f"| open at {big} entries, valid index | {ix['open_valid_s'] * 1e3:.0f} ms | forced rebuild "
            f"{ix['open_rebuild_s'] * 1e3:.0f} ms | {ix['open_rebuild_s'] / ix['open_valid_s']:.1f}x faster |"
        ),
        (
            f"| agent workload footprint (after gc) | {ag['points'][-1]['blockkv_footprint'] / MIB:.0f} MiB | ideal "
            f"{ag['points'][-1]['ideal_bytes'] / MIB:.0f} MiB; file-per-entry {ag['points'][-1]['fpe_footprint'] / MIB:.0f} MiB "
            f"| {ag['footprint_vs_ideal']:.3f}x ideal; {ag['footprint_vs_fpe']:.3f}x fpe (ideal: {ag['ideal_vs_fpe']:.3f}x fpe) |"
        ),
        (
            f"| agent workload bytes written | {ag['points'][-1]['blockkv_bytes_written'] / MIB:.0f} MiB | file-per-entry "
            f"{ag['points'][-1]['fpe_proc_write_bytes'] / MIB:.0f} MiB | {ag['written_vs_fpe']:.3f}x fpe; {ag['written_vs_ideal']:.3f}x ideal |"
        ),
        f"| agent store latency p50 / p99 | {ag['store_p50_s'] * 1e3:.0f} / {ag['store_p99_s'] * 1e3:.0f} ms | | |",
        "",
        "## Targets",
        "",
        "| target | measured | bound | met |",
        "|---|---|---|---|",
        *(
            f"| {t.name} | {t.value:.3f} {t.unit} | {t.op} {t.bound:g} | {'yes' if t.met else '**no**'} |"
            for t in targets(cfg, r)
        ),
        "",
        "## Entry sizes",
        "",
        (
            f"Fresh entries of {sh.layers} layers x {sh.kv_heads} KV heads x head_dim {sh.head_dim}, bf16; median of "
            f"{min(cfg.reps, 3)} reps. Store: "
            "fresh store vs mlx-lm save + fsync, interleaved reps. Warm restore: full restore with verify vs "
            f"mlx-lm load + eval, both in this one process, warmed, alternating, median of {3 * min(cfg.reps, 3)}. "
            "Cold restore: page cache of "
            "the store's files dropped (posix_fadvise DONTNEED) before each rep, vs a plain sequential read "
            "(8 MiB reads) of the same bytes from one file dropped the same way, interleaved."
        ),
        "",
        "| tokens | MiB | mlx-lm save+fsync | blockkv store | ratio | mlx-lm load | blockkv restore | ratio "
        "| sequential read, cold | blockkv restore, cold | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {z['tokens']} | {z['bytes'] / MIB:.0f} | {z['mlx_save_fsync_s'] * 1e3:.0f} ms | {z['store_s'] * 1e3:.0f} ms "
            f"| {z['mlx_save_fsync_s'] / z['store_s']:.2f}x | {z['mlx_load_s'] * 1e3:.1f} ms | {z['restore_s'] * 1e3:.1f} ms "
            f"| {z['mlx_load_s'] / z['restore_s']:.2f}x | {z['seq_read_cold_s'] * 1e3:.0f} ms ({gbps(z['bytes'], z['seq_read_cold_s'])}) "
            f"| {z['restore_cold_s'] * 1e3:.0f} ms ({gbps(z['bytes'], z['restore_cold_s'])}) "
            f"| {z['seq_read_cold_s'] / z['restore_cold_s']:.2f}x |"
            for z in r["sizes"].values()
        ),
        "",
        "## Large entry",
        "",
        (
            f"{cfg.large_shape.layers} layers x {cfg.large_shape.kv_heads} KV heads x head_dim {cfg.large_shape.head_dim}, "
            "bf16, in one fresh child process, the large entry first: each entry is built there, then stored, then "
            "its source arrays are freed (and MLX's buffer cache cleared) and it is restored (warm). Peak RSS growth "
            "of a step is VmHWM after it (reset just before) minus VmRSS before it."
        ),
        "",
        "| tokens | entry | store | store peak RSS growth | restore | restore peak RSS growth |",
        "|---|---|---|---|---|---|",
        *(
            f"| {t} | {g['bytes'] / MIB:.0f} MiB | {g['store_s'] * 1e3:.0f} ms ({gbps(int(g['bytes']), g['store_s'])}) "
            f"| {g['store_peak_delta'] / MIB:.0f} MiB ({g['store_peak_delta'] / g['bytes']:.2f}x) "
            f"| {g['restore_s'] * 1e3:.0f} ms ({gbps(int(g['bytes']), g['restore_s'])}) "
            f"| {g['restore_peak_delta'] / MIB:.0f} MiB ({g['restore_peak_delta'] / g['bytes']:.2f}x) |"
            for t, g in r["large"].items()
        ),
        "",
        *remote_markdown(cfg, r.get("remote")),
        "## Agent workload by number of sessions",
        "",
        "![footprint and bytes written vs sessions](benchmarks.png)",
        "",
        (
            "| sessions | entries stored / live | ideal MiB | blockkv footprint MiB (before gc) | blockkv written MiB "
            "| file-per-entry footprint MiB (every turn kept) | file-per-entry written MiB |"
        ),
        "|---|---|---|---|---|---|---|",
        *(
            f"| {p['sessions']} | {p['entries_stored']} / {p['entries_live']} | {p['ideal_bytes'] / MIB:.0f} | "
            f"{p['blockkv_footprint'] / MIB:.0f} ({p['blockkv_footprint_before_gc'] / MIB:.0f}) | "
            f"{p['blockkv_bytes_written'] / MIB:.0f} | {p['fpe_footprint'] / MIB:.0f} ({p['fpe_footprint_every_turn'] / MIB:.0f}) | "
            f"{p['fpe_proc_write_bytes'] / MIB:.0f} |"
            for p in ag["points"]
        ),
        "",
        (
            "Each turn of a session supersedes the previous one in blockkv (a prefix of a newer trimmable entry), so "
            "the file-per-entry footprint counts the files of the entries blockkv still holds; it writes every turn. "
            "The agent store runs with `gc_grace=0` and is gc'd before each measurement (steady state). "
            "Ideal = KV bytes of the distinct token prefixes of the live entries."
        ),
        "",
        (
            "Footprints are allocated bytes on disk (st_blocks, like `du`; blockkv's includes headers and the LMDB index). "
            "File-per-entry writes each entry whole with mlx-lm's `save_prompt_cache`, counts its allocated size and "
            "/proc/self/io write_bytes, then deletes it to keep the disk free."
        ),
        "",
    ]
    kept = (
        old.split(ANALYSIS_MARKER, 1)[1]
        if ANALYSIS_MARKER in old
        else "\n## Analysis\n\n(none yet)\n"
    )
    return "\n".join(lines) + "\n" + ANALYSIS_MARKER + kept


def remote_markdown(cfg: Config, rm: dict[str, Any] | None) -> list[str]:
    """The scale-out section: ratios against baselines of the same run, and the load."""
    if rm is None:
        return ["## Scale-out over a bucket", "", "Skipped: needs obstore and moto (`pip install 'blockkv[test]'`).", ""]
    rs, ag, op = rm["restore"], rm["agent"], rm["open"]
    load = ", ".join(f"{x:.2f}" for x in rm["loadavg"])
    return [
        "## Scale-out over a bucket",
        "",
        (
            f"Nodes are `BlockStore(root, remote=...)` handles with their own local roots on one bucket of moto's S3 "
            f"server, run as its own process on loopback. **moto is slow Python** (every request parsed and "
            f"answered by werkzeug; PUT bodies land in its memory): these figures bound what the protocol costs "
            f"from below, a real S3-compatible server is faster per request but further away. Load average "
            f"after the section: {load} (1, 5, 15 min). Median of {max(cfg.reps, 3)} reps where timed."
        ),
        "",
        "| figure | value | same-run baseline | ratio |",
        "|---|---|---|---|",
        (
            f"| restore from the bucket, {rs['tokens']} tokens ({rs['entry_bytes'] / MIB:.0f} MiB), fresh node "
            f"(cold local pool: every block fetched, verified, kept) | {rs['bucket_cold_s'] * 1e3:.0f} ms "
            f"({gbps(rs['entry_bytes'], rs['bucket_cold_s'])}) | warm local restore {rs['local_warm_s'] * 1e3:.0f} ms; "
            f"mlx-lm load {rs['mlx_load_s'] * 1e3:.0f} ms | {rs['local_warm_s'] / rs['bucket_cold_s']:.2f}x local; "
            f"{rs['mlx_load_s'] / rs['bucket_cold_s']:.2f}x mlx-lm |"
        ),
        (
            f"| the limit: plain concurrent GETs of the same blocks from the server (no verify, nothing kept) | "
            f"{rs['raw_get_s'] * 1e3:.0f} ms ({gbps(rs['entry_bytes'], rs['raw_get_s'])}) | restore from the bucket "
            f"{rs['bucket_cold_s'] * 1e3:.0f} ms | {rs['raw_get_s'] / rs['bucket_cold_s']:.2f}x of the limit |"
        ),
        (
            f"| agent workload ({ag['sessions']} sessions round-robin over {ag['nodes']} nodes joining as their first "
            f"session arrives, one {ag['system_prompt_bytes'] / MIB:.0f} MiB system prompt): request bodies the "
            f"server received | "
            f"{ag['bucket_bytes_received'] / MIB:.0f} MiB (holds {ag['bucket_bytes_held'] / MIB:.0f} MiB) | "
            f"{ag['nodes']} independent local stores wrote {ag['independent_bytes_written'] / MIB:.0f} MiB | "
            f"{ag['bucket_bytes_received'] / ag['independent_bytes_written']:.2f}x uploaded; "
            f"{ag['bucket_bytes_held'] / ag['independent_bytes_written']:.2f}x held |"
        ),
        (
            f"| fresh node's open against {op['entries']} entries, the first (lists the headers, GETs each) | "
            f"{op['fresh_open_first_s'] * 1e3:.0f} ms | the storing node's reopen (valid local index) "
            f"{op['local_open_s'] * 1e3:.0f} ms | {op['fresh_open_first_s'] / op['local_open_s']:.1f}x slower |"
        ),
        (
            f"| fresh node's open against {op['entries']} entries, later ones (lists the headers, reads the "
            f"MANIFEST the first leaves from 32 headers up) | {op['fresh_open_s'] * 1e3:.0f} ms | the storing node's reopen "
            f"{op['local_open_s'] * 1e3:.0f} ms | {op['fresh_open_s'] / op['local_open_s']:.1f}x slower |"
        ),
        f"| store of a tiny entry through the bucket (mean, into {op['entries']}) | {op['store_mean_s'] * 1e3:.1f} ms | | |",
        "",
    ]


def plot(r: dict[str, Any], path: Path) -> None:
    """Footprint and bytes written vs sessions: blockkv, file-per-entry, ideal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    pts = r["agent"]["points"]
    xs = [p["sessions"] for p in pts]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for ax, (title, bk_key, fpe_key) in zip(
        axes,
        (
            ("disk footprint", "blockkv_footprint", "fpe_footprint"),
            ("bytes written", "blockkv_bytes_written", "fpe_proc_write_bytes"),
        ),
    ):
        ax.plot(
            xs, [p[fpe_key] / MIB for p in pts], "s-", label="file-per-entry (mlx-lm)"
        )
        ax.plot(xs, [p[bk_key] / MIB for p in pts], "o-", label="blockkv")
        ax.plot(
            xs,
            [p["ideal_bytes"] / MIB for p in pts],
            "k--",
            label="ideal (unique bytes)",
        )
        ax.set(title=title, xlabel="sessions", ylabel="MiB", yscale="log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("agent workload: sessions sharing one system prompt")
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------
# main


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
