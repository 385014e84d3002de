"""Issue #22, the bucket side: one bad copy never takes good data with it, a
MANIFEST or header cache never decides what an entry is, a lying header
convicts only itself, a missing bucket is one clear line, and the optional
fleet key. Each node is a BlockStore with its own root against moto's S3
server on 127.0.0.1; caches are real mlx-lm caches of a tiny random-weight
model, compared bit for bit. Faults are real damage to real objects and
files; the server's clock is stepped through its seam (blockkv.testing.moto_clock)
instead of waited for."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import obstore
import pytest
import remote_node as node
from test_bucket import endpoint, keys, make_bucket, raw_store, server, server_clock  # noqa: F401 - fixtures
from test_cli import parsed, run_all

from blockkv import BlockStore
from blockkv.bucket.gc import Window, gc_runs_since
from blockkv.errors import CorruptBlockError, OversizedError
from blockkv.format.descriptor import blocks_for_prefix
from blockkv.format.frame import decode_block, max_frame_bytes
from blockkv.format.header import decode_header, encode_header
from blockkv.format.layout import fingerprint_dirname, header_name
from blockkv.mlx_lm.identity import StoreIdentity
from blockkv.mlx_lm.prompt_cache import PersistentPromptCache
from blockkv.testing.moto_clock import ServerClock

FP_DIR = fingerprint_dirname(node.IDENT["config_fingerprint"])
GRACE = float(node.TIMING["grace"])
KEY = "a fleet's shared secret, 32+ chars"


@pytest.fixture
def bucket_name(endpoint: str) -> str:  # noqa: F811
    return make_bucket(endpoint)


def blob_key(name: str) -> str:
    return f"fleet/{FP_DIR}/blobs/{name[:2]}/{name}"


def local_blob(store: BlockStore, name: str) -> Path:
    return store.directory / "blobs" / name[:2] / name


def rot(data: bytes) -> bytes:
    """One flipped bit in the payload, where bit rot lands most of the time."""
    damaged = bytearray(data)
    damaged[-5] ^= 0x10
    return bytes(damaged)


def rot_object(endpoint: str, bucket_name: str, key: str) -> None:  # noqa: F811
    raw = raw_store(endpoint, bucket_name)
    obstore.put(raw, key, rot(bytes(obstore.get(raw, key).bytes())))


def bucket_blocks_verify(endpoint: str, bucket_name: str, key: bytes | None = None) -> bool:  # noqa: F811
    raw = raw_store(endpoint, bucket_name)
    for k in keys(endpoint, bucket_name, f"fleet/{FP_DIR}/blobs"):
        name = k.rpartition("/")[2]
        try:
            decode_block(name, bytes(obstore.get(raw, k).bytes()), key=key)
        except CorruptBlockError:
            return False
    return True


def restores_bit_exact(store: BlockStore, tokens: list[int], caches: list, ns: str = "") -> bool:
    match = store.find_exact(tokens, ns=ns)
    loaded = store.restore(match.entry) if match is not None else None
    return loaded is not None and node.kv_bits(loaded.caches, len(tokens)) == node.kv_bits(caches, len(tokens))


# -- case 1: one node's bit rot never spreads --------------------------------------------------

def test_a_refresh_never_sends_a_rotten_local_block_and_heals_it_from_the_bucket(
        tmp_path: Path, endpoint: str, bucket_name: str, server_clock: ServerClock) -> None:  # noqa: F811
    """Node A's copy of a system-prompt block rots after it was uploaded. When A
    stores another conversation on that prompt after the block has aged past
    grace/2, the block is refreshed: with A's bytes it would overwrite the
    bucket's good copy and lose every entry that needs it, fleet-wide."""
    first, second = node.conversation(1), node.conversation(2)
    with node.open_node(tmp_path / "a", endpoint, bucket_name) as a:
        assert a.store(*first)
        victim = a.find_exact(first[0]).entry.blocks[0]  # the prompt's first block
        good = local_blob(a, victim).read_bytes()
        local_blob(a, victim).write_bytes(rot(good))
        server_clock.step(GRACE / 2 + 2)  # the prompt's blocks are old now: the next store refreshes them
        assert a.store(*second)
        assert local_blob(a, victim).read_bytes() == good  # healed from the bucket's verified copy
    assert bucket_blocks_verify(endpoint, bucket_name)
    with node.open_node(tmp_path / "c", endpoint, bucket_name) as c:  # a fresh node: both acknowledged entries
        assert restores_bit_exact(c, *first) and restores_bit_exact(c, *second)


