"""What a user waits for after a restart: an agent session and a long prompt
replayed through a real ``blockkv serve`` with the ``openai`` client, in three
phases (issue #34; the shape of oMLX #2662, the method of SGLang #32503):

- **warm**: one server for the whole session; each turn finds the previous
  turn's cache in mlx-lm's RAM tier and prefills only what is new.
- **restored**: the server is stopped (Ctrl-C, as a user would) and started
  again before *every* turn, and the page cache of every file under the cache
  directory is dropped (``posix_fadvise(DONTNEED)`` on each file, after the
  server has fsync'd and closed it; the model's files are left alone); each
  turn's prefix then comes from disk, cold. One unrelated short request after
  each start (untimed) warms the model up, as a server's first user would.
- **recomputed**: the same, but every start gets a new empty cache directory:
  every turn prefills its whole prompt.

The same prompts in every phase: the assistant's turns in the history are
fixed text (not what the model generated), so turn ``t``'s prompt is turn
``t-1``'s plus one assistant line and one tool result. TTFT is the time from
the request to the first streamed chunk (the first token); a turn's time is
the whole request (``--max-tokens`` tokens generated); a session's time is
the sum of its turns' (restarts not included). ``cached_tokens`` is what the
server reports it did not prefill.

The long prompt: a document of ``--long-tokens`` tokens with a question is
asked once (stored); the same document with a second question is timed warm
(same server), and with a third restored (restart + page cache dropped) and
recomputed (new empty cache directory): each time only the question is new.

Models: ``demo`` (``blockkv demo``'s random-weight llama: 4 layers, 2 KV
heads, head_dim 64, float32; 20 turns, a 12k-token document) and
``llama-1b-kv``: a random-weight llama with Llama-3.2-1B's KV shapes (16
layers, 8 KV heads, head_dim 64; bfloat16, so 32 KiB of KV per token as the
real model) and a narrow residual (hidden 128) so that it prefills at all on
a CPU; it still prefills at ~10-80 tokens/s on 2 cores, so its session has 4
turns and its document 8k tokens. And ``smollm2-135m``: a real model,
SmolLM2-135M-Instruct 4-bit (``blockkv.real_model``, fetched from PyPI once;
30 layers, 3 KV heads, head_dim 64; float32 KV, as its float32 norms make
it); MLX's CPU backend prefills it at ~5-10 tokens/s, so its session has 3
turns and its document 2k tokens (~17k prefilled tokens: 30-60 min more of
the full run on 2 cores, estimated from that rate; not run yet).

    python tools/restart_bench.py --quick --out DIR   # ~1-2 min: demo model, 3 turns of 400 tokens, 1.5k-token document
    python tools/restart_bench.py --quick --models smollm2-135m --turns 4 --system-tokens 150 --tool-tokens 40 --long-tokens 300 --out DIR
                                                      # the real model, short prompts (docs/benchmarks.md's table)
    python tools/restart_bench.py                     # docs/restart-bench.{md,json,png}; 72 min on 2 cores before smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# tools/, for its benchmarks/ package (this file is run as a script)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.harness import drop_page_cache  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
START_BOUND_S = 300.0  # a broken server fails the run instead of hanging it
REQUEST_BOUND_S = 3600.0

MODELS: dict[str, dict[str, Any]] = {
    "demo": {},  # blockkv.mlx_lm.demo.DEMO_MODEL, float32
    "llama-1b-kv": {
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 16,
        "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64,
    },
    "smollm2-135m": {},  # blockkv.real_model: SmolLM2-135M-Instruct as published, 4-bit
}


@dataclass
class Shape:
    """One benchmark's workload."""

    models: list[str]
    system_tokens: int = 1200
    tool_tokens: int = 950
    # the Llama-3.2-1B-shaped model prefills at ~10-80 tokens/s on a 2-core CPU: fewer turns, the shortest document
    turns: dict[str, int] = field(default_factory=lambda: {"demo": 20, "llama-1b-kv": 4, "smollm2-135m": 3})
    long_tokens: dict[str, int] = field(default_factory=lambda: {"demo": 12000, "llama-1b-kv": 8000,
                                                                  "smollm2-135m": 2000})
    max_tokens: int = 8


