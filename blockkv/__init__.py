"""blockkv: an SSD cold tier for MLX prompt/KV caches.

Entries are small header files that reference deduplicated, content-addressed
tensor blocks; an LMDB table of refcounts and last-use times makes open and
find fast and can always be rebuilt from the files.
"""

from .codec import minimum_reusable_offset, register_codec, trimmable
from .errors import (
    BlockKVError,
    BlockMissingError,
    CorruptBlockError,
    CorruptError,
    CorruptHeaderError,
    NewerFormatError,
)
from .check import CheckReport
from .directory import list_fingerprints
from .records import Entry, GenerationCheckpoint, Loaded, Match
from .store import BlockStore

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
    "list_fingerprints",
    "minimum_reusable_offset",
    "register_codec",
    "trimmable",
]
__version__ = "0.1.0"
