"""A copy is convicted only by fresh proof about that copy (issue #22, cases
2, 4 and 5, the local side).

- A restore or a ``check(repair=True)`` that saw a block fail its hash, then
  was slow, must not act on that verdict once a good copy has been written and
  a new entry acknowledged: the verdict is re-established under the directory
  lock. Two handles on one root, one of them paused through its own file
  layer right after it read the bad bytes, while the other quarantines, stores
  again and is acknowledged.
- A header whose sizes or layout do not fit the block it names (it verifies
  against its name) convicts itself, never the block.
- Under ``isolate_namespaces``, a header naming another namespace's blocks
  makes them fail under its key: the block is good under the key of the
  entries that store it, so only the bait header goes.

Real caches from forward passes of a tiny model, compared bit for bit.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
import remote_node as node
from test_bucket import endpoint, make_bucket, raw_store, server  # noqa: F401 - the S3 server fixtures

from blockkv import BlockStore, GenerationCheckpoint
from blockkv.format.header import decode_header, encode_header
from blockkv.format.layout import fingerprint_dirname, header_name, ns_dirname
from blockkv.fs import FileLayer
from blockkv.testing.models import prefill, random_tokens, tiny_model

IDENT = dict(model_id="m", config_fingerprint="fp-verdicts", tokenizer_hash="t", max_bytes=1 << 30)
B = 16  # block tokens: a 40-token entry has blocks [0, 16), [16, 32), [32, 40)
FP_DIR = fingerprint_dirname(node.IDENT["config_fingerprint"])


@pytest.fixture
def bucket_name(endpoint: str) -> str:  # noqa: F811
    return make_bucket(endpoint)


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_model("llama")


def caches(model: Any, tokens: list[int]) -> list[Any]:
    return prefill(model, tokens)[0]


def open_store(root: Path, **kw: Any) -> BlockStore:
    return BlockStore(root, **{**IDENT, "block_tokens": B, "gc_grace": 0.0, **kw})


def kv_bits(cache: Sequence[Any], n: int) -> list[bytes]:
    return [np.array(a[..., :n, :].reshape(-1).view(mx.uint32)).tobytes()
            for c in cache for a in (c.keys, c.values)]


def assert_restores(s: BlockStore, tokens: list[int], cache: list[Any], ns: str = "") -> None:
    match = s.find_exact(tokens, ns)
    assert match is not None, "an acknowledged entry is gone"
    loaded = s.restore(match.entry)
    assert loaded is not None, "an acknowledged entry no longer restores"
    assert kv_bits(loaded.caches, len(tokens)) == kv_bits(cache, len(tokens))


def block_of(s: BlockStore, tokens: list[int], k: int, ns: str = "") -> str:
    """The name of the k-th block of the entry storing ``tokens``."""
    match = s.find_exact(tokens, ns)
    assert match is not None
    return match.entry.blocks[k]


def rot(s: BlockStore, name: str) -> None:
    """Flip one payload byte of a block file in place (bit rot)."""
    path = s._dir.pool.path(name)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10
    path.write_bytes(bytes(data))


class PausedAfterReading(FileLayer):
    """A file layer that, the first time it has read block ``name`` (the
    restore's scatter read, or ``check``'s whole-file read), stops until
    ``go`` is set: a slow restore or check holding a verdict about bytes it
    read a while ago."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.paused = threading.Event()
        self.go = threading.Event()

    def _maybe_pause(self, path: Path) -> None:
        if path.name == self.name and not self.paused.is_set():
            self.paused.set()
            assert self.go.wait(60)

    def read_exact(self, path: Path, buffers: Sequence[memoryview],
                   on_read: Callable[[Sequence[memoryview]], None] | None = None) -> bool:
        ok = super().read_exact(path, buffers, on_read)
        self._maybe_pause(path)
        return ok

    def read(self, path: Path, limit: int | None = None) -> bytes:
        data = super().read(path, limit)
        self._maybe_pause(path)
        return data


# -- case 2: verdicts are fresh ---------------------------------------------------------------------


def _heal_while_paused(root: Path, tokens: list[int], cache: list[Any], paused: PausedAfterReading,
                       slow: Callable[[], Any]) -> Any:
    """Run ``slow`` on a thread until it has read the rotten block; meanwhile
    another handle's restore quarantines the block and a store of the same
    tokens writes a good copy and is acknowledged; then let ``slow`` finish."""
    out: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: out.setdefault("result", slow()), daemon=True)
    worker.start()
    try:
        assert paused.paused.wait(60), "the slow handle never read the block"
        with open_store(root) as other:
            assert other.restore(other.find_exact(tokens).entry) is None  # quarantines the rotten block
            assert other.find_exact(tokens) is None
            assert other.store(tokens, cache)  # a good copy, and a newly acknowledged entry
            assert_restores(other, tokens, cache)
    finally:
        paused.go.set()
        worker.join(60)
    assert not worker.is_alive()
    return out.get("result")


