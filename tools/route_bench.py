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

Two run shapes (issue #44): whole rounds (the default: every session runs to
its last turn, throughput over the time that took) or ``--window SECONDS``
(time-boxed: each fleet serves for that long, its clients starting new
sessions, new words on the same two system prompts, until it closes; only
requests answered inside the window count, throughput is them over the
window). ``--interleave N``: each client keeps N conversations going, a turn
of each in turn, instead of one after another, so a conversation's turns are
spaced by the others' (with ``--pooled``, the clients share all their
conversations, as a pool of workers over many sessions does).

Per way it reports, load-independent counts first:

- later turns served from the node's own RAM or disk: the node held the
  conversation so far (its published residency, read just before the request
  was sent) and did not prefill it (``cached_tokens`` covers it); and where
  each later turn's reused prefix came from, by its ``cached_tokens`` against
  what its node had published holding (``source``);
- later turns sent to a node already busy with another request of the run,
  and the requests in flight on a request's node when it was sent;
- prompt tokens prefilled (``prompt_tokens - cached_tokens``, summed), and
  the nodes' own /metrics counters (hits and tokens restored per tier,
  tokens prefilled), scraped from every node before its fleet stops;
- bytes of blocks read from the bucket (counted by the S3 server);
- time to first token (first streamed chunk) of the streamed requests, median
  and p95, of later turns (also split by whether their node was idle or busy
  when they were sent) and of all turns;
- throughput: requests answered per second of the way's wall time (fleets'
  start excluded), or of its window;
- per fleet: its way, the load average after it, requests by node.

    python tools/route_bench.py --rounds 4         # the soak's workload, router and round-robin, both orders twice
    python tools/route_bench.py --window 150       # issue #44's trial: 150 s time-boxed fleets of the soak's workload
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
import collections
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
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
from blockkv.wire.residency import BLOCK_SIZE, digest_key, prefix_digests

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
SOURCES = ("ram", "disk", "elsewhere", "prefill")


@dataclass
class Sent:
    """One request and what came back."""

    way: str
    fleet: int  # the fleet's place in the run (0, 1, ...)
    session: int
    turn: int
    node: str
    sent_at: float  # seconds since the run began
    stream: bool
    ttft_s: float | None  # streamed requests only
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    held_ram: int  # leading prompt tokens the node held in RAM as the request left (its published residency)
    held_disk: int  # ... and on its disk
    own: bool | None  # later turns: served from the node's own RAM or disk
    in_window: bool  # answered before the way's window closed (always, without --window)


class Fleet:
    """``--nodes`` ``blockkv serve`` nodes (three) on fresh roots and a fresh
    bucket prefix under ``work``, and, for the router's way, ``blockkv route``
    in front. With ``--pin``, node *i* runs on CPU core *i* alone: nodes that
    share no core, as on machines of their own, which one machine can only
    simulate (the router, the bucket and the clients still run beside them)."""

    def __init__(self, way: str, args: argparse.Namespace, model: Path, url: str, options: dict[str, str],
                 work: Path) -> None:
        interval = {"sync_interval": str(args.sync_interval)} if args.sync_interval is not None else {}
        remote = ["--remote", f"{url}-{work.name}",
                  *(a for k, v in {**options, **interval}.items() for a in ("--remote-option", f"{k}={v}"))]
        work.mkdir()
        self.nodes = [Process(["serve", "--model", str(model), "--cache-dir", str(work / f"node{i}"), "--fleet-salt",
                               SALT, "--log-level", "WARNING", *remote], work / f"node{i}.log")
                      for i in range(args.nodes)]
        for core, node in enumerate(self.nodes if args.pin else ()):  # before the node starts its threads
            os.sched_setaffinity(node.proc.pid, {core})
        self.router: Process | None = None
        self._robin = itertools.count()
        try:
            for node in self.nodes:
                node.wait_ready()
            if way == "router":
                self.router = Process(["route", "--model", str(model), "--fleet-salt", SALT, "--log-level", "WARNING",
                                       *(a for n in self.nodes for a in ("--node", n.url))], work / "router.log")
                self.router.wait_ready()
        except BaseException:
            self.stop()
            raise

    def base(self) -> str:
        """Where the next request goes: the router, or the next node in turn."""
        return self.router.url if self.router is not None else self.nodes[next(self._robin) % len(self.nodes)].url

    def held(self) -> dict[str, tuple[set[str], set[str]]]:
        """Each node's published residency: the digests in its RAM, and on its disk."""
        media = {n.url: n.get("/blockkv/residency")["media"] for n in self.nodes}
        return {u: (set(m["RAM"]), set(m["DISK"])) for u, m in media.items()}

    def counters(self) -> dict[str, dict[str, float]]:
        """Each node's /metrics lookups: hits and tokens restored per tier, misses, tokens prefilled."""
        return {n.url: node_counters(_text(n.url + "/metrics")) for n in self.nodes}

    def stop(self) -> None:
        for process in [self.router, *self.nodes]:
            if process is not None:
                process.stop()


