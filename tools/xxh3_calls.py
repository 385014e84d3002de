"""Would a GIL-free xxh3 speed a verified restore up? (issue #45) python-xxhash
keeps the GIL while it hashes, so the check's 8,704 calls of 32 KiB at 8,704
tokens run one at a time across the reading threads. Its extension also
exports libxxhash's streaming functions, which ctypes calls without the GIL
(``benchmarks/xxh3_ctypes.py``). This measures both ways:

- per call, on bytes in the CPU cache as the fused check meets them: thread
  CPU of 8,192 calls of 32 KiB (least of the reps), and how two threads doing
  that at once scale (2.0: fully parallel; 1.0: one at a time);
- whole verified restores, alternating in one process: mlx-lm's load, today's
  check, and a check hashing each piece by address through ctypes (the
  addresses worked out per block from the destination arrays, not per piece);
  median wall, least CPU, cores busy. Digests are checked bit-identical first,
  and the ctypes check's restores bit-exact, with no fallback to today's path;
- ``--native``: also a restore whose every block is read into its pieces and
  hashed by one native call with the GIL dropped (``benchmarks/read_hash.c``,
  built with the system's ``cc``): what the Python around the reads and the
  GIL-held hashing cost, measured by taking them away; the same fed by
  targets that hold no memoryviews (addresses and sizes in numpy arrays);
  and, with no compiled code, those targets read by libc's ``preadv`` and
  hashed piece by piece through ctypes.

    python tools/xxh3_calls.py                      # 4,096 and 8,704 tokens, 21 reps
    python tools/xxh3_calls.py --tokens 8704 --reps 41
    python tools/xxh3_calls.py --tokens 8704 --reps 41 --native
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/, for benchmarks/

import numpy as np
import xxhash
from benchmarks.config import FULL
from benchmarks.harness import open_store
from benchmarks.sources import KVSource, check_restored, eval_caches
from benchmarks.xxh3_ctypes import LIB, Xxh3At, native_reader, update_address
from cpu_budget import alternate
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from blockkv.format import rebuild
from blockkv.format.blocks import block_parts, finish_name, layout_bytes, rows_part
from blockkv.local.restore import EntryRead

PIECE, CALLS = 32 << 10, 8192  # a restore's piece; 256 MiB, about an 8,704-token restore's check


def _hashers(buf: np.ndarray) -> dict[str, Callable[[], str]]:
    """8,192 calls of 32 KiB over the same 1 MiB (in cache), each way."""
    views = [memoryview(buf)[o : o + PIECE] for o in range(0, buf.nbytes, PIECE)]
    addresses = [buf.ctypes.data + o for o in range(0, buf.nbytes, PIECE)]

    def python() -> str:
        h = xxhash.xxh3_128()
        for k in range(CALLS):
            h.update(views[k % len(views)])
        return h.hexdigest()

    def ctypes_() -> str:
        h = Xxh3At()
        update = h.update_at
        for k in range(CALLS):
            update(addresses[k % len(addresses)], PIECE)
        return h.hexdigest()

    def ctypes_empty() -> str:  # the call alone: what it costs beyond the hash, GIL held for most of it
        h = Xxh3At()
        update = h.update_at
        for k in range(CALLS):
            update(addresses[k % len(addresses)], 0)
        return h.hexdigest()

    return {"python-xxhash update": python, "ctypes XXH3_128bits_update": ctypes_,
            "ctypes XXH3_128bits_update of 0 bytes (the call alone)": ctypes_empty}


def piece_costs(reps: int) -> list[str]:
    bufs = [np.random.default_rng(s).integers(0, 256, 1 << 20, dtype=np.uint8) for s in (1, 2)]
    mine, other = _hashers(bufs[0]), _hashers(bufs[1])
    rows = []
    for name in mine:
        assert mine["python-xxhash update"]() == mine["ctypes XXH3_128bits_update"](), "the two ways disagree"
        one, two = [], []
        for _ in range(reps):
            t = time.thread_time()
            mine[name]()
            one.append(time.thread_time() - t)
            threads = [threading.Thread(target=fn) for fn in (mine[name], other[name])]
            t = time.perf_counter()
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            two.append(time.perf_counter() - t)
        rows.append(f"| {name}, one thread, {CALLS} calls from cache | {min(one) * 1e3:.1f} ms CPU "
                    f"({min(one) / CALLS * 1e9:.0f} ns a call) | two threads at once: {min(two) * 1e3:.1f} ms wall, "
                    f"scaling {2 * min(one) / min(two):.2f} |")
    return rows


def _digests_agree() -> None:
    """Random sizes and a layout tail, as a block's check ends: bit-identical or nothing is measured."""
    rng = np.random.default_rng(3)
    for size in (0, 1, 17, 240, 4096, PIECE, PIECE * 3 + 5):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        a, b = xxhash.xxh3_128(), Xxh3At()
        for h in (a, b):
            h.update(data)
        assert finish_name(a, b"{}") == finish_name(b, b"{}"), size


