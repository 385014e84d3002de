"""blockkv.bucket.bucket against a real S3 server process (moto's, on 127.0.0.1).

Nodes are separate processes where concurrency matters (tests/support/bucket_node.py).
Blocks come from blocks.split_entry of real mlx-lm KVCache objects; every
comparison of tensors is of raw bits."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import boto3
import bucket_node as node
import numpy as np
import obstore
import pytest
from moto.server import ThreadedMotoServer
from obstore.store import S3Store

from blockkv.bucket.bucket import Bucket
from blockkv.bucket.objects import BucketError
from blockkv.bucket.session import StoreTooSlow
from blockkv.errors import BlockMissingError, CorruptBlockError, CorruptHeaderError
from blockkv.format.blocks import Block
from blockkv.format.frame import encode_block
from blockkv.format.header import Identity
from blockkv.format.layout import ns_dirname
from blockkv.testing.moto_clock import ServerClock

NODE = str(Path(__file__).parents[1] / "support" / "bucket_node.py")


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadedMotoServer]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def server_clock(server: ThreadedMotoServer) -> Iterator[ServerClock]:
    """The clock moto's server (in this process) stamps objects with: ``step`` moves it."""
    clock = ServerClock.install()
    try:
        yield clock
    finally:
        clock.uninstall()


@pytest.fixture
def endpoint(server: ThreadedMotoServer) -> str:
    host, port = server.get_host_and_port()
    return f"http://{host}:{port}"


def make_bucket(endpoint: str) -> str:
    name = f"blockkv-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").create_bucket(Bucket=name)
    return name


@pytest.fixture
def bucket_name(endpoint: str) -> str:
    return make_bucket(endpoint)


@pytest.fixture
def bucket(endpoint: str, bucket_name: str) -> Iterator[Bucket]:
    b = node.open_bucket(endpoint, bucket_name)
    yield b
    b.close()


def keys(endpoint: str, bucket_name: str, under: str = "") -> list[str]:
    raw = S3Store(bucket_name, endpoint=endpoint, client_options={"allow_http": True}, **node.CREDENTIALS)
    return sorted(m["path"] for batch in obstore.list(raw, prefix=under or None) for m in batch)


def raw_store(endpoint: str, bucket_name: str) -> S3Store:
    return S3Store(bucket_name, endpoint=endpoint, client_options={"allow_http": True}, **node.CREDENTIALS)


def run_node(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, NODE, *args], stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    _, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err.decode()[-3000:]


def test_node_b_restores_bit_exact_what_node_a_uploaded(endpoint: str, bucket_name: str, bucket: Bucket,
                                                       tmp_path: Path) -> None:
    name, header, layout, caches = node.entry(100, seed=1)
    node.upload(bucket, name, header, layout)
    out = tmp_path / "b.npz"
    finish(run_node("fetch", endpoint, bucket_name, str(out)))  # node B: its own process, the bucket only
    with np.load(out) as got:
        fetched = [got[f"arr_{i}"].tobytes() for i in range(len(got.files))]
    assert fetched == list(node.raw_state(caches))


def test_the_header_is_written_after_its_blocks_and_listed_by_other_handles(
        endpoint: str, bucket_name: str, bucket: Bucket) -> None:
    name, header, layout, _ = node.entry(64, seed=2)
    session = bucket.begin_store()
    node.put_blocks(session, layout, None)
    other = node.open_bucket(endpoint, bucket_name)
    assert other.list_headers() == {}  # blocks alone are no entry
    session.commit(name, header)
    assert list(other.list_headers()) == [name]
    assert other.new_headers([name]) == []
    copy = other.fetch_header(name)
    assert copy.data == header and copy.header.identity == node.IDENTITY
    with pytest.raises(ValueError):
        session.commit(name, b"not a header")


def test_a_node_with_nothing_local_rebuilds_every_entry_from_the_bucket(
        endpoint: str, bucket_name: str, bucket: Bucket) -> None:
    stored = {}
    for seed, ns in [(50, ""), (51, "tenant-a"), (52, "tenant-a")]:
        name, header, layout, caches = node.entry(40, seed=seed, shared=32, ns=ns)
        node.upload(bucket, name, header, layout)
        stored[name] = (header, caches)
    fresh = node.open_bucket(endpoint, bucket_name)  # a wiped root knows no header
    found = fresh.new_headers([])
    assert sorted(found) == sorted(stored)
    assert fresh.new_headers(found[:1]) == found[1:]
    tenant = [n for n in stored if n.startswith(ns_dirname("tenant-a") + "/")]
    assert len(tenant) == 2 and sorted(fresh.list_headers(ns_dirname("tenant-a"))) == sorted(tenant)
    for name in found:
        assert fresh.fetch_header(name).data == stored[name][0]
        assert list(node.raw_state(node.restore(fresh, name))) == list(node.raw_state(stored[name][1]))