def test_a_rotten_local_block_is_replaced_from_the_bucket_not_dropped(
        tmp_path: Path, endpoint: str, bucket_name: str) -> None:  # noqa: F811
    conv = node.conversation(3)
    with node.open_node(tmp_path / "a", endpoint, bucket_name) as a:
        assert a.store(*conv)
        entry = a.find_exact(conv[0]).entry
        path = local_blob(a, entry.blocks[-1])
        good = path.read_bytes()
        path.write_bytes(rot(good))
        assert restores_bit_exact(a, *conv)  # the bucket's verified copy, not a dropped entry
        assert path.read_bytes() == good and a.find_exact(conv[0]).entry.id == entry.id


def test_a_rotten_block_is_never_uploaded(tmp_path: Path, endpoint: str, bucket_name: str) -> None:  # noqa: F811
    """A store the bucket did not acknowledge waits in the backlog; its block rots
    meanwhile. The next sync must not upload it: the bucket would then hold a bad
    copy under a good name, and every other node would fail on it."""
    conv = node.conversation(4)
    with node.open_node(tmp_path / "a", endpoint, bucket_name) as a:
        a._remote.breaker.failed()  # the bucket unreachable for a moment: stored locally, in the backlog
        assert not a.store(*conv)
        own = a.find_exact(conv[0]).entry.blocks[-1]
        path = local_blob(a, own)
        path.write_bytes(rot(path.read_bytes()))
        a.sync_remote()
        assert all(not k.endswith(own) for k in keys(endpoint, bucket_name))  # not sent
        assert a._remote.uploads.backlog() == [a.find_exact(conv[0]).entry.id]  # still owed, not lost
    assert bucket_blocks_verify(endpoint, bucket_name)


def test_a_bad_bucket_copy_is_sent_again_by_a_node_holding_a_verified_one(
        tmp_path: Path, endpoint: str, bucket_name: str) -> None:  # noqa: F811
    """A block rots in the bucket. The node that meets it has no good copy: it
    deletes the bad one (proof) and asks the fleet for a good copy; the node that
    stored the entry, holding a verified copy, sends it at its next sync. The
    entry is not lost fleet-wide."""
    conv = node.conversation(5)
    with node.open_node(tmp_path / "a", endpoint, bucket_name) as a:
        assert a.store(*conv)
        victim = a.find_exact(conv[0]).entry.blocks[-1]
        rot_object(endpoint, bucket_name, blob_key(victim))
        with node.open_node(tmp_path / "b", endpoint, bucket_name) as b:
            assert b.restore(b.find_exact(conv[0]).entry) is None  # a miss, never data
        assert a.sync_remote() == 0  # answers the fleet's request from its verified copy
    assert bucket_blocks_verify(endpoint, bucket_name)
    with node.open_node(tmp_path / "c", endpoint, bucket_name) as c:
        assert restores_bit_exact(c, *conv)


def test_a_bad_bucket_copy_is_replaced_in_place_by_a_verified_local_one(
        tmp_path: Path, endpoint: str, bucket_name: str) -> None:  # noqa: F811
    conv = node.conversation(6)
    with node.open_node(tmp_path / "a", endpoint, bucket_name) as a:
        assert a.store(*conv)
        ref = blocks_for_prefix(decode_header(a.remote.headers.get(
            header_name("", a.find_exact(conv[0]).entry.id))).descriptor, None)[-1]
        rot_object(endpoint, bucket_name, blob_key(ref.name))
        good = a._remote.local_copy(ref.name)
        assert a.remote.fetch_block(ref.name, ref.raw_bytes, None, vouched=True, local=lambda n: good) == good
    assert bucket_blocks_verify(endpoint, bucket_name)



