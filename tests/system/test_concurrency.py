"""Many processes, one root (issue #11): no acknowledged entry is lost to a
concurrent store, gc, repair, index rebuild, stall or clock step.

Every test runs real processes (multiprocessing, 'spawn') on one real root;
a test is bounded by join timeouts so a broken build fails instead of
hanging. Entries are synthetic bf16 ``KVCache`` layers regenerated from seeds
(``tools/mp_killloop.py``), compared bit for bit.
"""

from __future__ import annotations

import fcntl
import json
import logging
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from tool_scripts import load

from blockkv import BlockStore
from blockkv.fs import FileLayer

mp_killloop = load("mp_killloop")

CTX = mp.get_context("spawn")
IDENT = dict(model_id="tiny-conc", config_fingerprint="fp-conc", tokenizer_hash="tok")
BLOCK_TOKENS = mp_killloop.BLOCK_TOKENS
ENTRY_BYTES = 512  # per token: 2 layers x (keys + values) x 2 heads x 32 dims x 2 bytes
Spec = dict[str, Any]


def open_store(root: Path, **kw: Any) -> BlockStore:
    return BlockStore(root, **{**IDENT, "max_bytes": 1 << 40, "block_tokens": BLOCK_TOKENS, **kw})


def spec(prefix: int, plen: int, suffix: int, slen: int, ns: str = "") -> Spec:
    return {"prefix": prefix, "plen": plen, "suffix": suffix, "slen": slen, "ns": ns}


class SlowFS(FileLayer):
    """A slow disk: every fsync (of a block, a header, a directory) takes ``delay`` seconds."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def fsync(self, fd: int) -> None:
        time.sleep(self.delay)
        super().fsync(fd)


class StuckAtHeaderFS(SlowFS):
    """A slow disk on which a writer stops for good right before it renames its
    header's temp file: its blocks are published and referenced (pending), its
    temp file is durable, and a SIGKILL cannot come too late."""

    def replace(self, src: Path, dst: Path) -> None:
        if dst.name.endswith(".bkv"):
            time.sleep(600)
        super().replace(src, dst)


# -- child processes (top level: 'spawn' imports this module by name) -----------------------


def _save(result: Path | None, data: Any) -> None:
    if result is not None:
        tmp = result.with_suffix(".part")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, result)


def writer(root: Path, result: Path, kw: dict[str, Any], specs: list[Spec] | None = None,
           barrier: Any = None, stop: Any = None, started: Any = None, slot: int = 0) -> None:
    """Store ``specs`` (or unique entries until ``stop``), recording every
    acknowledged one and whether it was still there right after the store returned."""
    logging.disable(logging.WARNING)
    acked, refused = [], 0
    with open_store(root, **kw) as store:
        todo = iter(specs) if specs is not None else (spec(i % 4, 64, (slot << 32) + i, 8, f"w{slot}")
                                                       for i in range(10**9))
        for s in todo:
            if stop is not None and stop.is_set():
                break
            if barrier is not None:
                barrier.wait(120)
            tokens, caches = mp_killloop.spec_entry(s)
            if store.store(tokens, caches, s["ns"]):
                match = store.find_exact(tokens, s["ns"])
                acked.append({**s, "present": match is not None})
                if started is not None:
                    started.set()
            else:
                refused += 1
            _save(result, {"acked": acked, "refused": refused})
            if specs is None:
                time.sleep(0.05)  # busy, not flat out: the test verifies every entry afterwards
    _save(result, {"acked": acked, "refused": refused})


def looper(root: Path, stop: Any, kw: dict[str, Any], what: str, ready: Any = None) -> None:
    """Until ``stop``: ``gc``, ``gc+open`` (gc and reopen the root: recovery at
    open is a deleter too) or ``repair`` (check(repair=True))."""
    logging.disable(logging.WARNING)
    with open_store(root, **kw) as store:
        if ready is not None:
            ready.set()
        while not stop.is_set():
            if what.startswith("gc"):
                store.gc()
            if what == "gc+open":
                open_store(root, **kw).close()
            elif what == "repair":
                store.check(repair=True)
            time.sleep(0.01)


def locker(lock_path: Path, held: Any, seconds: float) -> None:
    """Hold the directory lock the way a stopped or very slow process would."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    held.set()
    time.sleep(seconds)


