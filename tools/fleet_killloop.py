"""Fleet kill -9 loop: three node processes, each a ``BlockStore`` with its own
root, share one bucket on moto's S3 server (its own process, on 127.0.0.1,
with a clock that steps: blockkv.testing.moto_clock). While they store,
restore and sync, ``blockkv gc --remote``, ``evict --remote`` and ``check
--remote --repair`` loop beside them as an operator's cron jobs would; the
parent SIGKILLs a random node at random moments and restarts it, rots blocks
on one node's disk (a flipped bit in a block file), and steps the server's
clock forward by about ``--step`` seconds (≥ grace/2: the step that lost
entries before #22). At the end a fresh node, with nothing local, must
restore every acknowledged entry (``store()`` returned True) that no
eviction removed, bit-exact from the bucket (one ``check --repair`` removed
counts as lost: it removes only entries whose block is gone for good).

Nodes journal as ``tools/mp_killloop.py`` workers do (one fsync'd JSON line
per fact; ``stored`` only after ``store()`` returned True; ``wrong`` when a
node restores another node's entry with other bits). Each node stores in its
own namespace over a few shared prompt prefixes, so blocks are shared across
nodes and no node's store replaces another's entry. The eviction loop
journals each run's plan before it runs (``--dry-run``) and what it evicted
after; the repair loop what it removed.

    python tools/fleet_killloop.py --kills 60                  # the long form (docs/reliability.md)
    python tools/fleet_killloop.py --kills 3 --seconds 600     # about what CI runs (--seconds: a deadline)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mp_killloop import BLOCK_TOKENS, Journal, _lines, same_bits, spec_entry, store_one

from blockkv import BlockStore
from blockkv.testing.fleet_processes import free_port
from blockkv.testing.moto_clock import write_offset

IDENT = {"model_id": "tiny-fleet", "config_fingerprint": "fp-fleet-kill", "tokenizer_hash": "tok"}
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}
# the fleet's protocol settings: short enough that blocks age past the grace period within a run
TIMING = {"grace": "12", "sweep_window": "5", "timeout": "2", "connect_timeout": "1", "max_retries": "0",
          "sync_interval": "2"}
NODES = 3
LOCAL_CAP = 8 << 20  # each node's local tier: small, so entries fall back to remote-only and are fetched again
BUCKET_BUDGET = 6 << 20  # the eviction loop keeps the bucket about this size


def node_options(endpoint: str) -> dict[str, str]:
    return {"endpoint_url": endpoint, **{k.removeprefix("AWS_").lower(): v for k, v in CREDENTIALS.items()},
            **TIMING}


def open_node(root: Path, url: str, endpoint: str) -> BlockStore:
    return BlockStore(root, **IDENT, max_bytes=LOCAL_CAP, block_tokens=BLOCK_TOKENS, remote=url,
                      remote_options=node_options(endpoint))


# -- a node ----------------------------------------------------------------------------------


def acknowledged_specs(journals: Path) -> list[dict[str, Any]]:
    return [f for path in sorted(journals.glob("n*.jsonl")) for f in _lines(path) if f["op"] == "stored"]


def node(root: Path, url: str, endpoint: str, journal_path: Path, slot: int, seed: int) -> None:
    """Store (own namespace, shared prefixes), restore anyone's acknowledged
    entries and check their bits, sync; forever, until killed."""
    logging.disable(logging.WARNING)
    rng = random.Random(seed)
    journal = Journal(journal_path)
    ns = f"n{slot}"
    store = open_node(root, url, endpoint)
    journal.write(op="ready")
    known: list[dict[str, Any]] = []
    for step in range(1 << 62):
        if step % 16 == 0:
            known = acknowledged_specs(journal_path.parent)
        op = rng.choices(("store", "restore", "sync"), (5, 4, 1))[0]
        if op == "store":
            store_one(store, journal, rng, ns)
        elif op == "restore" and known:
            fact = rng.choice(known)
            tokens, expected = spec_entry(fact)
            match = store.find_exact(tokens, fact["ns"])
            if match is not None and match.entry.id == fact["id"]:
                loaded = store.restore(match.entry)
                if loaded is not None and not same_bits(loaded.caches, expected):
                    journal.write(op="wrong", id=fact["id"])
        else:
            store.sync_remote()


# -- the operator's loops --------------------------------------------------------------------


def blockkv(args: list[str], endpoint: str) -> dict[str, Any] | None:
    """``python -m blockkv ARGS --json`` with the fleet's options; its report, or None."""
    options = [a for k, v in node_options(endpoint).items() if k != "sync_interval" for a in ("--remote-option", f"{k}={v}")]
    proc = subprocess.run([sys.executable, "-m", "blockkv", *args, "--json", *options], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **CREDENTIALS}, check=False)
    try:
        return json.loads(proc.stdout)
    except ValueError:
        return None


