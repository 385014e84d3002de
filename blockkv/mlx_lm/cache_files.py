"""Prompt-cache files in and out: an entry as the ``.safetensors`` file mlx-lm
writes (``save_prompt_cache``) and reads (``load_prompt_cache``, ``mlx_lm.generate
--prompt-cache-file``), and such a file, ours or ``mlx_lm.cache_prompt``'s,
into a store.

Export goes through mlx-lm's own ``save_prompt_cache``, so the file is what the
installed mlx-lm reads; the entry's tokens ride in its metadata
(``blockkv_tokens``) so an import needs nothing else. A file is untrusted
input: its safetensors header is read with bounds (size, tensor count, dtypes,
offsets inside the file) and its cache classes must be ones blockkv has a
codec for before mlx-lm's loader sees it. A cached KV tensor is only valid
for the weights that made it, so the file's metadata must name the store's
model (blockkv's own exports: its config fingerprint and tokenizer hash, which
hash the weights, revision and KV quantisation; ``mlx_lm.cache_prompt``'s: the
model's name) and a file that names none is taken only when the caller says so;
its caches must fit the model's own layout (``cache_fit``) before anything is
stored. An import stores through ``BlockStore.store``, which refuses tokens
that do not match the caches' offsets and deduplicates shared blocks.
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
from blockkv.format.header import Identity
from blockkv.format.state_api import TWO_PART_STATE
from blockkv.local.read_only import ReadOnlyStore
from blockkv.mlx_lm.cache_fit import ModelLayout
from blockkv.records import Entry
from blockkv.store import BlockStore

log = logging.getLogger("blockkv.mlx_lm")

TOKENS_KEY = "blockkv_tokens"
MAX_HEADER_BYTES = 64 << 20  # far above any real file's (a million tokens of metadata is ~7 MiB)
MAX_TENSORS = 1 << 16
MAX_METADATA_KEYS = 1 << 16
# A header's shape, known before json.loads builds it: with its strings emptied and its whitespace gone,
# a header is one object of tensor descriptions (objects of strings and flat int lists) and one metadata
# object (of strings), with at most _MAX_STRINGS strings, MAX_TENSORS + 2 objects and _MAX_COMMAS items.
# Counted and matched without building anything per item: 60 MiB of {} cost json.loads 3.7 GiB.
# Possessive repeats (*+): the regex engine keeps no backtracking state per character or item.
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.S)
_FIELD = rb'"":(?:""|\[(?:-?[0-9]++(?:,-?[0-9]++)*+)?\])'
_OBJECT = rb"\{(?:" + _FIELD + rb"(?:," + _FIELD + rb")*+)?\}"
_SKELETON = re.compile(rb'\{(?:"":' + _OBJECT + rb'(?:,"":' + _OBJECT + rb")*+)?\}")
_MAX_STRINGS = 5 * MAX_TENSORS + 2 * MAX_METADATA_KEYS + 1  # a name, three keys and a dtype per tensor
_MAX_DIMS = 8
_MAX_COMMAS = (4 + _MAX_DIMS) * MAX_TENSORS + MAX_METADATA_KEYS  # a tensor's three fields, its shape and offsets
_TENSOR_KEYS = frozenset({"dtype", "shape", "data_offsets"})
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
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: no directory {path.parent}")
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
    except (RuntimeError, ValueError):  # mlx's writer names only the temporary file it could not open
        raise OSError(f"cannot write {path}") from None
    finally:
        partial.unlink(missing_ok=True)
    return path


def import_prompt_cache(store: BlockStore, path: str | os.PathLike[str], *,
                        tokens: Sequence[int] | None = None, ns: str = "", layout: ModelLayout | None = None,
                        unlabelled: bool = False) -> Entry | None:
    """Store the caches of a prompt-cache file under ``tokens`` (default: the
    ones an export wrote into it). The file must name the store's model
    (``unlabelled=True`` takes one that names no model at all) and its caches
    must fit ``layout`` (the model's: ``ModelLayout([model])``; None: the
    caller vouches for them). Returns the stored entry, or None where the store
    did not take it (its warning says why). Raises ``PromptCacheFileError`` for
    a file it cannot read or that is not this model's, and ``ValueError`` for
    tokens that do not match the caches."""
    caches, tokens = read_for_import(path, store.identity, tokens, layout=layout, unlabelled=unlabelled)
    return store_imported(store, path, caches, tokens, ns)


def read_for_import(path: str | os.PathLike[str], identity: Identity, tokens: Sequence[int] | None = None, *,
                    layout: ModelLayout | None = None, unlabelled: bool = False) -> tuple[list[Any], Sequence[int]]:
    """The caches of a prompt-cache file of ``identity``'s model that fit
    ``layout``, and the tokens to store them under (default: an export's):
    everything an import checks before a store is opened, so a file it
    refuses leaves the root untouched."""
    caches, metadata = read_prompt_cache(path)
    check_file_identity(metadata, identity, path, unlabelled=unlabelled)
    if layout is not None:
        misfit = layout.misfit(caches)
        if misfit is not None:
            raise PromptCacheFileError(f"{path}: its caches do not fit the model ({misfit})")
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


def check_file_identity(metadata: dict[str, str], identity: Identity, path: str | os.PathLike[str], *,
                        unlabelled: bool = False) -> None:
    """Refuse a file whose metadata names another model than ``identity``'s:
    blockkv's export names it by config fingerprint and tokenizer hash (weights,
    revision, KV quantisation, template), ``mlx_lm.cache_prompt`` by the
    ``--model`` it was given (a directory's name or a repo id). A file that
    names no model is taken only with ``unlabelled``."""
    fingerprint = metadata.get("blockkv_config_fingerprint")
    if fingerprint is not None:
        if fingerprint != identity.config_fingerprint:
            raise PromptCacheFileError(f"{path}: made by {fingerprint!r}, not by this store's model "
                                       f"{identity.config_fingerprint!r}")
        if metadata.get("blockkv_tokenizer_hash") != identity.tokenizer_hash:
            raise PromptCacheFileError(f"{path}: made with another tokenizer or chat template than this store's")
        return
    name = metadata.get("model")
    if name is None:
        if not unlabelled:
            raise PromptCacheFileError(f"{path}: names no model in its metadata; import it only if you know "
                                       "which model made it (--unlabelled)")
        return
    if name.rstrip("/") != identity.model_id and Path(name.rstrip("/")).name != identity.model_id:
        raise PromptCacheFileError(f"{path}: made by model {name[:200]!r}, not {identity.model_id!r}")


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
    _check_structure(raw, path)
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
        ok = (isinstance(t, dict) and t.keys() == _TENSOR_KEYS and t.get("dtype") in _SAFETENSORS_DTYPES
              and isinstance(t.get("shape"), list) and len(t["shape"]) <= _MAX_DIMS
              and all(type(d) is int and d >= 0 for d in t["shape"])
              and isinstance(t.get("data_offsets"), list) and len(t["data_offsets"]) == 2
              and all(type(o) is int for o in t["data_offsets"]))
        if not ok:
            raise PromptCacheFileError(f"{path}: tensor {name[:80]!r} is not described as safetensors describes one")
        start, stop = t["data_offsets"]
        if not 0 <= start <= stop <= data or stop - start != math.prod(t["shape"]) * _SAFETENSORS_DTYPES[t["dtype"]]:
            raise PromptCacheFileError(f"{path}: tensor {name[:80]!r} does not fit in the file")
    return header


def _check_structure(raw: bytes, path: Path) -> None:
    """Refuse a header whose size or structure is not a safetensors header's
    before it is parsed: each step allocates at most a copy of ``raw`` (a
    substitution's pieces are bounded by the strings counted first)."""
    if raw.count(b'"') - raw.count(b'\\"') > 2 * _MAX_STRINGS:
        raise PromptCacheFileError(f"{path}: its safetensors header holds more strings than one can")
    skeleton = _STRING.sub(b'""', raw).translate(None, b" \t\r\n")
    if (skeleton.count(b"{") > MAX_TENSORS + 2 or skeleton.count(b",") > _MAX_COMMAS
            or not _SKELETON.fullmatch(skeleton)):
        raise PromptCacheFileError(f"{path}: its safetensors header is not one of tensor descriptions and metadata")


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
