"""``blockkv serve`` beside a stopped process (#43): another process on the
same cache root stopped (SIGSTOP) inside an index transaction costs a chat
request only a moment, ``/metrics`` answers with the last figures it read,
stores resume once the process is continued and nothing acknowledged is
lost; a serve started behind a stopped holder reports its disk tier off,
and why, and opens it at a later request once the holder is gone; a serve
started beside processes looping the ``ls``/``stats`` scan stores from its
first request.

A real server process driven by the ``openai`` client, real holders and
scanners, real caches. No rate is asserted: a request "answers" well under
the 10 s a stopped holder made it wait before (``QUICK``), and the store's own
counters (``/metrics``) show the mechanism: the lookups met the busy index
and served what the store knew, waiting once at most. The 0.1 s figure
itself is tools/stopped_bench.py's (docs/reliability.md). CI also runs this
file on py-lmdb built with POSIX semaphores (.ci/run).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_stopped_holders import SCANNER, SCANNERS, line, restored_exactly, spawn

from blockkv import BlockStore
from blockkv.model_dir import build_model_dir, sample_text
from blockkv.testing.fleet_processes import Process
from blockkv.testing.models import prefill, random_tokens, tiny_model
from blockkv.testing.stopped import (
    HOLDER_SEEDS,
    continued,
    ended,
    scrape,
    serve_store_options,
    stopped_in_txn,
)
from blockkv.testing.streams import Streamed, no_eos_bias, stream_chat

BOUND = 120.0  # a safety bound on any wait: far beyond a healthy run, short of a hung CI job
QUICK = 5.0  # a request, a scrape: well under the 10 s a stopped holder made each wait before
MAX_TOKENS = 4
ENTRIES = 60  # in the scanned root: each scan is a few transactions of the index; 3,000 is tools/scan_starvation.py's


class Node:
    """One ``blockkv serve`` on a tiny model and cache root ``cache`` (whose
    store a test's holder opens with ``options``), up and answering."""

    def __init__(self, model: Path, cache: Path, log: Path) -> None:
        self.cache, self.options, self.bias = cache, serve_store_options(model), no_eos_bias(model)
        self.process = Process(["serve", "--model", str(model), "--cache-dir", str(cache)], log)
        self.process.wait_ready()

    def ask(self, seed: int) -> Streamed:
        """A new chat of some 400 tokens (past the one-block minimum a disk lookup needs)."""
        answer = stream_chat(self.process.url, "none", [{"role": "user", "content": sample_text(400, seed=seed)}],
                             MAX_TOKENS, self.bias)
        assert answer.first > 0, "the server streamed no content"
        return answer

    def metrics(self) -> dict[str, float]:
        return scrape(self.process.url, BOUND)

    def stored(self, past: float) -> dict[str, float]:
        """/metrics once more than ``past`` spills landed and none is pending."""
        return until(lambda: (m := self.metrics())["blockkv_spills_total"] > past
                     and m["blockkv_pending_spills"] == 0 and m, f"a spill past {past:g} lands")

    def stored_keys(self) -> set[tuple[int, ...]]:
        """The token keys of the entries on disk (an identical store replaces an entry: its key stays)."""
        with BlockStore(self.cache, **self.options) as store:
            return {tuple(e.tokens) for e in store.entries()}

    def stop(self) -> str:
        self.process.stop()
        return self.process.log.read_text()


def until(fn: Callable[[], Any], what: str, bound: float = BOUND) -> Any:
    """``fn()``'s first true value, polled; fails after ``bound`` seconds."""
    deadline = time.monotonic() + bound
    while not (value := fn()):
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.1)
    return value


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("model") / "llama", "llama")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, model: Path) -> Iterator[Node]:
    work = tmp_path_factory.mktemp("stopped")
    n = Node(model, work / "cache", work / "serve.log")
    yield n
    log = n.stop()
    assert "Traceback" not in log, log[-4000:]


