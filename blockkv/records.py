"""What an entry is: the records the truth layer (header files) and the
in-memory catalog hand around, with no storage behind them.

``EntryRecord`` is an entry as its header file states it (the index keeps a
copy of it, directory.py reads it from a header); ``Entry`` is what callers
of the store see; ``Match`` and ``Loaded`` are what ``find`` and ``restore``
return; ``CheckReport`` is what a check of a directory or a bucket found.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

CHECKPOINT_NS = "__generation_checkpoint__:"  # reserved: no caller's ns may start with it


@dataclass(frozen=True)
class EntryRecord:
    """An entry as its header file states it, in the form the index keeps."""

    id: str
    ns: str
    path: str  # header path relative to the fingerprint directory
    header_bytes: int
    blocks: tuple[str, ...]
    trimmable: bool
    minimum_reusable_offset: int
    checkpoint: dict[str, Any] | None
    attachments: tuple[str, ...]
    owner: str  # Identity.digest() of the header: another identity's entry is kept, never served
    tokens: np.ndarray  # uint32


@dataclass(frozen=True)
class GenerationCheckpoint:
    """An in-flight generation: ``tokens`` = prompt + output so far."""

    key: str
    original_prompt_tokens: int
    cache_ns: str = ""
    meta: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "original_prompt_tokens": self.original_prompt_tokens,
                "cache_ns": self.cache_ns, "meta": dict(self.meta)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> GenerationCheckpoint:
        return cls(str(d["key"]), int(d["original_prompt_tokens"]), str(d.get("cache_ns", "")),
                   dict(d.get("meta") or {}))


class Paged(Protocol):
    """Where an entry's tokens and block names are read when asked, so that a
    catalog of many long entries holds neither (local/catalog.py: the header
    files and the index; local/header_pages.py: a handed-out entry's header)."""

    def tokens(self, entry_id: str) -> np.ndarray: ...
    def blocks(self, entry_id: str) -> tuple[str, ...]: ...


class Entry:
    """One stored prompt cache, as the index knows it (no tensors). Immutable.

    ``token_array`` and ``blocks`` are either held or paged (``Paged``: read
    each time they are asked for; ``KeyError`` once the entry is no longer
    stored). ``length`` is always held."""

    __slots__ = (
        "_blocks",
        "_nblocks",
        "_tokens",
        "attachments",
        "checkpoint",
        "header_bytes",
        "id",
        "last_use",
        "length",
        "minimum_reusable_offset",
        "nbytes",
        "ns",
        "trimmable",
    )
    id: str
    ns: str
    _tokens: np.ndarray | Paged
    nbytes: int  # header + every block it references
    header_bytes: int
    _blocks: tuple[str, ...] | Paged
    last_use: float
    trimmable: bool
    minimum_reusable_offset: int
    checkpoint: GenerationCheckpoint | None
    attachments: tuple[str, ...]
    length: int  # tokens
    _nblocks: int  # distinct blocks, for the repr

    def __init__(self, id: str, ns: str, token_array: np.ndarray | Paged, nbytes: int, header_bytes: int,
                 blocks: tuple[str, ...] | Paged, last_use: float, trimmable: bool, minimum_reusable_offset: int,
                 checkpoint: GenerationCheckpoint | None, attachments: tuple[str, ...], *,
                 length: int | None = None, nblocks: int | None = None) -> None:
        if length is None:
            if not isinstance(token_array, np.ndarray):
                raise TypeError("an entry whose tokens are paged needs its length")
            length = len(token_array)
        if nblocks is None:
            if not isinstance(blocks, tuple):
                raise TypeError("an entry whose block names are paged needs their count")
            nblocks = len(blocks)
        for name, value in (("id", id), ("ns", ns), ("_tokens", token_array), ("nbytes", nbytes),
                            ("header_bytes", header_bytes), ("_blocks", blocks), ("last_use", last_use),
                            ("trimmable", trimmable), ("minimum_reusable_offset", minimum_reusable_offset),
                            ("checkpoint", checkpoint), ("attachments", attachments), ("length", length),
                            ("_nblocks", nblocks)):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Entry is immutable: cannot set {name}")

    @classmethod
    def of(cls, record: EntryRecord, nbytes: int, last_use: float, paged: Paged | None = None) -> Entry:
        """The entry an index record describes (``nbytes``: its header plus its
        blocks; ``paged``: where its tokens and block names are read instead of held)."""
        return cls(
            record.id, record.ns, paged or record.tokens, nbytes, record.header_bytes, paged or record.blocks,
            last_use, record.trimmable, record.minimum_reusable_offset,
            GenerationCheckpoint.from_json(record.checkpoint) if record.checkpoint else None,
            record.attachments, length=len(record.tokens), nblocks=len(record.blocks),
        )

    def holding(self, tokens: np.ndarray | Paged, blocks: tuple[str, ...] | Paged) -> Entry:
        """A copy that holds ``tokens`` and ``blocks`` (a paged entry's, read
        now, or what it is read from): readable once the entry is removed or
        its store closed."""
        return Entry(self.id, self.ns, tokens, self.nbytes, self.header_bytes, blocks, self.last_use,
                     self.trimmable, self.minimum_reusable_offset, self.checkpoint, self.attachments,
                     length=self.length, nblocks=len(blocks) if isinstance(blocks, tuple) else self._nblocks)

    @property
    def token_array(self) -> np.ndarray:
        t = self._tokens
        return t if isinstance(t, np.ndarray) else t.tokens(self.id)

    @property
    def blocks(self) -> tuple[str, ...]:
        b = self._blocks
        return b if isinstance(b, tuple) else b.blocks(self.id)

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self.token_array.tolist())

    def __repr__(self) -> str:
        """Counts, not contents: an entry of 100,000 tokens has hundreds of blocks."""
        return (f"Entry(id={self.id!r}, ns={self.ns!r}, tokens={self.length}, nbytes={self.nbytes}, "
                f"blocks={self._nblocks}, last_use={self.last_use!r}, trimmable={self.trimmable}, "
                f"minimum_reusable_offset={self.minimum_reusable_offset}, checkpoint={self.checkpoint!r}, "
                f"attachments={self.attachments!r})")


