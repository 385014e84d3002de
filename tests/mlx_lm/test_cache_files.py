"""Prompt-cache files in and out: every cache kind exported goes through
mlx-lm's own loader and continues exactly as blockkv's own restore does; a
file made by mlx-lm's ``cache_prompt`` imports where ``serve --model`` finds
it, bit for bit; a bad file or wrong tokens store nothing."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from blockkv import BlockStore
from blockkv.format.codec import encode_caches, walk_tensors
from blockkv.mlx_lm import export_prompt_cache, import_prompt_cache
from blockkv.mlx_lm.cache_files import PromptCacheFileError
from blockkv.mlx_lm.cache_fit import ModelLayout
from blockkv.mlx_lm.identity import KVQuant, model_identity
from blockkv.mlx_lm.warm import cache_prompt_tokens
from blockkv.model_dir import build_model_dir, sample_text
from blockkv.testing.models import (
    chunked_cache_fills,
    concatenate_cache,
    model_config,
    prefill,
    quantized,
    random_tokens,
    tiny_model,
)

CONTINUE = 6  # greedy tokens generated from each restored cache


def open_store(root: Path, fingerprint: str = "portable") -> BlockStore:
    return BlockStore(root, model_id="tiny", config_fingerprint=fingerprint, tokenizer_hash="t",
                      max_bytes=1 << 30, block_tokens=64)


def greedy(model: Any, caches: list[Any], last: int) -> list[int]:
    """Greedy tokens after feeding ``last`` to caches that hold a prompt."""
    out, token = [], last
    for _ in range(CONTINUE):
        logits = model(mx.array([[token]]), cache=caches)
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
    return out


def raw(caches: list[Any]) -> list[bytes | None]:
    return [None if t is None else np.asarray(t.data).tobytes() for t in walk_tensors(encode_caches(caches))]


def case(name: str) -> tuple[Any, list[int], list[Any]]:
    """(model, tokens, caches) of one cache kind, the prompt but its last token prefilled."""
    kind, n, make = {
        "KVCache": ("llama", 150, None), "RotatingKVCache": ("gemma3", 12, None),
        "RotatingKVCache-wrapped": ("gemma3", 70, None), "ArraysCache": ("mamba", 40, None),
        "ChunkedKVCache": ("chunked", 100, None), "CacheList": ("cachelist", 40, None),
        "QuantizedKVCache": ("llama", 80, "quantized"), "ConcatenateKVCache": ("llama", 80, "concatenate"),
    }[name]
    model = tiny_model(kind)
    tokens = random_tokens(n, seed=n)
    if make == "concatenate":
        caches, _ = prefill(model, tokens, cache=concatenate_cache(model))
    else:
        caches, _ = prefill(model, tokens, chunk=30 if kind == "chunked" else None)
    return model, tokens, quantized(caches) if make == "quantized" else caches


KINDS = ["KVCache", "RotatingKVCache", "RotatingKVCache-wrapped", "ArraysCache",
         pytest.param("ChunkedKVCache", marks=pytest.mark.skipif(not chunked_cache_fills(), reason="mlx-lm < 0.32")),
         "CacheList", "QuantizedKVCache", "ConcatenateKVCache"]


@pytest.mark.parametrize("name", KINDS)
def test_export_loads_in_mlx_lm_and_imports_back(tmp_path: Path, name: str) -> None:
    model, tokens, caches = case(name)
    with open_store(tmp_path / "a") as store, open_store(tmp_path / "b") as other:
        assert store.store(tokens, caches)
        entry = store.find_exact(tokens).entry
        path = export_prompt_cache(store, entry, tmp_path / "out.safetensors", model="./tiny")
        loaded, metadata = load_prompt_cache(str(path), return_metadata=True)  # mlx-lm's own loader
        assert metadata["model"] == "./tiny" and json.loads(metadata["tokenizer_config"]) == {}
        assert [type(c) for c in loaded] == [type(c) for c in caches]
        ours = store.restore(entry).caches
        nxt = random_tokens(1, seed=99)[0]
        assert greedy(model, loaded, nxt) == greedy(model, ours, nxt)

        imported = import_prompt_cache(other, path)  # the tokens ride in the file
        assert imported is not None and imported.tokens == tuple(tokens)
        assert raw(other.restore(imported).caches) == raw(store.restore(entry).caches)
        written = store.stats["bytes_written"]
        again = import_prompt_cache(store, path, ns="copy")  # every block is already there
        assert again is not None and again.ns == "copy"
        assert store.stats["bytes_written"] - written < entry.nbytes // 4  # a header, no blocks


def test_export_of_a_prefix(tmp_path: Path) -> None:
    _, tokens, caches = case("KVCache")
    with open_store(tmp_path / "a") as store:
        assert store.store(tokens, caches)
        path = export_prompt_cache(store, store.find_exact(tokens).entry, tmp_path / "p.safetensors", prefix_len=64)
        (first, *_), metadata = load_prompt_cache(str(path), return_metadata=True)
        assert first.offset == 64 and json.loads(metadata["blockkv_tokens"]) == tokens[:64]
        with pytest.raises(ValueError, match=".safetensors"):
            export_prompt_cache(store, store.find_exact(tokens).entry, tmp_path / "p.bin")


def test_cache_prompt_file_imports_where_serve_finds_it(tmp_path: Path) -> None:
    """mlx-lm's own ``cache_prompt`` writes the file; ``blockkv import`` stores it
    under serve's identity; ``find`` hits and the restore is the file's bits."""
    model_dir = build_model_dir(tmp_path / "tiny-llama", "llama")
    text = sample_text(120, seed=7)
    made = tmp_path / "prompt.safetensors"
    run = subprocess.run([sys.executable, "-m", "mlx_lm", "cache_prompt", "--model", str(model_dir), "--prompt",
                          text, "--prompt-cache-file", str(made)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    root = tmp_path / "kv"
    cli = subprocess.run([sys.executable, "-m", "blockkv", "import", str(root), str(made), "--model", str(model_dir),
                          "--prompt", text, "--json"], capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    tokens = cache_prompt_tokens(model_dir, text)
    assert json.loads(cli.stdout)["entry"]["tokens"] == len(tokens)
    ident = model_identity(model_dir)
    with BlockStore(root, model_id=ident.model_id, config_fingerprint=ident.config_fingerprint,
                    tokenizer_hash=ident.tokenizer_hash, max_bytes=1 << 30) as store:
        match = store.find(tokens + [5, 6])
        assert match is not None and match.prefix_len == len(tokens)
        assert raw(store.restore(match.entry).caches) == raw(load_prompt_cache(str(made)))
    wrong = subprocess.run([sys.executable, "-m", "blockkv", "import", str(root), str(made), "--model",
                            str(model_dir), "--tokens", json.dumps(tokens[:-1])],
                           capture_output=True, text=True, timeout=300)
    assert wrong.returncode == 1 and "pass exactly the tokens" in wrong.stderr
    entry_id = json.loads(cli.stdout)["entry"]["id"]
    out = tmp_path / "back.safetensors"
    back = subprocess.run([sys.executable, "-m", "blockkv", "export", str(root), entry_id, "-o", str(out),
                           "--model", str(model_dir)], capture_output=True, text=True, timeout=300)
    assert back.returncode == 0, back.stderr
    assert raw(load_prompt_cache(str(out))) == raw(load_prompt_cache(str(made)))
    fp = json.loads(cli.stdout)["fingerprint"]
    by_fp = [sys.executable, "-m", "blockkv", "export", str(root), entry_id, "-o", str(out), "-f", fp]
    named = subprocess.run(by_fp, capture_output=True, text=True, timeout=300)
    assert named.returncode == 0 and "--as-model PATH" in named.stdout, named.stderr  # it says the name is no path
    assert load_prompt_cache(str(out), return_metadata=True)[1]["model"] == ident.model_id
    placed = subprocess.run([*by_fp, "--as-model", str(model_dir)], capture_output=True, text=True, timeout=300)
    assert placed.returncode == 0 and "--as-model" not in placed.stdout, placed.stderr
    assert load_prompt_cache(str(out), return_metadata=True)[1]["model"] == str(model_dir)  # mlx_lm.generate's
    stores = sorted(p.name for p in root.iterdir())
    missing = subprocess.run([sys.executable, "-m", "blockkv", "export", str(root), entry_id, "-o", str(out),
                              "--model", str(model_dir), "--kv-bits", "8"], capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "no store for --model" in missing.stderr
    assert sorted(p.name for p in root.iterdir()) == stores  # an export makes no store
    (blobs,) = root.glob("*/blobs")
    stray = blobs / "00" / ("0" * 64)  # a block nothing references: what opening the store would sweep
    stray.parent.mkdir(exist_ok=True)
    stray.write_bytes(b"not ours to judge")
    text_file = tmp_path / "notes.txt"
    text_file.write_text("not a prompt-cache file")
    refused = subprocess.run([sys.executable, "-m", "blockkv", "import", str(root), str(text_file), "--model",
                              str(model_dir)], capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "not a safetensors file" in refused.stderr
    assert stray.exists()  # refused before the store was opened: nothing swept


def hostile(path: Path, how: str) -> None:
    """A broken copy of a good file at ``path``."""
    data = bytearray(path.read_bytes())
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + length])
    if how == "truncated":
        del data[len(data) // 2 :]
    elif how == "huge-header":
        data[:8] = struct.pack("<Q", 1 << 60)
    elif how in ("offsets", "class"):
        if how == "offsets":
            name = next(k for k in header if k != "__metadata__")
            header[name]["data_offsets"][1] += 1 << 30
        else:
            header["__metadata__"] = {k: ("Quine" if v == "KVCache" else v) for k, v in header["__metadata__"].items()}
        raw_header = json.dumps(header).encode()
        data = bytearray(struct.pack("<Q", len(raw_header)) + raw_header + data[8 + length :])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "huge-header", "offsets", "class"])
def test_a_bad_file_stores_nothing(tmp_path: Path, how: str) -> None:
    _, tokens, caches = case("KVCache")
    with open_store(tmp_path / "a") as store, open_store(tmp_path / "b") as other:
        assert store.store(tokens, caches)
        path = export_prompt_cache(store, store.find_exact(tokens).entry, tmp_path / "x.safetensors")
        hostile(path, how)
        with pytest.raises(PromptCacheFileError):
            import_prompt_cache(other, path)
        assert len(other) == 0


def test_tokens_that_do_not_match_the_offsets_are_refused(tmp_path: Path) -> None:
    _, tokens, caches = case("KVCache")
    with open_store(tmp_path / "a") as store:
        assert store.store(tokens, caches)
        path = export_prompt_cache(store, store.find_exact(tokens).entry, tmp_path / "x.safetensors")
        with pytest.raises(ValueError, match="pass exactly the tokens"):
            import_prompt_cache(store, path, tokens=tokens + [1], ns="other")
        assert store.count("other") == 0


def llama_with(seed: int = 0, **config: Any) -> Any:
    """The tiny llama with ``config`` changed (another KV head count, head dim...)."""
    import importlib

    name, base = model_config("llama")
    module = importlib.import_module(f"mlx_lm.models.{name}")
    mx.random.seed(seed)
    return module.Model(module.ModelArgs.from_dict({**base, **config}))


def test_a_file_of_another_model_is_refused(tmp_path: Path) -> None:
    """A KV tensor is only valid for the weights that made it: an export names
    its store's fingerprint, an mlx-lm file its model; a file naming another
    model, or none (unless the caller vouches for it), stores nothing."""
    _, tokens, caches = case("KVCache")
    with open_store(tmp_path / "a", "model-A") as a, open_store(tmp_path / "b", "model-B") as b:
        assert a.store(tokens, caches)
        path = export_prompt_cache(a, a.find_exact(tokens).entry, tmp_path / "a.safetensors")
        with pytest.raises(PromptCacheFileError, match="made by 'model-A'"):
            import_prompt_cache(b, path)
        for name, metadata, ok in [("other", {"model": "other-model"}, False),
                                   ("same", {"model": "/elsewhere/tiny/"}, True),
                                   ("none", {}, False)]:
            made = tmp_path / f"{name}.safetensors"
            save_prompt_cache(str(made), caches, metadata)
            if ok:
                assert import_prompt_cache(b, made, tokens=tokens, ns=name) is not None
            else:
                with pytest.raises(PromptCacheFileError, match="made by model 'other-model'|names no model"):
                    import_prompt_cache(b, made, tokens=tokens, ns=name)
        assert import_prompt_cache(b, tmp_path / "none.safetensors", tokens=tokens, ns="vouched",
                                   unlabelled=True) is not None
        assert sorted(e.ns for e in b.entries()) == ["same", "vouched"]


def test_caches_that_do_not_fit_the_model_are_refused(tmp_path: Path) -> None:
    """Every cache's kind, layer count, KV heads, head dim and dtype must be the
    model's own (``make_prompt_cache``'s) before anything is stored: a file of
    one KV head under a two-head model would kill mlx-lm's generation."""
    model, tokens, caches = case("KVCache")
    assert ModelLayout([model]).misfit(caches) is None
    assert ModelLayout([model, model]).misfit(caches + caches) is None  # a draft model's caches follow
    misfits = {
        "heads": ModelLayout([llama_with(num_key_value_heads=2)]),
        "head dim": ModelLayout([llama_with(head_dim=16)]),
        "layers": ModelLayout([llama_with(num_hidden_layers=3)]),
        "window": ModelLayout([tiny_model("gemma3")]),
        "state": ModelLayout([tiny_model("mamba")]),
    }
    for what, layout in misfits.items():
        assert layout.misfit(caches) is not None, what
    half, _ = prefill(tiny_model("llama", dtype=mx.float16), tokens)
    assert ModelLayout([model]).misfit(half) is not None  # dtype
    assert ModelLayout([model], KVQuant(8, 32, 0)).misfit(quantized(caches)) is None
    assert ModelLayout([model]).misfit(quantized(caches)) is not None
    with open_store(tmp_path / "a") as store, open_store(tmp_path / "b") as other:
        assert store.store(tokens, caches)
        path = export_prompt_cache(store, store.find_exact(tokens).entry, tmp_path / "x.safetensors")
        with pytest.raises(PromptCacheFileError, match="do not fit the model"):
            import_prompt_cache(other, path, layout=misfits["heads"])
        assert len(other) == 0
        assert import_prompt_cache(other, path, layout=ModelLayout([model])) is not None