class Operator:
    """gc, evict and check --repair against the bucket, each in a loop of its own."""

    def __init__(self, url: str, endpoint: str, journals: Path, rng: random.Random) -> None:
        self.url, self.endpoint = url, endpoint
        self.journal = Journal(journals / "operator.jsonl")
        self.stop = threading.Event()
        self.runs = {"gc": 0, "evict": 0, "repair": 0}
        self.failures: list[str] = []
        self._rng = rng
        self._threads = [threading.Thread(target=self._loop, args=(job, pause), daemon=True)
                         for job, pause in ((self._gc, 2.0), (self._evict, 5.0), (self._repair, 6.0))]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def join(self) -> None:
        self.stop.set()
        for t in self._threads:
            t.join()

    def _loop(self, job: Any, pause: float) -> None:
        while not self.stop.wait(self._rng.uniform(0.5, 1.5) * pause):
            job()

    def _gc(self) -> None:
        if blockkv(["gc", "--remote", self.url, "--all"], self.endpoint) is None:
            self.failures.append("a gc run gave no report")
        self.runs["gc"] += 1

    def _evict(self) -> None:
        args = ["evict", "--remote", self.url, "--all", "--to", str(BUCKET_BUDGET)]
        plan = blockkv([*args, "--dry-run"], self.endpoint)
        planned = [h for fp in (plan or {}).get("fingerprints", []) for h in fp["headers"]]
        self.journal.write(op="evicting", ids=[h.rpartition("/")[2].removesuffix(".bkv") for h in planned])
        done = blockkv(args, self.endpoint)
        if done is None:
            self.failures.append("an evict run gave no report")
            return
        evicted = [h for fp in done.get("fingerprints", []) for h in fp["headers"]]
        self.journal.write(op="evicted", ids=[h.rpartition("/")[2].removesuffix(".bkv") for h in evicted])
        self.runs["evict"] += 1

    def _repair(self) -> None:
        report = blockkv(["check", "--remote", self.url, "--all", "--repair"], self.endpoint)
        if report is None:
            self.failures.append("a repair run gave no report")
            return
        actions = [a for fp in report.get("fingerprints", []) for a in fp["report"]["actions"]]
        removed = [a.split()[2] for a in actions if a.startswith("removed entry ")]
        removed += [a.split()[2].rstrip(":").rpartition("/")[2].removesuffix(".bkv")
                    for a in actions if a.startswith("removed header ")]
        if removed:
            self.journal.write(op="repaired", ids=removed)
        self.runs["repair"] += 1


# -- the parent ------------------------------------------------------------------------------


