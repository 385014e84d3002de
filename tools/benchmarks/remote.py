"""Scale-out over an S3-compatible bucket (issue #14), on moto's S3 server run
as its own process on loopback: what nodes sharing a bucket pay and save. A
restore on a node whose local pool is cold against a warm local restore,
mlx-lm's load and plain GETs of the same blocks; what a fleet of nodes uploads
for the agent workload against as many independent stores; a fresh node's open
against many entries."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from blockkv import BlockStore

from .config import Config
from .harness import ENTRY_POINT, STORE_IDENTITY, median_time, open_store
from .index import INDEX_IDENTITY
from .sources import VOCAB, KVSource, check_restored, eval_caches, kv_cache


def remote_available() -> bool:
    """The bucket section needs obstore (the s3 extra) and moto's server (the test extra)."""
    return all(importlib.util.find_spec(m) is not None for m in ("obstore", "moto", "boto3"))


def moto_child(port: int) -> int:
    """moto's S3 server, built as its ThreadedMotoServer builds it, behind a
    middleware that counts requests and their bodies (``GET /_bench/received``):
    what the nodes uploaded, refused creates included (their bodies are sent),
    and the bytes of blocks it sent (``blob_bytes_read``: GETs under ``/blobs/``)."""
    import threading

    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    app = DomainDispatcherApplication(create_backend_app)
    counts = {"bytes": 0, "requests": 0, "blob_bytes_read": 0}
    lock = threading.Lock()

    def sent(body: Iterable[bytes]) -> Iterator[bytes]:
        for chunk in body:
            with lock:
                counts["blob_bytes_read"] += len(chunk)
            yield chunk

    def counting(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if environ.get("PATH_INFO") == "/_bench/received":
            with lock:
                body = json.dumps(counts).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        with lock:
            counts["bytes"] += int(environ.get("CONTENT_LENGTH") or 0)
            counts["requests"] += 1
        body = app(environ, start_response)
        if environ.get("REQUEST_METHOD") == "GET" and "/blobs/" in environ.get("PATH_INFO", ""):
            return sent(body)
        return body

    make_server("127.0.0.1", port, counting, True, request_handler=MotoRequestHandler).serve_forever()
    return 0


@contextmanager
def moto_bucket() -> Iterator[tuple[str, dict[str, str], Callable[[], dict[str, int]]]]:
    """(s3:// URL, remote_options, what the server received so far) of a fresh
    bucket on moto's S3 server, run as its own process on loopback so its
    Python does not share this process's GIL."""
    import urllib.request

    import boto3

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, str(ENTRY_POINT), "--moto-child", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    options = {"endpoint_url": endpoint, "access_key_id": "bench", "secret_access_key": "bench",
               "region": "us-east-1"}
    try:
        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="bench",
                              aws_secret_access_key="bench", region_name="us-east-1")
        deadline = time.monotonic() + 60
        while True:
            try:
                client.create_bucket(Bucket="bench")
                break
            except Exception:  # noqa: BLE001 - not listening yet
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.2)

        def received() -> dict[str, int]:
            with urllib.request.urlopen(f"{endpoint}/_bench/received", timeout=30) as response:
                out: dict[str, int] = json.loads(response.read())
            return out

        yield "s3://bench/fleet", options, received
    finally:
        server.terminate()
        server.wait(timeout=30)


def bench_remote(cfg: Config, work: Path) -> dict[str, Any] | None:
    """Restore from the bucket on a node whose local pool is cold vs a warm local
    restore vs mlx-lm's load; bytes uploaded by the agent workload on
    ``remote_nodes`` nodes sharing a bucket vs as many independent local stores;
    a fresh node's open against ``remote_entries`` entries. None (skipped)
    without obstore and moto."""
    if not remote_available():
        return None
    return {
        "restore": remote_restore(cfg, work),
        "agent": remote_agent(cfg, work),
        "open": remote_open(cfg, work),
        "loadavg": os.getloadavg(),
    }


def remote_store(root: Path, url: str, options: dict[str, str], block_tokens: int, **identity: str) -> BlockStore:
    """A node: its own local root, the shared bucket."""
    return BlockStore(root, max_bytes=1 << 50, block_tokens=block_tokens, remote=url, remote_options=options,
                      **(identity or STORE_IDENTITY))


def restore_reps(cfg: Config) -> int:
    """Reps of the bucket restore: its ratio to plain GETs spread 0.73-0.84x
    between full runs of 5 reps (moto and the client share two cores), so
    twice as many plus one, alternating as before."""
    return 2 * max(cfg.reps, 3) + 1


