"""PersistentPromptCache with real mlx-lm models, real generation and a real store:
a new instance on the same directory (a restart) reuses what the old one stored,
and greedy output is identical to a cold run."""

from __future__ import annotations

import copy
import errno
import logging
import random
import shutil
import threading
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

from blockkv.format.header import Header, decode_header, encode_header
from blockkv.fs import Buffer, FileLayer
from blockkv.mlx_lm import PersistentPromptCache
from blockkv.mlx_lm.budget import DiskShare
from blockkv.mlx_lm.demo import Agent
from blockkv.mlx_lm.identity import KVQuant
from blockkv.model_dir import build_model_dir, sample_text
from blockkv.testing.faults import FaultyFileLayer
from blockkv.testing.models import prefill

MAX_TOKENS = 8
# Most tests here use prompts shorter than one block (256 tokens) to stay fast;
# restoring those is what they test, so they lower the minimum restore length.
ShortPromptCache = partial(PersistentPromptCache, min_restore_tokens=1)
STALL_BOUND_S = 120.0  # a safety bound so a blocking insert fails the test instead of hanging it


class Model:
    """A tiny model directory, loaded, with a greedy agent on its server-style key."""

    def __init__(self, root: Path) -> None:
        self.root = root
        loaded = mlx_lm.load(str(root))
        self.model, self.tokenizer = loaded[0], loaded[1]
        self.key = (str(root), None, None)
        self.agent = Agent(self.model, self.tokenizer, self.key, MAX_TOKENS)

    def encode(self, words: int, seed: int) -> list[int]:
        return list(self.tokenizer.encode(sample_text(words, seed=seed)))


