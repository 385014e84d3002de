"""Write work per request of the serving disk tier (issue #45): what
``PersistentPromptCache`` writes for each chat request the way mlx-lm
0.32.2's batched server inserts caches into it.

For a chat request that server inserts two caches: at the end of the prompt's
"user" segment (the prompt but its last token, ``cache_type="user"``), and
when the answer is done (the prompt and the answer, ``"assistant"``); the
first turn of a session also inserts its system prompt (``"system"``). Here a
tiny random-weight llama (real forward passes, real ``KVCache`` objects)
plays agent sessions on one system prompt: each request fetches its nearest
cache as the server does, prefills the rest, inserts the segment's cache,
generates the answer and inserts the final cache, then waits for the
write-behind (``flush``). Per request: bytes written (this process's
``/proc/self/io`` ``write_bytes``), fsyncs (counted at the store's file-layer
seam), wall time of the two inserts and of the flush that waits for their
writes (not the model's), and spills made.

    python tools/spill_work.py                    # 4 sessions x 6 turns
    PYTHONPATH=<another tree> python tools/spill_work.py --out before.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.harness import io_counters
from blockkv.serving.identity import StoreIdentity
from blockkv.serving.prompt_cache import PersistentPromptCache

from blockkv.fs import FileLayer
from blockkv.testing.models import VOCAB, prefill, tiny_model

MODEL_KEY = ("spill-work/tiny-llama", None, None)  # mlx-lm's (model, adapter, draft) key


class CountingFiles(FileLayer):
    """The store's file layer, counting the fsyncs that reach the OS."""

    def __init__(self) -> None:
        super().__init__()
        self.fsyncs = 0

    def plain_fsync(self, fd: int) -> None:
        self.fsyncs += 1
        super().plain_fsync(fd)


def answer(model: Any, cache: list[Any], last: int, n: int) -> list[int]:
    """``n`` greedy tokens after ``last``, extending ``cache`` in place."""
    out, token = [], last
    for _ in range(n):
        logits = model(mx.array([[token]]), cache=cache)
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
    mx.eval([c.state for c in cache])
    return out


def request(model: Any, cache: PersistentPromptCache, prompt: list[int], answer_tokens: int) -> tuple[list[int], float]:
    """One chat request as the batched server serves it; returns prompt +
    answer, and the seconds its two inserts took (not the model's)."""
    found, rest = cache.fetch_nearest_cache(MODEL_KEY, prompt)
    if len(rest) < 2:
        raise RuntimeError("the whole prompt was cached: the sessions need new tokens each turn")
    kv, _ = prefill(model, rest[:-1], found)
    t0 = time.perf_counter()
    cache.insert_cache(MODEL_KEY, prompt[:-1], copy.deepcopy(kv), cache_type="user")
    inserts = time.perf_counter() - t0
    tokens = prompt + answer(model, kv, prompt[-1], answer_tokens)
    t0 = time.perf_counter()
    cache.insert_cache(MODEL_KEY, tokens[:-1], kv, cache_type="assistant")  # all_tokens: the last is not in the cache
    return tokens, inserts + time.perf_counter() - t0


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    model = tiny_model("llama")
    files = CountingFiles()
    rng = np.random.default_rng(0)
    system = rng.integers(0, VOCAB, args.system_tokens).tolist()
    histories = [list(system) for _ in range(args.sessions)]
    rows: list[dict[str, float]] = []
    cache = PersistentPromptCache(max_size=args.ram_entries, cache_dir=root, fs=files,
                                  identity=lambda key: StoreIdentity("spill-work", "tiny-llama-f32", "vocab-256"))
    with cache:
        for _ in range(args.turns):
            for s, history in enumerate(histories):
                prompt = history + rng.integers(0, VOCAB, args.turn_tokens).tolist()
                io0, fsyncs0, spills0 = io_counters()["write_bytes"], files.fsyncs, cache.tier_stats["spills"]
                histories[s], inserts = request(model, cache, prompt, args.answer_tokens)
                t0 = time.perf_counter()
                cache.flush()
                rows.append({"insert_seconds": inserts, "flush_seconds": time.perf_counter() - t0,
                             "write_bytes": io_counters()["write_bytes"] - io0,
                             "fsyncs": files.fsyncs - fsyncs0,
                             "spills": cache.tier_stats["spills"] - spills0})
        (store,) = cache.stores()
        entries = len(store)
        stats = cache.tier_stats
    return {
        "requests": len(rows), "entries_at_end": entries, "tier_stats": stats,
        "per_request": {k: statistics.mean(r[k] for r in rows) for k in rows[0]},
        "per_request_median": {k: statistics.median(r[k] for r in rows) for k in rows[0]},
        "loadavg": os.getloadavg(),
        "config": vars(args) | {"out": str(args.out) if args.out else None},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--turn-tokens", type=int, default=200)
    parser.add_argument("--answer-tokens", type=int, default=48)
    parser.add_argument("--ram-entries", type=int, default=4, help="the RAM tier's max_size")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here too")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="blockkv-spill-") as root:
        report = run(args, Path(root))
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