def test_import_refuses_a_file_of_another_model_or_layout(tmp_path: Path) -> None:
    """``blockkv import --model B`` of A's file: refused by name; a file that
    names no model: refused unless ``--unlabelled``, and then still refused
    where its caches do not fit B's own layout (here B has two KV heads)."""
    import mlx_lm

    model_dir = build_model_dir(tmp_path / "tiny-llama", "llama")
    wide_dir = build_model_dir(tmp_path / "wide-llama", "llama", overrides={"num_key_value_heads": 2})
    tokens = random_tokens(80, seed=3)
    caches, _ = prefill(mlx_lm.load(str(model_dir))[0], tokens)
    labelled, bare = tmp_path / "labelled.safetensors", tmp_path / "bare.safetensors"
    save_prompt_cache(str(labelled), caches, {"model": str(model_dir)})
    save_prompt_cache(str(bare), caches, {})
    root = tmp_path / "kv"

    def blockkv_import(path: Path, model: Path, *more: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "blockkv", "import", str(root), str(path), "--model", str(model),
                               "--tokens", json.dumps(tokens), *more], capture_output=True, text=True, timeout=300)

    for path, model, more, why in [(labelled, wide_dir, (), "made by model"), (bare, model_dir, (), "names no model"),
                                    (bare, wide_dir, ("--unlabelled",), "do not fit the model")]:
        refused = blockkv_import(path, model, *more)
        assert refused.returncode == 1 and why in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    assert list(root.rglob("*.bkv")) == []
    taken = blockkv_import(bare, model_dir, "--unlabelled")
    assert taken.returncode == 0, taken.stderr


