"""Prefix-aware routing against round-robin (issues #23, #33), in one run: the
same workload sent through ``blockkv route`` and, round-robin, straight to
the same kind of fleet — three ``blockkv serve`` nodes on one machine, each
with its own --cache-dir, sharing one bucket on moto's S3 server (its own
process on loopback). Each run gets a fresh fleet (new roots, a new bucket
prefix), so neither way inherits the other's caches, and the ways alternate
(router, round-robin, round-robin, router) so a load that drifts during the
run weighs on both alike.

Agents run concurrently, each a conversation of several turns on one of two
system prompts. Two workloads (``--workload``):

- ``soak`` (the default): issue #33's fleet soak: 12 sessions, 3 at once, two
  ~1,500-token system prompts, 8 turns, every other request streamed;
- ``agent``: issue #23's: 8 sessions, 4 at once, two 800-word system prompts,
  8 turns, all streamed.

Per way it reports:

- later turns served from the node's own RAM or disk: the node held the
  conversation so far (its published residency, read just before the request
  was sent) and did not prefill it (``cached_tokens`` covers it);
- prompt tokens prefilled (``prompt_tokens - cached_tokens``, summed);
- bytes of blocks read from the bucket (counted by the S3 server);
- time to first token (first streamed chunk) of the streamed requests, median
  and p95, of later turns and of all turns;
- throughput: requests answered per second of the way's wall time (fleets'
  start excluded).

    python tools/route_bench.py --rounds 4         # the soak's workload, router and round-robin, both orders twice
    python tools/route_bench.py --workload agent   # issue #23's agent workload
    python tools/route_bench.py --quick            # a tiny run that checks the tool (figures mean nothing)
    python tools/route_bench.py --floor            # the floor: one idle node, direct, routed, mlx_lm.server

``--floor`` measures what a later turn costs when it lands where its
conversation is hot: one conversation at a time on one idle node, each later
turn's time to first token sent straight to a ``blockkv serve`` node, through
``blockkv route`` to the same node, and to ``mlx_lm.server`` (its own RAM
cache), the three in turn on turns of the same lengths (different words for
each way, so that the node never holds one way's turn for the other).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/, for benchmarks/

import openai
from benchmarks.remote import moto_bucket

from blockkv.mlx_lm.demo import DEMO_MODEL
from blockkv.model_dir import build_model_dir, sample_text
from blockkv.router.route import NODE_HEADER
from blockkv.router.route_tokens import PromptTokenizer
from blockkv.testing.fleet_processes import Process, free_port
from blockkv.wire.residency import digest_key, prefix_digests

SALT = "route bench"
WORKLOADS = {  # the flags each --workload sets, unless given
    "soak": {"sessions": 12, "concurrency": 3, "system_words": 1500, "turns": 8, "user_words": 150,
             "max_tokens": 12, "all_streamed": False},
    "agent": {"sessions": 8, "concurrency": 4, "system_words": 800, "turns": 8, "user_words": 150,
              "max_tokens": 12, "all_streamed": True},
}
QUICK = {"sessions": 3, "concurrency": 3, "turns": 2, "system_words": 100, "user_words": 20, "max_tokens": 4}
BEGAN = time.perf_counter()
WAYS = ("router", "round-robin")


@dataclass
class Sent:
    """One request and what came back."""

    way: str
    session: int
    turn: int
    node: str
    sent_at: float  # seconds since the run began
    stream: bool
    ttft_s: float | None  # streamed requests only
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    own: bool | None  # later turns: served from the node's own RAM or disk


def _held(node: Process) -> set[str]:
    media = node.get("/blockkv/residency")["media"]
    return set(media["RAM"]) | set(media["DISK"])


def run_way(way: str, args: argparse.Namespace, model: Path, tokenizer: PromptTokenizer, url: str,
            options: dict[str, str], work: Path) -> tuple[list[Sent], float]:
    """The workload through ``way`` on a fresh fleet (new roots and bucket prefix
    under ``work``); every request it sent, and the seconds from the first sent to
    the last answered."""
    options = {**options, **({"sync_interval": str(args.sync_interval)} if args.sync_interval is not None else {})}
    remote = ["--remote", f"{url}-{work.name}", *(a for k, v in options.items() for a in ("--remote-option", f"{k}={v}"))]
    work.mkdir()
    nodes = [Process(["serve", "--model", str(model), "--cache-dir", str(work / f"node{i}"), "--fleet-salt", SALT,
                      "--log-level", "WARNING", *remote], work / f"node{i}.log") for i in range(3)]
    router = None
    try:
        for node in nodes:
            node.wait_ready()
        if way == "router":
            router = Process(["route", "--model", str(model), "--fleet-salt", SALT, "--log-level", "WARNING",
                              *(a for n in nodes for a in ("--node", n.url))], work / "router.log")
            router.wait_ready()
        by_url = {n.url: n for n in nodes}
        turn_robin = itertools.count()
        key = digest_key(SALT)
        systems = [{"role": "system", "content": sample_text(args.system_words, seed=s)} for s in (1, 2)]

        def agent(session: int) -> list[Sent]:
            messages = [systems[session % 2]]
            sent: list[Sent] = []
            before: list[str] = []
            for turn in range(args.turns):
                messages.append({"role": "user", "content": sample_text(args.user_words, seed=1000 * session + turn)})
                tokens = tokenizer.tokens("/v1/chat/completions", {"messages": messages})
                held = {u: _held(n) for u, n in by_url.items()}  # what each node holds as the request leaves
                base = router.url if router is not None else nodes[next(turn_robin) % len(nodes)].url
                client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
                stream = args.all_streamed or (session + turn) % 2 == 0
                start = time.perf_counter()
                raw = client.chat.completions.with_raw_response.create(
                    model="default_model", messages=messages, max_tokens=args.max_tokens, temperature=0.0,
                    stream=stream, **({"stream_options": {"include_usage": True}} if stream else {}))
                ttft, text, usage = None, [], None
                if stream:
                    for chunk in raw.parse():
                        if chunk.choices and ttft is None:
                            ttft = time.perf_counter() - start
                        text.extend(c.delta.content or "" for c in chunk.choices)
                        usage = chunk.usage or usage
                    assert ttft is not None, "no token streamed"
                else:
                    answer = raw.parse()
                    text, usage = [answer.choices[0].message.content or ""], answer.usage
                node = raw.headers.get(NODE_HEADER) or base
                assert usage is not None and usage.prompt_tokens == len(tokens)
                cached = usage.prompt_tokens_details.cached_tokens
                own = None
                if before:  # the conversation so far, as whole blocks: on this node, and not prefilled
                    own = set(before) <= held[node] and cached >= 32 * len(before)
                sent.append(Sent(way, session, turn, node, start - BEGAN, stream, ttft, time.perf_counter() - start,
                                 usage.prompt_tokens, cached, own))
                messages.append({"role": "assistant", "content": "".join(text)})
                before = prefix_digests(tokens, key)
            return sent

        began = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            sent = [s for done in pool.map(agent, range(args.sessions)) for s in done]
        return sent, time.perf_counter() - began
    finally:
        for process in [router, *nodes]:
            if process is not None:
                process.stop()


def floor(args: argparse.Namespace, model: Path, work: Path) -> dict[str, float]:
    """Median time to first token of later turns on one idle node: direct, routed, mlx_lm.server."""
    node = Process(["serve", "--model", str(model), "--cache-dir", str(work / "floor-node"), "--fleet-salt", SALT,
                    "--log-level", "WARNING"], work / "floor-node.log")
    router = Process(["route", "--model", str(model), "--fleet-salt", SALT, "--log-level", "WARNING",
                      "--node", node.url], work / "floor-router.log")
    port = free_port()
    with open(work / "floor-mlx.log", "wb") as out:
        mlx = subprocess.Popen([sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--host", "127.0.0.1",
                                "--port", str(port), "--log-level", "WARNING"], stdout=out, stderr=subprocess.STDOUT)
    bases = {"direct": node.url, "routed": router.url, "mlx_lm.server": f"http://127.0.0.1:{port}"}
    ttft: dict[str, list[float]] = {way: [] for way in bases}
    try:
        node.wait_ready()
        router.wait_ready()
        deadline = time.monotonic() + 180
        while True:  # mlx_lm.server has no /health: its model list answers once it serves
            try:
                with urllib.request.urlopen(bases["mlx_lm.server"] + "/v1/models", timeout=10):
                    break
            except OSError:
                if mlx.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("mlx_lm.server did not come up") from None
                time.sleep(0.2)
        ways = list(bases)
        for session in range(args.sessions):
            for way in ways[session % 3 :] + ways[: session % 3]:  # each way goes first in turn
                client = openai.OpenAI(base_url=bases[way] + "/v1", api_key="unused", max_retries=0, timeout=600)
                messages = [{"role": "system", "content": sample_text(args.system_words, seed=session)}]
                for turn in range(args.turns):
                    messages.append({"role": "user", "content": sample_text(
                        args.user_words, seed=100_000 + 1000 * session + 100 * ways.index(way) + turn)})
                    start, first, text = time.perf_counter(), None, []
                    for chunk in client.chat.completions.create(model="default_model", messages=messages,
                                                                max_tokens=args.max_tokens, temperature=0.0,
                                                                stream=True):
                        if chunk.choices and first is None:
                            first = time.perf_counter() - start
                        text.extend(c.delta.content or "" for c in chunk.choices)
                    assert first is not None, f"{way}: no token streamed"
                    if turn:
                        ttft[way].append(first)
                    messages.append({"role": "assistant", "content": "".join(text)})
    finally:
        router.stop()
        node.stop()
        mlx.send_signal(signal.SIGTERM)  # Ctrl-C is ignored when the bench runs as a background job
        try:
            mlx.wait(timeout=60)
        except subprocess.TimeoutExpired:
            mlx.kill()
    return {way: statistics.median(v) for way, v in ttft.items()}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]  # nearest rank


def summary(sent: list[Sent], bucket_bytes: int, wall_s: float) -> dict[str, Any]:
    later = [s for s in sent if s.turn > 0]
    ttft_later = [s.ttft_s for s in later if s.ttft_s is not None]
    ttft_all = [s.ttft_s for s in sent if s.ttft_s is not None]
    return {
        "requests": len(sent),
        "later_turns": len(later),
        "later_from_own_ram_or_disk": sum(1 for s in later if s.own) / len(later),
        "prompt_tokens": sum(s.prompt_tokens for s in sent),
        "prefilled_tokens": sum(s.prompt_tokens - s.cached_tokens for s in sent),
        "bucket_bytes_read": bucket_bytes,
        "ttft_later_median_s": statistics.median(ttft_later),
        "ttft_later_p90_s": _percentile(ttft_later, 0.90),
        "ttft_later_p95_s": _percentile(ttft_later, 0.95),
        "ttft_all_median_s": statistics.median(ttft_all),
        "ttft_all_p95_s": _percentile(ttft_all, 0.95),
        "wall_s": wall_s,
        "requests_per_s": len(sent) / wall_s,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=list(WORKLOADS), default="soak",
                   help="the preset the flags below override (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="a tiny run that checks the tool: 3 sessions of 2 short "
                   "turns (the flags below still override)")
    p.add_argument("--sessions", type=int, help="agents (conversations)")
    p.add_argument("--turns", type=int, help="turns per conversation")
    p.add_argument("--concurrency", type=int, help="agents at once (not the number of nodes: agents in lockstep "
                   "would each meet the same node every turn under round-robin)")
    p.add_argument("--system-words", type=int, help="words per system prompt (about a token each)")
    p.add_argument("--user-words", type=int, help="words per user turn (an agent's tool output)")
    p.add_argument("--max-tokens", type=int, help="tokens per answer")
    p.add_argument("--all-streamed", action="store_true", default=None,
                   help="stream every request (the soak streams every other one)")
    p.add_argument("--rounds", type=int, default=2,
                   help="fleets per way, in the order router, round-robin, round-robin, router, ... (default %(default)s)")
    p.add_argument("--sync-interval", type=float, metavar="SECONDS",
                   help="the nodes' sync_interval: how soon a node learns what the others stored (default: theirs, 30)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--floor", action="store_true",
                   help="only the floor: later turns on one idle node, direct, routed and on mlx_lm.server")
    args = p.parse_args(argv)
    preset = {**WORKLOADS["agent" if args.floor else args.workload], **(QUICK if args.quick else {})}
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.floor:
        work = Path(tempfile.mkdtemp(prefix="blockkv-route-floor-"))
        try:
            medians = floor(args, build_model_dir(work / "model", "llama", overrides=DEMO_MODEL), work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(f"later turns ({args.sessions} conversations of {args.turns} turns, {args.user_words}-word turns), "
              "median time to first token: " + ", ".join(f"{k} {v:.3f} s" for k, v in medians.items()))
        return 0
    work = Path(tempfile.mkdtemp(prefix="blockkv-route-bench-"))
    load = [os.getloadavg()]
    started = time.perf_counter()
    try:
        model = build_model_dir(work / "model", "llama", overrides=DEMO_MODEL)
        tokenizer = PromptTokenizer(str(model))
        sent: dict[str, list[Sent]] = {way: [] for way in WAYS}
        read = dict.fromkeys(WAYS, 0)
        wall = dict.fromkeys(WAYS, 0.0)
        with moto_bucket() as (url, options, received):
            for r in range(args.rounds):  # A B B A ...: a load that drifts weighs on both ways alike
                for way in WAYS if r % 2 == 0 else WAYS[::-1]:
                    before = received()["blob_bytes_read"]
                    done, seconds = run_way(way, args, model, tokenizer, url, options, work / f"{way}-{r}")
                    sent[way] += done
                    wall[way] += seconds
                    read[way] += received()["blob_bytes_read"] - before
                    load.append(os.getloadavg())
        results = {way: summary(sent[way], read[way], wall[way]) for way in WAYS}
        requests = {way: [asdict(s) for s in sent[way]] for way in WAYS}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    router, robin = results["router"], results["round-robin"]
    report = {"config": vars(args) | {"json": None}, "load_average_1_5_15": load,
              "wall_s": time.perf_counter() - started, **results,
              "ttft_later_median_ratio": router["ttft_later_median_s"] / robin["ttft_later_median_s"],
              "throughput_ratio": router["requests_per_s"] / robin["requests_per_s"]}
    print(f"{'':32s}{'router':>14s}{'round-robin':>14s}")
    for name in router:
        a, b = router[name], robin[name]
        print(f"{name:32s}{a:14.3f}{b:14.3f}" if isinstance(a, float) else f"{name:32s}{a:14d}{b:14d}")
    print(f"TTFT median of later turns, router / round-robin: {report['ttft_later_median_ratio']:.2f} "
          f"(goal <= 0.9); throughput, router / round-robin: {report['throughput_ratio']:.2f} (goal >= 1)")
    print("load average (1, 5, 15 min) at start and after each fleet: "
          + "; ".join(", ".join(f"{x:.1f}" for x in la) for la in load))
    if args.json:
        args.json.write_text(json.dumps({**report, "requests": requests}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