def remote_restore(cfg: Config, work: Path) -> dict[str, Any]:
    """Node A stores one entry; node B, each rep with a wiped local root, opens,
    finds it and restores it from the bucket (timed: the restore, which returns
    once the caches are filled; what it fetched is kept in the background,
    which is let finish before anything else is timed); in the same rep, the
    limit (plain concurrent GETs of the same block objects, as many threads as
    the bucket fetches with: before the restore in odd reps, after it in even
    ones, so a drifting load weighs on both), B's warm local restore and
    mlx-lm's warm load of the same cache. Then, on fresh nodes, a restore of
    half the entry (the blocks the server sent counted) against plain GETs of
    the blocks it needs."""
    from blockkv.bucket.bucket import Bucket

    n = cfg.remote_tokens
    src = KVSource.random(cfg.shape, n, seed=11)
    path = work / "remote-mlx.safetensors"
    save_prompt_cache(str(path), src.caches())
    threads = int(inspect.signature(Bucket).parameters["fetch_threads"].default)
    runs: dict[str, list[float]] = {k: [] for k in ("bucket_cold", "raw_get", "local_warm", "mlx", "partial",
                                                     "partial_raw_get")}

    def plain_gets(store: BlockStore, blocks: list[str]) -> float:
        bucket = store.remote
        assert bucket is not None
        with ThreadPoolExecutor(threads) as pool:
            t0 = time.perf_counter()
            list(pool.map(bucket.blocks.get, blocks))
            return time.perf_counter() - t0

    half = n // 2
    with moto_bucket() as (url, options, received):
        with remote_store(work / "node-a", url, options, cfg.block_tokens) as a:
            assert a.store(src.tokens, src.caches()), "node A's store was not acknowledged"
            nbytes = a.total_bytes
            entry_blocks = list(a.find_exact(src.tokens).entry.blocks)
        needed = entry_blocks[: -(-half // cfg.block_tokens)]  # the blocks a restore of the first half reads
        for rep in range(restore_reps(cfg)):
            shutil.rmtree(work / "node-b", ignore_errors=True)
            with remote_store(work / "node-b", url, options, cfg.block_tokens) as b:
                match = b.find_exact(src.tokens)
                assert match is not None, "node B did not learn node A's entry"
                if rep % 2:
                    runs["raw_get"].append(plain_gets(b, entry_blocks))
                t0 = time.perf_counter()
                loaded = b.restore(match.entry)
                assert loaded is not None, "restore from the bucket failed"
                eval_caches(loaded.caches)
                runs["bucket_cold"].append(time.perf_counter() - t0)
                b.sync_remote()  # what the restore fetched is kept locally: let that finish first
                check_restored(loaded.caches, src, n)
                if not rep % 2:
                    runs["raw_get"].append(plain_gets(b, entry_blocks))
                local = b.find_exact(src.tokens)
                assert local is not None and b.tier_of(local.entry) == "disk"
                for key, fn in (("local_warm", lambda: eval_caches(b.restore(local.entry).caches)),
                                ("mlx", lambda: eval_caches(load_prompt_cache(str(path))))):
                    fn()  # warm
                    t0 = time.perf_counter()
                    fn()
                    runs[key].append(time.perf_counter() - t0)
            shutil.rmtree(work / "node-b", ignore_errors=True)
            with remote_store(work / "node-b", url, options, cfg.block_tokens) as b:
                match = b.find_exact(src.tokens)
                assert match is not None, "a fresh node did not learn node A's entry"
                if rep % 2:
                    runs["partial_raw_get"].append(plain_gets(b, needed))
                sent = received()["blob_bytes_read"]
                t0 = time.perf_counter()
                loaded = b.restore(match.entry, prefix_len=half)
                assert loaded is not None, "partial restore from the bucket failed"
                eval_caches(loaded.caches)
                runs["partial"].append(time.perf_counter() - t0)
                partial_sent = received()["blob_bytes_read"] - sent
                b.sync_remote()
                check_restored(loaded.caches, src, half)
                if not rep % 2:
                    runs["partial_raw_get"].append(plain_gets(b, needed))
    shutil.rmtree(work / "node-a")
    shutil.rmtree(work / "node-b")
    path.unlink()
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"tokens": n, "entry_bytes": nbytes, "runs_s": runs, "bucket_cold_s": med["bucket_cold"],
            "local_warm_s": med["local_warm"], "mlx_load_s": med["mlx"], "raw_get_s": med["raw_get"],
            "partial_tokens": half, "partial_s": med["partial"], "partial_raw_get_s": med["partial_raw_get"],
            "partial_blocks": len(needed), "entry_blocks": len(entry_blocks),
            "partial_bytes_sent": partial_sent}


def remote_agent(cfg: Config, work: Path) -> dict[str, Any]:
    """The agent workload (one system prompt, sessions of growing history) spread
    round-robin over ``remote_nodes`` nodes on one bucket (each joining when its
    first session arrives), against the same
    sessions on as many independent local stores: request bodies the S3 server
    received (refused creates included) and the bytes it holds, against the
    bytes the independent stores wrote."""
    shape, nodes = cfg.shape, cfg.remote_nodes
    rng = np.random.default_rng(5)
    system = KVSource.random(shape, cfg.agent_system_tokens, seed=1000)
    sessions = []
    for s in range(cfg.agent_sessions):
        turns = rng.integers(cfg.agent_turn_tokens[0], cfg.agent_turn_tokens[1] + 1, cfg.agent_turns)
        sessions.append((s % nodes, 2000 + s, (cfg.agent_system_tokens + np.cumsum(turns)).tolist()))

    def run(open_node: Callable[[Path], BlockStore]) -> tuple[int, list[BlockStore]]:
        """Each turn as a server handles it: look the prompt up, restore a match,
        store the turn. A node opens when its first session arrives (a node
        joining the fleet lists the bucket then). Returns bytes the nodes wrote
        and the open stores."""
        stores: dict[int, BlockStore] = {}
        written = 0
        try:
            for node, seed, lengths in sessions:
                store = stores.get(node) or stores.setdefault(node, open_node(work / f"agent-node-{node}"))
                session = system.extended(KVSource.random(shape, lengths[-1] - cfg.agent_system_tokens, seed=seed))
                for n in lengths:
                    before = store.stats["bytes_written"]
                    match = store.find(session.tokens[:n])
                    if match is not None:
                        store.restore(match.entry, prefix_len=match.prefix_len)
                    assert store.store(session.tokens[:n], session.caches(n)), "agent store refused"
                    written += int(store.stats["bytes_written"] - before)
        except BaseException:
            for st in stores.values():
                st.close()
            raise
        return written, list(stores.values())

    def close(stores: list[BlockStore]) -> None:
        for st in stores:
            st.close()
        for i in range(nodes):
            shutil.rmtree(work / f"agent-node-{i}", ignore_errors=True)

    independent, stores = run(lambda root: open_store(root, cfg.block_tokens))
    close(stores)
    with moto_bucket() as (url, options, received_so_far):
        before = received_so_far()
        fleet_local, stores = run(lambda root: remote_store(root, url, options, cfg.block_tokens))
        try:
            after = received_so_far()
            received, requests = after["bytes"] - before["bytes"], after["requests"] - before["requests"]
            bucket = stores[0].remote
            assert bucket is not None
            held = sum(i.size for i in bucket.blocks.list_info()) + sum(
                i.size for i in bucket.list_headers().values())
        finally:
            close(stores)
    return {"nodes": nodes, "sessions": cfg.agent_sessions, "independent_bytes_written": independent,
            "fleet_local_bytes_written": fleet_local, "bucket_bytes_received": received, "requests": requests,
            "bucket_bytes_held": held, "system_prompt_bytes": cfg.agent_system_tokens * shape.bytes_per_token}


def remote_open(cfg: Config, work: Path) -> dict[str, Any]:
    """``remote_entries`` small entries stored through one node; then a fresh node
    (empty local root) opens against the bucket and learns them all (timed:
    the open), against the storing node's own reopen (a valid local index)."""
    rng = np.random.default_rng(7)
    lo, hi = cfg.index_tokens
    pool = KVSource.random(cfg.index_shape, cfg.remote_entries * hi, seed=3)
    out: dict[str, Any] = {"entries": cfg.remote_entries}
    with moto_bucket() as (url, options, _):
        stored = []
        t0 = time.perf_counter()
        with remote_store(work / "open-a", url, options, cfg.block_tokens, **INDEX_IDENTITY) as a:
            for i in range(cfg.remote_entries):
                n = int(rng.integers(lo, hi + 1))
                tokens = rng.integers(0, VOCAB, n).tolist()
                caches = [kv_cache(k[:, :, i * hi : i * hi + n], v[:, :, i * hi : i * hi + n])
                          for k, v in zip(pool.keys, pool.values)]
                assert a.store(tokens, caches), "store refused"
                stored.append(tokens)
        out["store_mean_s"] = (time.perf_counter() - t0) / cfg.remote_entries

        opens = []
        for _ in range(max(cfg.reps, 3)):  # the first fetches headers one by one (and leaves a MANIFEST)
            shutil.rmtree(work / "open-b", ignore_errors=True)
            t0 = time.perf_counter()
            with remote_store(work / "open-b", url, options, cfg.block_tokens, **INDEX_IDENTITY) as b:
                assert b.find_exact(stored[-1]) is not None and b.find_exact(stored[0]) is not None
            opens.append(time.perf_counter() - t0)
        out["fresh_open_runs_s"] = opens
        out["fresh_open_first_s"], out["fresh_open_s"] = opens[0], statistics.median(opens[1:])

        def local_open() -> None:
            with open_store(work / "open-a", cfg.block_tokens, **INDEX_IDENTITY) as a:
                assert len(a) == cfg.remote_entries

        out["local_open_s"] = median_time(local_open, cfg.reps)
    shutil.rmtree(work / "open-a")
    shutil.rmtree(work / "open-b")
    return out