def test_an_oversized_copy_convicts_only_itself_not_the_copy_that_replaced_it(
        tmp_path: Path, endpoint: str, bucket_name: str) -> None:  # noqa: F811
    """A block's copy larger than its sealed header allows is proof against
    that copy alone. Another node puts a good copy back between this node's
    read and its verdict: the good copy stays (the verdict names the ETag of
    the copy read, not whatever a later HEAD sees), and the entry restores."""
    conv = node.conversation(7)
    with keyed(tmp_path / "a", endpoint, bucket_name) as a:
        assert a.store(*conv)
        victim = a.find_exact(conv[0]).entry.blocks[-1]
    raw, where = raw_store(endpoint, bucket_name), blob_key(victim)
    good = bytes(obstore.get(raw, where).bytes())
    obstore.put(raw, where, good + bytes(max_frame_bytes(len(good))))  # past what any frame of it can be
    with keyed(tmp_path / "b", endpoint, bucket_name) as b:
        read_limited = b.remote.blocks.read_limited

        def healed_meanwhile(name: str, limit: int):  # noqa: ANN202
            try:
                return read_limited(name, limit)
            except OversizedError:
                obstore.put(raw, where, good)  # another node's heal lands before our verdict
                raise

        b.remote.blocks.read_limited = healed_meanwhile
        assert b.restore(b.find_exact(conv[0]).entry) is None  # a miss, never data
    assert bytes(obstore.get(raw, where).bytes()) == good
    with keyed(tmp_path / "c", endpoint, bucket_name) as c:
        assert restores_bit_exact(c, *conv)

# -- case 3: a swapped MANIFEST record ---------------------------------------------------------

def test_a_swapped_manifest_record_is_never_learned_and_deletes_nothing(
        tmp_path: Path, endpoint: str, bucket_name: str) -> None:  # noqa: F811
    """The MANIFEST's record for header A holds header B's valid bytes. A fresh
    node must learn A as A (fetching it on its own) and its rules must never
    delete A or B from the bucket."""
    convs = [node.conversation(10), node.conversation(11)]
    with node.open_node(tmp_path / "a", endpoint, bucket_name) as a:
        assert all(a.store(*c) for c in convs)
        name_a, name_b = (header_name("", a.find_exact(t).entry.id) for t, _ in convs)
        bytes_a, bytes_b = a.remote.headers.get(name_a), a.remote.headers.get(name_b)
        assert len(bytes_a) == len(bytes_b)  # the premise: a swap that keeps every length
        for _ in range(40):  # more entries (a third conversation's header, stored again by other nodes)
            a.remote.headers.put_if_absent(header_name("", uuid.uuid4().hex), [bytes_b])
    with node.open_node(tmp_path / "b", endpoint, bucket_name):  # fetches them one by one, then packs them
        pass
    raw = raw_store(endpoint, bucket_name)
    key = f"fleet/{FP_DIR}/MANIFEST"
    manifest = bytes(obstore.get(raw, key).bytes())
    at = manifest.index(name_a.encode())
    start = manifest.index(bytes_a, at)
    obstore.put(raw, key, manifest[:start] + bytes_b + manifest[start + len(bytes_b):])
    with node.open_node(tmp_path / "c", endpoint, bucket_name) as c:
        for tokens, caches in convs:
            assert restores_bit_exact(c, tokens, caches)
        assert c.find_exact(convs[0][0]).entry.id == name_a.rpartition("/")[2].removesuffix(".bkv")
        c.sync_remote()
    listed = {k.partition("/entries/")[2] for k in keys(endpoint, bucket_name, f"fleet/{FP_DIR}/entries")}
    assert {name_a, name_b} <= listed


def _manifest_record_for_a_replaced(
        tmp_path: Path, endpoint: str, bucket_name: str, seeds: tuple[int, int],  # noqa: F811
        forge: Callable[[BlockStore, str, bytes, bytes], bytes]) -> tuple[list, str]:
    """Conversations A and B stored by one keyed node, 40 more entries sealed
    with B's bytes, a second node packing them into the MANIFEST; then the
    MANIFEST's record for header A replaced, in place, by ``forge(node, name_a,
    bytes_a, bytes_b)`` (same length). Returns the conversations and A's name."""
    convs = [node.conversation(seeds[0]), node.conversation(seeds[1])]
    with keyed(tmp_path / "a", endpoint, bucket_name) as a:
        assert all(a.store(*c) for c in convs)
        name_a, name_b = (header_name("", a.find_exact(t).entry.id) for t, _ in convs)
        bytes_a, bytes_b = a.remote.headers.get(name_a), a.remote.headers.get(name_b)
        forged = forge(a, name_a, bytes_a, bytes_b)
        assert len(forged) == len(bytes_a)  # the premise: a swap that keeps every length
        for _ in range(40):  # more entries, each sealed by a key holder under its own name
            name = header_name("", uuid.uuid4().hex)
            a.remote.headers.put_if_absent(name, [a.remote.key.seal_header(name, bytes_b)])
    with keyed(tmp_path / "b", endpoint, bucket_name):  # fetches them one by one, then packs them
        pass
    raw = raw_store(endpoint, bucket_name)
    key = f"fleet/{FP_DIR}/MANIFEST"
    manifest = bytes(obstore.get(raw, key).bytes())
    start = manifest.index(bytes_a, manifest.index(name_a.encode()))
    obstore.put(raw, key, manifest[:start] + forged + manifest[start + len(forged):])
    return convs, name_a


