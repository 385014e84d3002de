"""What one next-turn store costs, counted rather than timed, so that two trees
compare on a shared machine: the least process CPU time of the reps, the
LMDB transactions it opens and, under ``strace -f``, its system calls by name
(fsync, flock, openat, rename, ...). It is tools/bench.py's next-turn store:
a fresh store of ``--tokens`` into a new root (untimed), then the store of
``--new`` more tokens on top, timed and counted, ``--reps`` times.

The syscalls are those of every thread between two markers the child puts in
its trace (a ``stat`` of a path that does not exist) around each next-turn
store, divided by the reps. LMDB transactions are counted by wrapping
``lmdb.open``'s environments (``begin(write=True)`` and ``begin()``).

    python tools/store_profile.py                   # 8,192 + 512 tokens, 20 reps, with strace
    python tools/store_profile.py --no-strace       # CPU time only (strace slows every syscall)
    python tools/store_profile.py --instructions --reps 2   # user-space instructions (callgrind, minutes)
    PYTHONPATH=OTHER_TREE python tools/store_profile.py   # the same counts on another tree

``--scale-root ROOT`` instead times ``--reps`` stores of tools/scale_bench.py's
agent workload into a copy of a root it grew (``scale_bench.py --roots DIR``
keeps ``DIR/10000``): each store's wall and CPU time at that many entries,
where what a store reads of the whole index shows (its cap check, #45).

    python tools/store_profile.py --scale-root DIR/10000 --reps 24
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/, for benchmarks/

from restore_instructions import _tolerant_setrlimit

MARK = "/nonexistent-store-profile-mark"
TXNS = collections.Counter()


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class _CountingEnv:
    """An LMDB environment whose transactions are counted (everything else passes through)."""

    def __init__(self, env: Any) -> None:
        self._env = env

    def begin(self, *args: Any, **kwargs: Any) -> Any:
        TXNS["write" if kwargs.get("write") else "read"] += 1
        return self._env.begin(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


def count_lmdb_txns() -> None:
    import lmdb

    real_open = lmdb.open
    lmdb.open = lambda *a, **k: _CountingEnv(real_open(*a, **k))


def mark(what: str, rep: int, handshake: Path | None) -> None:
    """A marker in the trace; with ``handshake``, also a file there, then a
    wait for the driver's answer (it turns callgrind's counting on or off)."""
    try:
        os.stat(f"{MARK}-{what}")
    except FileNotFoundError:
        pass
    if handshake is not None:
        (handshake / f"{what}{rep}").touch()
        wait_for(handshake / f"{what}{rep}.ack")


def wait_for(path: Path, proc: subprocess.Popen[bytes] | None = None) -> None:
    while not path.exists():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the child exited ({proc.returncode}) before {path.name}: "
                               f"{(path.parent / 'stderr').read_text(errors='replace')[-2000:]}")
        time.sleep(0.05)


def child(tokens: int, new: int, reps: int, work: Path, handshake: Path | None) -> dict[str, Any]:
    """The next-turn stores, each between markers: CPU time and LMDB transactions."""
    if handshake is not None:  # under valgrind, which refuses mlx_lm's raising of the open-file limit
        resource.setrlimit = _tolerant_setrlimit
    count_lmdb_txns()
    from benchmarks.config import FULL
    from benchmarks.harness import open_store
    from benchmarks.sources import KVSource

    src = KVSource.random(FULL.shape, tokens + new, seed=0)
    prefix, whole = src.caches(tokens), src.caches(tokens + new)
    cpu, wall, txns = [], [], collections.Counter()
    for rep in range(reps + 1):  # the first is a warm-up, neither counted nor marked
        root = work / f"root{rep}"
        with open_store(root, FULL.block_tokens) as store:
            assert store.store(src.tokens[:tokens], prefix), "fresh store refused"
            before = TXNS.copy()
            if rep:
                mark("begin", rep, handshake)
            c0, t0 = cpu_s(), time.perf_counter()
            assert store.store(src.tokens[: tokens + new], whole), "next-turn store refused"
            spent, took = cpu_s() - c0, time.perf_counter() - t0
            if rep:
                mark("end", rep, handshake)
                cpu.append(spent)
                wall.append(took)
                txns.update(TXNS - before)
        shutil.rmtree(root)
    return {"cpu_least_s": min(cpu), "cpu_median_s": statistics.median(cpu),
            "wall_least_s": min(wall), "wall_median_s": statistics.median(wall),
            "lmdb_txns": {k: v / reps for k, v in txns.items()}}


_CALL = re.compile(r"^\d+\s+([a-z_0-9]+)\(")
_RESUMED = re.compile(r"^\d+\s+<\.\.\. ([a-z_0-9]+) resumed>")
_TIME = re.compile(r"<(\d+\.\d+)>$")


def syscalls(trace: Path, reps: int) -> dict[str, tuple[float, float]]:
    """{name: (calls, ms inside them)} of every thread between each begin and
    end marker of ``trace`` (``strace -f -T``), per rep; a call is counted where
    it starts, its time where it returns."""
    counts: collections.Counter[str] = collections.Counter()
    seconds: collections.Counter[str] = collections.Counter()
    inside = False
    for line in trace.read_text(errors="replace").splitlines():
        if MARK in line:
            inside = f"{MARK}-begin" in line
            continue
        if not inside:
            continue
        call, resumed, took = _CALL.match(line), _RESUMED.match(line), _TIME.search(line)
        if call:
            counts[call.group(1)] += 1
        name = (call or resumed).group(1) if call or resumed else None
        if name and took:
            seconds[name] += float(took.group(1))
    return {k: (v / reps, round(seconds[k] * 1000 / reps, 3)) for k, v in counts.most_common()}


def instructions(cmd: list[str], work: Path, reps: int) -> tuple[dict[str, Any], int]:
    """The child's report, and its user-space instructions per next-turn store
    (``valgrind --tool=callgrind``, counting only between each begin and end)."""
    dump = work / "callgrind.out"
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={dump}", *cmd,
           "--handshake", str(work)]
    with (work / "stderr").open("wb") as stderr:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr)
    try:
        for rep in range(1, reps + 1):
            for what, switch in (("begin", "on"), ("end", "off")):
                wait_for(work / f"{what}{rep}", proc)
                subprocess.run(["callgrind_control", "-i", switch, str(proc.pid)], check=True, capture_output=True)
                (work / f"{what}{rep}.ack").touch()
        out, _ = proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
    # "totals", the sum over the functions: with counting toggled, "summary" stays 0
    total = re.search(r"^totals: (\d+)", dump.read_text(errors="replace"), re.MULTILINE)
    return json.loads(out.decode().splitlines()[-1]), int(total.group(1)) // reps  # type: ignore[union-attr]


def scale_stores(grown: Path, stores: int, work: Path) -> dict[str, Any]:
    """``stores`` more of scale_bench's entries stored into a copy of ``grown``: p50s of wall and CPU."""
    import scale_bench
    from fleet_catalog import BLOCK_TOKENS, IDENTITY

    from blockkv import BlockStore

    root = work / "root"
    shutil.copytree(grown, root, symlinks=True)
    wall, cpu = [], []
    with BlockStore(root, max_bytes=1 << 50, block_tokens=BLOCK_TOKENS, **IDENTITY) as store:
        held, plain = len(store), store.store

        def timed(*args: Any) -> bool:
            c0, t0 = cpu_s(), time.perf_counter()
            stored = plain(*args)
            wall.append(time.perf_counter() - t0)
            cpu.append(cpu_s() - c0)
            return stored

        store.store = timed  # type: ignore[method-assign]
        scale_bench.store_entries(scale_bench.FULL, store, held, held + stores)
    return {"entries": held, "stores": len(wall), "wall_p50_s": statistics.median(wall),
            "cpu_p50_s": statistics.median(cpu), "cpu_least_s": min(cpu), "loadavg": os.getloadavg()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="store-profile-", dir=args.workdir))
    try:
        if args.scale_root:
            return scale_stores(args.scale_root, args.reps, work)
        cmd = [sys.executable, __file__, "--child", "--tokens", str(args.tokens), "--new", str(args.new),
               "--reps", str(args.reps), "--workdir", str(work)]
        if args.instructions:
            report, count = instructions(cmd, work, args.reps)
            return {**report, "instructions_per_store": count}
        trace = work / "trace"
        if args.strace:
            cmd = ["strace", "-f", "-T", "-qq", "-o", str(trace), *cmd]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        report = json.loads(out.splitlines()[-1])
        if args.strace:
            report["syscalls_per_store"] = syscalls(trace, args.reps)
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192, help="the fresh entry's tokens")
    parser.add_argument("--new", type=int, default=512, help="tokens the next turn adds")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--no-strace", dest="strace", action="store_false",
                        help="CPU time and LMDB transactions only")
    parser.add_argument("--instructions", action="store_true",
                        help="instead of strace, valgrind's callgrind: user-space instructions (minutes)")
    parser.add_argument("--scale-root", type=Path,
                        help="instead: time --reps stores into a copy of this root grown by scale_bench.py")
    parser.add_argument("--workdir", type=Path, help="where the scratch roots live (default: system temp)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--handshake", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.tokens, args.new, args.reps, args.workdir, args.handshake)))
        return 0
    print(json.dumps(run(args), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