def _with_addresses(made: Callable[..., rebuild.Target]) -> Callable[..., rebuild.Target]:
    """``_TokenTargets.__call__``, also noting each piece's address: each
    destination's base once, plus the same offsets the pieces are sliced at."""

    def call(self: rebuild._TokenTargets, ref: rebuild.BlockRef) -> rebuild.Target:
        target = made(self, ref)
        if not hasattr(self, "bases"):
            self.bases = [np.frombuffer(d, np.uint8).ctypes.data if d.nbytes else 0 for d in self._dest]
        addresses = []
        for i, a, b in block_parts(self._full, ref.start, ref.stop):
            row = self._geometry[i][1]
            if b > self._rows[i]:  # rows cut off: today's path
                return target
            addresses += [self.bases[i] + o + a * row for o in self._heads[i]]
        object.__setattr__(target, "addresses", addresses)
        return target

    return call


def _lean_targets(made: Callable[..., rebuild.Target]) -> Callable[..., rebuild.Target]:
    """``_TokenTargets.__call__`` without a memoryview per piece: the pieces'
    addresses and sizes as two arrays, a few numpy operations a block (for
    the native reader, which needs nothing else); a block whose tensors do
    not all hold the same whole rows goes today's way."""

    def call(self: rebuild._TokenTargets, ref: rebuild.BlockRef) -> rebuild.Target:
        spec = block_parts(self._full, ref.start, ref.stop)
        if len({(a, b) for _, a, b in spec}) != 1 or any(b > self._rows[i] for i, _, b in spec):
            return made(self, ref)
        order = tuple(i for i, _, _ in spec)
        lean = self.__dict__.setdefault("lean", {})
        if order not in lean:
            bases = [np.frombuffer(self._dest[i], np.uint8).ctypes.data for i in order]
            lean[order] = (np.array([base + o for base, i in zip(bases, order) for o in self._heads[i]], np.uint64),
                           np.array([self._geometry[i][1] for i in order for _ in self._heads[i]], np.uint64))
        starts, rows = lean[order]
        (_, a, b) = spec[0]
        key = tuple((i, b - a) for i in order)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = layout_bytes([rows_part(self._full[i], a, b) for i in order])
        covers = tuple((i, self._geometry[i][0] * (b - a) * self._geometry[i][1]) for i in order)
        target = rebuild.Target(ref, layout, [], covers)
        object.__setattr__(target, "addresses", starts + np.uint64(a) * rows)
        object.__setattr__(target, "sizes", np.uint64(b - a) * rows)
        return target

    return call


FALLBACKS = [0]


def _fall_back(today: Callable[[EntryRead, rebuild.Target], rebuild.Target], read: EntryRead,
               target: rebuild.Target) -> rebuild.Target:
    """Today's fill of a block a measured way could not take (counted: a run
    with any is not reported); a lean target has no pieces to fill, so it stops the run."""
    FALLBACKS[0] += 1
    if hasattr(target, "sizes"):
        raise RuntimeError(f"block {target.ref.name}: a target without memoryviews cannot fall back")
    return today(read, target)


