"""BlockStoreMachine: a hypothesis state machine that drives a real BlockStore
and the ReferenceStore side by side and fails on the first disagreement.

Subclass it to test an integration (override ``open_store`` to pass your own
parameters); run it as ``TestX = MySubclass.TestCase``. Every rule acts on
real files, a real LMDB environment and real mlx-lm caches; faults enter only
through the FaultyFileLayer seam; time is a FakeClock so grace periods and
LRU order are deterministic and shrinkable.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, multiple, precondition, rule
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from blockkv.fs import FileLayer
from blockkv.store import CHECKPOINT_NS, BlockStore, Entry, GenerationCheckpoint, Match
from blockkv.testing.faults import CRASH_POINTS, FaultyFileLayer, SimulatedCrash
from blockkv.testing.reference import ModelCheckpoint, ModelEntry, ReferenceStore
from blockkv.testing.strategies import agent_sessions, attachments, caches_for, namespaces, related_prompts, token_runs

GRACE = 60.0
BLOCK_TOKENS = 4  # small, so entries span several blocks and share prefix blocks
UNCAPPED = 1 << 40


def _exact(handle: BlockStore, tokens: Sequence[int], ns: str) -> Match | None:
    """``find_exact``, also in a checkpoint's namespace (which no caller's ns can name)."""
    if not ns.startswith(CHECKPOINT_NS):
        return handle.find_exact(tokens, ns)
    want = tuple(tokens)
    return next((Match(e, len(want)) for e in handle.entries() if e.ns == ns and e.tokens == want), None)


class FakeClock:
    """Injected time: every read advances a millisecond (LRU order is total),
    ``advance`` jumps past grace periods. Starts at the wall clock so file
    mtimes and clock readings stay comparable."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        self.now += 1e-3
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# -- raw bits of the live part of caches ----------------------------------------


def _raw(a: mx.array | None) -> tuple[str, tuple[int, ...], bytes] | None:
    if a is None:
        return None
    return (str(a.dtype), tuple(a.shape), np.array(a.reshape(-1).view(mx.uint8)).tobytes())


def _rows(a: Any, n: int) -> Any:
    """The first ``n`` token rows (axis -2) of an array or a tuple of arrays."""
    if isinstance(a, (tuple, list)):
        return tuple(_raw(x[..., :n, :]) for x in a)
    return _raw(a[..., :n, :]) if a is not None else None


def live_bits(cache: Any) -> tuple[Any, ...]:
    """What a cache holds, as raw bits: the live token rows (never the
    pre-allocated tail past ``offset``) and the counters that place them."""
    name = type(cache).__name__
    if isinstance(cache, CacheList):
        return (name, tuple(live_bits(c) for c in cache.caches))
    if isinstance(cache, ArraysCache):
        return (name, tuple(_raw(a) for a in cache.cache), _raw(cache.left_padding), _raw(cache.lengths))
    if isinstance(cache, RotatingKVCache):
        n = min(cache.offset, cache.keys.shape[-2]) if cache.keys is not None else 0
        return (name, cache.offset, cache.keep, cache.max_size, cache._idx, _rows(cache.keys, n), _rows(cache.values, n))
    if isinstance(cache, ChunkedKVCache):
        n = cache.offset - cache.start_position
        return (name, cache.offset, cache.start_position, cache.chunk_size, _rows(cache.keys, n), _rows(cache.values, n))
    if isinstance(cache, QuantizedKVCache):
        return (name, cache.offset, cache.group_size, cache.bits, _rows(cache.keys, cache.offset), _rows(cache.values, cache.offset))
    return (name, cache.offset, _rows(cache.keys, cache.offset), _rows(cache.values, cache.offset))


def _fresh(v: Any) -> Any:
    if isinstance(v, mx.array):
        return mx.array(v)
    if isinstance(v, (list, tuple)):
        return type(v)(_fresh(x) for x in v)
    return v


def clone_cache(cache: Any) -> Any:
    """An independent copy: new array objects, so mutating the original (or
    trimming the copy) never shows through."""
    if isinstance(cache, CacheList):
        return CacheList(*(clone_cache(c) for c in cache.caches))
    dup = copy.copy(cache)
    for k, v in vars(cache).items():
        setattr(dup, k, _fresh(v))
    return dup


