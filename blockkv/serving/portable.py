"""Prompt-cache files in and out: an entry as the ``.safetensors`` file mlx-lm
writes (``save_prompt_cache``) and reads (``load_prompt_cache``, ``mlx_lm.generate
--prompt-cache-file``), and such a file, ours or ``mlx_lm.cache_prompt``'s,
into a store.

Export goes through mlx-lm's own ``save_prompt_cache``, so the file is what the
installed mlx-lm reads; the entry's tokens ride in its metadata
(``blockkv_tokens``) so an import needs nothing else. A file is untrusted
input: its safetensors header is read with bounds (size, tensor count, dtypes,
offsets inside the file) and its cache classes must be ones blockkv has a
codec for before mlx-lm's loader sees it. An import stores through
``BlockStore.store``, which refuses tokens that do not match the caches'
offsets and deduplicates shared blocks.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import struct
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from blockkv.errors import BlockKVError
from blockkv.format.codec import codec_named
from blockkv.format.state_api import TWO_PART_STATE
from blockkv.local.read_only import ReadOnlyStore
from blockkv.records import Entry
from blockkv.store import BlockStore

log = logging.getLogger("blockkv.mlx_lm")

TOKENS_KEY = "blockkv_tokens"
MAX_HEADER_BYTES = 64 << 20  # far above any real file's (a million tokens of metadata is ~7 MiB)
MAX_TENSORS = 1 << 16
MAX_METADATA_KEYS = 1 << 16
# safetensors dtype names -> bytes per element (the ones mlx writes)
_SAFETENSORS_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2, "U32": 4,
                       "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8, "C64": 8}


class PromptCacheFileError(BlockKVError, ValueError):
    """A file that is not a prompt-cache file blockkv can read."""


def export_prompt_cache(store: BlockStore | ReadOnlyStore, entry: Entry, path: str | os.PathLike[str], *,
                        prefix_len: int | None = None, model: str | None = None) -> Path:
    """Write ``entry`` (cut to ``prefix_len`` tokens when given) as a
    prompt-cache file mlx-lm loads. ``model`` is what the file's ``model``
    metadata names, which ``mlx_lm.generate`` insists equals its ``--model``
    (default: the store's model id). Returns the path written; the file appears
    whole or not at all."""
    from mlx_lm.models.cache import save_prompt_cache

    path = Path(path).expanduser()
    if path.suffix != ".safetensors":
        raise ValueError(f"{path}: a prompt-cache file must end in .safetensors (mlx-lm reads it by its suffix)")
    loaded = store.restore(entry, prefix_len)
    if loaded is None:
        raise BlockKVError(f"entry {entry.id} could not be read (the store's warning says why)")
    metadata = {
        "model": model if model is not None else store.identity.model_id,
        "tokenizer_config": "{}",
        TOKENS_KEY: json.dumps(list(loaded.tokens)),
        "blockkv_model_id": store.identity.model_id,
        "blockkv_config_fingerprint": store.identity.config_fingerprint,
        "blockkv_tokenizer_hash": store.identity.tokenizer_hash,
        "blockkv_ns": entry.ns,
    }
    partial = path.with_name(f".{path.stem}.{uuid.uuid4().hex}.partial.safetensors")
    try:
        save_prompt_cache(str(partial), loaded.caches, metadata)
        os.replace(partial, path)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        partial.unlink(missing_ok=True)
    return path


def import_prompt_cache(store: BlockStore, path: str | os.PathLike[str], *,
                        tokens: Sequence[int] | None = None, ns: str = "") -> Entry | None:
    """Store the caches of a prompt-cache file under ``tokens`` (default: the
    ones an export wrote into it). Returns the stored entry, or None where the
    store did not take it (its warning says why). Raises ``PromptCacheFileError``
    for a file it cannot read and ``ValueError`` for tokens that do not match
    the caches."""
    caches, tokens = read_for_import(path, tokens)
    return store_imported(store, path, caches, tokens, ns)


def read_for_import(path: str | os.PathLike[str], tokens: Sequence[int] | None = None
                    ) -> tuple[list[Any], Sequence[int]]:
    """The caches of a prompt-cache file and the tokens to store them under
    (default: an export's): everything an import checks before a store is
    opened, so a file it refuses leaves the root untouched."""
    caches, metadata = read_prompt_cache(path)
    return caches, tokens_in(metadata, path) if tokens is None else tokens


def store_imported(store: BlockStore, path: str | os.PathLike[str], caches: list[Any], tokens: Sequence[int],
                   ns: str = "") -> Entry | None:
    """``read_for_import``'s caches stored under ``tokens``: the entry, or None (with a warning)."""
    stored = store.store(tokens, caches, ns)
    match = store.find_exact(tokens, ns)
    if match is None:
        log.warning("blockkv: %s was not stored (the store's warning above says why)", path)
        return None
    if not stored:  # with remote=: kept locally, the bucket gets it with a later listing
        log.info("blockkv: %s stored locally; the bucket did not acknowledge it yet", path)
    return match.entry


def tokens_in(metadata: dict[str, str], path: str | os.PathLike[str]) -> list[int]:
    """The tokens an export recorded in a file's metadata."""
    text = metadata.get(TOKENS_KEY)
    if text is None:
        raise PromptCacheFileError(f"{path}: no {TOKENS_KEY} in its metadata (not written by blockkv export): "
                                   "give the prompt (--prompt, --prompt-file) or its tokens")
    try:
        tokens = json.loads(text)
    except ValueError:
        tokens = None
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise PromptCacheFileError(f"{path}: {TOKENS_KEY} is not a JSON list of ints")
    return tokens


def read_prompt_cache(path: str | os.PathLike[str]) -> tuple[list[Any], dict[str, str]]:
    """The caches and user metadata of a prompt-cache file, after checking its
    header with bounds and its cache classes against blockkv's codecs."""
    from mlx_lm.models.cache import load_prompt_cache

    path = Path(path).expanduser()
    header = _safetensors_header(path)
    _check_classes(header.get("__metadata__", {}), path)
    try:
        caches, metadata = load_prompt_cache(str(path), return_metadata=True)
    except Exception as exc:  # noqa: BLE001 - another mlx-lm's layout fails in many ways
        raise PromptCacheFileError(f"{path}: mlx-lm cannot load it ({type(exc).__name__}: {exc}); "
                                   "was it written by an mlx-lm with another state layout?") from None
    return caches, dict(metadata)


def _safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file, each tensor's bytes inside the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
            if not 2 <= length <= min(MAX_HEADER_BYTES, size - 8):
                raise PromptCacheFileError(f"{path}: not a safetensors file (header length {length})")
            raw = f.read(length)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        header = json.loads(raw)
    except ValueError:
        raise PromptCacheFileError(f"{path}: its safetensors header is not JSON") from None
    if not isinstance(header, dict) or len(header) > MAX_TENSORS + 1:
        raise PromptCacheFileError(f"{path}: its safetensors header is not a bounded JSON object")
    data = size - 8 - length
    for name, t in header.items():
        if name == "__metadata__":
            if not isinstance(t, dict) or len(t) > MAX_METADATA_KEYS or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in t.items()):
                raise PromptCacheFileError(f"{path}: its metadata is not a bounded map of strings")
            continue
        ok = (isinstance(t, dict) and t.get("dtype") in _SAFETENSORS_DTYPES
              and isinstance(t.get("shape"), list) and all(type(d) is int and d >= 0 for d in t["shape"])
              and isinstance(t.get("data_offsets"), list) and len(t["data_offsets"]) == 2
              and all(type(o) is int for o in t["data_offsets"]))
        if not ok:
            raise PromptCacheFileError(f"{path}: tensor {name[:80]!r} is not described as safetensors describes one")
        start, stop = t["data_offsets"]
        if not 0 <= start <= stop <= data or stop - start != math.prod(t["shape"]) * _SAFETENSORS_DTYPES[t["dtype"]]:
            raise PromptCacheFileError(f"{path}: tensor {name[:80]!r} does not fit in the file")
    return header


def _check_classes(metadata: dict[str, str], path: Path) -> None:
    """Every cache class the file names must be one blockkv encodes: mlx-lm's
    loader looks the names up in its module and calls their ``from_state``."""
    slot = "2" if TWO_PART_STATE else "1"  # where this mlx-lm's save_prompt_cache puts the class names
    names = [v for k, v in metadata.items() if re.fullmatch(rf"{slot}\.\d+", k)]
    if not names:
        raise PromptCacheFileError(f"{path}: names no cache classes where this mlx-lm's save_prompt_cache "
                                   "puts them (not a prompt-cache file, or another mlx-lm's layout)")
    for name in names:
        try:
            codec_named(name)
        except ValueError:
            raise PromptCacheFileError(f"{path}: cache class {name[:80]!r} is not one blockkv stores") from None