# a smoke run: the demo model, 3 turns of a smaller session, a 1.5k-token document
QUICK = Shape(models=["demo"], system_tokens=600, tool_tokens=400,
              turns={"demo": 3, "llama-1b-kv": 2, "smollm2-135m": 2},
              long_tokens={"demo": 1500, "llama-1b-kv": 1000, "smollm2-135m": 500})


# ---------------------------------------------------------------- the model and its prompts


def build_model(kind: str, path: Path) -> Path:
    """A loadable model directory of ``kind`` (see ``MODELS``): random weights
    built in ``path``, or the real model from its cache."""
    import mlx.core as mx

    from blockkv.mlx_lm.demo import DEMO_MODEL
    from blockkv.model_dir import build_model_dir
    from blockkv.real_model import real_model_dir

    if kind == "smollm2-135m":
        return real_model_dir()
    build_model_dir(path, "llama", overrides=MODELS[kind] or DEMO_MODEL)
    if kind == "llama-1b-kv":  # the real model's bytes per token: bf16 weights, so bf16 KV
        weights = mx.load(str(path / "model.safetensors"))
        mx.save_safetensors(str(path / "model.safetensors"), {k: v.astype(mx.bfloat16) for k, v in weights.items()})
    return path


class Texts:
    """Reproducible prose of about ``n`` tokens under the model's tokenizer."""

    def __init__(self, model: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(model / "tokenizer.json"))

    def count(self, text: str) -> int:
        return len(self._tok.encode(text).ids)

    def of(self, tokens: int, seed: int) -> str:
        from blockkv.model_dir import sample_text

        words = max(1, tokens // 2)
        for _ in range(8):  # a few corrections of the words-per-token estimate
            text = sample_text(words, seed=seed)
            got = self.count(text)
            if abs(got - tokens) <= max(8, tokens // 100):
                break
            words = max(1, round(words * tokens / max(got, 1)))
        return text


def session(texts: Texts, shape: Shape, turns: int) -> list[list[dict[str, str]]]:
    """Each turn's messages: a system prompt, a task, then per turn the previous
    turns' fixed assistant lines and tool results (sent as user messages)."""
    history = [{"role": "system", "content": texts.of(shape.system_tokens, seed=1)},
               {"role": "user", "content": "task: " + texts.of(40, seed=2)}]
    out = []
    for t in range(turns):
        if t:
            history.append({"role": "assistant", "content": f"call tool step {t}"})
        history.append({"role": "user", "content": f"tool result {t}: " + texts.of(shape.tool_tokens, seed=100 + t)})
        out.append(list(history))
    return out


# ---------------------------------------------------------------- the server


class Server:
    """One ``blockkv serve`` process on 127.0.0.1 (the fleet kit's ``Process``,
    logging to a file) and an ``openai`` client on it."""

    def __init__(self, model: Path, cache_dir: Path, log: Path) -> None:
        from openai import OpenAI

        from blockkv.testing.fleet_processes import Process

        self.process = Process(["serve", "--model", str(model), "--cache-dir", str(cache_dir)], log)
        self.process.wait_ready(START_BOUND_S)
        self.client = OpenAI(base_url=f"{self.process.url}/v1", api_key="none",
                             timeout=REQUEST_BOUND_S, max_retries=0)

    def ask(self, messages: list[dict[str, str]], max_tokens: int) -> dict[str, float]:
        """One streamed chat request: TTFT, whole time, prompt and cached tokens."""
        t0 = time.perf_counter()
        ttft = None
        usage = None
        stream = self.client.chat.completions.create(
            model="default_model", messages=messages, max_tokens=max_tokens, temperature=0.0,  # type: ignore[arg-type]
            stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if ttft is None:
                ttft = time.perf_counter() - t0
            if chunk.usage is not None:
                usage = chunk.usage
        total = time.perf_counter() - t0
        assert ttft is not None and usage is not None, "the server streamed no token or no usage"
        details = getattr(usage, "prompt_tokens_details", None)
        cached = getattr(details, "cached_tokens", 0) or 0
        return {"ttft_s": ttft, "total_s": total, "prompt_tokens": usage.prompt_tokens, "cached_tokens": cached}

    def stop(self) -> None:
        """SIGTERM, as a service manager stops it: the disk tier finishes its
        writes and closes (Ctrl-C is ignored when the run is a background job)."""
        if self.process.stop(START_BOUND_S) == -signal.SIGKILL:
            raise RuntimeError(f"server did not stop on SIGTERM:\n{self.process.log.read_text()[-4000:]}")


class Restarts:
    """A server restarted before each request: on one cache directory, its page
    cache dropped each time (restored), or on a new empty one each time
    (recomputed)."""

    def __init__(self, model: Path, work: Path, name: str, fresh: bool, max_tokens: int) -> None:
        self._model, self._work, self._name, self._fresh = model, work, name, fresh
        self._max_tokens = max_tokens
        self._cache = work / f"{name}-cache"
        self._starts = 0

    def ask(self, messages: list[dict[str, str]], cache: Path | None = None) -> dict[str, float]:
        self._starts += 1
        cache = cache or (self._work / f"{self._name}-cache-{self._starts}" if self._fresh else self._cache)
        if not self._fresh and cache.exists():
            drop_page_cache(cache)
        server = Server(self._model, cache, self._work / f"{self._name}.log")
        try:
            server.ask([{"role": "user", "content": "hello"}], 1)  # untimed: the model's first use
            return server.ask(messages, self._max_tokens)
        finally:
            server.stop()
            if self._fresh:
                shutil.rmtree(cache, ignore_errors=True)


# ---------------------------------------------------------------- the phases


def run_model(kind: str, shape: Shape, work: Path) -> dict[str, Any]:
    model = build_model(kind, work / f"model-{kind}")
    texts = Texts(model)
    turns = session(texts, shape, shape.turns[kind])
    out: dict[str, Any] = {"model": kind, "config": json.loads((model / "config.json").read_text())}
    print(f"[{kind}] {len(turns)} turns; warm", flush=True)
    warm_cache = work / f"{kind}-warm-cache"
    server = Server(model, warm_cache, work / f"{kind}-warm.log")
    try:
        server.ask([{"role": "user", "content": "hello"}], 1)
        warm = [server.ask(m, shape.max_tokens) for m in turns]
    finally:
        server.stop()
    print(f"[{kind}] restored (a restart before each turn, page cache dropped)", flush=True)
    restored_runs = Restarts(model, work, f"{kind}-restored", fresh=False, max_tokens=shape.max_tokens)
    restored = [restored_runs.ask(m) for m in turns]
    print(f"[{kind}] recomputed (a restart before each turn, empty cache)", flush=True)
    recompute_runs = Restarts(model, work, f"{kind}-recomputed", fresh=True, max_tokens=shape.max_tokens)
    recomputed = [recompute_runs.ask(m) for m in turns]
    out["session"] = {"warm": warm, "restored": restored, "recomputed": recomputed}
    out["long"] = long_prompt(kind, model, texts, shape, work)
    return out


def long_prompt(kind: str, model: Path, texts: Texts, shape: Shape, work: Path) -> dict[str, Any]:
    print(f"[{kind}] long prompt of ~{shape.long_tokens[kind]} tokens", flush=True)
    document = texts.of(shape.long_tokens[kind], seed=7)
    first = [{"role": "system", "content": document}, {"role": "user", "content": "question: " + texts.of(20, seed=8)}]
    second, third = ([first[0], {"role": "user", "content": "question: " + texts.of(20, seed=seed)}] for seed in (9, 10))
    cache = work / f"{kind}-long-cache"
    server = Server(model, cache, work / f"{kind}-long.log")
    try:
        server.ask([{"role": "user", "content": "hello"}], 1)
        stored = server.ask(first, shape.max_tokens)
        warm = server.ask(second, shape.max_tokens)
    finally:
        server.stop()
    # a question not asked before: the document is on disk, the whole prompt is not
    restored = Restarts(model, work, f"{kind}-long", fresh=False, max_tokens=shape.max_tokens).ask(third, cache)
    recomputed = Restarts(model, work, f"{kind}-long-recomputed", fresh=True, max_tokens=shape.max_tokens).ask(third)
    return {"first": stored, "warm": warm, "restored": restored, "recomputed": recomputed}


# ---------------------------------------------------------------- the report


PHASES = ("warm", "restored", "recomputed")


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """Per phase: session time, TTFT of the later turns (median, max), and the goals' ratios."""
    s = result["session"]
    out: dict[str, Any] = {}
    for phase in PHASES:
        later = [t["ttft_s"] for t in s[phase][1:]] or [s[phase][0]["ttft_s"]]
        out[phase] = {"session_s": sum(t["total_s"] for t in s[phase]),
                      "later_ttft_median_s": statistics.median(later), "later_ttft_max_s": max(later)}
    ratios = [r["ttft_s"] / w["ttft_s"] for w, r in zip(s["warm"][1:], s["restored"][1:])]
    out["restored_over_warm_ttft_later_turns"] = {"median": statistics.median(ratios) if ratios else None,
                                                  "max": max(ratios) if ratios else None}
    out["restored_over_warm_session"] = out["restored"]["session_s"] / out["warm"]["session_s"]
    return out


def render(report: dict[str, Any], command: str) -> str:
    lines = ["# blockkv restart benchmark", "",
             f"Generated by `{command}` on {report['date']}; raw figures in `restart-bench.json`. "
             f"Load average before / after (1, 5, 15 min): {report['loadavg_before']} / {report['loadavg_after']}.",
             "", "How it is measured: see `tools/restart_bench.py`'s docstring. Restored = the server restarted "
             "before every turn and the page cache of its cache directory dropped (posix_fadvise DONTNEED per "
             "file); recomputed = restarted with an empty cache directory; warm = one server throughout.", ""]
    lines += ["| model | shape | turns | warm session | restored session | recomputed session | restored / warm "
              "session | later-turn TTFT restored / warm, median (max) |", "|---|---|---|---|---|---|---|---|"]
    for r in report["models"]:
        c, sm = r["config"], r["summary"]
        shape = f"{c['num_hidden_layers']} layers x {c['num_key_value_heads']} KV heads x {c.get('head_dim', 64)}"
        ratio = sm["restored_over_warm_ttft_later_turns"]
        med = "n/a" if ratio["median"] is None else f"{ratio['median']:.2f}x ({ratio['max']:.2f}x)"
        lines.append(f"| {r['model']} | {shape} | {len(r['session']['warm'])} | {sm['warm']['session_s']:.2f} s | "
                     f"{sm['restored']['session_s']:.2f} s | {sm['recomputed']['session_s']:.2f} s | "
                     f"{sm['restored_over_warm_session']:.2f}x | {med} |")
    for r in report["models"]:
        lines += ["", f"## {r['model']}: TTFT per turn", "",
                  "| turn | prompt tokens | warm TTFT (cached) | restored TTFT (cached) | recomputed TTFT | "
                  "restored / warm |", "|---|---|---|---|---|---|"]
        s = r["session"]
        for t, (w, rs, rc) in enumerate(zip(s["warm"], s["restored"], s["recomputed"]), 1):
            lines.append(f"| {t} | {w['prompt_tokens']} | {w['ttft_s'] * 1e3:.0f} ms ({w['cached_tokens']}) | "
                         f"{rs['ttft_s'] * 1e3:.0f} ms ({rs['cached_tokens']}) | {rc['ttft_s'] * 1e3:.0f} ms | "
                         f"{rs['ttft_s'] / w['ttft_s']:.2f}x |")
        lp = r["long"]
        lines += ["", f"Long prompt ({lp['warm']['prompt_tokens']} tokens, a new question on a stored document): "
                  f"warm {lp['warm']['ttft_s'] * 1e3:.0f} ms ({lp['warm']['cached_tokens']} cached), "
                  f"restored {lp['restored']['ttft_s'] * 1e3:.0f} ms ({lp['restored']['cached_tokens']} cached), "
                  f"recomputed {lp['recomputed']['ttft_s'] * 1e3:.0f} ms; restored / warm "
                  f"{lp['restored']['ttft_s'] / lp['warm']['ttft_s']:.2f}x."]
    lines += ["", "![TTFT per turn](restart-bench.png)", ""]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    models = report["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, r in zip(axes[0], models):
        for phase in PHASES:
            ttft = [t["ttft_s"] * 1e3 for t in r["session"][phase]]
            ax.plot(range(1, len(ttft) + 1), ttft, marker="o", label=phase)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("turn")
        ax.set_ylabel("TTFT (ms)")
        ax.set_title(f"{r['model']}: agent session")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def new_report(shape: Any) -> dict[str, Any]:
    """A benchmark report's head: when, on what machine, at what load, of what shape (headtohead_bench's too)."""
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "platform": platform.platform(),
            "cores": os.cpu_count(), "loadavg_before": ", ".join(f"{x:.2f}" for x in os.getloadavg()),
            "shape": asdict(shape), "models": []}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (~1-2 min): demo model, 3 short turns, a 1.5k-token document; needs --out")
    parser.add_argument("--out", type=Path, help="output directory (full mode default: docs/)")
    parser.add_argument("--models", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--turns", type=int, help="turns per session, every model")
    parser.add_argument("--long-tokens", type=int, help="tokens of the long prompt's document")
    parser.add_argument("--system-tokens", type=int, help="tokens of the session's system prompt")
    parser.add_argument("--tool-tokens", type=int, help="tokens of each turn's tool result")
    parser.add_argument("--workdir", type=Path, help="where the caches and models go (default: a temp dir)")
    args = parser.parse_args()
    if args.quick and args.out is None:
        parser.error("--quick writes only to --out DIR")
    shape = QUICK if args.quick else Shape(models=list(MODELS))
    if args.models:
        shape.models = args.models.split(",")
        unknown = set(shape.models) - set(MODELS)
        if unknown:
            parser.error(f"unknown models {sorted(unknown)}")
    if args.turns:
        shape.turns = {m: args.turns for m in MODELS}
    if args.long_tokens:
        shape.long_tokens = {m: args.long_tokens for m in MODELS}
    shape.system_tokens = args.system_tokens or shape.system_tokens
    shape.tool_tokens = args.tool_tokens or shape.tool_tokens
    out = args.out or REPO / "docs"
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="blockkv-restart-", dir=args.workdir))
    command = "python tools/restart_bench.py" + "".join(
        f" {flag}" + ("" if value is True else f" {value}")
        for flag, value in (("--quick", args.quick), ("--models", args.models), ("--turns", args.turns),
                            ("--long-tokens", args.long_tokens), ("--system-tokens", args.system_tokens),
                            ("--tool-tokens", args.tool_tokens)) if value)
    report = new_report(shape)
    t0 = time.perf_counter()
    try:
        for kind in shape.models:
            result = run_model(kind, shape, work)
            result["summary"] = summary(result)
            report["models"].append(result)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["loadavg_after"] = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    report["seconds"] = time.perf_counter() - t0
    (out / "restart-bench.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "restart-bench.md").write_text(render(report, command))
    plot(report, out / "restart-bench.png")
    print(render(report, command))
    print(f"\n{report['seconds']:.0f} s; wrote {out}/restart-bench.{{md,json,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