def test_a_system_prompt_uploaded_by_three_nodes_is_stored_once(endpoint: str, bucket_name: str) -> None:
    nodes = [node.open_bucket(endpoint, bucket_name) for _ in range(3)]
    shared = 64  # four whole blocks of system prompt, then each node's own tail
    layouts = []
    for seed, b in enumerate(nodes):
        name, header, layout, _ = node.entry(80, seed=10 + seed, shared=shared)
        node.upload(b, name, header, layout)
        layouts.append(layout)
    unique = {blk_.ref.name for layout in layouts for blk_ in layout.blocks}
    prompt_blocks = {b.ref.name for b in layouts[0].blocks} & {b.ref.name for b in layouts[1].blocks}
    assert len(prompt_blocks) >= 4  # the premise: the prompt's blocks really are shared
    blobs = keys(endpoint, bucket_name, f"fleet/{node.FP_DIR}/blobs")
    assert len(blobs) == len(unique) < sum(len(layout.blocks) for layout in layouts)
    assert len(keys(endpoint, bucket_name, f"fleet/{node.FP_DIR}/entries")) == 3


def test_a_flipped_byte_in_the_bucket_is_a_miss_and_is_replaced_by_the_next_store(
        endpoint: str, bucket_name: str, bucket: Bucket) -> None:
    name, header, layout, caches = node.entry(64, seed=3)
    node.upload(bucket, name, header, layout)
    victim = layout.blocks[1]
    key = f"fleet/{node.FP_DIR}/blobs/{victim.ref.name[:2]}/{victim.ref.name}"
    raw = raw_store(endpoint, bucket_name)
    damaged = bytearray(obstore.get(raw, key).bytes())
    damaged[-5] ^= 0x10
    obstore.put(raw, key, bytes(damaged))
    reader = node.open_bucket(endpoint, bucket_name)
    with pytest.raises(CorruptHeaderError):
        node.restore(reader, name)  # a miss, never data; and no proof whose fault it is: kept
    assert key in keys(endpoint, bucket_name)
    with pytest.raises(CorruptBlockError):
        node.restore(reader, name, vouched=True)  # the key it was named with is known: proof
    assert key not in keys(endpoint, bucket_name)  # quarantined, inside a window writers respect
    assert keys(endpoint, bucket_name, f"fleet/{node.FP_DIR}/wanted/") == [
        f"fleet/{node.FP_DIR}/wanted/{victim.ref.name}"]  # and a good copy asked of the fleet
    with pytest.raises(BlockMissingError):
        reader.fetch_block(victim.ref.name, victim.ref.raw_bytes, None)
    again = node.entry(64, seed=3)  # the same content stored again uploads a good copy
    node.upload(bucket, again[0], again[1], again[2])
    assert list(node.raw_state(node.restore(reader, name))) == list(node.raw_state(caches))


def test_identity_is_created_once_and_checked(bucket: Bucket) -> None:
    bucket.ensure_identity(node.IDENTITY)
    bucket.ensure_identity(node.IDENTITY)
    with pytest.raises(ValueError, match="IDENTITY"):
        bucket.ensure_identity(Identity("another", node.IDENTITY.config_fingerprint, "tok", node.IDENTITY.codec))


def test_a_store_past_its_deadline_rechecks_and_then_refuses(endpoint: str, bucket_name: str) -> None:
    # a re-check gets grace/2 - request_bound - 2 s of server time (2.5 s here, counted in the
    # whole seconds of Last-Modified): room for a loaded machine, and less than the stall below
    bucket = node.open_bucket(endpoint, bucket_name, grace=11.0, timeout=1.0, sweep_window=3.0)
    name, header, layout, _ = node.entry(32, seed=7)
    session = bucket.begin_store()
    node.put_blocks(session, layout, None)
    session.reading = replace(session.reading, server=session.start - bucket.grace)  # begun a grace period ago
    bucket.blocks.delete(layout.blocks[0].ref.name)
    session.commit(name, header)  # re-checked from a new start: the block came back
    assert bucket.blocks.exists(layout.blocks[0].ref.name)

    name2, header2, layout2, _ = node.entry(32, seed=8)
    slow = bucket.begin_store()

    def stall(b: Block) -> bytes:
        time.sleep(bucket.grace / 2)  # the re-check itself outlasts the deadline
        return b"".join(encode_block(b))

    for b in layout2.blocks:
        slow.put_block(b.ref, lambda b=b: stall(b) if b is layout2.blocks[0] else node.frame_of(b)())
    slow.reading = replace(slow.reading, server=slow.start - bucket.grace)
    bucket.blocks.delete(layout2.blocks[0].ref.name)
    with pytest.raises(StoreTooSlow):
        slow.commit(name2, header2)
    assert name2 not in bucket.list_headers()