def _text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


def node_counters(metrics: str) -> dict[str, float]:
    """The lookup counters of a node's Prometheus text, as ``hits_ram``,
    ``tokens_restored_disk``, ``misses``, ``tokens_prefilled``, ..."""
    counters: dict[str, float] = {}
    for line in metrics.splitlines():
        tiered = re.fullmatch(r'blockkv_(hits|tokens_restored)_total\{tier="(\w+)"\} (\S+)', line)
        plain = re.fullmatch(r"blockkv_(misses|tokens_prefilled)_total (\S+)", line)
        if tiered:
            counters[f"{tiered[1]}_{tiered[2]}"] = float(tiered[3])
        elif plain:
            counters[plain[1]] = float(plain[2])
    return counters


class Sessions:
    """The sessions the clients take, one at a time each: the workload's, or,
    with a window, new ones (new words on the same two system prompts) until
    it closes."""

    def __init__(self, count: int, window_s: float | None) -> None:
        self._next = itertools.count()
        self._lock = threading.Lock()
        self.count = count
        self.closes = None if window_s is None else time.perf_counter() + window_s

    def open(self) -> bool:
        return self.closes is None or time.perf_counter() < self.closes

    def take(self) -> int | None:
        with self._lock:
            session = next(self._next)
        return session if (session < self.count if self.closes is None else self.open()) else None


def _leading(digests: list[str], held: set[str]) -> int:
    """Tokens of the prompt's leading blocks in ``held``."""
    return BLOCK_SIZE * next((i for i, d in enumerate(digests) if d not in held), len(digests))


