"""A store identity derived from the model's own files.

A cached KV tensor is only valid for the exact weights, KV quantisation and
tokenizer that produced it, so the identity hashes all three: two models, two
revisions of one model, or one model served with and without ``--kv-bits``
never see each other's entries.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import blake3

# Files that decide how text becomes token ids (and the template that builds prompts).
_TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
_WEIGHT_SUFFIXES: tuple[str, ...] = (".safetensors", ".npz", ".gguf")
# Weight files run to gigabytes; hashing their size plus three samples of their
# bytes tells revisions apart without reading a model at every server start.
_SAMPLE_BYTES = 1 << 16


@dataclass(frozen=True)
class KVQuant:
    """mlx-lm's KV-cache quantisation settings (``--kv-bits`` and friends)."""

    bits: int | None = None
    group_size: int = 64
    start: int = 0

    def canonical(self) -> dict[str, int | None]:
        """Only settings that change the cache: none when quantisation is off."""
        if self.bits is None:
            return {"bits": None}
        return {"bits": self.bits, "group_size": self.group_size, "start": self.start}


@dataclass(frozen=True)
class StoreIdentity:
    """The three strings a ``BlockStore`` is opened with."""

    model_id: str
    config_fingerprint: str
    tokenizer_hash: str


def resolve_model_path(path_or_repo: str | os.PathLike[str]) -> Path:
    """A local directory as is, else the Hugging Face snapshot mlx-lm loaded (no download)."""
    path = Path(path_or_repo)
    if path.is_dir():
        return path
    from mlx_lm.utils import hf_repo_to_path

    try:
        return Path(hf_repo_to_path(str(path_or_repo)))
    except Exception as e:  # huggingface_hub raises several unrelated types here
        raise FileNotFoundError(
            f"model {str(path_or_repo)!r} is neither a directory nor a downloaded Hugging Face repo"
        ) from e


def _file_digest(path: Path) -> str:
    size = path.stat().st_size
    h = blake3.blake3(str(size).encode())
    with open(path, "rb") as f:
        for offset in (0, max(0, size // 2 - _SAMPLE_BYTES // 2), max(0, size - _SAMPLE_BYTES)):
            f.seek(offset)
            h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def _weights_digest(root: Path) -> dict[str, str]:
    names = sorted(p.name for p in root.iterdir() if p.name.endswith(_WEIGHT_SUFFIXES))
    return {name: _file_digest(root / name) for name in names}


def _json_file(path: Path) -> object:
    return json.loads(path.read_text()) if path.is_file() else None


def _model_description(root: Path) -> dict[str, object]:
    """Config, weight samples and (for HF snapshots) the revision of one model directory."""
    config_path = root / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in model directory {root}")
    return {
        "config": _json_file(config_path),
        "weights_index": _json_file(root / "model.safetensors.index.json"),
        "weights": _weights_digest(root),
        # huggingface_hub lays snapshots out as .../snapshots/<commit>/
        "revision": root.name if root.parent.name == "snapshots" else None,
    }


def _adapter_description(root: Path) -> dict[str, object]:
    return {"config": _json_file(root / "adapter_config.json"), "weights": _weights_digest(root)}


def _hash_json(value: object) -> str:
    return blake3.blake3(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def tokenizer_hash(root: Path, chat_template: str | None = None) -> str:
    """blake3 of the tokenizer files present in ``root`` and a chat-template override."""
    h = blake3.blake3()
    for name in _TOKENIZER_FILES:
        path = root / name
        if path.is_file():
            h.update(name.encode() + b"\0" + blake3.blake3(path.read_bytes()).digest())
    h.update(b"template\0" + (chat_template or "").encode())
    return h.hexdigest()


def model_identity(
    model: str | os.PathLike[str],
    *,
    adapter: str | os.PathLike[str] | None = None,
    draft_model: str | os.PathLike[str] | None = None,
    kv: KVQuant = KVQuant(),
    chat_template: str | None = None,
) -> StoreIdentity:
    """The identity of a model as mlx-lm loads it (optionally with an adapter and a
    draft model, whose caches mlx-lm keeps in the same list)."""
    root = resolve_model_path(model)
    description: dict[str, object] = {
        "model": _model_description(root),
        "adapter": _adapter_description(Path(adapter)) if adapter is not None else None,
        "draft": _model_description(resolve_model_path(draft_model))
        if draft_model is not None
        else None,
        "kv_quant": kv.canonical(),
    }
    model_id = str(model) if not Path(model).is_dir() else root.resolve().name
    return StoreIdentity(
        model_id=model_id,
        config_fingerprint=readable_fingerprint(model_id, kv, chat_template, _hash_json(description)),
        tokenizer_hash=tokenizer_hash(root, chat_template),
    )


_TEMPLATE_BUILTIN = "builtin"


def readable_fingerprint(model_id: str, kv: KVQuant, chat_template: str | None, digest: str) -> str:
    """``<model id> kv-<quantisation> template-<builtin|hash> config-<digest>``:
    the digest alone decides identity; the words before it let a person (and
    ``blockkv stats``) tell directories apart, and the fingerprint directory's
    name starts with the model. A chat-template override is in it so a server
    run with one gets its own directory instead of entries foreign to the other."""
    bits = kv.canonical()
    quant = "off" if bits["bits"] is None else f"{bits['bits']}bit-g{bits['group_size']}-s{bits['start']}"
    template = blake3.blake3(chat_template.encode()).hexdigest()[:12] if chat_template else _TEMPLATE_BUILTIN
    return f"{model_id} kv-{quant} template-{template} config-{digest}"


@dataclass(frozen=True)
class FingerprintWords:
    """What a ``readable_fingerprint`` says, for tools that show it."""

    model_id: str
    kv: str  # "off" or e.g. "8bit-g64-s0"
    template: str  # "builtin" or the first 12 hex of the override's blake3


def describe_fingerprint(config_fingerprint: str) -> FingerprintWords | None:
    """The words of a ``readable_fingerprint``; None for any other fingerprint
    (a library user's own string, or one from before the words existed)."""
    parts = config_fingerprint.rsplit(" ", 3)
    if len(parts) != 4:
        return None
    model_id, kv, template, config = parts
    if not (kv.startswith("kv-") and template.startswith("template-") and config.startswith("config-")):
        return None
    return FingerprintWords(model_id, kv[3:], template[len("template-") :])


def _path_or_none(value: object, what: str, key: object) -> str | os.PathLike[str] | None:
    if value is None or isinstance(value, (str, os.PathLike)):
        return value
    raise TypeError(f"model key {key!r}: {what} must be a path or None, got {type(value).__name__}")


def identity_from_key(
    key: object, kv: KVQuant = KVQuant(), chat_template: str | None = None
) -> StoreIdentity:
    """The identity for an mlx-lm prompt-cache model key: the server's
    ``(model_path, adapter_path, draft_model_path)`` tuple or a bare path."""
    if isinstance(key, (str, os.PathLike)):
        key = (key,)
    if not isinstance(key, tuple) or not 1 <= len(key) <= 3:
        raise TypeError(f"model key must be a path or a (model, adapter, draft) tuple, got {key!r}")
    model, adapter, draft = [*key] + [None] * (3 - len(key))
    model_path = _path_or_none(model, "model", key)
    if model_path is None:
        raise ValueError(f"model key {key!r} names no model")
    return model_identity(
        model_path,
        adapter=_path_or_none(adapter, "adapter", key),
        draft_model=_path_or_none(draft, "draft model", key),
        kv=kv,
        chat_template=chat_template,
    )