def test_fleet_wide_lru_eviction(endpoint: str, bucket_name: str, bucket: Bucket) -> None:
    names = []
    for seed in range(3):
        name, header, layout, _ = node.entry(48, seed=20 + seed, shared=32)
        node.upload(bucket, name, header, layout)
        names.append(name)
        time.sleep(1.1)  # Last-Modified has one-second resolution: no ties
    other = node.open_bucket(endpoint, bucket_name)
    other.touch(names[0])  # used on another node: now the most recent
    listed = bucket.list_headers()
    sizes = {i.name: i.size for i in bucket.blocks.list_info()}
    total = sum(i.size for i in listed.values()) + sum(sizes.values())
    evicted = bucket.evict_to(total - 1)
    assert evicted == [names[1]]  # the least recently used; the touched first entry stays
    assert set(bucket.list_headers()) == set(names) - {names[1]}
    assert bucket.evict_to(0) and bucket.list_headers() == {}
    with pytest.raises(ValueError):
        bucket.evict_to(-1)


def test_two_gc_runs_at_once_beside_a_writer_lose_nothing_committed(
        endpoint: str, bucket_name: str, tmp_path: Path) -> None:
    """Two GC processes loop while a third stores entries (sharing a system
    prompt, abandoning some stores, evicting some entries) for longer than the
    grace period: every header left in the bucket has all its blocks, verified."""
    seconds = node.TEST_TIMING["grace"] + 3
    procs = [run_node("store", endpoint, bucket_name, str(seconds), str(tmp_path / "store.json")),
             run_node("gc", endpoint, bucket_name, str(seconds + 1), str(tmp_path / "gc1.json")),
             run_node("gc", endpoint, bucket_name, str(seconds + 1), str(tmp_path / "gc2.json"))]
    for proc in procs:
        finish(proc)
    stored = json.loads((tmp_path / "store.json").read_text())
    runs = [json.loads((tmp_path / f"gc{i}.json").read_text()) for i in (1, 2)]
    deleted = [n for run in runs for n in run["deleted"]]
    print("store:", {k: len(v) if isinstance(v, list) else v for k, v in stored.items()},
          "gc runs:", [run["runs"] for run in runs], "deleted:", len(deleted))
    assert len(stored["committed"]) >= 3
    assert deleted  # the runs really swept garbage while the writer worked
    checker = node.open_bucket(endpoint, bucket_name)
    headers = checker.list_headers()
    assert set(stored["committed"]) <= set(headers)
    for name in headers:
        caches = node.restore(checker, name)  # every block present and hashing to its name
        assert caches


def test_an_outage_raises_bucket_error_promptly_and_recovers_on_the_same_port() -> None:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    name = make_bucket(endpoint)
    b = node.open_bucket(endpoint, name)
    entry_name, header, layout, _ = node.entry(48, seed=30)
    session = b.begin_store()
    session.put_block(layout.blocks[0].ref, node.frame_of(layout.blocks[0]), new=True)
    server.stop()  # mid-store
    calls: list[Any] = [
        lambda: session.put_block(layout.blocks[1].ref, node.frame_of(layout.blocks[1]), new=True),
        lambda: session.commit(entry_name, header),
        b.list_headers, b.gc, lambda: b.evict_to(0),
        lambda: b.fetch_blocks({layout.blocks[0].ref.name: layout.blocks[0].ref.raw_bytes}, None),
        lambda: b.touch(entry_name),
    ]
    for call in calls:
        started = time.monotonic()
        with pytest.raises(BucketError):
            call()
        assert time.monotonic() - started < 3 * b.request_bound  # bounded: never a hang
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:  # moto's data went with the old process: the same handle reaches the new server
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                     region_name="us-east-1").create_bucket(Bucket=name)
        node.upload(b, entry_name, header, layout)
        assert list(b.list_headers()) == [entry_name]
    finally:
        server.stop()


def test_bad_arguments_are_value_errors(endpoint: str) -> None:
    options = {"endpoint_url": endpoint, **node.CREDENTIALS}
    with pytest.raises(ValueError):
        Bucket("s3://b/p", "../escape", options)
    with pytest.raises(ValueError, match="grace"):
        Bucket("s3://b/p", "fp", options, grace=4, timeout=2, sweep_window=5, max_retries=0)
    with pytest.raises(ValueError, match="sweep_window"):
        Bucket("s3://b/p", "fp", options, timeout=10, sweep_window=5)