class Conversation:
    """One agent's conversation: its messages so far, one turn sent at a time."""

    def __init__(self, session: int, args: argparse.Namespace, tokenizer: PromptTokenizer) -> None:
        self.session, self.args, self.tokenizer = session, args, tokenizer
        self.messages = [{"role": "system", "content": sample_text(args.system_words, seed=1 + session % 2)}]
        self.turn = 0
        self._before: list[str] = []  # the previous prompt's digests

    @property
    def done(self) -> bool:
        return self.turn == self.args.turns

    def step(self, fleet: Fleet, label: tuple[str, int], closes: float | None) -> Sent:
        """Send the next turn through ``fleet``; what came back."""
        args, session, turn = self.args, self.session, self.turn
        self.messages.append({"role": "user", "content": sample_text(args.user_words, seed=1000 * session + turn)})
        tokens = self.tokenizer.tokens("/v1/chat/completions", {"messages": self.messages})
        digests = prefix_digests(tokens, digest_key(SALT))
        held = fleet.held()  # what each node holds as the request leaves
        base = fleet.base()
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
        stream = args.all_streamed or (session + turn) % 2 == 0
        start = time.perf_counter()
        raw = client.chat.completions.with_raw_response.create(
            model="default_model", messages=self.messages, max_tokens=args.max_tokens, temperature=0.0,
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
        end = time.perf_counter()
        node = raw.headers.get(NODE_HEADER) or base
        assert usage is not None and usage.prompt_tokens == len(tokens)
        cached = usage.prompt_tokens_details.cached_tokens
        ram, disk = held[node]
        own = None
        if self._before:  # the conversation so far, as whole blocks: on this node, and not prefilled
            own = set(self._before) <= ram | disk and cached >= BLOCK_SIZE * len(self._before)
        self.messages.append({"role": "assistant", "content": "".join(text)})
        self._before, self.turn = digests, turn + 1
        return Sent(*label, session, turn, node, start - BEGAN, stream, ttft, end - start, usage.prompt_tokens, cached,
                    _leading(digests, ram), _leading(digests, disk), own, closes is None or end <= closes)


class Ready:
    """Conversations waiting for their next turn, the longest waiting first:
    one client's, or, ``--pooled``, every client's (any client sends the next
    turn of whichever conversation has waited longest, never two turns of one
    at once). A finished one is followed by the next session, while there is
    one."""

    def __init__(self, count: int, sessions: Sessions, args: argparse.Namespace, tokenizer: PromptTokenizer) -> None:
        self.sessions, self.args, self.tokenizer = sessions, args, tokenizer
        self._lock = threading.Lock()
        self._queue = collections.deque(Conversation(n, args, tokenizer)
                                        for n in (sessions.take() for _ in range(count)) if n is not None)

    def pop(self) -> Conversation | None:
        with self._lock:
            return self._queue.popleft() if self._queue else None

    def put(self, conversation: Conversation) -> None:
        if conversation.done:
            n = self.sessions.take()
            if n is None:
                return
            conversation = Conversation(n, self.args, self.tokenizer)
        with self._lock:
            self._queue.append(conversation)


def client(fleet: Fleet, ready: Ready, label: tuple[str, int]) -> list[Sent]:
    """One client: the next turn of the conversation that has waited longest,
    while there is one (and the window, if any, is open)."""
    sent: list[Sent] = []
    while ready.sessions.open() and (conversation := ready.pop()) is not None:
        sent.append(conversation.step(fleet, label, ready.sessions.closes))
        ready.put(conversation)
    return sent


def run_way(way: str, fleet_no: int, args: argparse.Namespace, model: Path, tokenizer: PromptTokenizer, url: str,
            options: dict[str, str], work: Path) -> tuple[list[Sent], dict[str, Any]]:
    """The workload through ``way`` on a fresh fleet (new roots and bucket prefix
    under ``work``): every request it sent, and the fleet's record: the seconds
    from the first request sent to the last answered (or the window), the
    nodes' lookup counters, and for the router its view of the nodes."""
    fleet = Fleet(way, args, model, url, options, work)
    try:
        sessions = Sessions(args.sessions, args.window)
        began = time.perf_counter()

        shared = Ready(args.concurrency * args.interleave, sessions, args, tokenizer) if args.pooled else None
        queues = [shared or Ready(args.interleave, sessions, args, tokenizer) for _ in range(args.concurrency)]
        with ThreadPoolExecutor(args.concurrency) as pool:
            clients = [pool.submit(client, fleet, ready, (way, fleet_no)) for ready in queues]
            sent = [s for c in clients for s in c.result()]
        wall = args.window if args.window is not None else time.perf_counter() - began
        record = {"way": way, "fleet": fleet_no, "wall_s": wall, "load_average_after": os.getloadavg(),
                  "window_closed_at": None if sessions.closes is None else sessions.closes - BEGAN,
                  "nodes": [n.url for n in fleet.nodes], "counters": fleet.counters(),
                  "router_health": fleet.router.get("/health") if fleet.router is not None else None}
        return sent, record
    finally:
        fleet.stop()


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
    """Nearest rank; NaN of nothing (a window no request of the kind finished in)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))] if ordered else float("nan")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def source(s: Sent) -> str:
    """Where a request's reused prefix came from, by its ``cached_tokens`` against
    what the node had published holding as it left: its RAM, its disk,
    elsewhere (more than it published: the bucket, or a store of its own not
    published yet; the nodes' /metrics count the tiers exactly, per node), or
    nowhere (under a block reused: prefilled)."""
    if s.cached_tokens < BLOCK_SIZE:
        return "prefill"
    if s.cached_tokens <= s.held_ram + BLOCK_SIZE - 1:
        return "ram"
    return "disk" if s.cached_tokens <= max(s.held_ram, s.held_disk) + BLOCK_SIZE - 1 else "elsewhere"


def busy(sent: list[Sent]) -> list[int]:
    """Per request, the others of its fleet in flight on its node when it was sent (as the client saw them)."""
    return [sum(1 for o in sent if o is not s and o.fleet == s.fleet and o.node == s.node
                and o.sent_at <= s.sent_at < o.sent_at + o.total_s) for s in sent]


def summary(sent: list[Sent], bucket_bytes: int, wall_s: float, fleets: list[dict[str, Any]]) -> dict[str, Any]:
    """One way's figures; with a window, of the requests answered inside it."""
    queued = dict(zip(map(id, sent), busy(sent)))
    sent = [s for s in sent if s.in_window]
    later = [s for s in sent if s.turn > 0]
    ttft_later = [s.ttft_s for s in later if s.ttft_s is not None]
    ttft_all = [s.ttft_s for s in sent if s.ttft_s is not None]
    idle = [s.ttft_s for s in later if s.ttft_s is not None and not queued[id(s)]]
    crowded = [s.ttft_s for s in later if s.ttft_s is not None and queued[id(s)]]
    counters: dict[str, float] = {}
    for fleet in fleets:
        for node in fleet["counters"].values():
            for name, value in node.items():
                counters[name] = counters.get(name, 0.0) + value
    return {
        "requests": len(sent),
        "sessions": len({(s.fleet, s.session) for s in sent}),
        "later_turns": len(later),
        "later_from_own_ram_or_disk": sum(1 for s in later if s.own) / max(len(later), 1),
        **{f"later_from_{where}": sum(1 for s in later if source(s) == where) for where in SOURCES},
        "later_sent_to_a_busy_node": sum(1 for s in later if queued[id(s)]) / max(len(later), 1),
        "in_flight_on_node_at_send_mean": statistics.fmean(queued[id(s)] for s in sent) if sent else float("nan"),
        "prompt_tokens": sum(s.prompt_tokens for s in sent),
        "prefilled_tokens": sum(s.prompt_tokens - s.cached_tokens for s in sent),
        **{f"nodes_{name}": int(value) for name, value in sorted(counters.items())},
        "bucket_bytes_read": bucket_bytes,
        "ttft_later_median_s": _median(ttft_later),
        "ttft_later_p90_s": _percentile(ttft_later, 0.90),
        "ttft_later_p95_s": _percentile(ttft_later, 0.95),
        "ttft_later_idle_node_median_s": _median(idle),
        "ttft_later_busy_node_median_s": _median(crowded),
        "ttft_all_median_s": _median(ttft_all),
        "ttft_all_p95_s": _percentile(ttft_all, 0.95),
        "wall_s": wall_s,
        "requests_per_s": len(sent) / wall_s,
    }


def per_fleet(sent: list[Sent], fleets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per fleet, in the order run: its way, load, requests answered per node, later-turn TTFT median."""
    rows = []
    for fleet in fleets:
        mine = [s for s in sent if s.fleet == fleet["fleet"] and s.in_window]
        ttft = [s.ttft_s for s in mine if s.turn > 0 and s.ttft_s is not None]
        rows.append({"fleet": fleet["fleet"], "way": fleet["way"], "load_after": fleet["load_average_after"],
                     "requests_by_node": [sum(1 for s in mine if s.node == u) for u in fleet["nodes"]],
                     "ttft_later_median_s": _median(ttft),
                     "requests_per_s": len(mine) / fleet["wall_s"]})
    return rows


def fleets(args: argparse.Namespace) -> tuple[dict[str, list[Sent]], dict[str, int], list[dict[str, Any]]]:
    """Every fleet of the run, the ways alternated: the requests per way, the
    block bytes read from the bucket per way, and each fleet's record."""
    work = Path(tempfile.mkdtemp(prefix="blockkv-route-bench-"))
    sent: dict[str, list[Sent]] = {way: [] for way in WAYS}
    read = dict.fromkeys(WAYS, 0)
    records = []
    try:
        model = build_model_dir(work / "model", "llama", overrides=DEMO_MODEL)
        tokenizer = PromptTokenizer(str(model))
        with moto_bucket() as (url, options, received):
            order = [way for r in range(args.rounds) for way in (WAYS if r % 2 == 0 else WAYS[::-1])]
            for n, way in enumerate(order):  # A B B A ...: a load that drifts weighs on both ways alike
                before = received()["blob_bytes_read"]
                done, record = run_way(way, n, args, model, tokenizer, url, options, work / f"{way}-{n}")
                sent[way] += done
                read[way] += received()["blob_bytes_read"] - before
                records.append(record)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return sent, read, records


def report(args: argparse.Namespace, load: tuple[float, ...], started: float) -> dict[str, Any]:
    """Run the fleets; print and return the figures."""
    sent, read, records = fleets(args)
    results = {way: summary(sent[way], read[way], sum(r["wall_s"] for r in records if r["way"] == way),
                            [r for r in records if r["way"] == way]) for way in WAYS}
    router, robin = results["router"], results["round-robin"]
    rows = per_fleet([s for way in WAYS for s in sent[way]], records)
    figures = {"config": vars(args) | {"json": None}, "load_average_1_5_15_at_start": load,
               "wall_s": time.perf_counter() - started, **results, "fleets": rows,
               "ttft_later_median_ratio": router["ttft_later_median_s"] / robin["ttft_later_median_s"],
               "throughput_ratio": router["requests_per_s"] / robin["requests_per_s"]}
    print(f"{'':36s}{'router':>14s}{'round-robin':>14s}")
    for name in router:
        a, b = router[name], robin.get(name, 0)
        print(f"{name:36s}{a:14.3f}{b:14.3f}" if isinstance(a, float) else f"{name:36s}{a:14d}{b:14d}")
    print(f"TTFT median of later turns, router / round-robin: {figures['ttft_later_median_ratio']:.2f} "
          f"(goal <= 0.9); throughput, router / round-robin: {figures['throughput_ratio']:.2f} (goal >= 1)")
    print("load average (1, 5, 15 min) at the start: " + ", ".join(f"{x:.1f}" for x in load))
    for row in rows:
        print(f"fleet {row['fleet']} {row['way']:12s} load after {row['load_after'][0]:.1f}, requests by node "
              f"{'/'.join(map(str, row['requests_by_node']))}, later-turn TTFT median "
              f"{row['ttft_later_median_s']:.2f} s, {row['requests_per_s']:.2f} requests/s")
    figures["requests"] = {way: [asdict(s) for s in sent[way]] for way in WAYS}
    figures["fleet_records"] = records
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=list(WORKLOADS), default="soak",
                   help="the preset the flags below override (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="a tiny run that checks the tool: 3 sessions of 2 short "
                   "turns (the flags below still override)")
    p.add_argument("--sessions", type=int, help="agents (conversations); with --window, new ones follow")
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
    p.add_argument("--window", type=float, metavar="SECONDS",
                   help="time-boxed: each fleet serves for this long, its clients starting new sessions until it "
                   "closes; only requests answered inside it count, throughput is them over the window")
    p.add_argument("--interleave", type=int, default=1, metavar="N",
                   help="conversations each client keeps going at once, a turn of each in turn (default "
                   "%(default)s: one after another)")
    p.add_argument("--pooled", action="store_true",
                   help="the clients share their conversations: each sends the next turn of whichever has waited "
                   "longest (as a pool of workers over many sessions does), so a conversation's turns come from "
                   "any client")
    p.add_argument("--sync-interval", type=float, metavar="SECONDS",
                   help="the nodes' sync_interval: how soon a node learns what the others stored (default: theirs, 30)")
    p.add_argument("--nodes", type=int, default=3, help="nodes per fleet (default %(default)s)")
    p.add_argument("--pin", action="store_true", help="node i runs on CPU core i alone (at most one node per "
                   "core): nodes that share no core, as on machines of their own")
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--floor", action="store_true",
                   help="only the floor: later turns on one idle node, direct, routed and on mlx_lm.server")
    args = p.parse_args(argv)
    preset = {**WORKLOADS["agent" if args.floor else args.workload], **(QUICK if args.quick else {})}
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.interleave < 1:
        raise ValueError(f"--interleave must be at least 1, got {args.interleave}")
    if args.nodes < 1 or (args.pin and args.nodes > len(os.sched_getaffinity(0))):
        raise ValueError(f"--nodes must be at least 1, and with --pin at most the {len(os.sched_getaffinity(0))} "
                         f"cores this process may use, got {args.nodes}")
    if args.window is not None and not args.window > 0:
        raise ValueError(f"--window must be a positive number of seconds, got {args.window}")
    if args.floor:
        work = Path(tempfile.mkdtemp(prefix="blockkv-route-floor-"))
        try:
            medians = floor(args, build_model_dir(work / "model", "llama", overrides=DEMO_MODEL), work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(f"later turns ({args.sessions} conversations of {args.turns} turns, {args.user_words}-word turns), "
              "median time to first token: " + ", ".join(f"{k} {v:.3f} s" for k, v in medians.items()))
        return 0
    figures = report(args, os.getloadavg(), time.perf_counter())
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