@dataclass
class Figures:
    kills: int = 0
    acknowledged: int = 0
    verified: int = 0
    evicted: int = 0  # acknowledged entries an eviction (or its plan) accounts for
    repaired: int = 0  # acknowledged entries check --repair removed (counted as lost too)
    lost: int = 0
    wrong: int = 0
    steps: int = 0  # of the server's clock
    stepped_seconds: float = 0.0
    rotted: int = 0  # block files damaged on the rotting node's disk
    runs: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def _make_bucket(endpoint: str, name: str) -> None:
    import boto3  # the test extra

    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
    deadline = time.monotonic() + 60
    while True:
        try:
            client.create_bucket(Bucket=name)
            return
        except Exception:  # noqa: BLE001 - the server is still starting
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _rot(root: Path, rng: random.Random) -> bool:
    """Flip one bit near the end (the payload) of a random block file of ``root``."""
    blocks = [p for p in root.glob("*/blobs/*/*") if len(p.name) == 64]
    if not blocks:
        return False
    path = rng.choice(blocks)
    try:
        data = bytearray(path.read_bytes())
        data[-1 - rng.randrange(min(16, len(data)))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
    except OSError:
        return False  # evicted meanwhile
    return True


def verify(url: str, endpoint: str, journals: Path, root: Path, fig: Figures) -> None:
    """A fresh node restores every acknowledged entry no eviction accounts for."""
    facts = [f for path in sorted(journals.glob("*.jsonl")) for f in _lines(path)]
    acknowledged = {f["id"]: f for f in facts if f["op"] == "stored"}
    gone = {i for f in facts if f["op"] in ("evicting", "evicted") for i in f["ids"]}
    repaired = {i for f in facts if f["op"] == "repaired" for i in f["ids"]}
    fig.acknowledged = len(acknowledged)
    fig.wrong += len({f["id"] for f in facts if f["op"] == "wrong"})
    with open_node(root, url, endpoint) as fresh:
        for entry_id, fact in acknowledged.items():
            tokens, expected = spec_entry(fact)
            match = fresh.find_exact(tokens, fact["ns"])
            loaded = fresh.restore(match.entry) if match is not None and match.entry.id == entry_id else None
            if loaded is not None and same_bits(loaded.caches, expected):
                fig.verified += 1
            elif loaded is not None:
                fig.wrong += 1
                fig.problems.append(f"entry {entry_id} restored wrong bits")
            elif entry_id in gone:
                fig.evicted += 1
            elif entry_id in repaired:  # a repair removes an entry only when its block is gone for good: a loss
                fig.repaired += 1
                fig.lost += 1
                fig.problems.append(f"acknowledged entry {entry_id} of node {fact['ns']} removed by check --repair")
            else:
                fig.lost += 1
                fig.problems.append(f"lost acknowledged entry {entry_id} of node {fact['ns']}")


@dataclass
class Minimum:
    """The work a run must have done before it stops: that much, however long it takes (up to its deadline)."""

    kills: int
    steps: int = 0
    rotted: int = 0
    acknowledged: int = 0

    def done(self, fig: Figures, journals: Path) -> bool:
        return (fig.kills >= self.kills and fig.steps >= self.steps and fig.rotted >= self.rotted
                and len(acknowledged_specs(journals)) >= self.acknowledged)


def run(kills: int | Minimum, seed: int, workdir: Path, seconds: float | None = None, kill_every: float = 3.0,
        step: float = 8.0, step_every: float = 8.0, rot_every: float = 3.0) -> Figures:
    """Run until the minimum work is done (``kills`` SIGKILLs, or a ``Minimum``),
    or ``seconds`` (a deadline, not a window) have passed; then verify from a fresh node."""
    minimum = kills if isinstance(kills, Minimum) else Minimum(kills)
    rng = random.Random(seed)
    fig = Figures()
    journals = workdir / "journals"
    journals.mkdir(parents=True)
    clock = workdir / "clock-offset"
    write_offset(clock, 0.0)
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    url = "s3://fleet-kill/fleet"
    server = subprocess.Popen([sys.executable, "-m", "blockkv.testing.moto_clock", "--port", str(port),
                               "--clock-file", str(clock)], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs: dict[int, subprocess.Popen[bytes]] = {}
    incarnation = 0
    operator: Operator | None = None

    def start(slot: int) -> None:
        nonlocal incarnation
        incarnation += 1
        procs[slot] = subprocess.Popen(
            [sys.executable, __file__, "--node", str(workdir / f"node{slot}"), "--endpoint", endpoint,
             "--journal", str(journals / f"n{slot}-{incarnation}.jsonl"), "--slot", str(slot),
             "--seed", str(rng.randrange(1 << 30))], stdin=subprocess.DEVNULL)

    try:
        _make_bucket(endpoint, "fleet-kill")
        open_node(workdir / "setup", url, endpoint).close()  # the bucket's IDENTITY, once
        for slot in range(NODES):
            start(slot)
        operator = Operator(url, endpoint, journals, random.Random(rng.random()))
        operator.start()
        t0 = time.monotonic()
        next_kill, next_step, next_rot = (t0 + rng.uniform(1, 2) * x for x in (kill_every, step_every, rot_every))
        offset = 0.0
        while not minimum.done(fig, journals) and (seconds is None or time.monotonic() - t0 < seconds):
            time.sleep(0.2)
            now = time.monotonic()
            for slot, proc in list(procs.items()):
                if proc.poll() is not None:  # a node must never die on its own
                    fig.problems.append(f"node {slot} exited with {proc.returncode}")
                    start(slot)
            if now >= next_kill:
                slot = rng.randrange(NODES)
                procs[slot].send_signal(signal.SIGKILL)
                procs[slot].wait()
                fig.kills += 1
                start(slot)
                next_kill = now + rng.uniform(0.3, 1.7) * kill_every
            if now >= next_step:
                jump = rng.uniform(0.75, 1.25) * step
                offset += jump
                write_offset(clock, offset)
                fig.steps += 1
                fig.stepped_seconds += jump
                next_step = now + rng.uniform(0.5, 1.5) * step_every
            if now >= next_rot:
                fig.rotted += _rot(workdir / "node0", rng)
                next_rot = now + rng.uniform(0.5, 1.5) * rot_every
    finally:
        if operator is not None:
            operator.join()
            fig.runs = dict(operator.runs)
            fig.problems += operator.failures
        for proc in procs.values():
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    try:
        verify(url, endpoint, journals, workdir / "verifier", fig)
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait()
    return fig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seconds", type=float, help="a deadline: stop after this long even if fewer kills were made")
    ap.add_argument("--kill-every", type=float, default=3.0, help="mean seconds between kills")
    ap.add_argument("--step", type=float, default=8.0, help="mean forward step of the server's clock, seconds")
    ap.add_argument("--step-every", type=float, default=8.0, help="mean seconds between steps")
    ap.add_argument("--rot-every", type=float, default=3.0, help="mean seconds between rotted block files")
    ap.add_argument("--node", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", help=argparse.SUPPRESS)
    ap.add_argument("--journal", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--slot", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.node:
        node(args.node, "s3://fleet-kill/fleet", args.endpoint, args.journal, args.slot, args.seed)
        return 0
    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="blockkv-fleetkill-") as tmp:
        t0 = time.monotonic()
        fig = run(args.kills, args.seed, Path(tmp), args.seconds, args.kill_every, args.step, args.step_every,
                  args.rot_every)
    print(f"nodes {NODES}  kills {fig.kills}  acknowledged {fig.acknowledged}  verified {fig.verified}  "
          f"evicted {fig.evicted}  repaired {fig.repaired}  lost {fig.lost}  wrong {fig.wrong}  "
          f"clock steps {fig.steps} (+{fig.stepped_seconds:.0f} s)  rotted {fig.rotted}  runs {fig.runs}  "
          f"({time.monotonic() - t0:.0f} s)")
    for p in fig.problems[:20]:
        print("  problem:", p)
    return 0 if not (fig.lost or fig.wrong or fig.problems) else 1


if __name__ == "__main__":
    sys.exit(main())
