"""Caller mistakes are refused with a ValueError/TypeError naming the problem,
and nothing is stored; reserved namespaces cannot be named; mx.array tokens
work wherever tokens do; ``~`` is expanded in every path a user passes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from blockkv import BlockStore, GenerationCheckpoint, list_fingerprints
from blockkv.arguments import MAX_NS_BYTES
from blockkv.store import CHECKPOINT_NS
from blockkv.testing.models import prefill, random_tokens, tiny_model

IDENT = dict(model_id="m", config_fingerprint="fp", tokenizer_hash="t", max_bytes=1 << 30)
N = 30


@pytest.fixture(scope="module")
def filled() -> tuple[list[int], list[Any]]:
    tokens = random_tokens(N, seed=5)
    cache, _ = prefill(tiny_model("llama"), tokens)
    return tokens, cache


def _nothing_stored(s: BlockStore) -> None:
    assert len(s) == 0
    assert not [p for p in s.directory.rglob("*") if p.is_file() and ("entries" in p.parts or "blobs" in p.parts)]


@pytest.mark.parametrize("count", [N - 5, N + 5, 1])
def test_token_count_differing_from_the_caches_is_refused(
    tmp_path: Path, filled: tuple[list[int], list[Any]], count: int
) -> None:
    tokens, cache = filled
    wrong = (tokens * 2)[:count]
    with BlockStore(tmp_path, **IDENT) as s:
        with pytest.raises(ValueError, match=rf"{count} tokens but the caches hold {N}"):
            s.store(wrong, cache)
        with pytest.raises(ValueError, match="tokens but the caches hold"):
            s.store_async(wrong, cache)  # refused on the caller's thread, not in the future
        with pytest.raises(ValueError, match="tokens but the caches hold"):
            s.store_generation_checkpoint(wrong, cache, GenerationCheckpoint("k", 1))
        _nothing_stored(s)
        assert s.store(tokens, cache)


def test_caches_without_a_token_count_take_any_length(tmp_path: Path) -> None:
    tokens = random_tokens(12, seed=6)
    cache, _ = prefill(tiny_model("mamba"), tokens)  # SSM state: no offset to compare with
    with BlockStore(tmp_path, **IDENT) as s:
        assert s.store(tokens, cache)


def test_empty_tokens_and_empty_cache_list_are_refused(tmp_path: Path, filled: tuple[list[int], list[Any]]) -> None:
    tokens, cache = filled
    with BlockStore(tmp_path, **IDENT) as s:
        with pytest.raises(ValueError, match="tokens is empty"):
            s.store([], cache)
        with pytest.raises(ValueError, match="caches is empty"):
            s.store(tokens, [])
        with pytest.raises(ValueError, match="caches is empty"):
            s.store_async(tokens, [])
        _nothing_stored(s)


def test_namespace_too_long_or_not_encodable_is_refused(tmp_path: Path, filled: tuple[list[int], list[Any]]) -> None:
    tokens, cache = filled
    with BlockStore(tmp_path, **IDENT) as s:
        for ns in ("x" * 10_000_000, "é" * (MAX_NS_BYTES // 2 + 1), "a\ud800b"):
            for call in (lambda: s.store(tokens, cache, ns), lambda: s.find(tokens, ns),
                         lambda: s.find_exact(tokens, ns), lambda: s.has_durable_prefix(tokens, ns)):
                with pytest.raises(ValueError, match="ns ") as info:
                    call()
                assert not isinstance(info.value, UnicodeError)  # named, not a raw codec error
        _nothing_stored(s)
        assert s.store(tokens, cache, "y" * MAX_NS_BYTES)  # the bound itself is fine


def test_checkpoint_namespace_is_not_reachable_through_the_public_ns(
    tmp_path: Path, filled: tuple[list[int], list[Any]]
) -> None:
    tokens, cache = filled
    prompt = tokens[:10]
    with BlockStore(tmp_path, **IDENT) as s:
        assert s.store_generation_checkpoint(tokens, cache, GenerationCheckpoint("k", len(prompt)))
        reserved = CHECKPOINT_NS + "k"
        for call in (lambda: s.find(tokens, reserved), lambda: s.find_exact(tokens, reserved),
                     lambda: s.has_durable_prefix(tokens, reserved), lambda: s.store(tokens, cache, reserved),
                     lambda: s.store_async(tokens, cache, reserved)):
            with pytest.raises(ValueError, match="reserved for generation checkpoints"):
                call()
        checkpoint = s.find_generation_checkpoint(prompt, "k")  # still there, untouched
        assert checkpoint is not None and checkpoint.length == N
        assert s.restore(checkpoint) is not None


def test_closed_store_refuses_every_call(tmp_path: Path, filled: tuple[list[int], list[Any]]) -> None:
    tokens, cache = filled
    s = BlockStore(tmp_path, **IDENT)
    assert s.store(tokens, cache)
    entry = s.find_exact(tokens).entry
    s.close()
    s.close()  # twice is fine
    calls = {
        "store": lambda: s.store(tokens, cache), "store_async": lambda: s.store_async(tokens, cache),
        "find": lambda: s.find(tokens), "find_exact": lambda: s.find_exact(tokens),
        "has_durable_prefix": lambda: s.has_durable_prefix(tokens), "restore": lambda: s.restore(entry),
        "restore_async": lambda: s.restore_async(entry), "remove": lambda: s.remove(entry),
        "len": lambda: len(s), "entries": s.entries, "token_prefixes": lambda: list(s.token_prefixes()),
        "total_bytes": lambda: s.total_bytes, "gc": s.gc, "check": s.check, "scan": s.scan,
        "evict_to": lambda: s.evict_to(0), "rebuild_index": s.rebuild_index,
        "find_generation_checkpoint": lambda: s.find_generation_checkpoint(tokens, "k"),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match="store is closed"):
            call()
            pytest.fail(f"{name} answered on a closed store")


def test_handle_used_in_a_forked_child_says_so(tmp_path: Path, filled: tuple[list[int], list[Any]]) -> None:
    tokens, cache = filled
    with BlockStore(tmp_path, **IDENT) as s:
        assert s.store(tokens, cache)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report what the inherited handle says, then leave without cleanup
            os.close(read)
            try:
                s.find(tokens)
                message = "answered"
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                message = f"{type(exc).__name__}: {exc}"
            s.close()
            os.write(write, message.encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as f:
            message = f.read().decode()
        os.waitpid(pid, 0)
        assert message.startswith("RuntimeError") and "fork" in message, message
        assert s.find_exact(tokens) is not None  # the parent's handle is unharmed
        assert s.restore(s.find_exact(tokens).entry) is not None


def test_tilde_is_expanded_in_user_paths(
    tmp_path: Path, filled: tuple[list[int], list[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens, cache = filled
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    with BlockStore("~/.cache/blockkv", **IDENT) as s:
        assert s.store(tokens, cache)
        name = s.directory.name
    assert (home / ".cache" / "blockkv" / name).is_dir()
    [fp] = list_fingerprints("~/.cache/blockkv")
    with BlockStore.open_dir(f"~/.cache/blockkv/{name}") as s:
        assert s.find_exact(tokens) is not None and fp.path == s.directory
    assert list(cwd.iterdir()) == []  # no literal "~" directory


def test_mx_array_tokens_are_accepted_wherever_tokens_are(
    tmp_path: Path, filled: tuple[list[int], list[Any]]
) -> None:
    tokens, cache = filled
    arr = mx.array(tokens)
    longer = mx.array(tokens + [1, 2])
    with BlockStore(tmp_path, **IDENT) as s:
        assert s.store(arr, cache)
        assert s.find_exact(arr) is not None
        assert s.find(longer).prefix_len == N
        assert s.has_durable_prefix(arr[:10])
        assert s.store_generation_checkpoint(mx.array(tokens, dtype=mx.uint32), cache, GenerationCheckpoint("k", 5))
        assert s.find_generation_checkpoint(arr[:5], "k") is not None
        assert s.find_exact(np.array(tokens)).entry.id == s.find_exact(arr).entry.id
        with pytest.raises(TypeError, match="1-D sequence of ints"):
            s.find(mx.array([[1, 2]]))
        with pytest.raises(TypeError, match="1-D sequence of ints"):
            s.find(mx.array([1.0, 2.0]))