def test_with_a_fleet_key_a_manifest_record_that_fails_its_seal_costs_a_get_not_the_entry(
        tmp_path: Path, endpoint: str, bucket_name: str) -> None:  # noqa: F811
    """A keyless bucket writer swaps the MANIFEST's record for header A: A's
    name and ETag, B's sealed bytes. The record fails its seal as A: a fresh
    keyed node fetches A on its own and serves it (#32 case 12)."""
    convs, name_a = _manifest_record_for_a_replaced(tmp_path, endpoint, bucket_name, (12, 13),
                                                    lambda a, name_a, bytes_a, bytes_b: bytes_b)
    with keyed(tmp_path / "c", endpoint, bucket_name) as c:
        assert len(c._remote.catalog) == 42
        for tokens, caches in convs:
            assert restores_bit_exact(c, tokens, caches)
        assert c.find_exact(convs[0][0]).entry.id == name_a.rpartition("/")[2].removesuffix(".bkv")


def test_a_manifest_record_sealed_for_its_name_with_another_entrys_bytes_costs_a_get(
        tmp_path: Path, endpoint: str, bucket_name: str) -> None:  # noqa: F811
    """#43: the MANIFEST's record for header A holds header B's bytes, sealed
    with the fleet key under A's name, with A's ETag. The seal holds, but the
    bytes are not the object listed as A (its ETag is the MD5 of other bytes):
    a fresh node fetches A on its own. Before, it learned A as B; once it had
    stored B's conversation again, a second fresh node could not restore A."""
    convs, name_a = _manifest_record_for_a_replaced(
        tmp_path, endpoint, bucket_name, (14, 15),
        lambda a, name_a, bytes_a, bytes_b: a.remote.key.seal_header(name_a, bytes_b))  # B, validly sealed as A
    with keyed(tmp_path / "c", endpoint, bucket_name) as c:
        assert c.find_exact(convs[0][0]).entry.id == name_a.rpartition("/")[2].removesuffix(".bkv")
        assert c.store(*convs[1])  # B's conversation stored again
        c.sync_remote()
    with keyed(tmp_path / "d", endpoint, bucket_name) as d:
        for tokens, caches in convs:
            assert restores_bit_exact(d, tokens, caches)


# -- case 5: a header with a mismatched namespace key ------------------------------------------

def bait(store: BlockStore, tokens: list[int], ns: str, into: str) -> str:
    """A header naming the blocks of ``store``'s entry in ``ns`` as if they were namespace ``into``'s."""
    entry = store.find_exact(tokens, ns=ns).entry
    header = decode_header(store.remote.headers.get(header_name(ns, entry.id)))
    name = header_name(into, uuid.uuid4().hex)
    store.remote.headers.put_if_absent(name, [encode_header(
        type(header)(header.identity, into, header.tokens, header.descriptor, header.checkpoint, header.block_xxh3))])
    return name


def test_a_node_restoring_a_bait_header_convicts_only_the_header(
        tmp_path: Path, endpoint: str, bucket_name: str) -> None:  # noqa: F811
    conv = node.conversation(20)
    with node.open_node(tmp_path / "a", endpoint, bucket_name, isolate_namespaces=True) as a:
        assert a.store(*conv, ns="alice")
        blocks = a.find_exact(conv[0], ns="alice").entry.blocks
        bait(a, conv[0], "alice", "mallory")
    with node.open_node(tmp_path / "n", endpoint, bucket_name, isolate_namespaces=True) as n:
        match = n.find_exact(conv[0], ns="mallory")
        assert match is not None and n.restore(match.entry) is None  # a miss, never alice's KV
        assert n.find_exact(conv[0], ns="mallory") is None  # and forgotten
    assert all(any(k.endswith(b) for k in keys(endpoint, bucket_name)) for b in blocks)  # not one deleted
    with node.open_node(tmp_path / "c", endpoint, bucket_name, isolate_namespaces=True) as c:
        assert restores_bit_exact(c, *conv, ns="alice")