@pytest.fixture(scope="module", params=["llama", "gemma3", "mamba"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Model:
    return Model(build_model_dir(tmp_path_factory.mktemp(request.param) / "model", request.param))


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Model:
    return Model(build_model_dir(tmp_path_factory.mktemp("llama") / "model", "llama"))


@pytest.fixture
def cache_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "cache"


def _live_kv(caches: list[Any]) -> list[np.ndarray]:
    """The live rows of each KVCache (its buffers run past ``offset``)."""
    return [np.array(a[..., : c.offset, :]) for c in caches for a in (c.keys, c.values)]


def test_is_an_lru_prompt_cache(cache_dir: Path) -> None:
    with PersistentPromptCache(3, cache_dir=cache_dir) as cache:
        assert isinstance(cache, LRUPromptCache)
        assert cache.max_size == 3 and len(cache) == 0 and cache.nbytes == 0


def test_restart_reuses_the_stored_prefix_with_identical_output(llama: Model, cache_dir: Path) -> None:
    """The library acceptance test: generate, drop, reopen, and the next chat
    with the same system prompt prefills only what is new."""
    system = {"role": "system", "content": sample_text(120, seed=1)}
    first = [system, {"role": "user", "content": sample_text(10, seed=2)}]
    second = [system, {"role": "user", "content": sample_text(12, seed=3)}]
    with ShortPromptCache(cache_dir=cache_dir) as cache:
        llama.agent.ask(first, cache)
    del cache
    with ShortPromptCache(cache_dir=cache_dir) as cache:
        warm = llama.agent.ask(second, cache)
        stats = cache.tier_stats
    cold = llama.agent.ask(second, None)
    system_tokens = len(llama.tokenizer.apply_chat_template([system]))
    assert stats["disk_hits"] == 1 and stats["ram_hits"] == 0
    assert warm.from_disk >= system_tokens
    assert warm.prefilled < cold.prefilled == cold.prompt_tokens
    assert warm.generated == cold.generated


def test_exact_boundary_reuse_for_every_cache_kind(tiny: Model, cache_dir: Path) -> None:
    """A conversation's next turn resumes at the stored entry's end, for KVCache,
    RotatingKVCache (window 32, wrapped) and ArraysCache alike."""
    prompt = tiny.encode(100, seed=4)
    with ShortPromptCache(cache_dir=cache_dir) as cache:
        first = tiny.agent.ask_tokens(prompt, cache)
    follow_up = prompt + first.generated + tiny.encode(6, seed=5)
    with ShortPromptCache(cache_dir=cache_dir) as cache:
        warm = tiny.agent.ask_tokens(follow_up, cache)
    cold = tiny.agent.ask_tokens(follow_up, None)
    assert warm.from_disk == len(prompt) + len(first.generated)
    assert warm.generated == cold.generated


def test_only_trimmable_caches_are_cut_on_a_divergent_prompt(tiny: Model, cache_dir: Path) -> None:
    """A prompt that leaves the stored entry midway reuses the common prefix only
    if every layer can be trimmed (mlx-lm's rule): a wrapped sliding window or
    an SSM state cannot be rewound, so those reuse nothing here."""
    shared = tiny.encode(80, seed=6)
    with ShortPromptCache(cache_dir=cache_dir) as cache:
        tiny.agent.ask_tokens(shared + tiny.encode(10, seed=7), cache)
    divergent = shared + tiny.encode(10, seed=8)
    with ShortPromptCache(cache_dir=cache_dir) as cache:
        warm = tiny.agent.ask_tokens(divergent, cache)
    cold = tiny.agent.ask_tokens(divergent, None)
    trimmable = tiny.model.model_type == "llama"  # gemma3's window (32) has wrapped by 80 tokens
    common = next(i for i, (a, b) in enumerate(zip(shared + tiny.encode(10, seed=7), divergent)) if a != b)
    assert warm.from_disk == (common if trimmable else 0)
    assert warm.generated == cold.generated


def test_system_segment_entries_serve_new_conversations(tiny: Model, cache_dir: Path) -> None:
    """mlx-lm's server inserts a cache at the end of the system prompt
    (cache_type="system"); after a restart any new conversation with that system
    prompt restores exactly it, whatever the cache kind."""
    system = tiny.encode(90, seed=9)
    caches, _ = _prefill(tiny, system)
    with ShortPromptCache(cache_dir=cache_dir) as cache:
        cache.insert_cache(tiny.key, system, caches, cache_type="system")
        assert cache.stats_by_type()["system"]["n_sequences"] == 1
    prompt = system + tiny.encode(7, seed=10)
    with ShortPromptCache(cache_dir=cache_dir) as cache:
        warm = tiny.agent.ask_tokens(prompt, cache)
    cold = tiny.agent.ask_tokens(prompt, None)
    assert warm.from_disk == len(system)
    assert warm.generated == cold.generated


def test_a_prompt_segment_waits_for_the_final_cache_that_supersedes_it(tiny: Model, cache_dir: Path) -> None:
    """mlx-lm's batched server inserts the prompt but its last token
    (cache_type="user"), then the prompt and its answer: a trimmable final
    cache supersedes the segment, which is then never written; an untrimmable
    one (mamba) does not, and both are. Either way the disk serves the segment's
    prefix, and a flush writes a segment no final cache followed."""
    prompt = tiny.encode(60, seed=31)
    caches, logits = _prefill(tiny, prompt[:-1])
    with ShortPromptCache(cache_dir=cache_dir) as cache:
        cache.insert_cache(tiny.key, prompt[:-1], copy.deepcopy(caches), cache_type="user")
        assert cache.tier_stats["spills"] == 0  # held
        answer = [prompt[-1], *(int(t) for t in mx.argmax(logits[0, -3:], axis=-1).tolist())]
        tiny.model(mx.array(answer)[None], cache=caches)
        mx.eval([c.state for c in caches])
        final = prompt + answer[1:]
        cache.insert_cache(tiny.key, final, caches, cache_type="assistant")
        cache.flush()
        store = cache.store_for(tiny.key)
        assert store is not None
        superseded = cache.tier_stats["spills_superseded"]
        assert cache.tier_stats["spills"] + superseded == 2
        assert len(store) == 2 - superseded  # what the store's rule would have removed was never written
        assert superseded == all(c.is_trimmable() for c in caches)
        match = store.find(prompt[:-1] + [prompt[-1] + 1])
        assert match is not None and match.prefix_len == len(prompt) - 1
        other = tiny.encode(40, seed=32)
        cache.insert_cache(tiny.key, other, _prefill(tiny, other)[0], cache_type="system")
        cache.flush()
        assert cache.tier_stats["spills"] + superseded == 3 and store.find_exact(other) is not None


def _prefill(m: Model, tokens: list[int]) -> tuple[list[Any], mx.array]:
    caches = make_prompt_cache(m.model)
    logits = m.model(mx.array(tokens)[None], cache=caches)
    mx.eval(logits, [c.state for c in caches])
    return caches, logits


def test_ram_hit_wins_over_disk_and_disk_serves_after_trim(llama: Model, cache_dir: Path) -> None:
    prompt = llama.encode(60, seed=11)
    with ShortPromptCache(cache_dir=cache_dir) as cache:
        first = llama.agent.ask_tokens(prompt, cache)
        follow_up = prompt + first.generated + llama.encode(5, seed=12)
        from_ram = llama.agent.ask_tokens(follow_up, cache)
        assert from_ram.from_ram == len(prompt) + len(first.generated) and from_ram.from_disk == 0
        assert len(cache) == 1 and cache.nbytes > 0  # mlx-lm dropped the trimmable prefix entry
        cache.trim_to(n_bytes=0)
        assert len(cache) == 0 and cache.nbytes == 0
        cache.flush()
        again = llama.agent.ask_tokens(follow_up + from_ram.generated + [1], cache)
        assert again.from_disk == len(follow_up) + len(from_ram.generated)
        assert cache.tier_stats["spills"] >= 2


def test_spill_is_a_snapshot_taken_at_insert(llama: Model, cache_dir: Path) -> None:
    """Write-behind must write the cache as inserted, not as the caller changed it later."""
    tokens = llama.encode(50, seed=13)
    caches, _ = _prefill(llama, tokens)
    expected = _live_kv(caches)
    with ShortPromptCache(cache_dir=cache_dir) as cache:
        cache.insert_cache(llama.key, tokens, caches)
        for c in caches:  # keep using the object, as a server would
            c.trim(10)
        llama.model(mx.array(llama.encode(30, seed=14))[None], cache=caches)
        mx.eval([c.state for c in caches])
    with ShortPromptCache(cache_dir=cache_dir) as cache:
        store = cache.store_for(llama.key)
        assert store is not None
        match = store.find_exact(tokens)
        assert match is not None
        loaded = store.restore(match.entry)
        assert loaded is not None
        restored = _live_kv(loaded.caches)
    assert len(restored) == len(expected)
    for a, b in zip(restored, expected):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def test_models_and_kv_quantisation_never_share_entries(llama: Model, tmp_path: Path, cache_dir: Path) -> None:
    other = Model(build_model_dir(tmp_path / "other", "llama", seed=1))
    prompt = llama.encode(40, seed=15)
    with ShortPromptCache(cache_dir=cache_dir) as cache:
        llama.agent.ask_tokens(prompt, cache)
    probe = prompt + [1, 2, 3]
    with ShortPromptCache(cache_dir=cache_dir) as cache:
        assert other.agent.ask_tokens(probe, cache).from_disk == 0
    with ShortPromptCache(cache_dir=cache_dir, kv=KVQuant(bits=8)) as cache:
        assert llama.agent.ask_tokens(probe, cache).from_disk == 0
    with ShortPromptCache(cache_dir=cache_dir) as cache:
        assert llama.agent.ask_tokens(probe, cache).from_disk > 0


def test_a_restored_cache_that_does_not_fit_the_model_is_a_miss(
        llama: Model, tmp_path: Path, cache_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An entry of two KV heads planted under a one-head model's identity: with
    ``models=``, the fetch that matches it is a miss with one warning, never
    that cache in mlx-lm's hands; an entry that fits is restored as before."""
    wide = mlx_lm.load(str(build_model_dir(tmp_path / "wide", "llama", overrides={"num_key_value_heads": 2})))[0]
    planted, good = llama.encode(40, seed=16), llama.encode(40, seed=17)
    with ShortPromptCache(cache_dir=cache_dir) as cache:
        store = cache.store_for(llama.key)
        assert store is not None
        assert store.store(planted, prefill(wide, planted)[0])
        assert store.store(good, _prefill(llama, good)[0])

    def loaded(key: Any) -> list[Any] | None:
        return [llama.model] if key == llama.key else None

    with caplog.at_level(logging.WARNING, logger="blockkv"), \
            ShortPromptCache(cache_dir=cache_dir, models=loaded) as cache:
        for _ in range(2):
            assert cache.fetch_nearest_cache(llama.key, planted + [1]) == (None, planted + [1])
        found, rest = cache.fetch_nearest_cache(llama.key, good + [1])
        assert found is not None and rest == [1]
        assert cache.tier_stats["misfits"] == 2 and cache.tier_stats["disk_hits"] == 1
    assert len([r for r in caplog.records if "does not fit the model" in r.getMessage()]) == 1


def test_a_planted_header_whose_tokens_outrun_its_caches_is_a_miss(llama: Model, cache_dir: Path) -> None:
    """A header rewritten (valid digest) to name 20 more tokens than its caches
    hold: served, mlx-lm would skip those 20 tokens of the prompt."""
    tokens = llama.encode(40, seed=18)
    longer = tokens + llama.encode(20, seed=19)
    with ShortPromptCache(cache_dir=cache_dir) as cache:
        store = cache.store_for(llama.key)
        assert store is not None and store.store(tokens, _prefill(llama, tokens)[0])
        (path,) = (store.directory / "entries").rglob(f"{store.entries()[0].id}.bkv")
    header = decode_header(path.read_bytes())
    path.write_bytes(encode_header(Header(header.identity, header.ns, np.asarray(longer, np.uint32),
                                          header.descriptor)))
    shutil.rmtree(store.directory / "index")  # the next open rebuilds it from the headers, the planted one too
    with ShortPromptCache(cache_dir=cache_dir) as cache:
        assert cache.fetch_nearest_cache(llama.key, longer + [1]) == (None, longer + [1])
        assert cache.tier_stats["misfits"] == 1


def test_unopenable_cache_dir_degrades_to_ram_only(
    llama: Model, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    prompt = llama.encode(30, seed=16)
    with caplog.at_level(logging.WARNING, logger="blockkv.mlx_lm.prompt_cache"):
        with ShortPromptCache(cache_dir=blocker / "cache") as cache:
            first = llama.agent.ask_tokens(prompt, cache)
            again = llama.agent.ask_tokens(prompt + first.generated + [1], cache)
            assert cache.store_for(llama.key) is None
    assert again.from_ram == len(prompt) + len(first.generated)
    assert len([r for r in caplog.records if "RAM-only" in r.getMessage()]) == 1


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="cache_dir"):
        PersistentPromptCache(cache_dir=3)  # type: ignore[arg-type]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="cache_bytes"):
            PersistentPromptCache(cache_dir=tmp_path, cache_bytes=bad)  # type: ignore[arg-type]
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="min_restore_tokens"):
            PersistentPromptCache(cache_dir=tmp_path, min_restore_tokens=bad)  # type: ignore[arg-type]


def test_a_key_no_identity_can_be_made_for_runs_ram_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """mlx-lm's cache takes any hashable model key; the drop-in does too, and a
    key that names no model directory only costs that key its disk tier."""
    with caplog.at_level(logging.WARNING, logger="blockkv.mlx_lm.prompt_cache"):
        with PersistentPromptCache(cache_dir=tmp_path) as cache:
            cache.insert_cache(12345, [1, 2, 3], [MockCache("abc")])
            assert cache.fetch_nearest_cache(12345, [1, 2, 3, 4]) == ([MockCache("abc")], [4])
            assert cache.store_for(12345) is None
    assert [r for r in caplog.records if "RAM-only" in r.getMessage() and "12345" in r.getMessage()]


class GatedFileLayer(FileLayer):
    """Real writes that wait for ``gate`` once ``armed``: a disk that stalls."""

    def __init__(self) -> None:
        self.armed = False
        self.gate = threading.Event()
        self.waiting = threading.Event()

    def write(self, fd: int, buffers: Sequence[Buffer]) -> int:
        if self.armed:
            self.waiting.set()
            self.gate.wait()
        return super().write(fd, buffers)


def test_a_stalled_disk_never_blocks_insert_or_fetch(llama: Model, cache_dir: Path) -> None:
    fs = GatedFileLayer()
    prompt = llama.encode(40, seed=17)
    caches, _ = _prefill(llama, prompt)
    with ShortPromptCache(cache_dir=cache_dir, fs=fs) as cache:
        assert cache.store_for(llama.key) is not None
        fs.armed = True
        served: list[Any] = []

        def request() -> None:
            cache.insert_cache(llama.key, prompt, caches)
            served.append(cache.fetch_nearest_cache(llama.key, prompt + [1]))

        worker = threading.Thread(target=request)
        worker.start()
        try:
            assert fs.waiting.wait(STALL_BOUND_S)  # the spill reached the stalled disk...
            worker.join(STALL_BOUND_S)
            assert not worker.is_alive()  # ...and the request finished regardless
            assert cache.tier_stats["pending_spills"] == 1
            ((_, rest),) = served
            assert rest == [1]  # served from RAM meanwhile
        finally:
            fs.armed = False
            fs.gate.set()
    assert cache.tier_stats["spills"] == 1 and cache.tier_stats["pending_spills"] == 0
    with ShortPromptCache(cache_dir=cache_dir) as cache:
        assert llama.agent.ask_tokens(prompt + [1], cache).from_disk == len(prompt)


def test_disk_full_degrades_to_not_stored(
    llama: Model, cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fs = FaultyFileLayer()
    prompt = llama.encode(40, seed=18)
    with caplog.at_level(logging.WARNING):
        with ShortPromptCache(cache_dir=cache_dir, fs=fs) as cache:
            assert cache.store_for(llama.key) is not None
            fs.fail("write", err=errno.ENOSPC, times=1 << 20)
            first = llama.agent.ask_tokens(prompt, cache)
            cache.flush()
            again = llama.agent.ask_tokens(prompt + first.generated + [1], cache)
            cache.flush()
            fs.disarm()
    assert cache.tier_stats["spill_failures"] == 2 and cache.tier_stats["spills"] == 0
    assert again.from_ram == len(prompt) + len(first.generated)  # RAM tier unaffected
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) >= 1
    with ShortPromptCache(cache_dir=cache_dir) as cache:
        assert llama.agent.ask_tokens(prompt + [1], cache).from_disk == 0


# -- the RAM tier is mlx-lm's LRUPromptCache, whatever the disk tier does -----------------


class MockCache:
    """mlx-lm's own test double for its LRUPromptCache: any object with
    ``nbytes``/``is_trimmable``/``trim``. blockkv has no codec for it."""

    def __init__(self, value: str, is_trimmable: bool = True) -> None:
        self.value = value
        self._is_trimmable = is_trimmable

    @property
    def nbytes(self) -> int:
        return len(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MockCache) and other.value == self.value

    def is_trimmable(self) -> bool:
        return self._is_trimmable

    def trim(self, n: int) -> int:
        assert self._is_trimmable
        return n


class OtherMockCache(MockCache):
    """A second class blockkv cannot encode (a subclass has no codec either)."""


LRUFactory = Callable[..., LRUPromptCache]


@pytest.fixture(params=["mlx-lm", "blockkv, no identity for the key", "blockkv, disk tier live"])
def lru(request: pytest.FixtureRequest, llama: Model, tmp_path: Path) -> Iterator[tuple[LRUFactory, Any]]:
    """(make a cache, model key): mlx-lm's LRUPromptCache itself, then the drop-in
    with a key that gets no store and with the key of a real model directory, so
    every insert also reaches a live store (which cannot encode MockCache)."""
    made: list[PersistentPromptCache] = []

    def persistent(**kw: Any) -> PersistentPromptCache:
        made.append(PersistentPromptCache(cache_dir=tmp_path / "cache", **kw))
        return made[-1]

    if request.param == "mlx-lm":
        yield LRUPromptCache, ("test", None, None)
    elif request.param == "blockkv, no identity for the key":
        yield persistent, ("test", None, None)
    else:
        yield persistent, llama.key
        assert all(c.store_for(llama.key) is not None for c in made)
    for c in made:
        c.close()


def test_lru_order_and_cache_types(lru: tuple[LRUFactory, Any]) -> None:
    """mlx-lm's test_lru: exact, shorter and longer (trimmed) hits; the least
    recently inserted entry goes first; assistant entries before user ones."""
    make, model = lru
    cache = make(max_size=2)
    cache.insert_cache(model, [1, 2], [MockCache("test1")])
    cache.insert_cache(model, [2, 3], [MockCache("test2")])
    assert cache.fetch_nearest_cache(model, [1, 2]) == ([MockCache("test1")], [])
    assert cache.fetch_nearest_cache(model, [1]) == ([MockCache("test1")], [1])
    assert cache.fetch_nearest_cache(model, [1, 3, 4]) == ([MockCache("test1")], [3, 4])
    assert cache.fetch_nearest_cache(model, [2, 3, 4]) == ([MockCache("test2")], [4])
    assert cache.fetch_nearest_cache(model, [2, 4, 5]) == ([MockCache("test2")], [4, 5])

    cache.insert_cache(model, [1, 2], [MockCache("test1")])
    cache.insert_cache(model, [2, 3], [MockCache("test2")])
    cache.insert_cache(model, [3, 4], [MockCache("test3")])
    assert cache.fetch_nearest_cache(model, [1, 2]) == (None, [1, 2])
    assert cache.fetch_nearest_cache(model, [2, 3]) == ([MockCache("test2")], [])
    assert cache.fetch_nearest_cache(model, [3, 4]) == ([MockCache("test3")], [])

    cache.insert_cache(model, [4, 5], [MockCache("test4")], cache_type="user")
    assert cache.fetch_nearest_cache(model, [2, 3]) == (None, [2, 3])
    assert cache.fetch_nearest_cache(model, [3, 4]) == ([MockCache("test3")], [])
    assert cache.fetch_nearest_cache(model, [4, 5]) == ([MockCache("test4")], [])

    cache.insert_cache(model, [5, 6], [MockCache("test5")])
    cache.insert_cache(model, [6, 7], [MockCache("test6")])
    assert cache.fetch_nearest_cache(model, [5, 6]) == (None, [5, 6])
    assert cache.fetch_nearest_cache(model, [6, 7]) == ([MockCache("test6")], [])
    assert cache.fetch_nearest_cache(model, [4, 5]) == ([MockCache("test4")], [])
    assert cache.stats_by_type() == {
        "assistant": {"n_sequences": 1, "n_bytes": 5},
        "user": {"n_sequences": 1, "n_bytes": 5},
        "system": {"n_sequences": 0, "n_bytes": 0},
    }


def test_trimmable_insert_removes_prefixes_untrimmable_keeps_them(lru: tuple[LRUFactory, Any]) -> None:
    make, model = lru
    cache = make(max_size=10)
    cache.insert_cache(model, [1, 2], [MockCache("ab")])
    cache.insert_cache(model, [1, 2, 3], [MockCache("abc")])
    assert (len(cache), cache.nbytes) == (1, 3)
    cache.insert_cache(model, [1, 2, 3, 4], [MockCache("abcd", is_trimmable=False)])
    assert (len(cache), cache.nbytes) == (2, 7)
    # an untrimmable longer entry is never cut: the shorter one serves
    assert cache.fetch_nearest_cache(model, [1, 2, 3, 9]) == ([MockCache("abc")], [9])


def test_empty_token_lists(lru: tuple[LRUFactory, Any]) -> None:
    make, model = lru
    cache = make(max_size=10)
    cache.insert_cache(model, [], [MockCache("root")])
    assert (len(cache), cache.nbytes) == (1, 4)
    assert cache.fetch_nearest_cache(model, []) == ([MockCache("root")], [])
    cache.insert_cache(model, [1], [MockCache("a")])  # trimmable: pops the empty prefix
    assert cache.fetch_nearest_cache(model, []) == (None, [])


def test_byte_cap_and_trim_to(lru: tuple[LRUFactory, Any]) -> None:
    make, model = lru
    cache = make(max_size=100, max_bytes=10)
    for tokens, value in (([1, 2], "aaa"), ([3, 4], "bbb"), ([4, 5], "ccc"), ([6, 7], "ddd")):
        cache.insert_cache(model, tokens, [MockCache(value)])
    assert (len(cache), cache.nbytes) == (3, 9)
    cache.trim_to(n_bytes=7)
    assert (len(cache), cache.nbytes) == (2, 6)
    assert cache.fetch_nearest_cache(model, [1, 2]) == (None, [1, 2])
    assert cache.fetch_nearest_cache(model, [3, 4]) == (None, [3, 4])
    cache.trim_to(n_sequences=0)
    assert (len(cache), cache.nbytes) == (0, 0)


def test_random_operations_match_lru_prompt_cache_step_by_step(llama: Model, tmp_path: Path) -> None:
    """Every answer, size and count of the drop-in equals mlx-lm's on a long
    random mix of inserts (both trimmabilities, every cache type), fetches and
    trims, with the disk tier live on the same key."""
    rng = random.Random(7)
    model = llama.key
    ref = LRUPromptCache(max_size=6, max_bytes=60)
    with PersistentPromptCache(6, 60, cache_dir=tmp_path / "cache") as ours:
        for step in range(400):
            tokens = [rng.randrange(3) for _ in range(rng.randrange(0, 7))]
            op = rng.random()
            if op < 0.45:
                value = "x" * rng.randrange(1, 12)
                cache_type = rng.choice(["assistant", "user", "system"])
                kind = rng.choice([MockCache, OtherMockCache])
                trimmable = rng.random() < 0.7
                for c in (ref, ours):
                    c.insert_cache(model, list(tokens), [kind(value, trimmable)], cache_type=cache_type)
            elif op < 0.95:
                assert ours.fetch_nearest_cache(model, list(tokens)) == ref.fetch_nearest_cache(model, list(tokens)), step
            else:
                n = rng.randrange(0, 5)
                for c in (ref, ours):
                    c.trim_to(n_sequences=n)
            assert (len(ours), ours.nbytes, ours.stats_by_type()) == (len(ref), ref.nbytes, ref.stats_by_type()), step
        assert ours.store_for(model) is not None and ours.tier_stats["spill_failures"] == 0


def test_unencodable_caches_stay_in_ram_with_one_warning_per_class(
    llama: Model, cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tokens = llama.encode(40, seed=20)
    real, _ = _prefill(llama, tokens)
    with caplog.at_level(logging.DEBUG, logger="blockkv.mlx_lm.prompt_cache"):
        with ShortPromptCache(cache_dir=cache_dir) as cache:
            for i in range(3):
                cache.insert_cache(llama.key, tokens + [i], [MockCache("abc")])
                cache.insert_cache(llama.key, tokens + [i, 1], [*real, OtherMockCache("abcd")])
            cache.insert_cache(llama.key, tokens, real)  # an encodable list still spills
            cache.flush()
            assert len(cache.store_for(llama.key) or []) == 1
            stats = cache.tier_stats
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sorted(w for w in warnings if "no codec" in w) == [
        "blockkv: no codec for cache class MockCache; such entries stay in the RAM tier only",
        "blockkv: no codec for cache class OtherMockCache; such entries stay in the RAM tier only",
    ]
    assert stats["ram_only_inserts"] == 6 and stats["spills"] == 1 and stats["spill_failures"] == 0


def test_the_disk_tier_never_raises_into_the_caller(
    llama: Model, cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An identity that fails, and a store whose reads all fail: requests are
    still served from RAM, with a warning, never an exception."""

    def broken_identity(key: Any) -> Any:
        raise RuntimeError("model directory vanished")

    prompt = llama.encode(40, seed=21)
    with caplog.at_level(logging.WARNING):
        with ShortPromptCache(cache_dir=cache_dir, identity=broken_identity) as cache:
            first = llama.agent.ask_tokens(prompt, cache)
            again = llama.agent.ask_tokens(prompt + first.generated + [1], cache)
        assert again.from_ram == len(prompt) + len(first.generated)
        with ShortPromptCache(cache_dir=cache_dir) as cache:
            llama.agent.ask_tokens(prompt, cache)
        fs = ExplodingFileLayer()
        with ShortPromptCache(cache_dir=cache_dir, fs=fs) as cache:
            assert cache.store_for(llama.key) is not None
            fs.armed = True
            miss = llama.agent.ask_tokens(prompt + [1], cache)
            cache.flush()
            fs.armed = False
            assert cache.tier_stats["spill_failures"] == 1
    assert miss.from_disk == 0 and miss.prefilled == len(prompt) + 1
    assert any("vanished" in r.getMessage() for r in caplog.records)
    assert any("fell off" in r.getMessage() for r in caplog.records)


class ExplodingFileLayer(FileLayer):
    """Once ``armed``, every read and write fails with an error no layer expects."""

    armed = False

    def _explode(self) -> None:
        if self.armed:
            raise RuntimeError("the disk controller fell off")

    def read(self, path: Path, limit: int | None = None) -> bytes:
        self._explode()
        return super().read(path, limit)

    def read_into(self, path: Path, buffer: bytearray) -> memoryview:
        self._explode()
        return super().read_into(path, buffer)

    def write(self, fd: int, buffers: Sequence[Buffer]) -> int:
        self._explode()
        return super().write(fd, buffers)


def test_empty_cache_is_truthy(cache_dir: Path) -> None:
    with PersistentPromptCache(cache_dir=cache_dir) as cache:
        assert len(cache) == 0 and bool(cache)


# -- a disk hit warms the RAM tier; short disk matches are not worth a read ----------------


def test_a_disk_hit_warms_the_ram_tier_for_the_next_session(tiny: Model, cache_dir: Path) -> None:
    """After a restart the first new session with a known system prompt reads it
    from disk; the second finds it in RAM. Both answer as a cold prefill does."""
    system = tiny.encode(300, seed=22)  # longer than the default minimum (one block)
    caches, _ = _prefill(tiny, system)
    with PersistentPromptCache(cache_dir=cache_dir) as cache:
        cache.insert_cache(tiny.key, system, caches, cache_type="system")
    with PersistentPromptCache(cache_dir=cache_dir) as cache:
        first = tiny.agent.ask_tokens(system + tiny.encode(6, seed=23), cache)
        after_first = cache.tier_stats
        second_prompt = system + tiny.encode(7, seed=24)
        second = tiny.agent.ask_tokens(second_prompt, cache)
        after_second = cache.tier_stats
    assert first.from_disk == len(system) and first.from_ram == 0
    assert after_first["disk_hits"] == 1 and after_first["promoted_to_ram"] == 1
    assert second.from_disk == 0 and second.from_ram >= len(system)
    assert after_second["disk_hits"] == 1 and after_second["ram_hits"] == 1
    assert second.generated == tiny.agent.ask_tokens(second_prompt, None).generated
    assert first.generated == tiny.agent.ask_tokens(system + tiny.encode(6, seed=23), None).generated


def test_disk_matches_shorter_than_the_minimum_are_not_restored(llama: Model, cache_dir: Path) -> None:
    stored = llama.encode(100, seed=25)
    assert 90 < len(stored) < 128
    caches, _ = _prefill(llama, stored)
    with ShortPromptCache(cache_dir=cache_dir) as cache:
        cache.insert_cache(llama.key, stored, caches)
    prompt = stored + [5, 6]
    with PersistentPromptCache(cache_dir=cache_dir, block_tokens=128) as cache:
        assert cache.min_restore_tokens == 128  # the default: one block
        assert cache.fetch_nearest_cache(llama.key, prompt) == (None, prompt)
        assert cache.tier_stats["disk_hits"] == 0 and cache.tier_stats["misses"] == 1
    with PersistentPromptCache(cache_dir=cache_dir, min_restore_tokens=len(stored) + 1) as cache:
        assert cache.fetch_nearest_cache(llama.key, prompt) == (None, prompt)
    with PersistentPromptCache(cache_dir=cache_dir, min_restore_tokens=len(stored)) as cache:
        _, rest = cache.fetch_nearest_cache(llama.key, prompt)
        assert rest == [5, 6] and cache.tier_stats["disk_hits"] == 1
    # Against a RAM hit, a restore must save one token per 16 it reads: a near tie
    # is served from RAM even with no minimum length at all.
    for ram_len, rest, stats in ((len(stored) - 3, prompt[len(stored) - 3 :], (1, 0)), (60, [5, 6], (0, 1))):
        head, _ = _prefill(llama, stored[:ram_len])
        with PersistentPromptCache(cache_dir=cache_dir, min_restore_tokens=1) as cache:
            cache.insert_cache(llama.key, stored[:ram_len], head)
            assert cache.fetch_nearest_cache(llama.key, prompt)[1] == rest
            assert (cache.tier_stats["ram_hits"], cache.tier_stats["disk_hits"]) == stats


def test_a_share_of_the_disk_caps_each_store_as_the_disk_fills(llama: Model, cache_dir: Path) -> None:
    """``DiskShare``: the cap is the share of what the store holds plus the free
    space under the root, read again at each store, and never below the floor
    (here a share too small to matter: the floor is the cap, and the store
    evicts to it)."""
    share = DiskShare(0.25)
    with ShortPromptCache(cache_dir=cache_dir, cache_bytes=share) as cache:
        llama.agent.ask_tokens(llama.encode(60, seed=21), cache)
        cache.flush()
        (store,) = cache.stores()
        held = store.total_bytes
        low = share.cap(cache_dir, held)  # other jobs write to this disk meanwhile: the cap moves with them
        cap = store.max_bytes
        high = share.cap(cache_dir, held)
        assert held > 0 and min(low, high) <= cap <= max(low, high)
    tiny_floor = 64 << 10
    with ShortPromptCache(cache_dir=cache_dir / "small", cache_bytes=DiskShare(1e-12, floor=tiny_floor)) as cache:
        for seed in range(30, 36):
            llama.agent.ask_tokens(llama.encode(60, seed=seed), cache)
        cache.flush()
        (store,) = cache.stores()
        assert store.max_bytes == tiny_floor and 0 < store.total_bytes <= tiny_floor
        assert len(store) < cache.tier_stats["spills"]  # it stored more than the floor holds, and evicted to it
    with pytest.raises(ValueError, match="share of the disk"):
        DiskShare(1.5)