def test_gc_condemns_old_garbage_and_a_refresh_racing_its_sweep_is_caught_before_the_header(
        endpoint: str, bucket_name: str) -> None:
    """GC condemns only unreferenced blocks older than the grace period. And the
    race a grace period alone does not close: a GC run lists a block as
    old garbage, a writer's dedup hit refreshes it, then the run deletes it on
    its stale view. The writer saw the run's marker, waits for it to finish,
    checks every block again and uploads the deleted one before its header."""
    # short, since the test waits it out, but long enough that the store's deadline
    # (grace/2 - 1 s - 2 s) is not what sends it back to check its blocks again
    grace = 9.0
    timing = dict(grace=grace, timeout=1.0, sweep_window=10.0)  # room for the test's steps inside the window
    writer = node.open_bucket(endpoint, bucket_name, **timing)
    collector = node.open_bucket(endpoint, bucket_name, **timing)
    kept_name, kept_header, kept, _ = node.entry(48, seed=41)
    node.upload(writer, kept_name, kept_header, kept)  # old, but referenced
    name, header, layout, caches = node.entry(48, seed=40)
    frames = {b.ref.name: b for b in layout.blocks}
    node.put_blocks(writer.begin_store(), layout, None)  # garbage: no header names these blocks yet
    idle = node.open_bucket(endpoint, bucket_name, **timing)
    idle.server_now()  # its clock object, then silence
    gone = f"{ns_dirname('')}/{uuid.uuid4().hex}.bkv"
    idle.touch(gone)  # a last-use mark of an entry no longer there
    first = collector.gc()
    assert first.deleted == [] and first.young == len(frames)  # inside the grace period
    meta_keys = keys(endpoint, bucket_name, f"fleet/{node.FP_DIR}/")
    assert f"fleet/{node.FP_DIR}/used/{gone}" in meta_keys and f"fleet/{node.FP_DIR}/clock/{idle._node}" in meta_keys
    until = writer.server_now() + grace + 1.5
    while writer.server_now() <= until:  # the server's clock, not ours
        time.sleep(0.5)
    _, _, young, _ = node.entry(48, seed=42)
    node.put_blocks(writer.begin_store(), young, None)
    junk = f"{ns_dirname('')}/{uuid.uuid4().hex}.bkv"  # a header no one can read: its blocks are unknown
    collector.headers.put_if_absent(junk, [b"BKVHDR\x00\x00 from a future version"])
    fetched = collector.fetch_headers([junk, kept_name])
    assert list(fetched.damaged) == [junk] and list(fetched.found) == [kept_name]
    assert fetched.found[kept_name].data == kept_header
    blocked = collector.gc_mark()
    assert blocked.doomed == [] and blocked.report.unreadable_headers == [junk]
    assert collector.gc_sweep(blocked).deleted == []  # and marks the run done, so no writer waits for it
    collector.headers.delete(junk)
    plan = collector.gc_mark()
    assert sorted(plan.doomed) == sorted(frames)  # only the old unreferenced blocks
    assert plan.report.young == len(young.blocks)

    session = writer.begin_store()
    started = session.start
    for b in frames.values():
        assert session.put_block(b.ref, node.frame_of(b, None), new=True)  # old: refreshed
    assert session.refreshed == set(frames)
    committing = ThreadPoolExecutor(1).submit(session.commit, name, header)
    time.sleep(0.2)
    assert not committing.done()  # it waits for the run it saw
    report = collector.gc_sweep(plan)  # deletes the refreshed blocks: its view was stale
    assert sorted(report.deleted) == sorted(frames)
    committing.result(timeout=30)
    assert session.start == started  # not past its deadline: the re-check after the run did it
    assert list(node.raw_state(node.restore(writer, name))) == list(node.raw_state(caches))
    assert collector.fetch_blocks({b.ref.name: b.ref.raw_bytes for b in kept.blocks}, None).keys() == {
        b.ref.name for b in kept.blocks}
    meta_keys = keys(endpoint, bucket_name, f"fleet/{node.FP_DIR}/")  # reaped by the runs past the grace period
    assert f"fleet/{node.FP_DIR}/used/{gone}" not in meta_keys and f"fleet/{node.FP_DIR}/clock/{idle._node}" not in meta_keys
    fresh = writer.begin_store()  # refreshed or uploaded again just now: no refresh needed
    assert not any(fresh.put_block(b.ref, lambda: pytest.fail("no upload")) for b in frames.values())
