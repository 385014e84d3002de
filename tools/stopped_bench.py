"""What a process stopped inside an index transaction costs a chat request's
TTFT on ``blockkv serve`` (#43): baseline requests and requests made while
another process on the same cache root is stopped (SIGSTOP) inside a write
transaction, or a read transaction (and, "read+spill", a read transaction
once a spill of this server waits on it: the server's own writer then keeps
its lookups out for moments), alternated round by round (ABBA, so load
drifts hit every arm alike); every request is a new prompt, a miss that
prefills.

    python tools/stopped_bench.py --rounds 10
    python tools/stopped_bench.py --model ~/.cache/blockkv/models/smollm2-135m --words 1500

Prints each arm's TTFT (median, p90, max), the median's rise over baseline,
and the store's counters of lookups that met the busy index; ``--out`` also
writes them as JSON. docs/reliability.md has the runs. A real server driven
by the ``openai`` client, real holder processes (blockkv.testing.stopped);
nothing is mocked.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from blockkv.model_dir import build_model_dir, sample_text
from blockkv.testing.fleet_processes import Process
from blockkv.testing.stopped import MODES, continued, ended, scrape, serve_store_options, stopped_in_txn
from blockkv.testing.streams import no_eos_bias, stream_chat

BOUND = 300.0  # a safety bound on any wait (not a timing claim)
ARMS = (*MODES, "read+spill")


class Bench:
    def __init__(self, model: Path, work: Path, words: int) -> None:
        self.cache, self.words = work / "cache", words
        self.options, self.bias = serve_store_options(model), no_eos_bias(model)
        self.process = Process(["serve", "--model", str(model), "--cache-dir", str(self.cache)], work / "serve.log")
        self.process.wait_ready()
        self.seed = 0

    def settle(self) -> None:
        """Until the spills handed over so far have landed."""
        while scrape(self.process.url, BOUND)["blockkv_pending_spills"]:
            time.sleep(0.05)

    def ttft(self) -> float:
        """One new prompt's TTFT."""
        self.seed += 1
        answer = stream_chat(self.process.url, "none",
                             [{"role": "user", "content": sample_text(self.words, seed=self.seed)}], 4, self.bias)
        return answer.ttft

    def stopped_ttft(self, arm: str) -> float:
        """One new prompt's TTFT while a holder is stopped inside a transaction
        (``arm``: its mode; "+spill": asked once a spill of this server waits on it)."""
        mode, _, spill = arm.partition("+")
        holder = stopped_in_txn(self.cache, mode, self.options)
        try:
            if spill:
                self.ttft()
                while not scrape(self.process.url, BOUND)["blockkv_pending_spills"]:
                    time.sleep(0.02)
            ttft = self.ttft()
            if continued(holder, BOUND) != "stored":
                raise RuntimeError("the holder's store after SIGCONT did not land")
            return ttft
        finally:
            ended(holder)


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median_s": statistics.median(ordered), "p90_s": ordered[int(0.9 * (len(ordered) - 1))],
            "max_s": ordered[-1], "n": len(ordered)}


def run(bench: Bench, stopped: list[str], rounds: int) -> dict[str, Any]:
    """``rounds`` rounds; each measures the baseline and every arm, in ABBA order."""
    arms: dict[str, list[float]] = {"baseline": [], **{a: [] for a in stopped}}
    before = scrape(bench.process.url, BOUND)
    for r in range(rounds):
        order = ["baseline", *stopped]
        for arm in order if r % 2 == 0 else order[::-1]:
            bench.settle()
            arms[arm].append(bench.ttft() if arm == "baseline" else bench.stopped_ttft(arm))
    after = scrape(bench.process.url, BOUND)
    result: dict[str, Any] = {arm: summary(v) for arm, v in arms.items()}
    for arm in stopped:
        result[arm]["median_rise_s"] = result[arm]["median_s"] - result["baseline"]["median_s"]
    result["counters"] = {k: after[f"blockkv_index_busy_{k}_total"] - before[f"blockkv_index_busy_{k}_total"]
                          for k in ("refreshes", "waits")}
    result["counters"]["spill_failures"] = after["blockkv_spill_failures_total"] - before["blockkv_spill_failures_total"]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--arm", action="append", choices=ARMS,
                        help="what is stopped when the timed chat is asked (repeatable; default: all): "
                             "+spill: a spill of this server waits on it then")
    parser.add_argument("--model", type=Path, help="an mlx-lm model directory (default: a tiny random llama)")
    parser.add_argument("--words", type=int, default=400, help="words of each prompt (default: %(default)s)")
    parser.add_argument("--out", type=Path, help="also write the report here, as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = args.model or build_model_dir(work / "model", "llama")
        bench = Bench(model, work, args.words)
        try:
            bench.ttft()  # untimed: the model's first use
            load_before = os.getloadavg()
            result = run(bench, args.arm or list(ARMS), args.rounds)
        finally:
            bench.process.stop()
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "platform": platform.platform(),
              "cores": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg(),
              "model": str(args.model or "tiny random llama"), "words": args.words, "rounds": args.rounds, **result}
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
