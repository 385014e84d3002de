"""One side of the cross-version test (tests/system/cross_version.py), run by the
Python of one mlx-lm version: ``write ROOT`` stores an entry of every cache
kind this mlx-lm fills, with the raw bits of its records beside the root;
``read ROOT`` restores each and compares the records bit for bit. Exit 0 when
every entry matches, 1 with what differs."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import numpy as np

from blockkv import BlockStore
from blockkv.format.codec import encode_caches, walk_tensors
from blockkv.testing.models import chunked_cache_fills, concatenate_cache, prefill, quantized, random_tokens, tiny_model


def cases() -> dict[str, tuple[list[int], list[Any]]]:
    """name -> (tokens, caches) of every kind this mlx-lm can fill."""
    out: dict[str, tuple[list[int], list[Any]]] = {}
    for name, kind, n, dtype in [("kv", "llama", 300, mx.bfloat16), ("ring", "gemma3", 10, mx.bfloat16),
                                 ("ring-wrapped", "gemma3", 70, mx.float16), ("ssm", "mamba", 30, mx.bfloat16),
                                 ("list", "cachelist", 40, mx.float32)]:
        tokens = random_tokens(n, seed=n)
        out[name] = (tokens, prefill(tiny_model(kind, dtype=dtype), tokens)[0])
    tokens = random_tokens(50, seed=3)
    llama = tiny_model("llama")
    out["quantized"] = (tokens, quantized(prefill(llama, tokens)[0]))
    out["concatenate"] = (tokens, prefill(llama, tokens, cache=concatenate_cache(llama))[0])
    if chunked_cache_fills():
        tokens = random_tokens(100, seed=4)
        out["chunked"] = (tokens, prefill(tiny_model("chunked"), tokens, chunk=30)[0])
    return out


def fingerprint(caches: list[Any]) -> dict[str, Any]:
    """What must survive: kinds, meta and every tensor's raw bits (MambaCache
    is the ArraysCache of mlx-lm before 0.30)."""
    records = encode_caches(caches)
    shape = json.dumps([_describe(r) for r in records], sort_keys=True).replace('"MambaCache"', '"ArraysCache"')
    bits = [None if t is None else np.asarray(t.data).tobytes().hex() for t in walk_tensors(records)]
    return {"records": shape, "bits": bits}


def _describe(record: Any) -> dict[str, Any]:
    return {"kind": record.kind, "meta": record.meta, "children": [_describe(c) for c in record.children]}


def open_store(root: Path) -> BlockStore:
    return BlockStore(root, model_id="tiny", config_fingerprint="cross-version", tokenizer_hash="t",
                      max_bytes=1 << 30, block_tokens=64)


def main(mode: str, root: Path) -> int:
    reference = root.parent / "reference.json"
    with open_store(root) as store:
        if mode == "write":
            ref = {}
            for name, (tokens, caches) in cases().items():
                assert store.store(tokens, caches, ns=name), name
                ref[name] = {"tokens": tokens, **fingerprint(caches), "writer": mlx_lm.__version__}
            reference.write_text(json.dumps(ref))
            print(f"mlx-lm {mlx_lm.__version__} wrote {sorted(ref)}")
            return 0
        bad = []
        for name, want in json.loads(reference.read_text()).items():
            match = store.find_exact(want["tokens"], ns=name)
            loaded = store.restore(match.entry) if match is not None else None
            got = fingerprint(loaded.caches) if loaded is not None else None
            if got is None or got["records"] != want["records"] or got["bits"] != want["bits"]:
                bad.append(name)
        print(f"mlx-lm {mlx_lm.__version__} restored what mlx-lm {want['writer']} wrote; differing: {bad}")
        return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
