"""blockkv serve against the server its users run today, ``mlx_lm.server``, on
agent sessions that outgrow the RAM tier (issue #45).

The workload: S agent sessions on one shared system prompt, each with its own
task and T turns (a fixed assistant line and a tool result appended per turn,
as tools/restart_bench.py's session), sent interleaved round-robin (turn 1 of
every session, then turn 2 of every session, ...), so that by the time a
session comes back the others have passed through the RAM tier.

The RAM budget: about two sessions' caches. ``--prompt-cache-bytes`` is twice
the KV bytes of a session's last turn (tokens x layers x KV heads x head_dim
x 2 x 4 bytes: both models' KV is float32), and ``--prompt-cache-size`` is 4
entries (mlx-lm keeps two per request: the prompt, and the prompt plus its
answer). Both flags go to both servers. In mlx-lm 0.32.2 the entry count
bounds the RAM cache always (``LRUPromptCache(--prompt-cache-size)``) and the
byte cap only in the batched path (``trim_to`` when a request joins the
batch); both models here are batchable (their caches are ``KVCache``, no
seed, no KV quantisation), so both bounds apply. That the bound bites is
measured, not assumed: ``own-turn hits`` counts the later turns whose cached
tokens cover the session's previous prompt.

blockkv serve gets the same flags plus its disk tier: a fresh ``--cache-dir``
per run and ``--min-restore-tokens`` of ``MIN_RESTORE_TOKENS`` (below a turn's
new tokens, so a session's previous turn is worth restoring). The page cache
is not dropped during a run: the disk tier's files were written seconds
before, as in a live server.

Per run and server: TTFT of every request (streamed with the ``openai``
client, time to the first chunk with content), later-turn (turn >= 2) TTFT
median and p90, wall (all requests, in order, one at a time), prefilled
tokens (``usage.prompt_tokens - cached_tokens``), and each answer (greedy,
temperature 0, ``max_tokens`` tokens), compared across servers and runs.
Runs alternate mlx_lm, blockkv, blockkv, mlx_lm, ... in one process, each on
a freshly started server (one untimed "hello" first, the model's first use).
The same workload is also run with a RAM budget that holds every session
(``fits``): there both servers should be equal, and the table shows it.

    python tools/headtohead_bench.py --quick --out DIR   # ~1 min: demo model, 3 sessions x 3 short turns, one run each
    python tools/headtohead_bench.py                      # demo model: docs/headtohead-bench.{md,json,png}
    python tools/headtohead_bench.py --models smollm2-135m --sessions 3 --turns 3 --system-tokens 120 --tool-tokens 40
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/, for restart_bench

from restart_bench import MODELS, START_BOUND_S, Texts, build_model, new_report

from blockkv.testing.fleet_processes import Process

REPO = Path(__file__).resolve().parent.parent
REQUEST_BOUND_S = 3600.0
MIN_RESTORE_TOKENS = 32
SERVERS = ("mlx_lm.server", "blockkv serve")


@dataclass
class Shape:
    """One head-to-head's workload."""

    models: list[str]
    sessions: int = 6
    turns: int = 5
    system_tokens: int = 1000
    task_tokens: int = 40
    tool_tokens: int = 300
    max_tokens: int = 8
    runs: int = 4  # per point, alternated: mlx_lm, blockkv, blockkv, mlx_lm
    budget_sessions: float = 2.0  # the RAM tier holds about this many sessions' last turns
    points: tuple[str, ...] = ("budget", "fits")


QUICK = Shape(models=["demo"], sessions=3, turns=3, system_tokens=300, tool_tokens=100, runs=2)


def sessions(texts: Texts, shape: Shape) -> list[list[list[dict[str, str]]]]:
    """Per session, each turn's messages: the shared system prompt, the session's
    task, then per turn a fixed assistant line and a tool result."""
    system = {"role": "system", "content": texts.of(shape.system_tokens, seed=1)}
    out = []
    for s in range(shape.sessions):
        history = [system, {"role": "user", "content": f"task {s}: " + texts.of(shape.task_tokens, seed=10 + s)}]
        turns = []
        for t in range(shape.turns):
            if t:
                history.append({"role": "assistant", "content": f"call tool step {t}"})
            tool = texts.of(shape.tool_tokens, seed=1000 * (s + 1) + t)
            history.append({"role": "user", "content": f"tool result {t}: " + tool})
            turns.append(list(history))
        out.append(turns)
    return out


