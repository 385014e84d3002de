"""One store handle's local pieces, built in one direction.

Each piece is made from pieces made before it, so none needs a callback into
the store or into a piece made later: the directory and its writers' intents,
recovery, the catalog and the index keeper, retention (every decision to
delete), commits (the write order, under retention's lock), the disk tier
and the adoptions of what restores fetched from the tier behind the disk.
That tier is made before them (a wrong ``remote=`` raises before anything is
written) and handed the local catalog after them (``Tier.open``); of it the
pieces take only how to heal a block and how to drop the copies of entries
the store's rules replaced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from blockkv.errors import Warnings
from blockkv.format.header import Identity
from blockkv.fs import FileLayer
from blockkv.local.adoptions import Adoptions
from blockkv.local.catalog import Catalog
from blockkv.local.commit import Commits
from blockkv.local.directory import Directory
from blockkv.local.disk_tier import DiskTier, Heal
from blockkv.local.executors import Executors
from blockkv.local.header_pages import HeaderPages
from blockkv.local.index_keeper import IndexKeeper
from blockkv.local.locks import DirLock
from blockkv.local.recovery import Recovery
from blockkv.local.retention import Retention
from blockkv.local.writers import IntentFile
from blockkv.records import Entry


@dataclass
class HandleSettings:
    """The handle's options as they are now: the cap may follow a caller's
    ``limit``, and a tool may set ``gc_grace`` on an open handle."""

    cap: int
    limit: Callable[[], int] | None
    gc_grace: float
    tmp_grace: float
    lock_timeout: float
    namespace_share: float | None  # the most of the cap one namespace but the default holds

    @property
    def max_bytes(self) -> int:
        return self.limit() if self.limit is not None else self.cap


@dataclass(frozen=True)
class Options:
    """What the local pieces are made with, fixed for the handle's life."""

    verify: bool | str
    block_tokens: int
    compression: str | None
    index_map_size: int


class LocalHandle:
    """The local pieces of one ``BlockStore``."""

    def __init__(self, root: Path, directory: Directory, settings: HandleSettings, options: Options, *,
                 heal: Heal, replaced: Callable[[Iterable[Entry]], None], executor: Executors,
                 clock: Callable[[], float], warn: Warnings, stats: dict[str, float]) -> None:
        identity: Identity = directory.identity
        fs: FileLayer = directory.fs
        owner = identity.digest()
        directory.create(root)
        self.intents = IntentFile(directory.path / "writers")
        self.recovery = Recovery(directory, self.intents.directory, fs, clock, owner,
                                 tmp_grace=settings.tmp_grace, map_size=options.index_map_size, warn=warn)
        self.catalog = Catalog({owner}, clock, kin=directory.modes.keys() - {owner},  # the other mode's: kin
                               headers=HeaderPages(directory))  # tokens read from headers once loaded
        self.keeper = IndexKeeper(directory, DirLock(directory.path / "LOCK"), self.recovery, self.catalog,
                                  self.intents.directory, map_size=options.index_map_size,
                                  lock_timeout=settings.lock_timeout, warn=warn)
        self.retention = Retention(directory, self.keeper, self.catalog, settings, clock, warn)
        self.commits = Commits(directory, identity, self.intents, fs, clock, warn, keeper=self.keeper,
                               locked=self.retention.locked, executor=executor, block_tokens=options.block_tokens,
                               compression=options.compression)
        self.disk = DiskTier(directory, identity, options.verify, executor, self.retention, heal,
                             clock, stats)  # a rotten block healed from the tier
        self.adoptions = Adoptions(self.commits, settings, self.retention.landed, replaced)