def rebuilder(root: Path, result: Path, doomed: Spec, new: list[Spec]) -> None:
    """Rebuild the index, then remove one entry, store others and gc."""
    logging.disable(logging.WARNING)
    with open_store(root, gc_grace=0.0) as store:
        store.rebuild_index()
        tokens, _ = mp_killloop.spec_entry(doomed)
        match = store.find_exact(tokens, doomed["ns"])
        if match is not None:
            store.remove(match.entry)
        stored = [store.store(*mp_killloop.spec_entry(s)[:2], s["ns"]) for s in new]
        store.gc()
    _save(result, {"removed": match is not None, "stored": stored})


def map_threads(root: Path, result: Path, threads: int, per_thread: int) -> None:
    """Several threads of one process storing and querying a store whose LMDB map starts tiny."""
    logging.disable(logging.WARNING)
    errors: list[str] = []
    refused: list[bool] = []
    with open_store(root, index_map_size=96 << 10) as store:
        def work(slot: int) -> None:
            for i in range(per_thread):
                try:
                    s = spec(slot, 32, (slot << 32) + i, 40, f"t{slot}")
                    tokens, caches = mp_killloop.spec_entry(s)
                    if not store.store(tokens, caches, s["ns"]):
                        refused.append(True)
                    for _ in range(20):
                        store.total_bytes, store.block_count, store.evict_plan(0)  # noqa: B018
                except Exception as exc:  # noqa: BLE001 - what reaches a caller is the finding
                    errors.append(repr(exc))

        pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    _save(result, {"errors": errors, "refused": len(refused)})


# -- helpers of the parent ---------------------------------------------------------------------------


def start(target: Callable[..., None], *args: Any, **kwargs: Any) -> Any:
    proc = CTX.Process(target=target, args=args, kwargs=kwargs, daemon=True)
    proc.start()
    return proc