def _rotten_entry(root: Path, model: Any, seed: int) -> tuple[list[int], list[Any], PausedAfterReading]:
    """An entry whose last block has rotted, and a file layer that pauses after reading that block."""
    tokens = random_tokens(40, seed=seed)
    cache = caches(model, tokens)
    with open_store(root) as s:
        assert s.store(tokens, cache)
        victim = block_of(s, tokens, 2)
        rot(s, victim)
    return tokens, cache, PausedAfterReading(victim)


def test_a_slow_restores_stale_verdict_deletes_no_good_block(tmp_path: Path, model: Any) -> None:
    tokens, cache, paused = _rotten_entry(tmp_path, model, 1)
    with open_store(tmp_path, fs=paused) as slow:
        entry = slow.find_exact(tokens).entry
        assert _heal_while_paused(tmp_path, tokens, cache, paused, lambda: slow.restore(entry)) is None
    with open_store(tmp_path) as s:
        assert_restores(s, tokens, cache)  # the entry acknowledged meanwhile, and its good block, are there


def test_a_slow_repairs_stale_verdict_deletes_no_good_block(tmp_path: Path, model: Any) -> None:
    tokens, cache, paused = _rotten_entry(tmp_path, model, 2)
    victim = paused.name
    with open_store(tmp_path, fs=paused) as slow:
        report = _heal_while_paused(tmp_path, tokens, cache, paused, lambda: slow.check(repair=True))
        assert victim not in report.corrupt_blocks and report.dangling == []
    with open_store(tmp_path) as s:
        assert_restores(s, tokens, cache)
        assert s.check().clean


# -- case 4: a header that lies about a block's size convicts only itself ----------------------------


def _plant(s: BlockStore, header: Any, filed_under: str | None = None) -> str:
    """Write ``header`` as a new entry's header file (sealed with a valid checksum), in its
    namespace's directory or ``filed_under``'s."""
    entry_id = uuid.uuid4().hex
    ns = header.ns if filed_under is None else filed_under
    path = s.directory / "entries" / ns_dirname(ns) / f"{entry_id}.bkv"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_header(header))
    return entry_id


def _header_of(s: BlockStore, tokens: list[int], ns: str = "") -> Any:
    entry = s.find_exact(tokens, ns).entry
    return decode_header(s._dir.header_path(ns, entry.id).read_bytes())


@pytest.mark.parametrize("compression, verify", [(None, True), ("zstd", True), (None, False)])
def test_a_header_lying_about_a_block_size_convicts_only_itself(
        tmp_path: Path, model: Any, compression: str | None, verify: bool) -> None:
    tokens = random_tokens(40, seed=3)
    cache = caches(model, tokens)
    short = tokens[:36]  # its last block is [32, 36): smaller than the real [32, 40)
    with open_store(tmp_path / "scratch", compression=compression) as scratch:
        assert scratch.store(short, caches(model, short))
        liar = _header_of(scratch, short)
    with open_store(tmp_path, compression=compression) as s:
        assert s.store(tokens, cache)
        assert s.store(tokens, cache, ns="other")  # a second entry sharing every block
        shared = block_of(s, tokens, 2)
        descriptor = json.loads(json.dumps(liar.descriptor))
        descriptor["token_blocks"][2][0] = shared  # names the real block, declares 4 rows for its 8
        bait_tokens = random_tokens(36, seed=4)
        _plant(s, replace(liar, tokens=np.array(bait_tokens, np.uint32), descriptor=descriptor))
    with open_store(tmp_path, compression=compression, verify=verify) as s:
        bait = s.find_exact(bait_tokens)
        assert bait is not None
        assert s.restore(bait.entry) is None
        assert s.find_exact(bait_tokens) is None  # the bad header went
        assert_restores(s, tokens, cache)  # the good block, and both entries needing it, stayed
        assert_restores(s, tokens, cache, ns="other")
        assert s.check().clean


# -- case 5: a header with another namespace's key convicts only itself ------------------------------


def _bait_in(s: BlockStore, tokens: list[int], victim_ns: str, bait_ns: str, *, keep_xxh3: bool,
             filed_under: str | None = None) -> list[int]:
    """A header in ``bait_ns`` naming the blocks of the entry in ``victim_ns`` (keyed with that
    namespace's key); without ``keep_xxh3`` it has no per-block checksums (an older header), so
    a restore checks blake3 with the bait's own key. Returns the bait's tokens."""
    victim = _header_of(s, tokens, victim_ns)
    bait_tokens = random_tokens(len(tokens), seed=sum(bait_ns.encode()))
    _plant(s, replace(victim, ns=bait_ns, tokens=np.array(bait_tokens, np.uint32),
                      block_xxh3=victim.block_xxh3 if keep_xxh3 else None), filed_under)
    return bait_tokens