def test_a_header_of_another_structure_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    """A safetensors header's size and structure are known before json.loads
    builds it: a million ``{}`` where a shape's ints belong (60 MiB of them cost
    3.7 GiB) allocate no more than a few copies of the header's bytes, and a
    tensor description with a key safetensors does not have is refused."""
    import tracemalloc

    _, tokens, caches = case("KVCache")
    with open_store(tmp_path / "a") as store, open_store(tmp_path / "b") as other:
        assert store.store(tokens, caches)
        good = export_prompt_cache(store, store.find_exact(tokens).entry, tmp_path / "x.safetensors").read_bytes()
        length = struct.unpack("<Q", good[:8])[0]
        name = next(k for k in json.loads(good[8 : 8 + length]) if k != "__metadata__")
        for how, change in [("containers", {"shape": [{}] * 1_000_000}), ("unknown key", {"extra": "x"})]:
            header = json.loads(good[8 : 8 + length])
            header[name].update(change)
            raw = json.dumps(header).encode()
            path = tmp_path / f"{how}.safetensors"
            path.write_bytes(struct.pack("<Q", len(raw)) + raw + good[8 + length :])
            tracemalloc.start()
            try:
                with pytest.raises(PromptCacheFileError):
                    import_prompt_cache(other, path)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert peak < 8 * len(raw) + (1 << 20), (how, peak, len(raw))
        assert len(other) == 0
