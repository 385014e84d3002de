"""blockkv: an SSD cold tier for MLX prompt/KV caches.

Entries are small header files that reference deduplicated, content-addressed
tensor blocks; an LMDB table of refcounts and last-use times makes open and
find fast and can always be rebuilt from the files.
"""

from blockkv.errors import (
    BlockKVError,
    BlockMissingError,
    CorruptBlockError,
    CorruptError,
    CorruptHeaderError,
    NewerFormatError,
)
from blockkv.format.codec import minimum_reusable_offset, register_codec, trimmable
from blockkv.local.check import CheckReport
from blockkv.local.directory import list_fingerprints
from blockkv.local.read_only import ReadOnlyStore
from blockkv.records import Entry, GenerationCheckpoint, Loaded, Match
from blockkv.store import BlockStore

__all__ = [
    "BlockKVError",
    "BlockMissingError",
    "BlockStore",
    "CheckReport",
    "CorruptBlockError",
    "CorruptError",
    "CorruptHeaderError",
    "Entry",
    "GenerationCheckpoint",
    "Loaded",
    "Match",
    "NewerFormatError",
    "ReadOnlyStore",
    "list_fingerprints",
    "minimum_reusable_offset",
    "register_codec",
    "trimmable",
]
__version__ = "0.1.0"
