"""Concurrent streamed chats through the ``openai`` client, timed per chunk:
whether a server ran them together (batched) or one after another, and what
each was told of its cached tokens. For the per-key tests and
tools/tenants_bench.py."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Any

import openai

BOUND_S = 300.0  # a safety bound on one request (not a timing claim)


@dataclass(frozen=True)
class Streamed:
    """One streamed chat: when it was sent, its first and last content chunk
    (``time.monotonic``), and its usage."""

    sent: float
    first: float
    last: float
    cached_tokens: int
    prompt_tokens: int
    completion_tokens: int

    @property
    def ttft(self) -> float:
        """Seconds from sending to the first content chunk."""
        return self.first - self.sent


def no_eos_bias(model_dir: Path) -> dict[str, int]:
    """A ``logit_bias`` that keeps a random-weight model from stopping early, so
    every stream decodes its ``max_tokens``."""
    config = json.loads((model_dir / "config.json").read_text())
    eos = config["eos_token_id"]
    return {str(e): -100 for e in (eos if isinstance(eos, list) else [eos])}


def stream_chat(url: str, key: str, messages: list[dict[str, str]], max_tokens: int,
                logit_bias: dict[str, int] | None = None, seed: int | None = None) -> Streamed:
    """One greedy streamed chat at ``url`` with API key ``key`` (a ``seed`` makes
    mlx-lm serve it outside the batch)."""
    return _stream(_client(url, key), messages, max_tokens, logit_bias, seed)


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=BOUND_S)


def _stream(client: openai.OpenAI, messages: list[dict[str, str]], max_tokens: int,
            logit_bias: dict[str, int] | None, seed: int | None) -> Streamed:
    extra: dict[str, Any] = {"logit_bias": logit_bias} if logit_bias else {}
    if seed is not None:
        extra["seed"] = seed
    sent = time.monotonic()
    chunks = client.chat.completions.create(  # type: ignore[call-overload]  # extra: logit_bias, seed
        model="default_model", messages=messages, max_tokens=max_tokens, temperature=0.0,
        stream=True, stream_options={"include_usage": True}, **extra)
    first = last = 0.0
    usage: Any = None
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.monotonic()
            first = first or last
        usage = chunk.usage or usage
    if usage is None or usage.prompt_tokens_details is None:
        raise RuntimeError("the server sent no usage with its stream")
    return Streamed(sent, first, last, int(usage.prompt_tokens_details.cached_tokens or 0),
                    int(usage.prompt_tokens), int(usage.completion_tokens))


def concurrently(url: str, chats: list[tuple[str, list[dict[str, str]]]], max_tokens: int,
                 logit_bias: dict[str, int] | None = None) -> list[Streamed]:
    """``chats`` ((key, messages) each) streamed at once, one thread each, sent
    together (a barrier); their results in ``chats``' order. The first error raised
    by any of them is raised here."""
    results: list[Streamed | BaseException | None] = [None] * len(chats)
    barrier = threading.Barrier(len(chats))
    # each client made before the barrier: made after it, on four threads at once, one
    # (its SSL context, even for http) sent its request up to 45 ms after the others, after
    # the batch had started, and it was served once that batch ended (test_tenants, ~1 run in 5)
    clients = [_client(url, key) for key, _ in chats]

    def run(i: int) -> None:
        try:
            barrier.wait(timeout=BOUND_S)
            results[i] = _stream(clients[i], chats[i][1], max_tokens, logit_bias, None)
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(chats))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return [r for r in results if isinstance(r, Streamed)]


def overlap(streams: list[Streamed]) -> float:
    """The share of pairs of streams that were producing tokens at the same
    time (their first-to-last chunk spans intersect): 1.0 batched, 0.0 served
    one after another."""
    pairs = list(combinations(streams, 2))
    if not pairs:
        raise ValueError("overlap needs at least two streams")
    return sum(a.first < b.last and b.first < a.last for a, b in pairs) / len(pairs)


def wall(streams: list[Streamed]) -> float:
    """Seconds from the first request sent to the last chunk received."""
    return max(s.last for s in streams) - min(s.sent for s in streams)