def scribble(caches: Sequence[Any]) -> None:
    """Overwrite every array of the caller's caches in place (what a server
    does to its live cache right after handing it to ``store_async``)."""
    for cache in caches:
        if isinstance(cache, CacheList):
            scribble(cache.caches)
            continue
        for v in vars(cache).values():
            for a in v if isinstance(v, (list, tuple)) else (v,):
                if isinstance(a, mx.array) and a.size:
                    a[...] = 0
        mx.eval([a for a in vars(cache).values() if isinstance(a, mx.array)])


@dataclass(frozen=True)
class Snapshot:
    """What was stored, kept to compare restores against bit for bit."""

    caches: tuple[Any, ...]
    attachments: tuple[tuple[str, Any], ...]
    length: int

    @classmethod
    def of(cls, caches: Sequence[Any], atts: dict[str, mx.array] | None, length: int) -> Snapshot:
        return cls(tuple(clone_cache(c) for c in caches),
                   tuple(sorted((k, _raw(v)) for k, v in (atts or {}).items())), length)

    def bits_at(self, p: int) -> tuple[Any, ...]:
        """The caches cut to ``p`` tokens by mlx-lm's own ``trim``."""
        cut = [clone_cache(c) for c in self.caches]
        for c in cut:
            if p < self.length:
                c.trim(self.length - p)
        return tuple(live_bits(c) for c in cut)


# -- the machine ------------------------------------------------------------------