def finish(procs: Sequence[Any], timeout: float) -> None:
    """Join ``procs``; kill and fail on any still running after ``timeout`` or exiting badly."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    assert not hung, f"{len(hung)} process(es) still running after {timeout} s"
    assert [p.exitcode for p in procs] == [0] * len(procs)


def load(result: Path) -> Any:
    return json.loads(result.read_text())


def lost_or_wrong(root: Path, acked: list[Spec], **kw: Any) -> list[str]:
    """Every acknowledged entry, looked up and restored by a fresh handle: what is missing or differs."""
    problems = []
    with open_store(root, **kw) as store:
        for s in acked:
            tokens, expected = mp_killloop.spec_entry(s)
            match = store.find_exact(tokens, s["ns"])
            loaded = store.restore(match.entry) if match is not None else None
            if loaded is None:
                problems.append(f"lost: {s}")
            elif not mp_killloop.same_bits(loaded.caches, expected):
                problems.append(f"wrong bits: {s}")
    return problems


def tmp_files(store: BlockStore) -> list[Path]:
    return [p for p in store.directory.rglob("*.tmp") if "index" not in p.parts]


def block_files(store: BlockStore) -> set[str]:
    return {p.name for p in (store.directory / "blobs").rglob("*") if p.is_file() and not p.name.endswith(".tmp")}


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# -- 1. a refused store never deletes a concurrent store's blocks ----------------------------------


def test_refused_store_keeps_a_concurrent_stores_blocks(store_root: Path, tmp_path: Path) -> None:
    n, barrier = 24, CTX.Barrier(2)
    ours = [spec(i, 128, 1000 + i, 8) for i in range(n)]  # a fresh shared prefix every round
    theirs = [spec(i, 128, 2000 + i, 8) for i in range(n)]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    open_store(store_root).close()
    procs = [start(writer, store_root, a, {}, ours, barrier),
             start(writer, store_root, b, {"max_bytes": 16 << 10}, theirs, barrier)]  # every store over its cap
    finish(procs, 180)
    assert load(b)["refused"] == n and not load(b)["acked"]
    acked = load(a)["acked"]
    assert len(acked) == n
    assert lost_or_wrong(store_root, acked) == []


# -- 2. gc, eviction sweeps and recovery at open never delete an in-flight store's blocks ----------


def test_gc_and_open_leave_a_slow_writers_blocks_alone(store_root: Path, tmp_path: Path) -> None:
    result, stop = tmp_path / "w.json", CTX.Event()
    open_store(store_root).close()
    sweeper = start(looper, store_root, stop, {"gc_grace": 0.0}, "gc+open")
    specs = [spec(i, 128, 100 + i, 8) for i in range(6)]
    w = start(writer, store_root, result, {"gc_grace": 0.0, "fs": SlowFS(0.02)}, specs)
    try:
        finish([w], 180)
    finally:
        stop.set()
        finish([sweeper], 120)
    acked = load(result)["acked"]
    assert len(acked) == len(specs)
    assert lost_or_wrong(store_root, acked) == []


# -- 3. repair and plain check on a live root --------------------------------------------------------


def test_repair_loop_beside_workers_loses_nothing(store_root: Path, tmp_path: Path) -> None:
    stop = CTX.Event()
    open_store(store_root).close()
    fixer = start(looper, store_root, stop, {}, "repair")
    results = [tmp_path / f"w{i}.json" for i in range(2)]
    workers = [start(writer, store_root, r, {"fs": SlowFS(0.02)},  # every entry a fresh prefix: new blocks
                     [spec(100 * i + k, 96, (i << 8) + k, 8, f"w{i}") for k in range(8)])
               for i, r in enumerate(results)]
    try:
        finish(workers, 180)
    finally:
        stop.set()
        finish([fixer], 120)
    acked = [s for r in results for s in load(r)["acked"]]
    assert len(acked) == 16
    assert lost_or_wrong(store_root, acked) == []


def test_plain_check_on_a_busy_healthy_root_is_clean(store_root: Path, tmp_path: Path) -> None:
    stop, started = CTX.Event(), CTX.Event()
    open_store(store_root).close()
    results = [tmp_path / f"w{i}.json" for i in range(2)]
    workers = [start(writer, store_root, r, {"fs": SlowFS(0.005)}, None, None, stop, started, i)
               for i, r in enumerate(results)]
    findings = []
    try:
        assert started.wait(120), "no worker stored anything"
        with open_store(store_root) as store:
            for round_ in range(10):
                report = store.check()
                if not report.clean:
                    findings.append(f"check() round {round_}: {report.to_json()}")
                if round_ % 4 == 0:
                    cli = subprocess.run([sys.executable, "-m", "blockkv", "check", str(store_root)],
                                         capture_output=True, text=True, timeout=60)
                    if cli.returncode != 0:
                        findings.append(f"blockkv check exit {cli.returncode}: {cli.stdout[-2000:]}")
    finally:
        stop.set()
        finish(workers, 120)
    assert sum(len(load(r)["acked"]) for r in results) > 0
    assert findings == []


# -- 4. index/ deleted under running processes -------------------------------------------------------


def test_index_deleted_by_an_operator_while_processes_run(store_root: Path, tmp_path: Path) -> None:
    stop, started, ready = CTX.Event(), CTX.Event(), CTX.Event()
    store = open_store(store_root)
    store.close()
    results = [tmp_path / f"w{i}.json" for i in range(2)]
    workers = [start(writer, store_root, r, {}, None, None, stop, started, i) for i, r in enumerate(results)]
    sweeper = None
    try:
        assert started.wait(120), "no worker stored anything"
        time.sleep(0.5)
        shutil.rmtree(store.directory / "index")  # documented as safe: the index is only an accelerator
        # a process that opens after it and then only gc's: it must learn of the others' new entries
        sweeper = start(looper, store_root, stop, {"gc_grace": 1.0}, "gc", ready)
        assert ready.wait(120), "the sweeper did not open"
        time.sleep(3)
    finally:
        stop.set()
        finish(workers + ([sweeper] if sweeper else []), 120)
    acked = [s for r in results for s in load(r)["acked"]]
    assert acked
    assert lost_or_wrong(store_root, acked) == []


# -- 5. rebuild_index in one process while another handle keeps working ------------------------------


def test_rebuild_elsewhere_never_gives_a_phantom_or_a_false_store(store_root: Path, tmp_path: Path) -> None:
    specs = [spec(i, 32, 500 + i, 8) for i in range(10)]
    doomed = specs[5]
    new = [spec(20 + i, 32, 600 + i, 8) for i in range(2)]
    result = tmp_path / "r.json"
    problems = []
    with open_store(store_root) as ours:
        for s in specs:
            assert ours.store(*mp_killloop.spec_entry(s)[:2], s["ns"])
        for s in specs[:2]:
            ours.remove(ours.find_exact(mp_killloop.spec_entry(s)[0]).entry)  # type: ignore[union-attr]
        assert len(ours) == 8
        finish([start(rebuilder, store_root, result, doomed, new)], 120)
        assert load(result) == {"removed": True, "stored": [True, True]}

        mine = spec(40, 32, 700, 8)
        if not ours.store(*mp_killloop.spec_entry(mine)[:2]):
            problems.append("a good store returned False")
        tokens, _ = mp_killloop.spec_entry(doomed)
        if ours.find_exact(tokens) is not None:
            problems.append("find_exact served the removed entry")
        match = ours.find(tokens + [1])
        if match is not None and match.prefix_len == len(tokens):
            problems.append("find served the removed entry")
            if ours.restore(match.entry) is not None:
                problems.append("restore of the removed entry returned caches")
        for s in new + [mine]:
            if ours.find_exact(mp_killloop.spec_entry(s)[0]) is None:
                problems.append(f"entry stored after the rebuild not visible: {s}")
        for call in (lambda: ours.evict_plan(0), lambda: ours.evict_to(ours.total_bytes // 2)):
            try:
                call()
            except Exception as exc:  # noqa: BLE001 - any exception here is the finding
                problems.append(f"eviction raised {exc!r}")
    assert problems == [], "\n".join(problems)


# -- 6. two identities in one fingerprint directory: each cap counts and evicts its own --------------


def test_two_identities_each_evict_only_their_own_entries(store_root: Path, tmp_path: Path) -> None:
    size = 128 * ENTRY_BYTES
    cap = int(4.5 * size)
    barrier = CTX.Barrier(2)
    results = [tmp_path / "a.json", tmp_path / "b.json"]
    kws = [{"tokenizer_hash": tok, "max_bytes": cap} for tok in ("tok-chatml", "tok-llama3")]
    with open_store(store_root, **kws[0]) as first:  # one identity fills the cap...
        for k in range(4):
            assert first.store(*mp_killloop.spec_entry(spec(k, 0, 7000 + k, 128))[:2])
    procs = [start(writer, store_root, r, kw, [spec(10 * i + k, 0, 7010 + 10 * i + k, 128) for k in range(3)],
                   barrier)  # ...then both store turn about
             for i, (r, kw) in enumerate(zip(results, kws))]
    finish(procs, 180)
    acked = [s for r in results for s in load(r)["acked"]]
    assert len(acked) == 6
    assert [s for s in acked if not s["present"]] == []  # each store still there right after it returned
    for kw in kws:
        with open_store(store_root, **kw) as store:
            assert store.total_bytes <= cap
    with open_store(store_root, **kws[0]) as store:
        mine = len(store)
    with open_store(store_root, **kws[1]) as store:  # evicting everything of its own...
        assert store.evict_to(0) and store.total_bytes == 0
    with open_store(store_root, **kws[0]) as store:  # ...takes none of the other identity's
        assert len(store) == mine and store.check().clean


# -- also: LMDB map growth under threads, lock timeouts, dead writers, clock steps --------------------


def test_map_growth_under_threads_reaches_no_caller(store_root: Path, tmp_path: Path) -> None:
    result = tmp_path / "m.json"
    finish([start(map_threads, store_root, result, 4, 12)], 120)
    got = load(result)
    assert got["errors"][:5] == [] and got["refused"] == 0


def test_lock_timeout_store_gives_up_restore_does_not_wait(store_root: Path, caplog: pytest.LogCaptureFixture) -> None:
    held = CTX.Event()
    store = open_store(store_root, lock_timeout=1.0)
    old = spec(1, 32, 1, 8)
    assert store.store(*mp_killloop.spec_entry(old)[:2])
    entry = store.find_exact(mp_killloop.spec_entry(old)[0]).entry  # type: ignore[union-attr]
    holder = start(locker, store.directory / "LOCK", held, 60.0)
    outcome: dict[str, Any] = {}
    t, waited = None, False
    try:
        assert held.wait(120)

        def blocked_calls() -> None:
            t0 = time.monotonic()
            outcome["store"] = store.store(*mp_killloop.spec_entry(spec(2, 32, 2, 8))[:2])
            outcome["store_s"] = time.monotonic() - t0
            outcome["restore"] = store.restore(entry)
            pending = store.store_async(*mp_killloop.spec_entry(spec(3, 32, 3, 8))[:2])
            outcome["restore_async"] = store.restore_async(entry).result(timeout=10)
            outcome["store_async"] = pending.result(timeout=10)

        with caplog.at_level(logging.WARNING, logger="blockkv"):
            t = threading.Thread(target=blocked_calls, daemon=True)
            t.start()
            t.join(30)
            waited = t.is_alive()
    finally:
        holder.kill()
        holder.join()
        if t is not None and waited:
            t.join(30)
        store.close()
    assert not waited, "a store or restore waited for the lock"
    assert outcome["store"] is False and outcome["store_s"] < 6
    assert caplog.records, "a store that gave up on the lock must warn"
    assert outcome["restore"] is not None and outcome["restore_async"] is not None
    assert outcome["store_async"] is False


def _kill_mid_store(root: Path, tmp_path: Path, store: BlockStore) -> None:
    """Start a slow writer of a big entry and SIGKILL it once it has finished
    blocks and a tmp file on disk (it stops there for good)."""
    big = spec(0, 0, 99, 64 * BLOCK_TOKENS)
    child = start(writer, root, tmp_path / "killed.json", {"fs": StuckAtHeaderFS(0.01)}, [big])
    try:
        # the header's temp file: the writer stops for good once it is durable (a block's temp
        # file could be renamed between this check and the kill)
        wait_for(lambda: any("entries" in p.parts for p in tmp_files(store)) and len(block_files(store)) >= 2,
                 120, "the writer's files")
    finally:
        child.kill()
        child.join()


def test_dead_writers_tmp_files_are_reported_and_reaped(store_root: Path, tmp_path: Path) -> None:
    with open_store(store_root, tmp_grace=3600.0) as store:
        _kill_mid_store(store_root, tmp_path, store)
        assert tmp_files(store)
        report = store.check()
        assert report.stale_tmp and not report.clean
        store.gc()
        assert tmp_files(store) == []


def test_clock_a_day_behind_still_frees_a_dead_writers_blocks(store_root: Path, tmp_path: Path) -> None:
    with open_store(store_root, gc_grace=0.0, clock=lambda: time.time() - 86400) as store:
        _kill_mid_store(store_root, tmp_path, store)
        assert block_files(store)
        store.gc()
        assert block_files(store) == set() and tmp_files(store) == []


def test_clock_two_hours_ahead_spares_a_live_writer(store_root: Path, tmp_path: Path) -> None:
    result = tmp_path / "w.json"
    ahead: dict[str, Any] = {"clock": lambda: time.time() + 7200}
    big = spec(0, 0, 77, 24 * BLOCK_TOKENS)
    with open_store(store_root, **ahead) as store:
        child = start(writer, store_root, result, {"fs": SlowFS(0.1)}, [big])
        deadline = time.monotonic() + 180
        while child.is_alive() and time.monotonic() < deadline:
            store.gc()
            open_store(store_root, **ahead).close()
            time.sleep(0.05)
        finish([child], 1)
    acked = load(result)["acked"]
    assert len(acked) == 1
    assert lost_or_wrong(store_root, acked) == []