def _ctypes_fill(today: Callable[[EntryRead, rebuild.Target], rebuild.Target]) -> Callable[..., rebuild.Target]:
    """``EntryRead._fill`` hashing each piece by address through ctypes; any
    other case (no addresses, a mismatch, an odd frame) goes today's way."""

    def fill(self: EntryRead, target: rebuild.Target) -> rebuild.Target:
        addresses = getattr(target, "addresses", None)
        if self._verify is not True or addresses is None:
            return today(self, target)
        head = memoryview(bytearray(len(target.frame_prefix)))
        h, sizes, done = Xxh3At(), [p.nbytes for p in target.pieces], [0]
        update = h.update_at

        def feed(run: list[memoryview]) -> None:
            k = done[0]
            n = len(run) - (run[0] is head)
            for j in range(k, k + n):
                update(addresses[j], sizes[j])
            done[0] = k + n

        if (self._pool.read_exact(target.ref.name, [head, *target.pieces], feed)
                and head == target.frame_prefix and finish_name(h, target.layout) == target.ref.xxh3):
            return target
        return _fall_back(today, self, target)

    return fill


def _read_block(self: EntryRead, target: rebuild.Target, payload_bytes: int,
                read: Callable[[int, int], bool]) -> bool:
    """Open ``target``'s block file, check its size and frame prefix as today's
    fill does, then ``read(fd, payload offset)`` the payload into the pieces."""
    prefix = target.frame_prefix
    fd = os.open(self._pool.path(target.ref.name), os.O_RDONLY | os.O_NOFOLLOW)
    try:
        return (os.fstat(fd).st_size == len(prefix) + payload_bytes and os.pread(fd, len(prefix), 0) == prefix
                and read(fd, len(prefix)))
    finally:
        os.close(fd)


def _native_fill(today: Callable[[EntryRead, rebuild.Target], rebuild.Target],
                 reader: Callable[..., int]) -> Callable[..., rebuild.Target]:
    """``EntryRead._fill`` reading and hashing each block in one native call
    (after the frame's header and layout are read and compared, as today);
    any other case goes today's way."""
    update = update_address()

    def fill(self: EntryRead, target: rebuild.Target) -> rebuild.Target:
        addresses = getattr(target, "addresses", None)
        if self._verify is not True or addresses is None:
            return today(self, target)
        sizes = getattr(target, "sizes", None)
        if sizes is None:
            sizes = np.fromiter((p.nbytes for p in target.pieces), np.uint64, len(target.pieces))
        where, total, h = np.asarray(addresses, np.uint64), int(sizes.sum()), Xxh3At()

        def read(fd: int, offset: int) -> bool:
            return reader(fd, offset, where.ctypes.data, sizes.ctypes.data, len(sizes), h._state, update,
                          512 << 10) == total

        if _read_block(self, target, total, read) and finish_name(h, target.layout) == target.ref.xxh3:
            return target
        return _fall_back(today, self, target)

    return fill


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.preadv.restype = ctypes.c_ssize_t
_LIBC.preadv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong]


