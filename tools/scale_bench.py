"""How a store's costs grow from 1k to 100k agent-shaped entries (issue #45).

Agent sessions on one shared system prompt, each a chain of turns: turn *k*'s
entry is the session's first *k* turns and then a reasoning tail of its own
(a reasoning model's chat template drops the reasoning from the history, so
the next turn's prompt continues the visible turns, not the entry): an entry
holds thousands of tokens, shares all but its last turn and tail with the one
before, and is not superseded by it (a trimmable entry that continues another
supersedes it: a plain chain would leave one entry per session). The caches are real mlx-lm ``KVCache`` objects of a tiny KV geometry
(one layer, one head of 8: 32 bytes a token) so that 100k entries fit the
disk. One root grows through the sizes; at each, with the writer closed:

- open in a fresh process: with the valid index, after a "reboot" (the
  index stamped by a boot that ended, settled, and every file of the root
  dropped from the page cache) and with the index deleted (a forced rebuild);
- that serving process's resident memory (against the same process before
  the open; its anonymous part, the heap, apart from the index's file pages), ``find`` p50/p99 (a stored turn continued, and a new session
  that shares only the system prompt), ``gc`` and ``check``;
- ``blockkv ls`` and ``blockkv stats`` as a user runs them (whole process);
- store p50/p99 over the last tenth of the stores that filled the root;
- a fresh fleet node's first open against a bucket holding the root's headers
  (moto's S3 server on loopback: every header fetched, a MANIFEST left) and
  its later open (the MANIFEST read).

    python tools/scale_bench.py --out scale.json          # 1k / 10k / 100k
    python tools/scale_bench.py --quick --out scale.json  # seconds: the test's run
    python tools/scale_bench.py --sizes 10000 --roots DIR --no-fleet  # one size, a root kept in DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.harness import drop_page_cache, percentile
from benchmarks.index import drop_index, reboot
from benchmarks.sources import VOCAB, KVSource, kv_cache
from fleet_catalog import BLOCK_TOKENS, IDENTITY, SHAPE

from blockkv import BlockStore
from blockkv.format.header import Header, decode_header, encode_header
from blockkv.local.directory import new_entry_id


@dataclass(frozen=True)
class Workload:
    sizes: tuple[int, ...]  # entries at which everything is measured
    system_tokens: int  # the prompt every session starts with
    turns: int  # entries per session
    turn_tokens: tuple[int, int]  # visible tokens each turn adds, uniform in [lo, hi]
    tail_tokens: tuple[int, int]  # each entry's reasoning tail, uniform in [lo, hi]
    finds: int  # per kind, per size
    fleet_max: int  # the largest size the fleet rows are measured at
    stored_max: int  # entries stored through a store; beyond, headers are cloned (``clone``)

    @property
    def shapes(self) -> int:
        """Sessions stored for real: a cloned session has one of their shapes."""
        return self.stored_max // self.turns


FULL = Workload((1_000, 10_000, 100_000), 2048, 8, (150, 450), (64, 192), 1000, 10_000, 10_000)
QUICK = Workload((24, 96), 256, 4, (16, 48), (8, 24), 20, 96, 24)


@dataclass(frozen=True)
class Session:
    tokens: np.ndarray  # the system prompt, then every visible turn
    ends: list[int]  # where each turn's visible part ends
    tails: list[np.ndarray]  # each turn's reasoning tail

    def entry(self, t: int) -> np.ndarray:
        return np.concatenate([self.tokens[: self.ends[t]], self.tails[t]])


def session(w: Workload, s: int) -> Session:
    """Session ``s``'s tokens (the same in every process: seeded by ``s``). A
    session beyond ``w.shapes`` has the lengths of session ``s % w.shapes``
    and tokens of its own."""
    system = np.random.default_rng(0).integers(0, VOCAB, w.system_tokens, dtype=np.uint32)
    rng = np.random.default_rng(1000 + s % w.shapes)
    lengths = rng.integers(w.turn_tokens[0], w.turn_tokens[1] + 1, w.turns)
    rest = rng.integers(0, VOCAB, int(lengths.sum()), dtype=np.uint32)
    tails = [rng.integers(0, VOCAB, int(rng.integers(w.tail_tokens[0], w.tail_tokens[1] + 1)), dtype=np.uint32)
             for _ in range(w.turns)]
    if s >= w.shapes:
        own = np.random.default_rng(10_000_000 + s)
        rest = own.integers(0, VOCAB, len(rest), dtype=np.uint32)
        tails = [own.integers(0, VOCAB, len(t), dtype=np.uint32) for t in tails]
    return Session(np.concatenate([system, rest]), (w.system_tokens + np.cumsum(lengths)).tolist(), tails)


def entry_caches(w: Workload, sess: Session, s: int, system: KVSource) -> list[Any]:
    """Real ``KVCache`` lists of every entry of session ``s`` (prefixes share their bytes)."""
    kv = system.extended(KVSource.random(SHAPE, len(sess.tokens) - w.system_tokens, seed=s + 1))
    tail_kv = KVSource.random(SHAPE, sum(len(t) for t in sess.tails), seed=(s + 1) * 7919 % (1 << 31))
    out, at = [], 0
    for end, tail in zip(sess.ends, sess.tails):
        caches = [kv_cache(mx.concatenate([k[:, :, :end], tk[:, :, at : at + len(tail)]], axis=2),
                           mx.concatenate([v[:, :, :end], tv[:, :, at : at + len(tail)]], axis=2))
                  for k, v, tk, tv in zip(kv.keys, kv.values, tail_kv.keys, tail_kv.values)]
        mx.eval([c.state for c in caches])
        out.append(caches)
        at += len(tail)
    return out


def store_entries(w: Workload, store: BlockStore, start: int, stop: int) -> list[float]:
    """Entries ``start`` to ``stop`` (in session order) stored; each store's wall seconds."""
    system = KVSource.random(SHAPE, w.system_tokens, seed=0)
    times: list[float] = []
    for s in range(start // w.turns, -(-stop // w.turns)):
        sess = session(w, s)
        for t, caches in enumerate(entry_caches(w, sess, s, system)):
            if start <= s * w.turns + t < stop:
                t0 = time.perf_counter()
                assert store.store(sess.entry(t).tolist(), caches), "a store was refused"
                times.append(time.perf_counter() - t0)
    return times


def memory() -> dict[str, int]:
    """This process's resident set, bytes: all of it (``rss``), its anonymous
    part (the heap: what the catalog costs) and its file-backed part (here
    mostly the index's pages an open read, which the kernel can drop)."""
    fields = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file"}
    lines = (line.split() for line in Path("/proc/self/status").read_text().splitlines())
    return {fields[f[0][:-1]]: int(f[1]) * 1024 for f in lines if f and f[0][:-1] in fields}


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """A fresh serving process: open (timed), resident memory; with ``serve``,
    finds, then stores of new sessions' entries (timed), which it removes
    again, ``gc`` (which deletes their blocks) and ``check``."""
    w = Workload(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec["workload"].items()})
    entries = spec["entries"]
    before = memory()
    t0 = time.perf_counter()
    store = BlockStore(Path(spec["root"]), max_bytes=1 << 50, block_tokens=BLOCK_TOKENS, gc_grace=0, **IDENTITY)
    out: dict[str, Any] = {"open_s": time.perf_counter() - t0}
    assert len(store) == entries, f"opened {len(store)} of {entries} entries"
    after = memory()
    out.update({f"{k}_delta": after[k] - before[k] for k in after})
    if spec.get("serve"):
        out.update(time_finds(w, store, entries))
        probe = (10_000_000 // w.turns) * w.turns  # sessions no fill reaches
        times = store_entries(w, store, probe, probe + spec["stores"])
        out["store_p50_ms"], out["store_p99_ms"] = 1e3 * percentile(times, 50), 1e3 * percentile(times, 99)
        for entry in store.entries()[entries:]:
            store.remove(entry)
        assert len(store) == entries
        t0 = time.perf_counter()
        out["gc_blocks"] = store.gc()
        out["gc_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        report = store.check()
        out["check_s"] = time.perf_counter() - t0
        assert report.clean, f"check found problems: {report.to_json()}"
    store.close()
    return out


def time_finds(w: Workload, store: BlockStore, entries: int) -> dict[str, float]:
    """p50/p99 of ``find``: a stored turn continued (the match is that turn
    whole), and a new session (the match is the system prompt)."""
    rng = np.random.default_rng(5)
    hits, news = [], []
    for i in rng.integers(0, entries, w.finds):
        sess = session(w, int(i) // w.turns)
        stored = sess.entry(int(i) % w.turns)
        prompt = np.concatenate([stored, rng.integers(0, VOCAB, 64, dtype=np.uint32)]).tolist()
        t0 = time.perf_counter()
        match = store.find(prompt)
        hits.append(time.perf_counter() - t0)
        assert match is not None and match.prefix_len == len(stored), "a stored turn was not found whole"
        prompt = np.concatenate([sess.tokens[: w.system_tokens], rng.integers(0, VOCAB, 96, dtype=np.uint32)]).tolist()
        t0 = time.perf_counter()
        match = store.find(prompt)
        news.append(time.perf_counter() - t0)
        # at least: a session's next token may be the one drawn (1 in VOCAB per session)
        assert match is not None and match.prefix_len >= w.system_tokens, "the system prompt was not found"
    return {"find_hit_p50_ms": 1e3 * percentile(hits, 50), "find_hit_p99_ms": 1e3 * percentile(hits, 99),
            "find_new_p50_ms": 1e3 * percentile(news, 50), "find_new_p99_ms": 1e3 * percentile(news, 99)}


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cli_seconds(command: str, root: Path) -> float:
    """Wall seconds of ``blockkv COMMAND ROOT --all --json`` in its own process."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "blockkv", command, str(root), "--all", "--json"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return time.perf_counter() - t0


def measure(w: Workload, root: Path, entries: int) -> dict[str, Any]:
    """Every row at one size, no handle open (the index settled)."""
    spec = {"root": str(root), "entries": entries, "workload": asdict(w)}
    out: dict[str, Any] = {"entries": entries, "loadavg_before": os.getloadavg()}
    out.update(run_child({**spec, "serve": True, "stores": max(w.turns, min(entries // 10, 200))}))
    out["open_valid_s"] = run_child(spec)["open_s"]
    reboot(root, settled=True)
    drop_page_cache(root)
    out["open_reboot_s"] = run_child(spec)["open_s"]
    drop_index(root)
    out["open_rebuild_s"] = run_child(spec)["open_s"]
    out["ls_s"] = cli_seconds("ls", root)
    out["stats_s"] = cli_seconds("stats", root)
    out["disk_bytes"] = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    return out


def fleet(root: Path, work: Path, entries: int) -> dict[str, float]:
    """A fresh node's first and later open against a bucket holding every header of ``root``."""
    from benchmarks.remote import moto_bucket
    from fleet_catalog import node
    from fleet_catalog import run_child as fleet_child

    headers = sorted(p for p in root.rglob("*.bkv") if "blocks" not in p.parts)
    assert len(headers) == entries, f"{len(headers)} header files for {entries} entries"
    with moto_bucket() as (url, options, _):
        with node(work / "writer", url, options) as writer:
            bucket = writer.remote
            assert bucket is not None

            def put(path: Path) -> None:
                bucket.headers.put_if_absent(f"{path.parent.name}/{path.name}", [path.read_bytes()])

            t0 = time.perf_counter()
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(put, headers))
            upload = time.perf_counter() - t0
        shutil.rmtree(work / "writer")
        spec = {"root": str(work / "fresh"), "url": url, "options": options}
        first, later = fleet_child(spec), fleet_child(spec)
    shutil.rmtree(work / "fresh", ignore_errors=True)
    return {"fleet_upload_s": upload, "fleet_first_open_s": first["open_s"], "fleet_later_open_s": later["open_s"],
            "fleet_rss_delta": later["rss_after"] - later["rss_before"]}


def grow(w: Workload, roots: Path, size: int, previous: int | None) -> float:
    """``roots/<size>`` filled up to ``size`` entries, from a copy of the
    previous size's root; one kept from an earlier run is reused as it is (so
    a rerun, e.g. of another tree through PYTHONPATH, measures the same
    entries without storing them again). Stores up to ``w.stored_max``, then
    ``clone``. Wall seconds."""
    root = roots / str(size)
    if not root.exists() and previous is not None:
        shutil.copytree(roots / str(previous), root, symlinks=True)
    t0 = time.perf_counter()
    with BlockStore(root, max_bytes=1 << 50, block_tokens=BLOCK_TOKENS, **IDENTITY) as store:
        held = len(store)
        store_entries(w, store, held, min(size, w.stored_max))
    if size > max(held, w.stored_max):
        clone(w, root, max(held, w.stored_max), size)
    with BlockStore(root, max_bytes=1 << 50, block_tokens=BLOCK_TOKENS, **IDENTITY) as store:
        assert len(store) == size, f"the root holds {len(store)} entries, not {size}"
    return time.perf_counter() - t0


def clone(w: Workload, root: Path, start: int, stop: int) -> None:
    """Entries ``start`` to ``stop`` as header files cloned from the stored
    ones: each a stored entry's header (so its blocks, which its KV bytes
    are) over a session of its own's tokens of the same length; then the
    index rebuilt from the headers. 100k real stores take hours on a shared
    2-core machine; what open, find, ls and memory read is the same."""
    (fp_dir,) = (p for p in root.iterdir() if (p / "IDENTITY").is_file())
    stored: dict[bytes, tuple[Path, Header]] = {}
    for path in fp_dir.glob("entries/*/*.bkv"):
        header = decode_header(path.read_bytes())
        stored[header.tokens.tobytes()] = (path, header)
    for i in range(start, stop):
        s, t = divmod(i, w.turns)
        path, h = stored[session(w, s % w.shapes).entry(t).tobytes()]
        header = Header(h.identity, h.ns, session(w, s).entry(t), h.descriptor, h.checkpoint, h.block_xxh3)
        (path.parent / f"{new_entry_id(time.time())}.bkv").write_bytes(encode_header(header))
    drop_index(root)


def run(w: Workload, work: Path, roots: Path, fleet_rows: bool) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    base = run_child({"root": str(work / "empty"), "entries": 0, "workload": asdict(w)})
    shutil.rmtree(work / "empty")
    for previous, size in zip((None, *w.sizes), w.sizes):
        row = {"fill_s": grow(w, roots, size, previous), **measure(w, roots / str(size), size)}
        if fleet_rows and size <= w.fleet_max:
            row.update(fleet(roots / str(size), work, size))
        for part in ("rss", "anon", "file"):
            row[f"{part}_per_entry"] = (row[f"{part}_delta"] - base[f"{part}_delta"]) / size
        row["loadavg_after"] = os.getloadavg()
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    lengths = [len(sess.entry(t)) for sess in map(partial(session, w), range(w.sizes[-1] // w.turns))
               for t in range(w.turns)]
    return {"workload": asdict(w), "mean_entry_tokens": float(np.mean(lengths)), "empty_open": base, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: seconds")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--workdir", type=Path, help="where the root grows (default: system temp)")
    parser.add_argument("--no-fleet", action="store_true", help="skip the bucket rows")
    parser.add_argument("--roots", type=Path, help="grow and keep a root per size here (a rerun, e.g. of another "
                        "tree through PYTHONPATH, measures the same entries without storing them again)")
    parser.add_argument("--sizes", type=int, nargs="+", help="measure at these sizes only (default: 1k 10k 100k)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    work = Path(tempfile.mkdtemp(prefix="blockkv-scale-", dir=args.workdir))
    try:
        w = QUICK if args.quick else FULL
        if args.sizes:
            w = replace(w, sizes=tuple(sorted(args.sizes)))
        report = run(w, work, args.roots or work / "roots", not args.no_fleet)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(report, indent=2) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
