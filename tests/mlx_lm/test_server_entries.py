"""The entries mlx-lm 0.32.2's server inserts besides a plain prompt's, through
PersistentPromptCache with real caches from real forward passes: a draft
model's caches one token behind the model's, image keys (negative ids), KV
quantised past ``--quantized-kv-start``, snapshots at every segment boundary,
and a store that cannot open yet (a first run still downloading the model)."""

from __future__ import annotations

import copy
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, LRUPromptCache, QuantizedKVCache, make_prompt_cache

from blockkv.format.codec import encode_caches, walk_tensors
from blockkv.mlx_lm.identity import KVQuant
from blockkv.mlx_lm.prompt_cache import RETRY_OPEN_S
from blockkv.model_dir import build_model_dir
from blockkv.testing.models import prefill
from tests.mlx_lm.test_mlx_lm import Model, ShortPromptCache

# a safety bound for the retry wait below (not a speed assertion)
OPEN_BOUND_S = 60.0


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Model:
    return Model(build_model_dir(tmp_path_factory.mktemp("llama") / "model", "llama"))


def _rows(caches: list[Any], n: int | None = None) -> list[np.ndarray]:
    """Every tensor of ``caches`` as the codec reads it, cut to ``n`` tokens if given
    (a QuantizedKVCache's packed values, scales and biases alike)."""
    caches = [_cut(c, n) for c in caches] if n is not None else caches
    return [np.asarray(t.data) for t in walk_tensors(encode_caches(caches)) if t is not None]


def _cut(cache: Any, n: int) -> Any:
    cut = copy.copy(cache)
    cut.trim(cache.offset - n)
    return cut


def _restored(cache: Any, key: Any, tokens: list[int]) -> list[Any]:
    store = cache.store_for(key)
    assert store is not None
    match = store.find_exact(tokens)
    assert match is not None, "not on disk"
    loaded = store.restore(match.entry)
    assert loaded is not None
    return list(loaded.caches)