def test_check_repair_convicts_a_bait_header_and_keeps_the_blocks(
        tmp_path: Path, endpoint: str, bucket_name: str) -> None:  # noqa: F811
    """``blockkv check --remote --repair`` judges each block under the key of every
    header that names it: good under alice's, so the header that says mallory's
    is what is wrong, and only it goes."""
    conv = node.conversation(21)
    with node.open_node(tmp_path / "a", endpoint, bucket_name, isolate_namespaces=True) as a:
        assert a.store(*conv, ns="alice")
        victim = header_name("alice", a.find_exact(conv[0], ns="alice").entry.id)
        blocks = a.find_exact(conv[0], ns="alice").entry.blocks
        fake = bait(a, conv[0], "alice", "mallory")
    env = {**os.environ, "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}
    timing = [arg for k, v in node.TIMING.items() for arg in ("--remote-option", f"{k}={v}")]
    (repair,) = run_all(["check", "--remote", f"s3://{bucket_name}/fleet", "--repair", "--all", "--json", *timing],
                        env=env)
    (fp,) = parsed(repair, expect=1)["fingerprints"]
    assert fp["report"]["corrupt_blocks"] == [] and fp["report"]["bad_headers"] == [fake]
    listed = {k.partition("/entries/")[2] for k in keys(endpoint, bucket_name, f"fleet/{FP_DIR}/entries")}
    assert listed == {victim}  # the bait went, the victim stayed
    assert all(any(k.endswith(b) for k in keys(endpoint, bucket_name)) for b in blocks)
    with node.open_node(tmp_path / "c", endpoint, bucket_name, isolate_namespaces=True) as c:
        assert restores_bit_exact(c, *conv, ns="alice")


# -- case 7: the fleet key ---------------------------------------------------------------------

def keyed(root: Path, endpoint: str, bucket_name: str, **kw: object) -> BlockStore:  # noqa: F811
    return node.open_node(root, endpoint, bucket_name, remote_options={"key": KEY}, **kw)


def test_with_a_fleet_key_nodes_serve_only_what_a_key_holder_sealed(
        tmp_path: Path, endpoint: str, bucket_name: str, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    own, forged_tokens = node.conversation(30), node.conversation(31)[0]
    with keyed(tmp_path / "a", endpoint, bucket_name) as a:
        assert a.store(*own)
        name = header_name("", a.find_exact(own[0]).entry.id)
        sealed = a.remote.headers.get(name)
        assert b'"fleet_mac":"' in sealed and decode_header(sealed).ns == ""  # older readers see a header
        identity = a.remote.meta.get("IDENTITY")
        assert b"fleet_mac" in identity
        # a bucket writer without the key: the header of another conversation's tokens over these blocks
        header = decode_header(sealed)
        forged = header_name("", uuid.uuid4().hex)
        a.remote.headers.put_if_absent(forged, [encode_header(type(header)(
            header.identity, "", node.np.asarray(forged_tokens, dtype=node.np.uint32), header.descriptor))])
        # and a keyless node of the same model: its entries are not sealed either
        with node.open_node(tmp_path / "k", endpoint, bucket_name) as keyless:
            assert keyless.store(*node.conversation(32))
    with caplog.at_level(logging.WARNING, logger="blockkv"), keyed(tmp_path / "b", endpoint, bucket_name) as b:
        assert len(b._remote.catalog) == 1  # the sealed entry alone
        assert b.find_exact(forged_tokens) is None and b.find_exact(node.conversation(32)[0]) is None
        assert restores_bit_exact(b, *own)
    assert any("not sealed with the fleet key" in r.getMessage() for r in caplog.records)
    assert len(keys(endpoint, bucket_name, f"fleet/{FP_DIR}/entries")) == 3  # nothing deleted for it


def test_with_a_fleet_key_a_header_planted_in_a_nodes_root_is_never_sealed(
        tmp_path: Path, endpoint: str, bucket_name: str, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    """A local writer of node A's root without the key plants a header (a valid
    unkeyed digest: another prompt over A's blocks) and an empty backlog mark.
    A's next sync must not seal it with the fleet key, or every keyed node
    would serve it; a store of A's own that waited in the backlog still goes."""
    own, waiting = node.conversation(36), node.conversation(37)
    forged_tokens = own[0][::-1]
    with keyed(tmp_path / "a", endpoint, bucket_name) as a:
        assert a.store(*own)
        header = a._dir.read_header(a._dir.header_path("", a.find_exact(own[0]).entry.id))
        a._remote.breaker.failed()  # the bucket unreachable for a moment: stored locally, in the backlog
        assert not a.store(*waiting)
        planted = uuid.uuid4().hex
        path = a._dir.header_path("", planted)
        backlog = a.directory / "backlog"
    forged = node.np.asarray(forged_tokens, dtype=node.np.uint32)
    path.write_bytes(encode_header(type(header)(header.identity, "", forged, header.descriptor)))
    (backlog / planted).touch()
    with caplog.at_level(logging.WARNING, logger="blockkv"), keyed(tmp_path / "a", endpoint, bucket_name) as a:
        assert a.find_exact(forged_tokens) is not None  # the root is the planter's: this node serves it
        a.sync_remote()
        assert a._remote.uploads.backlog() == []
    with keyed(tmp_path / "b", endpoint, bucket_name) as b:
        assert b.find_exact(forged_tokens) is None
        assert restores_bit_exact(b, *own) and restores_bit_exact(b, *waiting)
    assert not any(k.endswith(planted + ".bkv") for k in keys(endpoint, bucket_name))  # not uploaded at all
    assert any("backlog mark is not this node's own" in r.getMessage() for r in caplog.records)


def test_with_a_fleet_key_a_planted_identity_does_not_stop_a_node(
        tmp_path: Path, endpoint: str, bucket_name: str) -> None:  # noqa: F811
    raw = raw_store(endpoint, bucket_name)
    obstore.put(raw, f"fleet/{FP_DIR}/IDENTITY", b'{"format": 1, "model_id": "someone else\'s", '
                b'"config_fingerprint": "x", "tokenizer_hash": "y"}')
    conv = node.conversation(33)
    with keyed(tmp_path / "a", endpoint, bucket_name) as a:  # not sealed: not acted on
        assert a.store(*conv)
    with keyed(tmp_path / "b", endpoint, bucket_name) as b:
        assert restores_bit_exact(b, *conv)
    with pytest.raises(ValueError, match="IDENTITY"):  # without a key, it is a clear error
        node.open_node(tmp_path / "c", endpoint, bucket_name)


def test_with_a_fleet_key_only_a_sealed_done_mark_ends_a_writers_wait(
        tmp_path: Path, endpoint: str, bucket_name: str) -> None:  # noqa: F811
    with keyed(tmp_path / "a", endpoint, bucket_name) as a:
        bucket = a.remote
        start = bucket.server_now()
        window = Window(bucket)  # a GC run's window, open
        forged = f"{window.marker}.done"
        bucket.meta.put_if_absent(forged, [b"written by someone without the key"])
        assert gc_runs_since(bucket, start)[window.marker] is not None  # still waited for
        bucket.meta.delete(forged)
        window.close()  # the run's own, sealed
        assert gc_runs_since(bucket, start)[window.marker] is None


def test_a_fleet_key_too_short_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fleet key"):
        BlockStore(tmp_path, **node.IDENT, max_bytes=1 << 20, remote="s3://b/p", remote_options={"key": "short"})


# -- case 10: a missing bucket -----------------------------------------------------------------

def test_a_missing_bucket_is_one_clear_line(tmp_path: Path, endpoint: str) -> None:  # noqa: F811
    with pytest.raises(FileNotFoundError) as raised:
        node.open_node(tmp_path / "a", endpoint, "no-such-bucket")
    message = str(raised.value)
    assert "'no-such-bucket'" in message and "create it" in message and "\n" not in message


def test_a_missing_bucket_keeps_the_local_tier_of_a_prompt_cache(
        tmp_path: Path, endpoint: str, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    options = {"endpoint_url": endpoint, **node.CREDENTIALS, **node.TIMING}
    cache = PersistentPromptCache(cache_dir=tmp_path / "c", remote="s3://no-such-bucket/fleet",
                                  remote_options=options,
                                  identity=lambda key: StoreIdentity(**node.IDENT))
    with caplog.at_level(logging.WARNING, logger="blockkv"):
        store = cache.store_for("model")
    try:
        assert store is not None and store.remote is None  # the local disk tier, not RAM-only
        assert any("no-such-bucket" in r.getMessage() for r in caplog.records)
    finally:
        cache.close()


def test_serve_with_a_missing_bucket_exits_2_naming_it(tmp_path: Path, endpoint: str) -> None:  # noqa: F811
    proc = subprocess.run(
        [sys.executable, "-m", "blockkv", "serve", "--model", str(tmp_path), "--cache-dir",
         str(tmp_path / "c"), "--remote", "s3://no-such-bucket/fleet",
         *(arg for k, v in {"endpoint_url": endpoint, **node.CREDENTIALS}.items()
           for arg in ("--remote-option", f"{k}={v}"))],
        capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "'no-such-bucket' does not exist" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
