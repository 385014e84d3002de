"""Per-key caches against one key, on one ``blockkv serve --per-key-cache``
(issue 44): N concurrent streamed requests split over several API keys, and
the same requests under one key, same server, same flags, the two ways
alternated (per-key, one key, one key, per-key, ...) so a load that drifts
during the run weighs on both alike.

Every round sends N chats at once (a barrier), each of ``--decode`` tokens
(EOS is biased away, so every stream decodes them all) on a system prompt of
its own, new to the round (so neither way saves prefill on another chat of
the round: what is measured is the batching); chat ``j`` goes to key
``j % K`` (per-key) or to key 0 (one key). ``--same-system`` gives the chats
of a round one system prompt instead: under one key the chats that join the
batch after its first prefill step find it cached, under K keys each key
prefills it, which is what per-key isolation costs on its own; add
``--warm-shared`` and the operator declares each round's system prompt shared
first (``blockkv warm --shared``, outside the wall), so every key restores
the one copy. Per round it reports:

- the wall: first request sent to last chunk received;
- the overlap: the share of pairs of streams that were producing tokens at the
  same time (1.0: one batch; 0.0: one after another);
- isolation, checked in the same run after each per-key round: one of the
  round's chats sent again by its own key is cached in full (all but its last
  token), and by a key that has sent nothing (a fresh one per round) not at
  all (``cached_tokens`` 0; with ``--warm-shared``, the shared prompt only).

    python tools/tenants_bench.py                    # 8 streams over 4 keys, 4 rounds per way
    python tools/tenants_bench.py --streams 16 --keys 8 --rounds 6
    python tools/tenants_bench.py --same-system      # one system prompt per round: isolation's own cost
    python tools/tenants_bench.py --same-system --warm-shared   # ... declared shared by the operator
    python tools/tenants_bench.py --quick            # a tiny run that checks the tool (figures mean nothing)
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from blockkv.mlx_lm.demo import DEMO_MODEL
from blockkv.model_dir import build_model_dir, sample_text
from blockkv.testing.fleet_processes import Process
from blockkv.testing.streams import concurrently, no_eos_bias, overlap, stream_chat, wall

SYSTEM_WORDS = 300  # over one block (256 tokens): the disk tier stores it too


@dataclass
class Round:
    way: str  # "per-key" or "one key"
    wall_s: float
    overlap: float
    prompt_tokens: int
    cached_tokens: int
    shared_tokens: int  # the operator's shared prompt (--warm-shared), else 0
    own_again_cached: int | None = None  # per-key rounds: a chat sent again by its own key
    own_again_prompt: int | None = None
    fresh_key_cached: int | None = None  # ... and by a key that sent nothing before (the shared prompt at most)


def _chats(round_no: int, n: int, same_system: bool) -> list[list[dict[str, str]]]:
    return [[{"role": "system", "content": sample_text(SYSTEM_WORDS, seed=1000 * (round_no + 2) + (0 if same_system else j))},
             {"role": "user", "content": sample_text(20, seed=round_no * 100 + j)}] for j in range(n)]


def _warm_shared(root: Path, model: Path, system: str) -> int:
    """``blockkv warm --shared`` of ``system``, as an operator runs it: the tokens it stored."""
    (root.parent / "system.txt").write_text(system)
    done = subprocess.run([sys.executable, "-m", "blockkv", "warm", str(root), str(root.parent / "system.txt"),
                           "--model", str(model), "--shared", "--json"], check=True, capture_output=True,
                          timeout=600)
    return int(json.loads(done.stdout)["entry"]["tokens"])


def _round(url: str, way: str, keys: list[str], probe: str, round_no: int, args: argparse.Namespace,
           bias: dict[str, int]) -> Round:
    chats = _chats(round_no, args.streams, args.same_system)
    shared = _warm_shared(args.root, args.model_dir, chats[0][0]["content"]) if args.warm_shared else 0
    senders = [keys[j % args.keys] if way == "per-key" else keys[0] for j in range(args.streams)]
    streams = concurrently(url, list(zip(senders, chats)), args.decode, bias)
    result = Round(way, wall(streams), overlap(streams), sum(s.prompt_tokens for s in streams),
                   sum(s.cached_tokens for s in streams), shared)
    if way == "per-key":
        again = stream_chat(url, senders[0], chats[0], 1)
        result.own_again_cached, result.own_again_prompt = again.cached_tokens, again.prompt_tokens
        result.fresh_key_cached = stream_chat(url, probe, chats[0], 1).cached_tokens
    return result


def _summary(rounds: list[Round]) -> dict[str, Any]:
    ways: dict[str, Any] = {}
    for way in ("per-key", "one key"):
        mine = [r for r in rounds if r.way == way]
        ways[way] = {"wall_s_median": statistics.median(r.wall_s for r in mine),
                     "walls_s": [round(r.wall_s, 3) for r in mine],
                     "overlap_min": min(r.overlap for r in mine)}
    per_key = [r for r in rounds if r.way == "per-key"]
    ways["wall_ratio"] = ways["per-key"]["wall_s_median"] / ways["one key"]["wall_s_median"]
    ways["isolated"] = all(r.fresh_key_cached == r.shared_tokens and r.own_again_prompt is not None
                           and r.own_again_cached == r.own_again_prompt - 1 for r in per_key)
    return ways


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model = build_model_dir(work / "model", "llama", overrides=DEMO_MODEL)
    keys = [f"sk-bench-{i}-{secrets.token_hex(8)}" for i in range(args.keys)]
    probes = [f"sk-probe-{i}-{secrets.token_hex(8)}" for i in range(args.rounds)]
    key_file = work / "keys"
    key_file.write_text("\n".join(keys + probes) + "\n")
    args.root, args.model_dir = work / "kv", model
    node = Process(["serve", "--model", str(model), "--cache-dir", str(work / "kv"), "--per-key-cache",
                    "--api-key-file", str(key_file), "--log-level", "WARNING"], work / "node.log")
    rounds: list[Round] = []
    try:
        node.wait_ready()
        bias = no_eos_bias(model)
        concurrently(node.url, [(k, c) for k, c in zip(keys, _chats(-1, args.keys, False))], args.decode,
                     bias)  # load the model, warm mlx up
        order = ["per-key", "one key", "one key", "per-key"]
        for i in range(2 * args.rounds):
            way = order[i % 4]
            done = sum(r.way == way for r in rounds)
            rounds.append(_round(node.url, way, keys, probes[done], i, args, bias))
            print(f"{way:8s} wall {rounds[-1].wall_s:6.2f} s  overlap {rounds[-1].overlap:.2f}", flush=True)
    finally:
        node.stop()
    return {"streams": args.streams, "keys": args.keys, "decode": args.decode, "rounds": args.rounds,
            "system_words": SYSTEM_WORDS, "same_system": args.same_system, "warm_shared": args.warm_shared, "summary": _summary(rounds), "per_round": [asdict(r) for r in rounds]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=8, help="concurrent streamed requests per round (default 8)")
    p.add_argument("--keys", type=int, default=4, help="API keys the per-key rounds split them over (default 4)")
    p.add_argument("--decode", type=int, default=128, help="tokens each stream decodes (default 128)")
    p.add_argument("--rounds", type=int, default=4, help="rounds per way (default 4)")
    p.add_argument("--same-system", action="store_true", help="one system prompt for a round's chats")
    p.add_argument("--warm-shared", action="store_true", help="with --same-system: declare it shared first")
    p.add_argument("--quick", action="store_true", help="4 streams, 2 keys, 1 round each way, 32 tokens")
    p.add_argument("--json", type=Path, help="write the report here too")
    args = p.parse_args(argv)
    if args.quick:
        args.streams, args.keys, args.decode, args.rounds = 4, 2, 32, 1
    if args.warm_shared and not args.same_system:
        p.error("--warm-shared needs --same-system")
    if args.streams < 2 or not 1 < args.keys <= args.streams or args.decode < 1 or args.rounds < 1:
        p.error("needs --streams >= 2, 1 < --keys <= --streams, --decode >= 1, --rounds >= 1")
    with tempfile.TemporaryDirectory(prefix="tenants-bench-") as tmp:
        report = run(args, Path(tmp))
    summary = report["summary"]
    print(json.dumps(summary, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