def _libc_fill(today: Callable[[EntryRead, rebuild.Target], rebuild.Target]) -> Callable[..., rebuild.Target]:
    """``EntryRead._fill`` over ``_lean_targets`` with no compiled code of its
    own: libc's ``preadv`` through ctypes over an iovec array numpy builds
    once a block, one call per 512 KiB run, then each piece of the run hashed
    by address through ctypes (one call a piece); any other case goes today's way."""

    def fill(self: EntryRead, target: rebuild.Target) -> rebuild.Target:
        sizes = getattr(target, "sizes", None)
        if self._verify is not True or sizes is None:
            return today(self, target)
        iov = np.empty((len(sizes), 2), np.uint64)
        iov[:, 0], iov[:, 1] = target.addresses, sizes
        ends = np.cumsum(sizes)
        runs = np.arange(1, -(-int(ends[-1]) // (512 << 10)) + 1) * (512 << 10)
        cuts = sorted({*(np.searchsorted(ends, runs) + 1).tolist(), len(sizes)} - {len(sizes) + 1})
        pieces, h = list(zip(target.addresses.tolist(), sizes.tolist())), Xxh3At()

        def read(fd: int, offset: int) -> bool:
            update, start = h.update_at, 0
            for end in cuts:
                want = int(ends[end - 1]) - (int(ends[start - 1]) if start else 0)
                if _LIBC.preadv(fd, iov.ctypes.data + 16 * start, end - start, offset) != want:
                    return False  # short or failed: today's path reads it again
                for address, size in pieces[start:end]:
                    update(address, size)
                start, offset = end, offset + want
            return True

        if _read_block(self, target, int(ends[-1]), read) and finish_name(h, target.layout) == target.ref.xxh3:
            return target
        return _fall_back(today, self, target)

    return fill


def restores(tokens: int, reps: int, work: Path, native: Callable[..., int] | None = None) -> list[str]:
    src = KVSource.random(FULL.shape, tokens, seed=1)
    path = work / f"mlx-{tokens}.safetensors"
    save_prompt_cache(str(path), src.caches())
    today_call, today_fill = rebuild._TokenTargets.__call__, EntryRead._fill
    ways = {"today's check": (today_call, today_fill),
            "ctypes check": (_with_addresses(today_call), _ctypes_fill(today_fill))}
    if native is not None:
        ways["native read + check of each block"] = (_with_addresses(today_call), _native_fill(today_fill, native))
        ways["the same, targets without memoryviews"] = (_lean_targets(today_call), _native_fill(today_fill, native))
        ways["no compiled code: libc preadv + ctypes hash, no memoryviews"] = (_lean_targets(today_call),
                                                                             _libc_fill(today_fill))
    with open_store(work / f"root-{tokens}", FULL.block_tokens) as store:
        assert store.store(src.tokens, src.caches()), "store refused"
        entry = store.find_exact(src.tokens).entry

        def restore(way: str) -> Callable[[], None]:
            def run() -> None:
                rebuild._TokenTargets.__call__, EntryRead._fill = ways[way]  # type: ignore[method-assign]
                eval_caches(store.restore(entry).caches)
            return run

        try:
            for way in ways:
                restore(way)()
                check_restored(store.restore(entry).caches, src, tokens)
            FALLBACKS[0] = 0
            got = alternate({"mlx-lm load": lambda: eval_caches(load_prompt_cache(str(path))),
                             **{way: restore(way) for way in ways}}, reps)
        finally:
            rebuild._TokenTargets.__call__, EntryRead._fill = today_call, today_fill  # type: ignore[method-assign]
    assert FALLBACKS[0] == 0, f"{FALLBACKS[0]} blocks fell back to today's path"
    load_wall = got["mlx-lm load"][0]
    return [f"| {tokens} tokens: {k} | {wall * 1e3:.1f} ms | {least * 1e3:.1f} ms | {cpu / wall:.2f} "
            f"| {load_wall / wall:.2f} | {flt:.0f} |" for k, (wall, cpu, least, flt) in got.items()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8704])
    parser.add_argument("--native", action="store_true", help="also a native read + check of each block (needs cc)")
    args = parser.parse_args()
    if LIB is None:
        print("this xxhash build does not export the XXH3 streaming functions: nothing to compare")
        return 1
    _digests_agree()
    rows = ["| way | CPU (least) | two threads |", "|---|---|---|", *piece_costs(args.reps), "",
            "| restore | wall (median) | CPU (least) | cores busy | mlx-lm load's wall / this | minor faults |",
            "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory(prefix="blockkv-xxh3-") as work:
        native = native_reader(Path(work)) if args.native else None
        if args.native and native is None:
            print("no C compiler (cc): no native row")
        for tokens in args.tokens:
            rows += restores(tokens, args.reps, Path(work), native)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
