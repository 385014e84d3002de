"""Many tenants on one ``blockkv serve --per-key-cache`` (issue 44), through
real server processes and the ``openai`` client: requests of different keys
run in one batch, each key's caches stay its own."""

from __future__ import annotations

import hashlib
import json
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from blockkv import BlockStore
from blockkv.model_dir import build_model_dir, sample_text
from blockkv.node.tenants import key_id
from blockkv.router.route import NODE_HEADER
from blockkv.testing.fleet_processes import Process
from blockkv.testing.streams import concurrently, no_eos_bias, overlap, stream_chat
from blockkv.wire.auth import namespace_of

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
    keys = {name: f"sk-{name}-{secrets.token_hex(12)}" for name in ("a", "b", "c", "d", "e", "m", "s", "t", "operator")}
    key_file, operator_file = tmp / "keys", tmp / "operator"
    key_file.write_text("\n".join(k for name, k in keys.items() if name != "operator") + "\n")
    operator_file.write_text(keys["operator"] + "\n")
    node = Process(["serve", "--model", str(model), "--cache-dir", str(tmp / "kv"), "--per-key-cache",
                    "--api-key-file", str(key_file), "--operator-key-file", str(operator_file),
                    "--log-level", "INFO"], tmp / "node.log")
    try:
        node.wait_ready()
        yield Tenants(node, keys, model, tmp / "kv")
    finally:
        assert node.stopped_cleanly(), node.log.read_text()


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


def test_a_key_past_its_share_evicts_its_own_entries_not_anothers(tmp_path: Path) -> None:
    """--key-share: key b storing far more than its share of the disk cap
    evicts b's own least recently used entries; key a's entry stays on disk."""
    model = build_model_dir(tmp_path / "model", "llama")
    a, b = (f"sk-{name}-{secrets.token_hex(12)}" for name in "ab")
    (tmp_path / "keys").write_text(f"{a}\n{b}\n")
    cap, share = 1 << 20, 0.5
    node = Process(["serve", "--model", str(model), "--cache-dir", str(tmp_path / "kv"), "--per-key-cache",
                    "--api-key-file", str(tmp_path / "keys"), "--cache-bytes", str(cap), "--key-share", f"{share}",
                    "--log-level", "INFO"], tmp_path / "node.log")
    try:
        node.wait_ready()
        stream_chat(node.url, a, _chat(sample_text(300, seed=60), 1), 4)
        for i in range(10):  # each about a sixth of the cap: b stores well past its share, and past the cap
            stream_chat(node.url, b, _chat(sample_text(300, seed=61 + i), 1), 4)
    finally:
        assert node.stopped_cleanly(), node.log.read_text()
    (directory,) = (d for d in (tmp_path / "kv").iterdir() if d.is_dir())
    store = BlockStore.open_dir(directory, isolate_namespaces=True)
    try:
        ns_a, ns_b = (namespace_of(hashlib.sha256(key.encode()).digest()) for key in (a, b))
        kept_a, kept_b = store.entries(ns_a), store.entries(ns_b)
        held_b = sum(e.nbytes for e in kept_b)  # each entry's header and blocks: at least b's footprint
    finally:
        store.close()
    assert kept_a, node.log.read_text()  # a's entry outlived b's flood
    assert 0 < len(kept_b) < 10 and held_b <= cap * share  # b evicted its own, down to its share
    assert held_b / len(kept_b) * 10 > cap  # b's ten chats would not have fitted the cap: b evicted a's before


