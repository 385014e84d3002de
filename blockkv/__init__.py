"""blockkv: an SSD cold tier for MLX prompt/KV caches.

Entries are small header files that reference deduplicated, content-addressed
tensor blocks; an LMDB table of refcounts and last-use times makes open and
find fast and can always be rebuilt from the files.

The public names below are imported the first time they are used (PEP 562):
``import blockkv`` and the ``blockkv`` console script's ``ls``/``stats`` load
only what they use, and never mlx-lm (``format/kinds.py`` says why).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from blockkv import moved
from blockkv.errors import (
    BlockKVError,
    BlockMissingError,
    CorruptBlockError,
    CorruptError,
    CorruptHeaderError,
    LockTimeout,
    NewerFormatError,
)

if TYPE_CHECKING:
    from blockkv.format.codec import minimum_reusable_offset, register_codec, trimmable
    from blockkv.local.directory import list_fingerprints
    from blockkv.local.read_only import ReadOnlyStore
    from blockkv.records import CheckReport, Entry, EntryRecord, GenerationCheckpoint, Loaded, LocalChanges, Match
    from blockkv.store import BlockStore

_LAZY = {
    "BlockStore": "blockkv.store",
    "CheckReport": "blockkv.records",
    "Entry": "blockkv.records",
    "EntryRecord": "blockkv.records",
    "LocalChanges": "blockkv.records",
    "GenerationCheckpoint": "blockkv.records",
    "Loaded": "blockkv.records",
    "Match": "blockkv.records",
    "ReadOnlyStore": "blockkv.local.read_only",
    "list_fingerprints": "blockkv.local.directory",
    "minimum_reusable_offset": "blockkv.format.codec",
    "register_codec": "blockkv.format.codec",
    "trimmable": "blockkv.format.codec",
}

__all__ = [
    "BlockKVError",
    "BlockMissingError",
    "BlockStore",
    "CheckReport",
    "CorruptBlockError",
    "CorruptError",
    "CorruptHeaderError",
    "Entry",
    "EntryRecord",
    "GenerationCheckpoint",
    "LocalChanges",
    "Loaded",
    "LockTimeout",
    "Match",
    "NewerFormatError",
    "ReadOnlyStore",
    "list_fingerprints",
    "minimum_reusable_offset",
    "register_codec",
    "trimmable",
]
__version__ = "0.2.0"

moved.install()  # old import paths of moved modules, for one minor version (moved.py)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'blockkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
