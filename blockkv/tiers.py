"""What ``BlockStore`` asks of the tier behind its disk, and the store without one.

The local directory answers first and keeps every invariant it has alone; a
tier (``remote/tier.py``'s ``RemoteTier``, a bucket a fleet shares) adds
entries the disk lacks, heals a block the disk holds rotten, and takes what
the store wrote. It never calls back into the store: a restore from it
returns what it fetched and what to keep of it (``Adoption``), and the store
hands that to ``local/adoptions.py``. ``NoTier`` is a store without
``remote=``: every question answered as the disk alone would.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import numpy as np

from blockkv.format.blocks import BlockRef
from blockkv.local.adoptions import Adoption
from blockkv.local.disk_tier import Read
from blockkv.records import Entry, Match

if TYPE_CHECKING:
    from blockkv.bucket.bucket import Bucket


class Tier(Protocol):
    bucket: Bucket | None
    uploaded_bytes: int

    def open(self) -> None: ...
    def close(self) -> None: ...
    def sync(self) -> int: ...
    def find(self, tokens: np.ndarray, ns: str, local: Match | None, exact: bool = False) -> Match | None: ...
    def has_durable_prefix(self, tokens: np.ndarray, ns: str) -> bool: ...
    def is_remote_only(self, entry_id: str) -> bool: ...
    def restore(self, entry: Entry, cut: int | None) -> tuple[Read, Adoption | None] | None: ...
    def adopted(self, entry_id: str) -> None: ...
    def used(self, entry: Entry) -> None: ...
    def heal_block(self, entry: Entry, block: str) -> bool: ...
    def upload(self, entry_id: str, ns: str, encoded: bytes, blocks: Iterable[BlockRef], new: set[str],
               replaced: Iterable[Entry]) -> bool: ...
    def remove_replaced(self, replaced: Iterable[Entry]) -> None: ...


class NoTier:
    """The disk alone: nothing more to find, heal or upload."""

    bucket = None
    uploaded_bytes = 0

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass

    def sync(self) -> int:
        return 0

    def find(self, tokens: np.ndarray, ns: str, local: Match | None, exact: bool = False) -> Match | None:
        return local

    def has_durable_prefix(self, tokens: np.ndarray, ns: str) -> bool:
        return False

    def is_remote_only(self, entry_id: str) -> bool:
        return False

    def restore(self, entry: Entry, cut: int | None) -> tuple[Read, Adoption | None] | None:
        return None

    def adopted(self, entry_id: str) -> None:
        pass

    def used(self, entry: Entry) -> None:
        pass

    def heal_block(self, entry: Entry, block: str) -> bool:
        return False

    def upload(self, entry_id: str, ns: str, encoded: bytes, blocks: Iterable[BlockRef], new: set[str],
               replaced: Iterable[Entry]) -> bool:
        return True

    def remove_replaced(self, replaced: Iterable[Entry]) -> None:
        pass