def _metrics(url: str, key: str) -> dict[str, float]:
    """GET /metrics with ``key``, parsed: sample name{labels} -> value."""
    request = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        text = response.read().decode()
    return {s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_show_a_key_its_own_counts_and_the_operator_every_keys(tenants: Tenants) -> None:
    """/metrics with a tenant's key: that key's own lookup counts, nothing of
    anyone else's (no totals either); with the operator's key: everything, each
    key's counts labelled by a key id, never by the key."""
    m, operator = tenants.keys["m"], tenants.keys["operator"]
    sent = stream_chat(tenants.node.url, m, _chat(sample_text(80, seed=70), 1), 4)
    stream_chat(tenants.node.url, tenants.keys["a"], _chat(sample_text(80, seed=71), 1), 4)
    mine = key_id(namespace_of(hashlib.sha256(m.encode()).digest()))
    own = _metrics(tenants.node.url, m)
    assert own[f"blockkv_key_tokens_prefilled_total{{key={mine}}}"] == sent.prompt_tokens - sent.cached_tokens
    lookups = own[f"blockkv_key_misses_total{{key={mine}}}"] + sum(
        own[f"blockkv_key_hits_total{{key={mine}}}{{tier={tier}}}"] for tier in ("ram", "disk", "bucket"))
    assert lookups == 1  # m's one request
    assert all(f"key={mine}" in name for name in own), own  # nothing but m's own samples
    everything = _metrics(tenants.node.url, operator)
    labelled = {name.split("key=")[1].split("}")[0] for name in everything if "key=" in name}
    assert mine in labelled and len(labelled) >= 2 and "blockkv_hits_total{tier=ram}" in everything
    assert not any(k in name for k in tenants.keys.values() for name in everything)


def test_a_shared_system_prompt_serves_every_key_from_one_copy(tenants: Tenants, tmp_path: Path) -> None:
    """``blockkv warm --shared`` while the server runs: two keys that never sent
    it restore it on their first request, from the one entry of the shared
    namespace; neither key stores a copy of that segment of its own."""
    system = sample_text(300, seed=80)
    (tmp_path / "system.txt").write_text(system)
    warm = subprocess.run([sys.executable, "-m", "blockkv", "warm", str(tenants.root), str(tmp_path / "system.txt"),
                           "--model", str(tenants.model), "--shared", "--json"], check=False, capture_output=True,
                          text=True, timeout=300)
    assert warm.returncode == 0, warm.stderr
    warmed = json.loads(warm.stdout)["entry"]
    s, t = (stream_chat(tenants.node.url, tenants.keys[name], _chat(system, seed), 4) for name, seed in (("s", 1),
                                                                                                     ("t", 2)))
    assert s.cached_tokens == t.cached_tokens == warmed["tokens"]  # first requests of both keys: restored
    flush = urllib.request.Request(tenants.node.url + "/blockkv/flush", data=b"", method="POST",
                                   headers={"Authorization": f"Bearer {tenants.keys['s']}"})
    urllib.request.urlopen(flush, timeout=60).close()
    (directory,) = (d for d in tenants.root.iterdir() if d.is_dir())
    with BlockStore.open_dir(directory, isolate_namespaces=True) as store:
        assert [e.id for e in store.entries("")] == [warmed["id"]]  # one copy
        for name in ("s", "t"):
            own = store.entries(namespace_of(hashlib.sha256(tenants.keys[name].encode()).digest()))
            assert own and all(e.length != warmed["tokens"] for e in own)  # its conversation, not the system copy


def _routed(url: str, key: str, messages: list[dict[str, str]]) -> tuple[str, int, int]:
    """(the node that served it, cached_tokens, prompt_tokens) of one chat sent to ``url``."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
    raw = client.chat.completions.with_raw_response.create(model="default_model", messages=messages,  # type: ignore[arg-type]
                                                           max_tokens=4, temperature=0.0)
    usage = raw.parse().usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return raw.headers.get(NODE_HEADER, ""), int(usage.prompt_tokens_details.cached_tokens or 0), usage.prompt_tokens


def _residency(url: str, key: str) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url + "/blockkv/residency", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, {}


def test_a_router_places_each_key_by_its_own_residency(tmp_path: Path) -> None:
    """blockkv route --per-key-cache in front of two per-key nodes: key a's
    prompt, cached on the second node, draws a's request there (served from a's
    cache); key b's same prompt finds nothing of a's, neither in placement (it
    goes where load alone sends it, the first node) nor in cached_tokens; a
    tenant's key reads no node's residency."""
    model = build_model_dir(tmp_path / "model", "llama")
    a, b, router_key = (f"sk-{name}-{secrets.token_hex(12)}" for name in ("a", "b", "router"))
    (tmp_path / "tenants").write_text(f"{a}\n{b}\n")
    (tmp_path / "router").write_text(router_key + "\n")
    salt = ["--fleet-salt", "tenants test"]
    nodes = [Process(["serve", "--model", str(model), "--cache-dir", str(tmp_path / f"kv{i}"), "--per-key-cache",
                      "--api-key-file", str(tmp_path / "tenants"), "--operator-key-file", str(tmp_path / "router"),
                      *salt], tmp_path / f"node{i}.log") for i in (1, 2)]
    router = None
    try:
        for node in nodes:
            node.wait_ready()
        router = Process(["route", "--model", str(model), "--node", nodes[0].url, "--node", nodes[1].url, *salt,
                          "--per-key-cache", "--api-key-file", str(tmp_path / "tenants"), "--node-api-key-file",
                          str(tmp_path / "router"), "--log-level", "DEBUG"], tmp_path / "router.log")
        router.wait_ready()
        messages = _chat(sample_text(300, seed=90), 1)
        _routed(nodes[1].url, a, messages)  # a's prompt, straight to the second node
        deadline = time.monotonic() + 60
        while not _residency(nodes[1].url, router_key)[1]["media"]["RAM"]:
            assert time.monotonic() < deadline, nodes[1].log.read_text()
            time.sleep(0.2)
        time.sleep(2.0)  # the router's long poll of the node's events brings it over (a bound, not a claim)
        where_a, cached_a, prompt_a = _routed(router.url, a, messages)
        where_b, cached_b, _ = _routed(router.url, b, messages)
        refused, _ = _residency(nodes[1].url, a)
    finally:
        for process in (router, *nodes):
            if process is not None:
                process.stop()
    assert where_a == nodes[1].url and cached_a == prompt_a - 1  # a's own residency drew it, a's cache served it
    assert where_b == nodes[0].url and cached_b == 0  # nothing of a's: not its placement, not its cache
    assert refused == 403