def _assert_bit_exact(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def test_draft_model_caches_one_token_behind_are_stored_at_their_common_length(
    llama: Model, tmp_path: Path
) -> None:
    """mlx-lm's server appends the draft model's caches to the model's, one token
    behind: the disk keeps what both hold, and a restart restores both at it."""
    draft = Model(build_model_dir(tmp_path / "draft", "llama", seed=3))
    key = (str(llama.root), None, str(draft.root))
    tokens = llama.encode(40, seed=1)
    main, _ = prefill(llama.model, tokens)
    behind, _ = prefill(draft.model, tokens[:-1])
    entry = main + behind
    want = _rows(main, len(tokens) - 1) + _rows(behind)
    with ShortPromptCache(cache_dir=tmp_path / "cache", models=lambda k: [llama.model, draft.model]) as cache:
        cache.insert_cache(key, tokens, entry)
        cache.flush()
        assert cache.tier_stats["spills"] == 1 and cache.tier_stats["spill_failures"] == 0
        assert [c.offset for c in entry] == [len(tokens)] * len(main) + [len(tokens) - 1] * len(behind)  # RAM's own
    with ShortPromptCache(cache_dir=tmp_path / "cache", models=lambda k: [llama.model, draft.model]) as cache:
        restored = _restored(cache, key, tokens[:-1])
        _assert_bit_exact(_rows(restored), want)
        served, rest = cache.fetch_nearest_cache(key, tokens + [5])
        assert served is not None and rest == tokens[-1:] + [5]
        assert {c.offset for c in served} == {len(tokens) - 1}


def test_image_keys_store_their_text_before_the_first_image_only(llama: Model, tmp_path: Path) -> None:
    """An image's KV is never on disk (its key names pixels the tokens do not
    hold): the text before it is, so another image, or the same one after a
    restart, is served that text from disk and never a row past it."""
    text = llama.encode(30, seed=2)
    image_a, image_b = [-1 - (1 << 59)] * 3, [-1 - (1 << 58)] * 3  # two images of one size
    key_a = text[:10] + image_a + text[10:]
    caches, _ = prefill(llama.model, text[:10] + [1, 1, 1] + text[10:])
    want = _rows(caches, 10)
    with ShortPromptCache(cache_dir=tmp_path / "cache") as cache:
        cache.insert_cache(llama.key, key_a, caches)
        cache.flush()
        store = cache.store_for(llama.key)
        assert store is not None
        assert [list(e.token_array) for e in store.entries()] == [text[:10]]
        assert {c.offset for c in caches} == {len(key_a)}  # mlx-lm's RAM entry is untouched
        _assert_bit_exact(_rows(_restored(cache, llama.key, text[:10])), want)
        # the RAM tier serves the image it holds, as in mlx-lm
        assert cache.fetch_nearest_cache(llama.key, key_a + [7])[1] == [7]
    for image in (image_b, image_a):
        with ShortPromptCache(cache_dir=tmp_path / "cache") as cache:
            served, rest = cache.fetch_nearest_cache(llama.key, text[:10] + image + text[10:] + [7])
            assert served is not None and rest == text[9:10] + image + text[10:] + [7]  # the text only
            assert cache.tier_stats["disk_hits"] == 1


def test_a_text_only_entry_beside_an_image_entry_is_whole(llama: Model, tmp_path: Path) -> None:
    """The text of an image prompt is an ordinary entry: a text-only entry it
    begins supersedes it (trimmable caches, as any prefix), and restores whole."""
    text = llama.encode(40, seed=3)
    caches, _ = prefill(llama.model, text)
    with ShortPromptCache(cache_dir=tmp_path / "cache", block_tokens=8) as cache:
        cache.insert_cache(llama.key, text[:16] + [-7, -7] + text[18:], caches)
        cache.flush()
        cache.insert_cache(llama.key, text, caches)
        cache.flush()
        store = cache.store_for(llama.key)
        assert store is not None
        assert [len(e.token_array) for e in store.entries()] == [len(text)]
        _assert_bit_exact(_rows(_restored(cache, llama.key, text)), _rows(caches))
        assert cache.tier_stats["spills"] == 2 and cache.tier_stats["spill_failures"] == 0


def test_quantised_kv_past_the_start_is_stored_and_restored_bit_exact(llama: Model, tmp_path: Path) -> None:
    """--kv-bits with --quantized-kv-start: an entry shorter than the start holds
    KVCache, a longer one QuantizedKVCache; both come back bit for bit in a new
    process, under a store whose identity names the settings."""
    kv = KVQuant(bits=8, group_size=32, start=24)
    short, long = llama.encode(15, seed=4), llama.encode(40, seed=5)
    plain, _ = prefill(llama.model, short)
    full, _ = prefill(llama.model, long)
    quantised = [c.to_quantized(group_size=kv.group_size, bits=kv.bits) for c in full]
    with ShortPromptCache(cache_dir=tmp_path / "cache", kv=kv) as cache:
        cache.insert_cache(llama.key, short, plain)
        cache.insert_cache(llama.key, long, quantised)
    with ShortPromptCache(cache_dir=tmp_path / "cache", kv=kv) as cache:
        for tokens, caches, kind in ((short, plain, KVCache), (long, quantised, QuantizedKVCache)):
            restored = _restored(cache, llama.key, tokens)
            assert {type(c) for c in restored} == {kind}
            _assert_bit_exact(_rows(restored), _rows(caches))
    (directory,) = [d.name for d in (tmp_path / "cache").iterdir() if d.is_dir()]
    assert "_kv-8bit-g32-s24_" in directory


def test_segment_boundary_snapshots_keep_mlx_lms_priorities_and_share_blocks(tmp_path: Path) -> None:
    """mlx-lm's batched server inserts the system, user and whole prompt of one
    request (cache types system/user/assistant): the RAM tier counts and evicts
    them as mlx-lm's own class does; on disk each is an entry (a wrapped
    sliding window cannot be cut back, so none supersedes another) and the
    blocks they share are stored once."""
    gemma = Model(build_model_dir(tmp_path / "gemma3", "gemma3"))  # window 32
    tokens = gemma.encode(60, seed=6)[:48]
    bounds = [(16, "system"), (32, "user"), (48, "assistant")]
    ref = LRUPromptCache(max_size=10)
    with ShortPromptCache(cache_dir=tmp_path / "cache", block_tokens=16) as cache:
        caches, start = make_prompt_cache(gemma.model), 0
        for end, cache_type in bounds:
            prefill(gemma.model, tokens[start:end], cache=caches)
            start = end
            for c in (ref, cache):
                c.insert_cache(gemma.key, tokens[:end], copy.deepcopy(caches), cache_type=cache_type)
            assert cache.stats_by_type() == ref.stats_by_type() and len(cache) == len(ref)
        cache.flush()
        store = cache.store_for(gemma.key)
        assert store is not None
        blocks = {len(e.token_array): e.blocks for e in store.entries()}
        assert sorted(blocks) == [16, 32, 48]
        assert store.block_count == len(set().union(*blocks.values()))
        assert store.block_count < sum(len(b) for b in blocks.values())
        for c in (ref, cache):
            c.trim_to(n_sequences=1)
        assert cache.stats_by_type() == ref.stats_by_type() and cache.stats_by_type()["system"]["n_sequences"] == 1


def test_a_store_that_cannot_open_yet_opens_at_a_later_use(
    llama: Model, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A first run: the model key names a repo whose snapshot is not there yet.
    The open fails (one warning), the model runs RAM-only meanwhile, and once
    the files are there a later use opens the store: nothing is given up."""
    late = tmp_path / "late"
    key = (str(late), None, None)
    tokens = llama.encode(30, seed=7)
    caches, _ = prefill(llama.model, tokens)
    logs = caplog.at_level(logging.INFO, logger="blockkv.mlx_lm.prompt_cache")
    with logs, ShortPromptCache(cache_dir=tmp_path / "cache") as cache:
        assert cache.disk_tier(key) == ("not open yet", None) and cache.store_for(key) is None
        assert cache.disk_tier(key)[0] == "off" and str(late) in str(cache.disk_tier(key)[1])
        cache.insert_cache(key, tokens, caches)
        assert cache.fetch_nearest_cache(key, tokens + [3])[1] == [3]  # RAM-only meanwhile
        shutil.copytree(llama.root, late)
        deadline = time.monotonic() + OPEN_BOUND_S
        while cache.store_for(key) is None:
            assert time.monotonic() < deadline, "the store never opened"
            time.sleep(RETRY_OPEN_S / 4)
        assert cache.disk_tier(key) == ("on", None)
        cache.insert_cache(key, tokens + [3], copy.deepcopy(prefill(llama.model, [3], cache=caches)[0]))
        cache.flush()
        assert cache.tier_stats["spills"] == 1
    assert len([r for r in caplog.records if "RAM-only" in r.getMessage()]) == 1
    assert len([r for r in caplog.records if "opened after" in r.getMessage()]) == 1


def test_an_image_key_over_a_state_that_cannot_be_cut_stays_in_ram(tmp_path: Path) -> None:
    """An SSM's state holds every token of the key, the image's included: no
    prefix of it can be stored, so the entry is the RAM tier's alone."""
    mamba = Model(build_model_dir(tmp_path / "mamba", "mamba"))
    text = mamba.encode(20, seed=8)
    caches, _ = prefill(mamba.model, text)
    with ShortPromptCache(cache_dir=tmp_path / "cache") as cache:
        cache.insert_cache(mamba.key, text[:5] + [-3, -3] + text[7:], caches)
        cache.flush()
        store = cache.store_for(mamba.key)
        assert store is not None and store.entries() == []
        stats = cache.tier_stats
        assert (stats["ram_only_inserts"], stats["spills"], stats["spill_failures"]) == (1, 0, 0)
        assert len(cache) == 1


def test_a_quantised_model_cache_beside_a_draft_one_token_behind_is_one_entry(llama: Model, tmp_path: Path) -> None:
    """--draft-model with --kv-bits: the model's caches crossed the quantised
    start, the draft's (one token behind) not yet, so one entry mixes
    QuantizedKVCache and KVCache; both come back at the common length, bit for bit."""
    draft = Model(build_model_dir(tmp_path / "draft", "llama", seed=3))
    key = (str(llama.root), None, str(draft.root))
    tokens = llama.encode(40, seed=9)
    kv = KVQuant(bits=8, group_size=32, start=len(tokens))
    main = [c.to_quantized(group_size=kv.group_size, bits=kv.bits) for c in prefill(llama.model, tokens)[0]]
    behind, _ = prefill(draft.model, tokens[:-1])
    want = _rows(main, len(tokens) - 1) + _rows(behind)
    with ShortPromptCache(cache_dir=tmp_path / "cache", kv=kv) as cache:
        cache.insert_cache(key, tokens, main + behind)
    with ShortPromptCache(cache_dir=tmp_path / "cache", kv=kv,
                          models=lambda k: [llama.model, draft.model]) as cache:
        restored = _restored(cache, key, tokens[:-1])
        assert [type(c) for c in restored] == [QuantizedKVCache] * len(main) + [KVCache] * len(behind)
        _assert_bit_exact(_rows(restored), want)
        served, rest = cache.fetch_nearest_cache(key, tokens + [5])
        assert served is not None and rest == tokens[-1:] + [5] and cache.tier_stats["misfits"] == 0