@pytest.mark.parametrize("verify, keep_xxh3", [(True, False), ("full", True)], ids=["no-xxh3", "verify-full"])
def test_isolated_restore_of_a_bait_header_convicts_only_the_header(
        tmp_path: Path, model: Any, verify: Any, keep_xxh3: bool) -> None:
    tokens = random_tokens(40, seed=5)
    cache = caches(model, tokens)
    with open_store(tmp_path, isolate_namespaces=True) as s:
        assert s.store(tokens, cache, ns="victim")
        bait_tokens = _bait_in(s, tokens, "victim", "bait", keep_xxh3=keep_xxh3)
    with open_store(tmp_path, isolate_namespaces=True, verify=verify) as s:
        bait = s.find_exact(bait_tokens, "bait")
        assert bait is not None
        assert s.restore(bait.entry) is None
        assert s.find_exact(bait_tokens, "bait") is None
        assert_restores(s, tokens, cache, ns="victim")
        assert s.check().clean


def test_isolated_repair_with_bait_headers_convicts_only_the_headers(tmp_path: Path, model: Any) -> None:
    tokens = random_tokens(40, seed=6)
    cache = caches(model, tokens)
    with open_store(tmp_path, isolate_namespaces=True) as s:
        assert s.store(tokens, cache, ns="victim")
        victim = s.find_exact(tokens, "victim").entry.id
        baits: dict[str, list[int]] = {}
        # baits filed beside the victim's header (in its namespace's directory, naming another
        # namespace), until the listing reads one after the victim's header: a check that kept
        # one key per block, the last header's, then hashed the block with a bait's key. The
        # listing is the directory's order (a hash of the names on ext4): a victim whose name
        # keeps it last is stored again, under a new name
        while not baits or list(s._dir.listing().headers)[-1] == victim:
            if len(baits) % 8 == 7:
                s.remove(s.find_exact(tokens, "victim").entry)
                assert s.store(tokens, cache, ns="victim")
                victim = s.find_exact(tokens, "victim").entry.id
            ns = f"bait{len(baits)}"
            baits[ns] = _bait_in(s, tokens, "victim", ns, keep_xxh3=True, filed_under="victim")
            assert len(baits) < 64
    with open_store(tmp_path, isolate_namespaces=True) as s:
        report = s.check(repair=True)
        assert report.corrupt_blocks == [] and report.dangling == []
        assert len(report.corrupt_headers) == len(baits)
        assert_restores(s, tokens, cache, ns="victim")
        assert s.check().clean


def test_a_bucket_header_lying_about_a_block_size_takes_no_local_checkpoint(
        tmp_path: Path, endpoint: str, bucket_name: str) -> None:  # noqa: F811
    """Through the bucket: a node learns a planted header naming one of its
    blocks with the wrong size; restoring it must not take the node's
    local-only generation checkpoint (nor its entry) with the shared block."""
    tokens, cache = node.conversation(1)
    short = tokens[: len(tokens) - 10]  # its last block is shorter than the real one of the same range
    with BlockStore(tmp_path / "scratch", **node.IDENT, max_bytes=1 << 30, block_tokens=node.BLOCK_TOKENS) as s:
        assert s.store(short, caches(node.model(), short))
        liar = _header_of(s, short)
    with node.open_node(tmp_path / "a", endpoint, bucket_name) as a:
        assert a.store(tokens, cache)
        assert a.store_generation_checkpoint(tokens, cache, GenerationCheckpoint("req", len(node.PROMPT)))
        shared = a.find_exact(tokens).entry.blocks[-1]
        descriptor = json.loads(json.dumps(liar.descriptor))
        descriptor["token_blocks"][-1][0] = shared
        bait_tokens = random_tokens(len(short), seed=9)
        bait = replace(liar, tokens=np.array(bait_tokens, np.uint32), descriptor=descriptor)
        raw_store(endpoint, bucket_name).put(f"fleet/{FP_DIR}/entries/{header_name('', uuid.uuid4().hex)}",
                                              encode_header(bait))
        assert a.sync_remote() == 1
        assert a.restore(a.find_exact(bait_tokens).entry) is None
        checkpoint = a.find_generation_checkpoint(tokens[: len(node.PROMPT)], "req")
        assert checkpoint is not None, "the local-only checkpoint went with the good block"
        loaded = a.restore(checkpoint)
        assert loaded is not None and kv_bits(loaded.caches, len(tokens)) == kv_bits(cache, len(tokens))
        assert_restores(a, tokens, cache)
