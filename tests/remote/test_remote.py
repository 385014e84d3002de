"""BlockStore(remote=...) against a real S3 server process (moto's, on 127.0.0.1).

Each node is a BlockStore with its own local root; nodes are separate
processes where concurrency matters (tests/support/remote_node.py). Caches are real
mlx-lm caches of a tiny random-weight model; every comparison of tensors is
of raw bits."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import boto3
import obstore
import pytest
import remote_node as node
from moto.server import ThreadedMotoServer
from test_bucket import endpoint, keys, make_bucket, raw_store, server  # noqa: F401 - the server fixtures

from blockkv import BlockStore, GenerationCheckpoint
from blockkv.bucket.manifest import MANIFEST_MIN, manifest_stream
from blockkv.format.layout import fingerprint_dirname, header_name

NODE = str(Path(__file__).parents[1] / "support" / "remote_node.py")
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
        b._adoptions.wait_kept()  # what it fetched is kept locally in the background
        assert len(b) == 1 and set(b.entries()[0].blocks) <= local_blocks(b)  # materialised: a local entry now
        cut = b.restore(b.find_exact(tokens).entry, prefix_len=150)  # and served locally from here on
        assert node.kv_bits(cut.caches, 150) == node.kv_bits(caches, 150)
        assert b.sync_remote() == 0  # local now: nothing to learn
    with node.open_node(tmp_path / "c", endpoint, bucket_name) as c:  # a node opened afterwards learns at open
        loaded = c.restore(c.find_exact(tokens).entry)
        assert node.kv_bits(loaded.caches, len(tokens)) == node.kv_bits(caches, len(tokens))


def test_a_system_prompt_stored_by_three_nodes_is_uploaded_once(tmp_path: Path, endpoint: str,  # noqa: F811
                                                                 bucket_name: str,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    nodes = [node.open_node(tmp_path / f"n{i}", endpoint, bucket_name) for i in range(3)]
    try:
        with caplog.at_level(logging.INFO, logger="werkzeug"):  # moto's server logs every request it answers
            for i, n in enumerate(nodes):
                tokens, caches = node.conversation(10 + i)
                n.sync_remote()  # knows the entries stored before: their blocks are asked about, not sent
                assert n.store(tokens, caches)
        entries = [n.entries()[0] for n in nodes]
        prompt_blocks = set.intersection(*(set(e.blocks) for e in entries))
        assert len(prompt_blocks) == len(node.PROMPT) // node.BLOCK_TOKENS  # the premise: whole prompt blocks shared
        unique = {b for e in entries for b in e.blocks}
        listed = [k.rpartition("/")[2] for k in blobs(endpoint, bucket_name)]
        assert sorted(listed) == sorted(unique)  # each block once
        assert len(listed) < sum(len(e.blocks) for e in entries)
        assert len(headers(endpoint, bucket_name)) == 3
        block_puts = [r.getMessage() for r in caplog.records if "PUT /" in r.getMessage() and "/blobs/" in r.getMessage()]
        for block in prompt_blocks:  # the prompt's bytes went over the wire once, not once per node
            assert len([m for m in block_puts if block in m]) == 1
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
        a._adoptions.wait_kept()
        assert len(a) == 3 and a.check().clean  # ordinary local entries now
    with node.open_node(tmp_path / "a", endpoint, bucket_name) as a:
        assert len(a) == 3 and a.sync_remote() == 0


def flip_byte(endpoint: str, bucket_name: str, key: str) -> None:  # noqa: F811
    raw = raw_store(endpoint, bucket_name)
    damaged = bytearray(obstore.get(raw, key).bytes())
    damaged[-5] ^= 0x10
    obstore.put(raw, key, bytes(damaged))


def test_a_flipped_byte_in_the_bucket_is_a_miss_on_every_node(tmp_path: Path, endpoint: str,  # noqa: F811
                                                              bucket_name: str) -> None:
    (tokens, caches), (other, other_caches) = node.conversation(30), node.conversation(31)
    with node.open_node(tmp_path / "a", endpoint, bucket_name) as a:
        assert a.store(tokens, caches) and a.store(other, other_caches)
        entry, victim_header = a.find_exact(tokens).entry, a.find_exact(other).entry
        victim = entry.blocks[-1]  # the conversation's own block, not the shared prompt's
        flip_byte(endpoint, bucket_name, f"fleet/{FP_DIR}/blobs/{victim[:2]}/{victim}")
        flip_byte(endpoint, bucket_name, f"fleet/{FP_DIR}/entries/{header_name('', victim_header.id)}")
        for name in "bc":
            with node.open_node(tmp_path / name, endpoint, bucket_name) as n:
                assert n.find_exact(other) is None  # a damaged header is never learned
                match = n.find_exact(tokens)
                assert match is not None and n.restore(match.entry) is None  # a miss, never data
                assert n.find_exact(tokens) is None and len(n) == 0  # forgotten, nothing written locally
                assert victim not in local_blocks(n)
        # the node that stored it still serves its own verified local copy
        loaded = a.restore(a.find_exact(tokens).entry)
        assert node.kv_bits(loaded.caches, len(tokens)) == node.kv_bits(caches, len(tokens))
        # no proof yet of whose fault it is: a header that does not read might name it with a key
        assert any(k.endswith(victim) for k in blobs(endpoint, bucket_name))
        a.remote.headers.delete(header_name("", victim_header.id))
        with node.open_node(tmp_path / "d", endpoint, bucket_name) as d:  # every header reads, none keyed
            assert d.restore(d.find_exact(tokens).entry) is None
        assert not any(k.endswith(victim) for k in blobs(endpoint, bucket_name))  # proof of damage: quarantined


def start_server(port: int = 0) -> ThreadedMotoServer:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server


def test_an_outage_degrades_to_local_only_and_the_backlog_is_uploaded_when_the_server_returns(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    moto = start_server()
    host, port = moto.get_host_and_port()
    endpoint = f"http://{host}:{port}"  # noqa: F811
    name = make_bucket(endpoint)
    convs = [node.conversation(40 + i) for i in range(4)]
    with node.open_node(tmp_path / "a", endpoint, name) as a, node.open_node(tmp_path / "b", endpoint, name) as b:
        assert a.store(*convs[0])
        assert b.store(*convs[1])
        assert a.sync_remote() == 1  # b's entry: remote-only on a
        moto.stop()
        with caplog.at_level(logging.WARNING, logger="blockkv"):
            started = time.monotonic()
            results = [a.store(*c) for c in convs[2:]]  # never raises
            assert results == [False, False]  # kept locally, not acknowledged by the bucket
            assert a.find_exact(convs[1][0]) is None  # remote-only entries are not offered during the outage
            for tokens, caches in [convs[0], *convs[2:]]:  # finds keep working on the local index
                loaded = a.restore(a.find_exact(tokens).entry)
                assert node.kv_bits(loaded.caches, len(tokens)) == node.kv_bits(caches, len(tokens))
            assert a.sync_remote() == 0
            assert time.monotonic() - started < 10  # refused connections fail at once; the breaker skips the rest
        outage_warnings = [r for r in caplog.records if "bucket" in r.getMessage()]
        assert len(outage_warnings) == 1, [r.getMessage() for r in outage_warnings]  # one per kind, no flood
        assert len(a._remote.uploads.backlog()) == 2
        moto = start_server(port)  # the server returns
        try:
            boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                         region_name="us-east-1").create_bucket(Bucket=name)  # in case its data went with the old one
            assert a.sync_remote() == 0
            ids = {a.find_exact(t).entry.id for t, _ in convs[2:]}
            assert {header_name("", i) for i in ids} <= set(headers(endpoint, name))  # the backlog, caught up
            assert a._remote.uploads.backlog() == []
            assert a.store(*node.conversation(50))  # and stores are acknowledged again
        finally:
            with node.open_node(tmp_path / "c", endpoint, name) as c:  # a fresh node serves the backlog
                for tokens, caches in convs[2:]:
                    loaded = c.restore(c.find_exact(tokens).entry)
                    assert node.kv_bits(loaded.caches, len(tokens)) == node.kv_bits(caches, len(tokens))
            moto.stop()


def run_node(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, NODE, *args], stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    _, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err.decode()[-3000:]


def test_two_nodes_running_gc_beside_a_storing_node_lose_nothing_acknowledged(
        tmp_path: Path, endpoint: str, bucket_name: str) -> None:  # noqa: F811
    """Three processes, one bucket: a node stores conversations for longer than
    the grace period (evicting some fleet-wide at once and storing their content
    again later, a dedup hit on blocks a GC run may condemn) while two nodes run
    bucket GC in a loop. Every acknowledged entry still listed is then restored
    bit-exact by a fresh node."""
    seconds = "20"  # > grace (12 s): blocks of the evicted entries age into condemnation
    with node.open_node(tmp_path / "early", endpoint, bucket_name) as early:  # garbage from the start
        assert early.store(*node.conversation(200))
        early.remote.headers.delete(header_name("", early.entries()[0].id))
    procs = [run_node("store", str(tmp_path / "writer"), endpoint, bucket_name, seconds, str(tmp_path / "store.json"))]
    procs += [run_node("gc", str(tmp_path / f"gc{i}"), endpoint, bucket_name, seconds, str(tmp_path / f"gc{i}.json"))
              for i in (1, 2)]
    for proc in procs:
        finish(proc)
    stored = json.loads((tmp_path / "store.json").read_text())
    runs = [json.loads((tmp_path / f"gc{i}.json").read_text()) for i in (1, 2)]
    deleted = [n for run in runs for n in run["deleted"]]
    print("store:", {k: len(v) if isinstance(v, (list, dict)) else v for k, v in stored.items()},
          "gc runs:", [run["runs"] for run in runs], "deleted:", len(deleted))
    assert len(stored["acknowledged"]) >= 3 and stored["evicted"]
    assert deleted  # the runs really swept garbage while the writer worked
    listed = set(headers(endpoint, bucket_name))
    assert set(stored["acknowledged"]) <= listed
    assert not listed & set(stored["evicted"])
    # an entry a repeat replaced leaves the bucket after the repeat's upload, best effort (a
    # leftover is a harmless duplicate, shadowed wherever it is found): nothing else is listed
    assert listed - set(stored["acknowledged"]) <= set(stored["superseded"])
    with node.open_node(tmp_path / "fresh", endpoint, bucket_name) as fresh:
        for name, seed in stored["acknowledged"].items():
            tokens, caches = node.conversation(seed)
            entry = fresh._remote.entry(name.rpartition("/")[2].removesuffix(".bkv"))
            loaded = fresh.restore(entry)  # every block present and hashing to its name
            assert loaded is not None and node.kv_bits(loaded.caches, len(tokens)) == node.kv_bits(caches, len(tokens))


def test_a_local_eviction_reverts_an_entry_to_remote_only(tmp_path: Path, endpoint: str,  # noqa: F811
                                                          bucket_name: str) -> None:
    convs = [node.conversation(60 + i) for i in range(2)]
    with node.open_node(tmp_path / "a", endpoint, bucket_name) as a:
        assert all(a.store(*c) for c in convs)
        one_entry = max(e.nbytes for e in a.entries())
    with node.open_node(tmp_path / "b", endpoint, bucket_name, max_bytes=one_entry + 4096) as b:
        for turn, (tokens, caches) in enumerate([*convs, convs[0]]):  # each restore evicts the other locally
            loaded = b.restore(b.find_exact(tokens).entry)
            assert node.kv_bits(loaded.caches, len(tokens)) == node.kv_bits(caches, len(tokens))
            b._adoptions.wait_kept()
            assert len(b) == 1 and b.total_bytes <= b.max_bytes
            assert b.sync_remote() == (1 if turn else 0)  # the evicted one is remote-only again


def test_isolated_namespaces_fetch_and_verify_their_keyed_blocks(tmp_path: Path, endpoint: str,  # noqa: F811
                                                                 bucket_name: str) -> None:
    tokens, caches = node.conversation(70)
    with node.open_node(tmp_path / "a", endpoint, bucket_name, isolate_namespaces=True) as a:
        assert a.store(tokens, caches, ns="t1") and a.store(tokens, caches, ns="t2")
    with node.open_node(tmp_path / "plain", endpoint, bucket_name) as plain:
        assert plain.find_exact(tokens, ns="t1") is None  # the other mode's entries are foreign
    with node.open_node(tmp_path / "b", endpoint, bucket_name, isolate_namespaces=True) as b:
        for ns in ("t1", "t2"):
            loaded = b.restore(b.find_exact(tokens, ns=ns).entry)  # blocks named with the namespace's key
            assert node.kv_bits(loaded.caches, len(tokens)) == node.kv_bits(caches, len(tokens))


def test_a_restarted_node_reads_remote_headers_from_its_cache(tmp_path: Path, endpoint: str,  # noqa: F811
                                                              bucket_name: str,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    convs = [node.conversation(80 + i) for i in range(4)]
    with node.open_node(tmp_path / "a", endpoint, bucket_name) as a:
        assert all(a.store(*c) for c in convs)
        names = [header_name("", a.find_exact(t).entry.id) for t, _ in convs]
        with node.open_node(tmp_path / "b", endpoint, bucket_name):
            pass
        cache = tmp_path / "b" / FP_DIR / "remote-headers"
        assert sorted(str(p.relative_to(cache)) for p in cache.rglob("*.bkv")) == sorted(names)
        damaged = bytearray((cache / names[1]).read_bytes())
        damaged[-3] ^= 1
        (cache / names[1]).write_bytes(bytes(damaged))  # a torn copy: fetched again
        a.remote.headers.delete(names[2])  # evicted fleet-wide meanwhile
        flip_byte(endpoint, bucket_name, f"fleet/{FP_DIR}/entries/{names[3]}")  # the bucket's object changed
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="werkzeug"), \
                node.open_node(tmp_path / "b", endpoint, bucket_name) as b:
            for tokens, caches in convs[:2]:  # the first from the cache, the second fetched again
                loaded = b.restore(b.find_exact(tokens).entry)
                assert node.kv_bits(loaded.caches, len(tokens)) == node.kv_bits(caches, len(tokens))
            assert b.find_exact(convs[2][0]) is None and not (cache / names[2]).exists()  # pruned
            # a cached copy of an object the bucket no longer holds is not trusted: dropped, and the
            # bucket's object (damaged) is never served
            assert b.find_exact(convs[3][0]) is None and not (cache / names[3]).exists()
        gets = [m for m in (r.getMessage() for r in caplog.records) if "GET /" in m and "/entries/" in m]
        assert not any(names[0] in m for m in gets) and any(names[1] in m for m in gets)


def test_wrong_remote_arguments_raise_before_anything_is_written(tmp_path: Path) -> None:
    root = tmp_path / "r"
    with pytest.raises(TypeError, match="remote"):
        BlockStore(root, **node.IDENT, max_bytes=1 << 20, remote=b"s3://b/p")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="s3://"):
        BlockStore(root, **node.IDENT, max_bytes=1 << 20, remote="https://b/p")
    with pytest.raises(ValueError, match="without remote"):
        BlockStore(root, **node.IDENT, max_bytes=1 << 20, remote_options={"region": "x"})
    with pytest.raises(ValueError, match="unknown remote option 'endpoint'"):
        BlockStore(root, **node.IDENT, max_bytes=1 << 20, remote="s3://b/p", remote_options={"endpoint": "x"})
    with pytest.raises(ValueError, match="'timeout' must be a number"):
        BlockStore(root, **node.IDENT, max_bytes=1 << 20, remote="s3://b/p", remote_options={"timeout": "soon"})
    with pytest.raises(ValueError, match="grace"):
        BlockStore(root, **node.IDENT, max_bytes=1 << 20, remote="s3://b/p", remote_options={"grace": "1"})
    assert not root.exists()


def test_a_bucket_directory_of_another_model_is_refused_at_open(tmp_path: Path, endpoint: str,  # noqa: F811
                                                                bucket_name: str) -> None:
    with node.open_node(tmp_path / "a", endpoint, bucket_name):
        pass
    with pytest.raises(ValueError, match="IDENTITY"):  # same fingerprint directory, another tokenizer
        node.open_node(tmp_path / "b", endpoint, bucket_name, tokenizer_hash="another")


def test_a_longer_conversation_from_the_bucket_supersedes_its_prefix_everywhere(
        tmp_path: Path, endpoint: str, bucket_name: str) -> None:  # noqa: F811
    short, short_caches = node.conversation(90)
    longer = short + node.random_tokens(70, seed=91)
    longer_caches = node.conversation(90)[1]
    node.prefill(node.model(), longer[len(short):], cache=longer_caches)
    with node.open_node(tmp_path / "a", endpoint, bucket_name) as a, \
            node.open_node(tmp_path / "b", endpoint, bucket_name) as b:
        assert a.store(short, short_caches)
        assert b.sync_remote() == 1 and b.restore(b.find(longer).entry) is not None  # b continues a's conversation
        assert b.store(longer, longer_caches)
        b_entry = b.find_exact(longer).entry
        deadline = time.monotonic() + 10  # the replaced header leaves the bucket in the background
        while len(headers(endpoint, bucket_name)) > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert headers(endpoint, bucket_name) == [header_name("", b_entry.id)]  # b's rules, fleet-wide
        assert a.sync_remote() == 1
        match = a.find(longer + [5])
        assert match.entry.id == b_entry.id  # longer than a's own
        loaded = a.restore(match.entry)
        assert node.kv_bits(loaded.caches, len(longer)) == node.kv_bits(longer_caches, len(longer))
        a._adoptions.wait_kept()
        assert [e.id for e in a.entries()] == [b_entry.id]  # adopting it superseded a's shorter entry
        cut = a.restore(a.find(short).entry, prefix_len=len(short) - 1)  # which it serves by trimming
        assert node.kv_bits(cut.caches, len(short) - 1) == node.kv_bits(short_caches, len(short) - 1)


def test_nothing_is_written_or_deleted_through_a_linked_cache_or_backlog_directory(
        tmp_path: Path, endpoint: str, bucket_name: str) -> None:  # noqa: F811
    tokens, caches = node.conversation(95)
    with node.open_node(tmp_path / "a", endpoint, bucket_name) as a:
        assert a.store(tokens, caches)
    victim = tmp_path / "outside" / "0123456789abcdef" / f"{'a' * 32}.bkv"
    victim.parent.mkdir(parents=True)
    victim.write_bytes(b"not ours")
    (tmp_path / "outside" / ("b" * 32)).write_bytes(b"not ours either")
    with node.open_node(tmp_path / "b", endpoint, bucket_name):
        pass
    fp = tmp_path / "b" / FP_DIR
    shutil.rmtree(fp / "remote-headers")
    (fp / "remote-headers").symlink_to(tmp_path / "outside")
    (fp / "backlog").symlink_to(tmp_path / "outside")
    with node.open_node(tmp_path / "b", endpoint, bucket_name) as b:  # learns, prunes, sends the backlog
        loaded = b.restore(b.find_exact(tokens).entry)
        assert node.kv_bits(loaded.caches, len(tokens)) == node.kv_bits(caches, len(tokens))
        assert b.store(*node.conversation(96))
    assert sorted(p.name for p in (tmp_path / "outside").rglob("*")) == sorted(
        ["0123456789abcdef", victim.name, "b" * 32])


def test_a_server_that_never_answers_costs_a_bounded_wait_per_backoff_not_per_call(tmp_path: Path) -> None:
    """A listener that accepts and never replies: open, stores and finds all
    return and never raise; while the breaker is open no request is even
    tried (connections counted), and a try waits about one request timeout."""
    def connections(listener: socket.socket) -> int:
        n = 0
        with contextlib.suppress(BlockingIOError):
            while True:
                listener.accept()[0].close()
                n += 1
        return n

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        silent.setblocking(False)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"  # noqa: F811
        convs = [node.conversation(100 + i) for i in range(3)]
        started = time.monotonic()
        with node.open_node(tmp_path / "a", endpoint, "silent", remote_options={"timeout": "1"}) as a:
            assert time.monotonic() - started < 10  # the IDENTITY check timed out once
            tried = connections(silent)
            assert tried >= 1
            for tokens, caches in convs[:2]:  # inside the breaker's first backoff (2 s)
                assert a.store(tokens, caches) is False  # kept locally, never raised
                assert a.find_exact(tokens) is not None
            assert connections(silent) == 0  # not tried: the breaker skips the bucket
            time.sleep(2)
            started = time.monotonic()
            assert a.store(*convs[2]) is False  # the backoff is over: tried, timed out
            assert time.monotonic() - started < 10  # bounded by the request timeout
            assert connections(silent) >= 1
            assert a._remote.uploads.backlog() == sorted(a.find_exact(t).entry.id for t, _ in convs)


def test_a_fresh_node_learns_the_fleet_from_the_manifest_and_verifies_every_header_in_it(
        tmp_path: Path, endpoint: str, bucket_name: str, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    tokens, caches = node.conversation(110)
    with node.open_node(tmp_path / "a", endpoint, bucket_name) as a:
        assert a.store(tokens, caches)
        data = a.remote.headers.get(header_name("", a.entries()[0].id))
        copies = [header_name("", uuid.uuid4().hex) for _ in range(MANIFEST_MIN + 8)]
        for name in copies:  # more entries of the same content, as other nodes would have stored
            a.remote.headers.put_if_absent(name, [data])
        with node.open_node(tmp_path / "b", endpoint, bucket_name):  # fetches them one by one, then packs them
            pass
        listed = a.remote.list_headers()
        packed = dict(manifest_stream(a.remote.meta, listed, listed))
        assert sorted(packed) == sorted([header_name("", a.entries()[0].id), *copies])
        (tmp_path / "full").write_bytes(b"")  # a spool that cannot be made: no MANIFEST, and no outage either
        assert list(manifest_stream(a.remote.meta, listed, listed, spool=tmp_path / "full")) == []
        damaged, evicted = copies[0], copies[1]
        key = f"fleet/{FP_DIR}/MANIFEST"
        raw = raw_store(endpoint, bucket_name)
        manifest = bytearray(obstore.get(raw, key).bytes())
        at = manifest.index(damaged.encode()) + len(damaged) + 10
        manifest[at] ^= 1  # one record damaged inside the manifest
        obstore.put(raw, key, bytes(manifest))
        a.remote.headers.delete(evicted)  # and one entry evicted since the manifest was written
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="werkzeug"):
        with node.open_node(tmp_path / "c", endpoint, bucket_name) as c:
            assert len(c._remote.catalog) == len(copies)  # every listed entry, the evicted one not
            assert evicted.removesuffix(".bkv").rpartition("/")[2] not in c._remote.catalog
            loaded = c.restore(c.find_exact(tokens).entry)
            assert node.kv_bits(loaded.caches, len(tokens)) == node.kv_bits(caches, len(tokens))
    gets = [m for m in (r.getMessage() for r in caplog.records) if "GET /" in m and "/entries/" in m
            and "list-type" not in m]
    assert len(gets) == 1 and damaged in gets[0]  # only the damaged record was fetched on its own