@pytest.mark.parametrize("mode", ["write", "read"])
def test_a_stopped_holder_costs_a_chat_request_only_a_moment(node: Node, mode: str) -> None:
    seed = 100 if mode == "write" else 200
    spills = node.metrics()["blockkv_spills_total"]
    node.ask(seed)
    before = node.stored(spills)
    acked = node.stored_keys()  # that chat's entry among them: the stop must not lose it
    holder = None
    try:
        holder = stopped_in_txn(node.cache, mode, node.options)
        a = node.ask(seed + 1)  # its spill then waits on the holder, in the background
        until(lambda: node.metrics()["blockkv_pending_spills"] >= 1, "a spill waits on the holder")
        b = node.ask(seed + 2)  # asked while a store of this very server waits on the holder
        t0 = time.monotonic()
        during = node.metrics()
        scraped = time.monotonic() - t0
        assert (a.ttft, b.ttft, scraped) < (QUICK, QUICK, QUICK)
        if mode == "write":  # the lookups met the index held and served what the store knew, one short wait at most
            busy = {k: during[f"blockkv_index_busy_{k}_total"] - before[f"blockkv_index_busy_{k}_total"]
                    for k in ("refreshes", "waits")}
            assert busy["refreshes"] >= 2 and busy["waits"] <= 1, busy
            # the index's byte count was last read before the holder came: /metrics shows that figure
            assert during["blockkv_disk_bytes"] == before["blockkv_disk_bytes"]
        assert continued(holder, BOUND) == "stored"
    finally:
        ended(holder)
    spills = node.stored(before["blockkv_spills_total"])["blockkv_spills_total"]
    node.ask(seed + 3)
    node.stored(spills)  # stores resume
    assert acked <= node.stored_keys()
    with BlockStore(node.cache, **node.options) as fresh:
        assert [s for s in HOLDER_SEEDS if not restored_exactly(fresh, s)] == []


def test_a_serve_started_behind_a_stopped_holder_says_off_then_opens(tmp_path: Path, model: Path) -> None:
    """The store cannot open while a writer is stopped inside its index:
    /health says the disk tier is off, and why; the node serves from RAM.
    Once the holder is continued, a later request opens it, and stores."""
    cache = tmp_path / "cache"
    holder = stopped_in_txn(cache, "write", serve_store_options(model))
    node = None
    try:
        node = Node(model, cache, tmp_path / "serve.log")
        health = node.process.get("/health")
        assert health["status"] == "ok" and health["disk_tier"]["state"] == "off", health
        assert "held by another process" in health["disk_tier"]["why"], health
        assert node.ask(1).ttft < QUICK  # from RAM; a retried open waits for no lock
        assert continued(holder, BOUND) == "stored"
        seeds = iter(range(2, 10**6))
        until(lambda: node.ask(next(seeds)) and node.process.get("/blockkv/health")["disk_tier"]["state"] == "on",
              "the disk tier opens at a request")
        assert "disk_tier" not in node.process.get("/health")  # mlx-lm's own answer again
        node.stored(0)
    finally:
        ended(holder)
        log = node.stop() if node is not None else ""
    assert "opened after" in log and "its disk tier is on" in log, log[-4000:]


def test_a_serve_started_beside_scanning_processes_stores_from_its_first_request(tmp_path: Path,
                                                                                  model: Path) -> None:
    """Eight processes loop the ``ls``/``stats`` scan of the root's index while
    serve (re)starts on it: its store opens, and its first request is stored."""
    cache = tmp_path / "cache"
    options = serve_store_options(model)
    small = tiny_model("llama")
    with BlockStore(cache, **options) as store:  # shared prefixes keep the root small and its stores quick
        for seed in range(ENTRIES):
            tokens = random_tokens(16, seed=0) + random_tokens(8, seed=1000 + seed)
            assert store.store(tokens, prefill(small, tokens)[0])
        directory = store.directory
    stop = tmp_path / "stop"
    scanners = [spawn(SCANNER, directory, stop) for _ in range(SCANNERS)]
    node = None
    try:
        assert [line(p) for p in scanners] == ["scanning"] * SCANNERS
        node = Node(model, cache, tmp_path / "serve.log")
        assert node.process.get("/blockkv/health")["disk_tier"]["state"] == "on"
        node.ask(1)
        assert node.stored(0)["blockkv_spill_failures_total"] == 0
        stop.touch()
        assert min(int(line(p)) for p in scanners) >= 1  # they scanned all along
    finally:
        for p in scanners:
            p.kill()
            p.wait()
        if node is not None:
            node.stop()