def kv_bytes_per_token(config: dict[str, Any]) -> int:
    """Keys and values of one token over every layer, float32 (both models' KV is)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4


def budget(texts: Texts, last_turn: list[dict[str, str]], config: dict[str, Any], shape: Shape) -> dict[str, int]:
    """The RAM flags: ``budget_sessions`` times the KV of a session's last turn
    (its tokens counted with 16 per message for the chat template, rounded up)."""
    tokens = sum(texts.count(m["content"]) + 16 for m in last_turn)
    return {"prompt_cache_bytes": int(shape.budget_sessions * tokens * kv_bytes_per_token(config)),
            "prompt_cache_size": max(1, round(2 * shape.budget_sessions)), "last_turn_tokens": tokens}


class Server:
    """One server process on 127.0.0.1 and an ``openai`` client on it."""

    def __init__(self, name: str, model: Path, ram: dict[str, int], cache_dir: Path, log: Path) -> None:
        from openai import OpenAI

        args = ["--model", str(model), "--prompt-cache-size", str(ram["prompt_cache_size"]),
                "--prompt-cache-bytes", str(ram["prompt_cache_bytes"])]
        if name == "blockkv serve":
            self.process = Process(["serve", *args, "--cache-dir", str(cache_dir),
                                    "--min-restore-tokens", str(MIN_RESTORE_TOKENS)], log)
        else:
            self.process = Process(args, log, program=("mlx_lm", "server"))
        self.process.wait_ready(START_BOUND_S)
        self.client = OpenAI(base_url=f"{self.process.url}/v1", api_key="none",
                             timeout=REQUEST_BOUND_S, max_retries=0)

    def ask(self, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
        """One streamed greedy request: TTFT (first chunk with content), whole
        time, prompt and cached tokens, the answer."""
        t0 = time.perf_counter()
        ttft, usage, parts = None, None, []
        stream = self.client.chat.completions.create(
            model="default_model", messages=messages, max_tokens=max_tokens, temperature=0.0,  # type: ignore[arg-type]
            stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            content = chunk.choices[0].delta.content if chunk.choices else None
            if content:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                parts.append(content)
            if chunk.usage is not None:
                usage = chunk.usage
        total = time.perf_counter() - t0
        if usage is None:
            raise RuntimeError("the server streamed no usage")
        details = getattr(usage, "prompt_tokens_details", None)
        cached = getattr(details, "cached_tokens", 0) or 0
        return {"ttft_s": total if ttft is None else ttft, "total_s": total, "prompt_tokens": usage.prompt_tokens,
                "cached_tokens": cached, "answer": "".join(parts)}

    def stop(self) -> None:
        self.process.stop(START_BOUND_S)


def run_once(name: str, model: Path, ram: dict[str, int], work: Path, plan: list[list[list[dict[str, str]]]],
             shape: Shape) -> dict[str, Any]:
    """One server, fresh, through the interleaved workload: every request's figures."""
    cache = Path(tempfile.mkdtemp(prefix="cache-", dir=work))
    server = Server(name, model, ram, cache, work / f"{cache.name}.log")
    try:
        server.ask([{"role": "user", "content": "hello"}], 1)  # untimed: the model's first use
        t0 = time.perf_counter()
        requests = []
        for t in range(shape.turns):
            for s, turns in enumerate(plan):
                requests.append({"session": s, "turn": t + 1, **server.ask(turns[t], shape.max_tokens)})
        wall = time.perf_counter() - t0
    finally:
        server.stop()
        shutil.rmtree(cache, ignore_errors=True)
    return {"server": name, "wall_s": wall, "requests": requests}


