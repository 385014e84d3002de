"""Issue #23 against a real S3 server process (moto's, on 127.0.0.1): a restore
of a bucket entry reads only the blocks its prefix needs, and a node holds
the fleet's entries as digests, settling each match from the header.

Blocks are 64 tokens; a conversation is the fleet's 200-token system prompt
and a tail of its own (tests/support/remote_node.py). GETs are counted in moto's
request log; tensors are compared as raw bits."""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import remote_node as node
from test_bucket import endpoint, keys, make_bucket, raw_store, server  # noqa: F401 - the server fixtures
from test_remote import FP_DIR, flip_byte

from blockkv.local.directory import stored_at
from blockkv.records import Entry


@pytest.fixture
def bucket_name(endpoint: str) -> str:  # noqa: F811
    return make_bucket(endpoint)


def block_gets(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The blocks GET from the bucket since the log was cleared."""
    return [m.split("/blobs/")[1].split()[0].rpartition("/")[2] for m in (r.getMessage() for r in caplog.records)
            if "GET /" in m and "/blobs/" in m]


def test_a_partial_restore_of_a_bucket_entry_reads_only_the_blocks_its_prefix_needs(
        tmp_path: Path, endpoint: str, bucket_name: str, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    tokens, caches = node.conversation(1, tail=120)  # 320 tokens: 5 blocks
    with node.open_node(tmp_path / "a", endpoint, bucket_name) as a:
        assert a.store(tokens, caches)
        stored = a.find_exact(tokens).entry
    with node.open_node(tmp_path / "b", endpoint, bucket_name) as b:
        prompt = tokens[:150] + [tokens[150] ^ 1, *node.random_tokens(30, seed=5)]  # diverges inside the third block
        match = b.find(prompt)
        assert match is not None and match.entry.id == stored.id and match.prefix_len == 150  # settled from the header
        assert b.tier_of(match.entry) == "bucket"
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="werkzeug"):
            loaded = b.restore(match.entry, prefix_len=match.prefix_len)
            b._adoptions.wait_kept()
        assert loaded is not None and loaded.tokens == tuple(tokens[:150])
        assert node.kv_bits(loaded.caches, 150) == node.kv_bits(caches, 150)
        needed = math.ceil(150 / node.BLOCK_TOKENS)
        assert sorted(block_gets(caplog)) == sorted(stored.blocks[:needed])  # ceil(p/B) GETs, each block once
        # kept: a prefix entry of b's own over the blocks it fetched; the bucket's entry stays remote-only
        assert [e.length for e in b.entries()] == [needed * node.BLOCK_TOKENS]
        assert b.entries()[0].blocks == stored.blocks[:needed] and b.check().clean
        assert stored_at(b.entries()[0].id) is not None  # its id minted as a store's: store order in it
        assert b.tier_of(stored) == "bucket" and b.find(tokens + [1]).entry.id == stored.id
        inside = b.find(tokens[:120] + [tokens[120] ^ 1])  # inside the kept prefix: served locally
        assert inside.prefix_len == 120 and b.tier_of(inside.entry) == "disk"
        cut = b.restore(inside.entry, prefix_len=120)
        assert node.kv_bits(cut.caches, 120) == node.kv_bits(caches, 120)

        caplog.clear()
        with caplog.at_level(logging.INFO, logger="werkzeug"):
            whole = b.restore(b.find(tokens + [1]).entry)  # the rest: only the blocks b lacks
            b._adoptions.wait_kept()
        assert node.kv_bits(whole.caches, len(tokens)) == node.kv_bits(caches, len(tokens))
        assert sorted(block_gets(caplog)) == sorted(stored.blocks[needed:])
        assert [e.id for e in b.entries()] == [stored.id]  # the bucket's entry, local now: it superseded the prefix
        assert b.tier_of(stored) == "disk" and b.check().clean


def test_a_bucket_entry_is_held_as_digests_and_its_matches_are_settled_by_its_header(
        tmp_path: Path, endpoint: str, bucket_name: str, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    long_tokens, _ = node.conversation(2, tail=440)  # 640 tokens: 10 whole blocks
    short = node.random_tokens(40, seed=3)  # less than one block
    with node.open_node(tmp_path / "a", endpoint, bucket_name) as a:
        assert a.store(long_tokens, node.conversation(2, tail=440)[1])
        assert a.store(short, node.prefill(node.model(), short)[0])
        ids = {len(e.token_array): e.id for e in a.entries()}
        rows = sum(e.length // node.BLOCK_TOKENS + 1 + len(set(e.blocks)) + 1 for e in a.entries())
    with node.open_node(tmp_path / "b", endpoint, bucket_name) as b:
        catalog = b._remote.catalog
        for entry_id in ids.values():
            record = catalog.get(entry_id)
            values = [getattr(record, f.name) for f in dataclasses.fields(record)]
            assert all(isinstance(v, (str, int, float, bool)) for v in values), values  # no tokens, no block names
        assert catalog.rows == rows  # a digest per whole block, one of every token, 8 bytes per block name and id
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="werkzeug"):
            for p in (1, 63, 64, 65, 300, 639):  # the common prefix anywhere, in a block or at its edge
                prompt = long_tokens[:p] + [long_tokens[p] ^ 1, *node.random_tokens(5, seed=p)]
                match = b.find(prompt)
                if p < node.BLOCK_TOKENS:  # a match shorter than one block is not looked for in the bucket
                    assert match is None
                else:
                    assert match is not None and match.entry.id == ids[640] and match.prefix_len == p
                    assert isinstance(match.entry, Entry) and np.array_equal(match.entry.token_array, long_tokens)
            assert b.find(long_tokens).prefix_len == 639  # capped at all but the last token
            assert b.find_exact(long_tokens).entry.id == ids[640] and b.find_exact(long_tokens[:-1]) is None
            assert b.find_exact(short).entry.id == ids[40]  # found exactly, whatever its length
            assert b.has_durable_prefix(long_tokens[:200]) and not b.has_durable_prefix(long_tokens[:199] + [long_tokens[199] ^ 1])
        gets = [r.getMessage() for r in caplog.records if "GET /" in r.getMessage() and "/entries/" in r.getMessage()]
        assert gets == []  # every header was read from the node's cache: a lookup waits for no bucket


def test_a_damaged_block_past_the_prefix_costs_a_partial_restore_nothing(
        tmp_path: Path, endpoint: str, bucket_name: str) -> None:  # noqa: F811
    tokens, caches = node.conversation(4, tail=120)
    with node.open_node(tmp_path / "a", endpoint, bucket_name) as a:
        assert a.store(tokens, caches)
        last = a.find_exact(tokens).entry.blocks[-1]
    flip_byte(endpoint, bucket_name, f"fleet/{FP_DIR}/blobs/{last[:2]}/{last}")
    with node.open_node(tmp_path / "b", endpoint, bucket_name) as b:
        entry = b.find_exact(tokens).entry
        cut = b.restore(entry, prefix_len=100)  # never reads the damaged block
        assert cut is not None and node.kv_bits(cut.caches, 100) == node.kv_bits(caches, 100)
        assert b.restore(entry) is None  # the whole entry needs it: a miss, never data
        assert b.find_exact(tokens) is None  # and forgotten
