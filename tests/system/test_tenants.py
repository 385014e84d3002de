"""Many tenants on one ``blockkv serve --per-key-cache`` (issue 44), through
real server processes and the ``openai`` client: requests of different keys
run in one batch, each key's caches stay its own."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from blockkv.model_dir import build_model_dir, sample_text
from blockkv.testing.fleet_processes import Process
from blockkv.testing.streams import concurrently, no_eos_bias, overlap, stream_chat

DECODE_TOKENS = 400  # long enough that streams sent together are decoding together if batched


@dataclass
class Tenants:
    node: Process
    keys: dict[str, str]  # tenant name -> its API key; each test uses keys of its own
    model: Path
    root: Path


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tenants]:
    tmp = tmp_path_factory.mktemp("tenants")
    model = build_model_dir(tmp / "model", "llama")
    keys = {name: f"sk-{name}-{secrets.token_hex(12)}" for name in "abcde"}
    key_file = tmp / "keys"
    key_file.write_text("\n".join(keys.values()) + "\n")
    node = Process(["serve", "--model", str(model), "--cache-dir", str(tmp / "kv"), "--per-key-cache",
                    "--api-key-file", str(key_file), "--log-level", "INFO"], tmp / "node.log")
    try:
        node.wait_ready()
        yield Tenants(node, keys, model, tmp / "kv")
    finally:
        assert node.stop() == 0, node.log.read_text()


def _chat(system: str, user_seed: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": sample_text(12, seed=user_seed)}]


def test_keys_share_one_batch_and_nothing_else(tenants: Tenants) -> None:
    """Four streams over two keys decode together; the same system prompt sent
    by both keys at once is cached for neither, and afterwards for each key in
    its own namespace only (a third key, which sent nothing, gets 0)."""
    a, b, c = (tenants.keys[name] for name in "abc")
    system = sample_text(300, seed=44)  # over one block (256 tokens): stored on disk too
    bias = no_eos_bias(tenants.model)
    together = concurrently(tenants.node.url, [(a, _chat(system, 1)), (b, _chat(system, 2)),
                                               (a, _chat(system, 3)), (b, _chat(system, 4))], DECODE_TOKENS, bias)
    assert overlap(together) == 1.0, together
    assert all(s.completion_tokens == DECODE_TOKENS for s in together)
    later = concurrently(tenants.node.url, [(a, _chat(system, 5)), (b, _chat(system, 6)), (c, _chat(system, 7)),
                                            (a, _chat(system, 1))], DECODE_TOKENS, bias)
    assert overlap(later) == 1.0, later
    mine_a, mine_b, never, again = later
    assert never.cached_tokens == 0  # c sent nothing: a's and b's system prompt is not c's
    assert mine_a.cached_tokens > 0 and mine_b.cached_tokens > 0  # each key's own system segment
    assert again.cached_tokens == again.prompt_tokens - 1  # a's whole earlier prompt, all but the last token


def test_a_request_served_alone_reads_and_saves_its_own_keys_cache(tenants: Tenants) -> None:
    """A request mlx-lm serves outside the batch (a seed) looks up and saves in
    its key's namespace too: the key's second identical request is cached in
    full, another key's is not."""
    d, e = tenants.keys["d"], tenants.keys["e"]
    messages = _chat(sample_text(300, seed=45), 9)
    first, again, other = (stream_chat(tenants.node.url, key, messages, 4, seed=3) for key in (d, d, e))
    assert first.cached_tokens == 0 and other.cached_tokens == 0
    assert again.cached_tokens == again.prompt_tokens - 1
