"""BlockStore(remote=...) against a real S3 server process (moto's, on 127.0.0.1).

Each node is a BlockStore with its own local root; nodes are separate
processes where concurrency matters (tests/remote_node.py). Caches are real
mlx-lm caches of a tiny random-weight model; every comparison of tensors is
of raw bits."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import obstore
import pytest
from moto.server import ThreadedMotoServer

import remote_node as node
from blockkv import BlockStore, GenerationCheckpoint
from blockkv.directory import fingerprint_dirname
from blockkv.remote import header_name
from test_bucket import endpoint, keys, make_bucket, raw_store, server  # noqa: F401 - the server fixtures

NODE = str(Path(__file__).with_name("remote_node.py"))
FP_DIR = fingerprint_dirname(node.IDENT["config_fingerprint"])


@pytest.fixture
def bucket_name(endpoint: str) -> str:  # noqa: F811
    return make_bucket(endpoint)


def blobs(endpoint: str, bucket_name: str) -> list[str]:  # noqa: F811
    return keys(endpoint, bucket_name, f"fleet/{FP_DIR}/blobs")


def headers(endpoint: str, bucket_name: str) -> list[str]:  # noqa: F811
    return [k.partition("/entries/")[2] for k in keys(endpoint, bucket_name, f"fleet/{FP_DIR}/entries")]


def local_blocks(store: BlockStore) -> set[str]:
    return {p.name for p in (store.directory / "blobs").rglob("*") if p.is_file() and not p.name.startswith(".")}


def test_node_b_restores_bit_exact_what_node_a_stored(tmp_path: Path, endpoint: str, bucket_name: str) -> None:  # noqa: F811
    tokens, caches = node.conversation(1)
    with node.open_node(tmp_path / "a", endpoint, bucket_name) as a, \
            node.open_node(tmp_path / "b", endpoint, bucket_name) as b:
        assert b.find(tokens) is None
        assert a.store(tokens, caches)  # True: its header is in the bucket
        entry = a.find_exact(tokens).entry
        assert headers(endpoint, bucket_name) == [header_name("", entry.id)]
        assert a.store_generation_checkpoint(tokens, caches, GenerationCheckpoint("req", 180))
        assert len(headers(endpoint, bucket_name)) == 1  # checkpoints stay local
        assert b.sync_remote() == 1 and b.sync_remote() == 0
        match = b.find(tokens + [1, 2])
        assert match is not None and match.entry.id == entry.id and match.prefix_len == len(tokens)
        assert len(b) == 0  # remote-only: nothing local until it is restored
        loaded = b.restore(match.entry)
        assert loaded is not None and loaded.tokens == tuple(tokens)
        assert node.kv_bits(loaded.caches, len(tokens)) == node.kv_bits(caches, len(tokens))
        assert len(b) == 1 and set(b.entries()[0].blocks) <= local_blocks(b)  # materialised: a local entry now
        cut = b.restore(b.find_exact(tokens).entry, prefix_len=150)  # and served locally from here on
        assert node.kv_bits(cut.caches, 150) == node.kv_bits(caches, 150)
        assert b.sync_remote() == 0  # local now: nothing to learn
    with node.open_node(tmp_path / "c", endpoint, bucket_name) as c:  # a node opened afterwards learns at open
        loaded = c.restore(c.find_exact(tokens).entry)
        assert node.kv_bits(loaded.caches, len(tokens)) == node.kv_bits(caches, len(tokens))


def test_a_system_prompt_stored_by_three_nodes_is_uploaded_once(tmp_path: Path, endpoint: str,  # noqa: F811
                                                                 bucket_name: str) -> None:
    nodes = [node.open_node(tmp_path / f"n{i}", endpoint, bucket_name) for i in range(3)]
    try:
        for i, n in enumerate(nodes):
            tokens, caches = node.conversation(10 + i)
            assert n.store(tokens, caches)
        entries = [n.entries()[0] for n in nodes]
        prompt_blocks = set.intersection(*(set(e.blocks) for e in entries))
        assert len(prompt_blocks) == len(node.PROMPT) // node.BLOCK_TOKENS  # the premise: whole prompt blocks shared
        unique = {b for e in entries for b in e.blocks}
        listed = [k.rpartition("/")[2] for k in blobs(endpoint, bucket_name)]
        assert sorted(listed) == sorted(unique)  # each block once
        assert len(listed) < sum(len(e.blocks) for e in entries)
        assert len(headers(endpoint, bucket_name)) == 3
    finally:
        for n in nodes:
            n.close()


def test_a_node_with_a_wiped_root_rebuilds_from_the_bucket_and_serves(tmp_path: Path, endpoint: str,  # noqa: F811
                                                                      bucket_name: str) -> None:
    stored = []
    with node.open_node(tmp_path / "a", endpoint, bucket_name) as a:
        for i, ns in [(20, ""), (21, "tenant"), (22, "tenant")]:
            tokens, caches = node.conversation(i, tail=30 + i)
            assert a.store(tokens, caches, ns=ns)
            stored.append((tokens, ns, caches))
    shutil.rmtree(tmp_path / "a")
    with node.open_node(tmp_path / "a", endpoint, bucket_name) as a:
        assert len(a) == 0
        for tokens, ns, caches in stored:
            match = a.find_exact(tokens, ns=ns)
            assert match is not None and a.find_exact(tokens, ns="other") is None
            loaded = a.restore(match.entry)
            assert node.kv_bits(loaded.caches, len(tokens)) == node.kv_bits(caches, len(tokens))
        assert len(a) == 3 and a.check().clean  # ordinary local entries now
    with node.open_node(tmp_path / "a", endpoint, bucket_name) as a:
        assert len(a) == 3 and a.sync_remote() == 0