@dataclass(frozen=True)
class Match:
    entry: Entry
    prefix_len: int


@dataclass(frozen=True)
class LocalChanges:
    """What entered and left a store's local directory since a position in its
    index's change log (``BlockStore.changes``). ``reset``: the log could not
    reach back there, and ``added`` is then every entry (the caller starts over)."""

    position: tuple[bytes, int]
    reset: bool
    added: tuple[EntryRecord, ...]
    removed: tuple[str, ...]


@dataclass
class Loaded:
    caches: list[Any]
    tokens: tuple[int, ...]
    attachments: dict[str, Any]
    checkpoint: GenerationCheckpoint | None


@dataclass
class CheckReport:
    """What ``check`` found; ``actions`` is what a repair did about it."""

    entries: int = 0
    blocks: int = 0
    dangling: list[str] = field(default_factory=list)  # entry ids with a block missing or corrupt
    orphan_blocks: list[str] = field(default_factory=list)  # block files nothing references
    refcount_mismatches: list[tuple[str, int, int]] = field(default_factory=list)  # (name, index, truth)
    corrupt_headers: list[str] = field(default_factory=list)  # paths relative to the fingerprint dir
    corrupt_blocks: list[str] = field(default_factory=list)
    foreign_headers: list[str] = field(default_factory=list)  # another identity's: kept, never served
    newer_headers: list[str] = field(default_factory=list)  # a newer blockkv's format: kept, never served
    unreadable: list[str] = field(default_factory=list)  # headers, blocks and live intent files not read
    oversized_blocks: list[str] = field(default_factory=list)  # longer than their frame can be: not read
    stale_tmp: list[str] = field(default_factory=list)  # temp files of dead writers (relative paths)
    in_flight: list[str] = field(default_factory=list)  # blocks of stores in progress: not findings
    index_missing: bool = False
    actions: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.dangling or self.orphan_blocks or self.refcount_mismatches
                    or self.corrupt_headers or self.corrupt_blocks or self.stale_tmp or self.index_missing
                    or self.unreadable or self.oversized_blocks or self.newer_headers)

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "clean": self.clean}