def figures(run: dict[str, Any]) -> dict[str, Any]:
    """A run's summary: later-turn TTFT median and p90, wall, prefilled tokens,
    and the later turns that found their session's previous prompt cached."""
    reqs = run["requests"]
    later = sorted(r["ttft_s"] for r in reqs if r["turn"] > 1)
    previous = {(r["session"], r["turn"]): r["prompt_tokens"] for r in reqs}
    own_hits = sum(1 for r in reqs if r["turn"] > 1 and r["cached_tokens"] >= previous[(r["session"], r["turn"] - 1)])
    return {"later_ttft_median_s": statistics.median(later),
            "later_ttft_p90_s": later[min(len(later) - 1, round(0.9 * (len(later) - 1)))],
            "wall_s": run["wall_s"], "prefilled": sum(r["prompt_tokens"] - r["cached_tokens"] for r in reqs),
            "own_turn_hits": own_hits, "later_turns": len(later)}


def run_point(model: Path, ram: dict[str, int], work: Path, plan: list[Any], shape: Shape) -> dict[str, Any]:
    """``shape.runs`` runs alternated A B B A ...; per server the median of the
    runs' figures, and whether every answer matched across servers and runs."""
    order = [SERVERS[(i + i // 2) % 2] for i in range(shape.runs)]  # A B B A A B B A ...
    runs = []
    for name in order:
        print(f"  {name} ...", flush=True)
        runs.append(run_once(name, model, ram, work, plan, shape))
        f = figures(runs[-1])
        print(f"    later TTFT median {f['later_ttft_median_s'] * 1e3:.0f} ms, wall {f['wall_s']:.1f} s, "
              f"prefilled {f['prefilled']}, own-turn hits {f['own_turn_hits']}/{f['later_turns']}", flush=True)
    answers = [[r["answer"] for r in run["requests"]] for run in runs]
    same = sum(all(a[i] == answers[0][i] for a in answers) for i in range(len(answers[0])))
    per_server = {}
    for name in SERVERS:
        mine = [figures(r) for r in runs if r["server"] == name]
        per_server[name] = {k: statistics.median(f[k] for f in mine) for k in mine[0]}
    a, b = per_server[SERVERS[1]], per_server[SERVERS[0]]
    return {"ram": ram, "runs": runs, "per_server": per_server,
            "answers_identical": same, "answers": len(answers[0]),
            "ttft_ratio": a["later_ttft_median_s"] / b["later_ttft_median_s"], "wall_ratio": a["wall_s"] / b["wall_s"]}


def run_model(kind: str, shape: Shape, work: Path) -> dict[str, Any]:
    model = build_model(kind, work / f"model-{kind}")
    config = json.loads((model / "config.json").read_text())
    texts = Texts(model)
    plan = sessions(texts, shape)
    tight = budget(texts, plan[0][-1], config, shape)
    # every request's two entries, with room to spare: nothing is evicted
    fits = {"prompt_cache_bytes": 4 * shape.sessions * tight["prompt_cache_bytes"],
            "prompt_cache_size": 4 * shape.sessions * shape.turns, "last_turn_tokens": tight["last_turn_tokens"]}
    out: dict[str, Any] = {"model": kind, "config": config, "kv_bytes_per_token": kv_bytes_per_token(config)}
    for point, ram in (("budget", tight), ("fits", fits)):
        if point not in shape.points:
            continue
        print(f"[{kind}] {point}: --prompt-cache-bytes {ram['prompt_cache_bytes']} "
              f"--prompt-cache-size {ram['prompt_cache_size']}", flush=True)
        out[point] = run_point(model, ram, work, plan, shape)
    return out


# ---------------------------------------------------------------- the report


def render(report: dict[str, Any], command: str) -> str:
    s = report["shape"]
    lines = [f"Generated by `{command}` on {report['date']} ({report['cores']} cores; load average 1/5/15 min "
             f"before {report['loadavg_before']}, after {report['loadavg_after']}). {s['sessions']} sessions x "
             f"{s['turns']} turns, interleaved; system prompt ~{s['system_tokens']} tokens shared, tool results "
             f"~{s['tool_tokens']} tokens, {s['max_tokens']} tokens generated; {s['runs']} runs per point, "
             f"alternated; medians of the runs.", "",
             "| model | RAM point | server | later-turn TTFT median | p90 | wall | prefilled tokens | own-turn hits "
             "| blockkv / mlx_lm TTFT | wall | answers identical |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["models"]:
        for point in report["shape"]["points"]:
            p = r[point]
            ram = (f"{p['ram']['prompt_cache_bytes'] / 2**20:.1f} MiB, {p['ram']['prompt_cache_size']} entries")
            for name in SERVERS:
                f = p["per_server"][name]
                ratios = (f"**{p['ttft_ratio']:.2f}x** | **{p['wall_ratio']:.2f}x** | "
                          f"{p['answers_identical']}/{p['answers']}") if name == SERVERS[1] else " | | "
                lines.append(f"| {r['model']} | {point} ({ram}) | {name} | {f['later_ttft_median_s'] * 1e3:.0f} ms | "
                             f"{f['later_ttft_p90_s'] * 1e3:.0f} ms | {f['wall_s']:.1f} s | {f['prefilled']:.0f} | "
                             f"{f['own_turn_hits']:.0f}/{f['later_turns']:.0f} | {ratios} |")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = report["models"]
    points = report["shape"]["points"]
    fig, axes = plt.subplots(1, len(points) * len(models), figsize=(6 * len(models) * len(points), 4), squeeze=False)
    for i, r in enumerate(models):
        for ax, point in zip(axes[0][len(points) * i: len(points) * (i + 1)], points):
            for name, color in zip(SERVERS, ("tab:red", "tab:blue")):
                run = next(x for x in r[point]["runs"] if x["server"] == name)
                ttft = [q["ttft_s"] * 1e3 for q in run["requests"]]
                ax.plot(range(1, len(ttft) + 1), ttft, marker="o", ms=3, color=color, label=name)
            ax.set_yscale("log")
            ax.set_xlabel("request (interleaved: turn 1 of every session, then turn 2, ...)")
            ax.set_ylabel("TTFT (ms)")
            ram = r[point]["ram"]
            ax.set_title(f"{r['model']}, {point}: {ram['prompt_cache_bytes'] / 2**20:.1f} MiB RAM")
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_shape(argv: list[str] | None) -> tuple[argparse.Namespace, Shape]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: demo model, 3 sessions x 3 short turns")
    parser.add_argument("--out", type=Path, help="output directory (full mode default: docs/)")
    parser.add_argument("--models", help=f"comma-separated, of {', '.join(MODELS)} (default: demo)")
    for flag in ("sessions", "turns", "system-tokens", "tool-tokens", "runs"):
        parser.add_argument(f"--{flag}", type=int)
    parser.add_argument("--points", help="comma-separated, of budget, fits (default: both)")
    parser.add_argument("--workdir", type=Path, help="where the caches and models go (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.quick and args.out is None:
        parser.error("--quick writes only to --out DIR")
    shape = Shape(**asdict(QUICK)) if args.quick else Shape(models=["demo"])
    if args.models:
        shape.models = args.models.split(",")
        if set(shape.models) - set(MODELS):
            parser.error(f"unknown models {sorted(set(shape.models) - set(MODELS))}")
    if args.points:
        shape.points = tuple(args.points.split(","))
        if not shape.points or set(shape.points) - {"budget", "fits"}:
            parser.error("--points takes budget, fits or both")
    for key in ("sessions", "turns", "system_tokens", "tool_tokens", "runs"):
        if getattr(args, key):
            setattr(shape, key, getattr(args, key))
    return args, shape


def main(argv: list[str] | None = None) -> int:
    args, shape = parse_shape(argv)
    out = args.out or REPO / "docs"
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="blockkv-h2h-", dir=args.workdir))
    command = "python tools/headtohead_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report = new_report(shape)
    t0 = time.perf_counter()
    try:
        for kind in shape.models:
            report["models"].append(run_model(kind, shape, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["loadavg_after"] = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    report["seconds"] = time.perf_counter() - t0
    (out / "headtohead-bench.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "headtohead-bench.md").write_text(render(report, command.strip()))
    plot(report, out / "headtohead-bench.png")
    print(render(report, command.strip()))
    print(f"{report['seconds']:.0f} s; wrote {out}/headtohead-bench.{{md,json,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
