"""What ``BlockStore`` asks of its tiers, and the store without a second one.

Both tiers present one ``Tier``: an entry read back, with what to keep
locally of what the read fetched (``Restored``). The local disk
(``local/disk_tier.py``'s ``DiskTier``) answers first and keeps every
invariant it has alone, with nothing to keep; the tier behind it
(``BackingTier``: ``remote/tier.py``'s ``RemoteTier``, a bucket a fleet
shares) also adds entries the disk lacks, heals a block the disk holds
rotten, and takes what the store wrote. Neither calls back into the store:
the store hands what a restore fetched to ``local/adoptions.py``.
``NoTier`` is a store without ``remote=``: every question answered as the
disk alone would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

import numpy as np

from blockkv.format.blocks import BlockRef
from blockkv.local.disk_tier import Restored
from blockkv.records import Entry, Match

if TYPE_CHECKING:
    from blockkv.bucket.bucket import Bucket


class Tier(Protocol):
    def restore(self, entry: Entry, cut: int | None) -> Restored | None: ...


class BackingTier(Tier, Protocol):
    @property
    def bucket(self) -> Bucket | None: ...
    @property
    def uploaded_bytes(self) -> int: ...

    def open(self, local_entries: Callable[[], list[Entry]]) -> None: ...
    def close(self) -> None: ...
    def sync(self) -> int: ...
    def find(self, tokens: np.ndarray, ns: str, local: Match | None, exact: bool = False) -> Match | None: ...
    def has_durable_prefix(self, tokens: np.ndarray, ns: str) -> bool: ...
    def is_remote_only(self, entry_id: str) -> bool: ...
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

    def open(self, local_entries: Callable[[], list[Entry]]) -> None:
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

    def restore(self, entry: Entry, cut: int | None) -> Restored | None:
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