class BlockStoreMachine(RuleBasedStateMachine):
    """BlockStore ⇄ ReferenceStore. Override ``open_store`` to change parameters."""

    prompts = Bundle("prompts")

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="blockkv-machine-"))
        self.clock = FakeClock()
        self.fs = FaultyFileLayer()
        self.cap = UNCAPPED
        self.model = ReferenceStore()
        self.damaged_blocks: set[str] = set()
        self.damaged_headers: set[str] = set()
        self.handles: list[BlockStore] = [self.open_store(self.fs)]
        self.abandoned: list[BlockStore] = []

    def open_store(self, fs: FileLayer) -> BlockStore:
        """A handle on the machine's root (the hook a subclass overrides)."""
        return BlockStore(self.root, model_id="tiny", config_fingerprint="fp-test", tokenizer_hash="tok",
                          max_bytes=UNCAPPED, limit=lambda: self.cap, block_tokens=BLOCK_TOKENS,
                          fs=fs, clock=self.clock, gc_grace=GRACE)

    def teardown(self) -> None:
        for h in self.handles + self.abandoned:
            h.close()
        shutil.rmtree(self.root, ignore_errors=True)

    # -- helpers ------------------------------------------------------------
    @property
    def store(self) -> BlockStore:
        return self.handles[0]

    def _handle(self, data: st.DataObject) -> BlockStore:
        return data.draw(st.sampled_from(self.handles), label="handle")

    def _entry(self, data: st.DataObject) -> ModelEntry:
        # Store order, not ids: ids are random uuids, and draws must replay.
        return data.draw(st.sampled_from(list(self.model.entries())), label="entry")

    def _live(self, handle: BlockStore, e: ModelEntry) -> Entry:
        m = _exact(handle, e.tokens, e.ns)
        assert m is not None and m.entry.id == e.id, f"entry {e.id} {e.tokens} missing from the store"
        return m.entry

    def _is_damaged(self, entry_id: str, blocks: Any) -> bool:
        return entry_id in self.damaged_headers or bool(set(blocks) & self.damaged_blocks)

    def _sync_damaged(self) -> None:
        """A damaged entry may be dropped by the store at any time; never served wrong."""
        live = {e.id for e in self.store.entries()}
        for e in list(self.model.entries()):
            if e.id not in live and self._is_damaged(e.id, e.blocks):
                self.model.remove(e.id)

    def _block_size(self, name: str) -> int:
        return (self.store.directory / "blobs" / name[:2] / name).stat().st_size

    def _adopt(self, handle: BlockStore, tokens: tuple[int, ...], ns: str, snap: Snapshot,
               checkpoint: GenerationCheckpoint | None) -> None:
        """Record a store the real store acknowledged, and check the model agrees it was allowed."""
        m = _exact(handle, tokens, ns)
        assert m is not None, "an acknowledged store is not found"
        e = m.entry
        expect_trim = not snap.attachments and all(c.is_trimmable() for c in snap.caches)
        assert e.trimmable == expect_trim, (e.trimmable, expect_trim)
        sizes = {n: self._block_size(n) for n in e.blocks}
        assert e.nbytes == e.header_bytes + sum(sizes.values())
        entry = ModelEntry(id=e.id, ns=ns, tokens=tokens, trimmable=e.trimmable,
                           minimum_reusable_offset=e.minimum_reusable_offset, header_bytes=e.header_bytes,
                           blocks=sizes, payload=snap)
        if checkpoint is not None:
            cp = ModelCheckpoint(checkpoint.key, checkpoint.original_prompt_tokens, checkpoint.cache_ns)
            out = self.model.store_generation_checkpoint(entry, cp, self.cap)
        else:
            out = self.model.store(entry, self.cap)
        assert out.stored, f"store accepted {e.nbytes} bytes over the {self.cap}-byte cap"
        note(f"stored {e.id[:6]} ns={ns!r} len={len(tokens)} trim={e.trimmable} removed={out.removed}")

    def _store(self, handle: BlockStore, tokens: tuple[int, ...], kind: str, caches: list[Any], ns: str,
               atts: dict[str, mx.array] | None, use_async: bool) -> None:
        snap = Snapshot.of(caches, atts, len(tokens))
        if use_async:
            fut = handle.store_async(tokens, caches, ns, atts)
            scribble(caches)
            ok = fut.result()
        else:
            ok = handle.store(tokens, caches, ns, atts)
        note(f"store kind={kind} async={use_async} -> {ok}")
        if ok:
            self._adopt(handle, tokens, ns, snap, None)
        else:
            self._expect_refused(tokens, snap, ns, atts)

    def _expect_refused(self, tokens: tuple[int, ...], snap: Snapshot, ns: str, atts: Any,
                        checkpoint: GenerationCheckpoint | None = None) -> None:
        """A False without a fault must be the over-cap refusal: weigh the entry in
        a scratch store of the same parameters and check it really exceeds the cap.
        (A checkpoint is weighed as one: its header carries the checkpoint.)"""
        scratch = Path(tempfile.mkdtemp(prefix="blockkv-weigh-"))
        try:
            with BlockStore(scratch, model_id="tiny", config_fingerprint="fp-test", tokenizer_hash="tok",
                            max_bytes=UNCAPPED, block_tokens=BLOCK_TOKENS) as twin:
                if checkpoint is not None:
                    assert twin.store_generation_checkpoint(tokens, list(snap.caches), checkpoint)
                else:
                    assert twin.store(tokens, list(snap.caches), ns, atts)
                weight = _exact(twin, tokens, ns).entry.nbytes  # type: ignore[union-attr]
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        assert weight > self.cap, f"store refused a {weight}-byte entry under the {self.cap}-byte cap"

    def _check_restore(self, handle: BlockStore, e: ModelEntry, p: int) -> None:
        live = self._live(handle, e)
        loaded = handle.restore(live, prefix_len=p)
        if loaded is None:
            assert self._is_damaged(e.id, e.blocks), f"restore of healthy entry {e.id} failed"
            self.model.remove(e.id)
            note(f"restore {e.id[:6]} -> miss (damaged)")
            return
        snap: Snapshot = e.payload
        assert loaded.tokens == e.tokens[:p]
        assert tuple(live_bits(c) for c in loaded.caches) == snap.bits_at(p), f"wrong tensors from {e.id} at {p}"
        assert tuple(sorted((k, _raw(v)) for k, v in loaded.attachments.items())) == snap.attachments
        self.model.touch(e.id)

    # -- rules ----------------------------------------------------------------
    @initialize(target=prompts, sessions=agent_sessions())
    def seed_prompts(self, sessions: list[tuple[int, ...]]) -> Any:
        return multiple(*sessions)

    @rule(target=prompts, base=prompts, data=st.data())
    def related_prompt(self, base: tuple[int, ...], data: st.DataObject) -> tuple[int, ...]:
        return data.draw(related_prompts(base))

    @rule(prompt=prompts, data=st.data())
    def store_entry(self, prompt: tuple[int, ...], data: st.DataObject) -> None:
        kind, caches = data.draw(caches_for(prompt), label="caches")
        atts = data.draw(attachments(), label="attachments") if data.draw(st.integers(0, 4)) == 0 else None
        self._store(self._handle(data), prompt, kind, caches, data.draw(namespaces, label="ns"),
                    atts or None, data.draw(st.booleans(), label="async"))
        assert self.store.total_bytes <= self.cap

    @rule(prompt=prompts, ns=namespaces, data=st.data())
    def lookups(self, prompt: tuple[int, ...], ns: str, data: st.DataObject) -> None:
        h = self._handle(data)
        got = h.find(prompt, ns)
        want = self.model.find(prompt, ns)
        assert (got and (got.entry.id, got.prefix_len)) == (want and (want[0].id, want[1])), (got, want)
        exact = h.find_exact(prompt, ns)
        want_exact = self.model.find_exact(prompt, ns)
        assert (exact and exact.entry.id) == (want_exact and want_exact.id)
        assert h.has_durable_prefix(prompt, ns) == self.model.has_durable_prefix(prompt, ns)
        assert h.longest_durable_prefix_tokens == self.model.longest_durable_prefix_tokens

    @precondition(lambda self: len(self.model) > 0)
    @rule(data=st.data())
    def restore(self, data: st.DataObject) -> None:
        e = self._entry(data)
        p = len(e.tokens)
        if e.trimmable and data.draw(st.booleans()):
            p = data.draw(st.integers(max(1, e.minimum_reusable_offset), len(e.tokens)), label="prefix")
        self._check_restore(self._handle(data), e, p)

    @precondition(lambda self: len(self.model) > 0)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        e = self._entry(data)
        h = self._handle(data)
        h.remove(self._live(h, e))
        self.model.remove(e.id)

    @precondition(lambda self: len(self.model) > 0)
    @rule(fraction=st.sampled_from((0.0, 0.3, 0.6, 0.9)), data=st.data())
    def shrink_cap_and_evict(self, fraction: float, data: st.DataObject) -> None:
        self._sync_damaged()
        self.cap = int(self.store.total_bytes * fraction)
        self._handle(data).evict_to_cap()
        gone = self.model.evict_to_cap(self.cap)
        note(f"cap {self.cap}: evicted {gone}")
        assert self.store.total_bytes <= self.cap

    @rule()
    def raise_cap(self) -> None:
        self.cap = UNCAPPED

    @rule(past_grace=st.booleans(), data=st.data())
    def gc(self, past_grace: bool, data: st.DataObject) -> None:
        if past_grace:
            self.clock.advance(GRACE + 1)
        self._handle(data).gc()
        if past_grace:
            referenced = {n for e in self.store.entries() for n in e.blocks}
            files = {f.name for d in (self.store.directory / "blobs").iterdir() for f in d.iterdir()
                     if not f.name.startswith(".")}
            assert files <= referenced, f"unreferenced blocks survived gc: {sorted(files - referenced)}"
            self.damaged_blocks &= files

    @rule(prompt=prompts, gen=token_runs(1, 6), key=st.sampled_from(("req-a", "req-b")),
          cache_ns=st.sampled_from(("", "adapter:a")), data=st.data())
    def generation_checkpoint(self, prompt: tuple[int, ...], gen: tuple[int, ...], key: str,
                              cache_ns: str, data: st.DataObject) -> None:
        tokens = prompt + gen
        _, caches = data.draw(caches_for(tokens), label="caches")
        snap = Snapshot.of(caches, None, len(tokens))
        cp = GenerationCheckpoint(key, len(prompt), cache_ns)
        h = self._handle(data)
        if h.store_generation_checkpoint(tokens, caches, cp):
            self._adopt(h, tokens, f"__generation_checkpoint__:{key}", snap, cp)
        else:
            self._expect_refused(tokens, snap, f"__generation_checkpoint__:{key}", None, cp)
        got = h.find_generation_checkpoint(prompt, key, cache_ns)
        want = self.model.find_generation_checkpoint(prompt, key, cache_ns)
        assert (got and got.id) == (want and want.id)

    @rule(key=st.sampled_from(("req-a", "req-b")), data=st.data())
    def remove_generation_checkpoints(self, key: str, data: st.DataObject) -> None:
        self._handle(data).remove_generation_checkpoints(key)
        self.model.remove_generation_checkpoints(key)

    @rule()
    def reopen(self) -> None:
        for h in self.handles:
            h.close()
        self.handles = [self.open_store(self.fs)]

    @precondition(lambda self: len(self.handles) == 1)
    @rule()
    def open_second_handle(self) -> None:
        self.handles.append(self.open_store(FileLayer()))

    @rule(point=st.sampled_from(CRASH_POINTS), prompt=prompts, data=st.data())
    def crash(self, point: str, prompt: tuple[int, ...], data: st.DataObject) -> None:
        """Die at a named point inside store/remove/gc; abandon the handle, open a new one."""
        self.fs.crash_at(point)
        before = {e.id for e in self.model.entries()}
        pending: tuple[tuple[int, ...], str, Snapshot] | None = None
        try:
            if point.startswith("store:"):
                _, caches = data.draw(caches_for(prompt), label="caches")
                ns = data.draw(namespaces, label="ns")
                pending = (prompt, ns, Snapshot.of(caches, None, len(prompt)))
                if self.store.store(prompt, caches, ns):
                    self.fs.disarm()
                    self._adopt(self.store, prompt, ns, pending[2], None)
                    return
            elif point.startswith("remove:") and len(self.model):
                e = self._entry(data)
                self.store.remove(self._live(self.store, e))
                self.model.remove(e.id)
            else:
                self.clock.advance(GRACE + 1)
                self.store.gc()
        except SimulatedCrash:
            note(f"crashed at {point}")
            self.abandoned.append(self.handles.pop(0))
            for h in self.handles:
                h.close()
            self.handles = [self.open_store(self.fs)]
            self._recover_from_crash(point, before, pending)
        finally:
            self.fs.disarm()

    def _recover_from_crash(self, point: str, before: set[str],
                            pending: tuple[tuple[int, ...], str, Snapshot] | None) -> None:
        """The interrupted operation may have happened or not; nothing else may change."""
        live = {e.id: e for e in self.store.entries()}
        if point == "remove:header-unlinked":
            gone = before - set(live)
            assert len(gone) == 1, f"a crashed remove changed {gone}"
            self.model.remove(gone.pop())
        if pending is not None:
            tokens, ns, snap = pending
            m = _exact(self.store, tokens, ns)
            if m is not None and m.entry.id not in before:
                assert point == "store:header-written", f"entry visible after a crash at {point}"
                self._adopt(self.store, tokens, ns, snap, None)

    @precondition(lambda self: len(self.model) > 0)
    @rule(target_header=st.booleans(), data=st.data())
    def flip_byte(self, target_header: bool, data: st.DataObject) -> None:
        """Bit rot in one block or header: the entries using it may become misses, never wrong data."""
        e = self._entry(data)
        if target_header:
            path = self.store.directory / "entries"
            path = next(p for p in path.rglob(f"{e.id}.bkv"))
            self.damaged_headers.add(e.id)
        else:
            name = data.draw(st.sampled_from(sorted(e.blocks)), label="block")
            path = self.store.directory / "blobs" / name[:2] / name
            self.damaged_blocks.add(name)
        raw = bytearray(path.read_bytes())
        at = data.draw(st.integers(0, len(raw) - 1), label="offset")
        raw[at] ^= data.draw(st.integers(1, 255), label="xor")
        path.write_bytes(bytes(raw))
        note(f"flipped byte {at} of {path.name}")

    @rule(delete=st.booleans())
    def damage_lmdb(self, delete: bool) -> None:
        """Lose the LMDB accelerator (deleted, or garbage in its place): the files
        are the truth, so every entry survives; only last-use order may be lost."""
        for h in self.handles:
            h.close()
        index = self.store.directory / "index"
        if delete:
            shutil.rmtree(index)
        else:
            garbage = index / "data.mdb.garbage"
            garbage.write_bytes(os.urandom(8192))
            os.replace(garbage, index / "data.mdb")
        self.handles = [self.open_store(self.fs)]
        order = sorted(self.store.entries(), key=lambda e: e.last_use)
        self.model.set_lru_order([e.id for e in order if e.id in self.model])

    # -- invariants -------------------------------------------------------------
    @invariant()
    def agrees_with_model(self) -> None:
        self._sync_damaged()
        for h in self.handles:
            assert len(h) == len(self.model), (len(h), len(self.model))
            for e in self.model.entries():
                self._live(h, e)
        assert self.store.total_bytes == self.model.total_bytes
        report = self.store.check()
        assert not report.dangling or set(report.dangling) <= self.damaged_headers | {
            e.id for e in self.model.entries() if set(e.blocks) & self.damaged_blocks}, report.dangling
        low = [(n, idx, truth) for n, idx, truth in report.refcount_mismatches if idx < truth]
        assert not low, f"refcounts below the truth: {low}"
