"""ReferenceStore: the store's rules (issue #3, the seed's file-per-entry tier)
as a small in-memory model, written from the rules rather than from the block
store's code, so a test can compare the two and trust the disagreement.

It knows nothing about mlx, files or blocks beyond names and sizes: an entry
is tokens, a namespace, two trim facts, its header size, the names and sizes
of the blocks it references, and an opaque payload (what a test stored, to
compare restores against).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

CHECKPOINT_NS_PREFIX = "__generation_checkpoint__:"


def checkpoint_ns(key: str) -> str:
    """The namespace generation checkpoints of ``key`` live in (rule 6)."""
    return f"{CHECKPOINT_NS_PREFIX}{key}"


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class ModelCheckpoint:
    """What rule 6 needs of a generation checkpoint."""

    key: str
    original_prompt_tokens: int
    cache_ns: str = ""


@dataclass(frozen=True)
class ModelEntry:
    """One stored entry as the rules see it.

    ``header_bytes`` and ``blocks`` (name -> size) let the model count bytes
    the way the store does: headers plus each unique block once (rule 7).
    ``seq`` (store order) and ``last_use`` are assigned by the model."""

    id: str
    ns: str
    tokens: tuple[int, ...]
    trimmable: bool
    minimum_reusable_offset: int = 0
    header_bytes: int = 0
    blocks: Mapping[str, int] = field(default_factory=dict)
    checkpoint: ModelCheckpoint | None = None
    payload: Any = None
    seq: int = 0
    last_use: int = 0

    @property
    def nbytes(self) -> int:
        """Header plus each of its blocks once: what the over-cap refusal weighs."""
        return self.header_bytes + sum(self.blocks.values())


@dataclass(frozen=True)
class StoreOutcome:
    """What one ``store`` did: whether it stored, and which ids it removed and why."""

    stored: bool
    replaced: tuple[str, ...] = ()
    superseded: tuple[str, ...] = ()
    evicted: tuple[str, ...] = ()

    @property
    def removed(self) -> tuple[str, ...]:
        return self.replaced + self.superseded + self.evicted


class ReferenceStore:
    """The oracle: find / find_exact / has_durable_prefix / store / remove /
    LRU eviction / generation checkpoints, by the numbered rules."""

    def __init__(self) -> None:
        self._entries: dict[str, ModelEntry] = {}
        self._ticks = itertools.count(1)

    # -- views --------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._entries

    def __getitem__(self, entry_id: str) -> ModelEntry:
        return self._entries[entry_id]

    def entries(self) -> Iterator[ModelEntry]:
        """Present entries, oldest stored first."""
        return iter(sorted(self._entries.values(), key=lambda e: e.seq))

    @property
    def total_bytes(self) -> int:
        """Headers plus unique blocks of present entries (rule 7)."""
        return self.bytes_of(self._entries.values())

    @staticmethod
    def bytes_of(entries: Iterable[ModelEntry]) -> int:
        """Headers plus unique blocks of ``entries``."""
        headers = 0
        blocks: dict[str, int] = {}
        for e in entries:
            headers += e.header_bytes
            blocks.update(e.blocks)
        return headers + sum(blocks.values())

    @property
    def longest_durable_prefix_tokens(self) -> int:
        return max((len(e.tokens) for e in self._entries.values()), default=0)

    # -- lookups (rules 1-3, 6) -------------------------------------------
    def find(self, prompt: Sequence[int], ns: str = "") -> tuple[ModelEntry, int] | None:
        """Rule 1: longest usable common prefix, capped at len(prompt) - 1; the
        oldest entry wins a tie."""
        best: tuple[ModelEntry, int] | None = None
        cap = len(prompt) - 1
        for e in self.entries():
            if e.ns != ns:
                continue
            p = min(common_prefix_len(e.tokens, prompt), cap)
            if p <= 0 or p < e.minimum_reusable_offset:
                continue
            if len(e.tokens) > p and not e.trimmable:
                continue
            if best is None or p > best[1]:
                best = (e, p)
        return best

    def find_exact(self, tokens: Sequence[int], ns: str = "") -> ModelEntry | None:
        """Rule 2: same ns, identical tokens."""
        key = tuple(tokens)
        for e in self.entries():
            if e.ns == ns and e.tokens == key:
                return e
        return None

    def has_durable_prefix(self, tokens: Sequence[int], ns: str = "") -> bool:
        """Rule 3: some same-ns entry could seed every token of ``tokens``."""
        n = len(tokens)
        for e in self._entries.values():
            if e.ns != ns or len(e.tokens) < n or n < e.minimum_reusable_offset:
                continue
            if common_prefix_len(e.tokens, tokens) != n:
                continue
            if len(e.tokens) == n or e.trimmable:
                return True
        return False

    def find_generation_checkpoint(
        self, prompt: Sequence[int], key: str, cache_ns: str = ""
    ) -> ModelEntry | None:
        """Rule 6: the longest checkpoint of ``key`` that extends this exact prompt."""
        best: ModelEntry | None = None
        n = len(prompt)
        for e in self.entries():
            c = e.checkpoint
            if c is None or c.key != key or c.cache_ns != cache_ns:
                continue
            if c.original_prompt_tokens != n or len(e.tokens) <= n:
                continue
            if common_prefix_len(e.tokens, prompt) != n:
                continue
            if best is None or len(e.tokens) > len(best.tokens):
                best = e
        return best

    # -- mutations (rules 4, 6, 7) ----------------------------------------
    def store(self, entry: ModelEntry, max_bytes: int) -> StoreOutcome:
        """Rule 4: refuse over cap; replace the identical entry; supersede the
        trimmable entry's prefixes; evict to cap. A checkpoint entry then
        supersedes the older checkpoints of its key (rule 6)."""
        if entry.nbytes > max_bytes:
            return StoreOutcome(stored=False)
        if entry.id in self._entries:
            raise ValueError(f"entry id {entry.id!r} is already present")
        replaced = tuple(
            e.id for e in self.entries() if e.ns == entry.ns and e.tokens == entry.tokens
        )
        superseded: tuple[str, ...] = ()
        if entry.trimmable:
            superseded = tuple(
                e.id
                for e in self.entries()
                if e.ns == entry.ns
                and e.id not in replaced
                and len(e.tokens) < len(entry.tokens)
                and len(e.tokens) >= entry.minimum_reusable_offset
                and entry.tokens[: len(e.tokens)] == e.tokens
            )
        if entry.checkpoint is not None:
            superseded += tuple(
                e.id
                for e in self.entries()
                if e.checkpoint is not None
                and e.checkpoint.key == entry.checkpoint.key
                and e.id not in replaced
                and e.id not in superseded
            )
        for victim in replaced + superseded:
            del self._entries[victim]
        tick = next(self._ticks)
        self._entries[entry.id] = replace(entry, seq=tick, last_use=tick)
        return StoreOutcome(True, replaced, superseded, self.evict_to_cap(max_bytes))

    def store_generation_checkpoint(
        self, entry: ModelEntry, checkpoint: ModelCheckpoint, max_bytes: int
    ) -> StoreOutcome:
        """Rule 6: a checkpoint is an ordinary store in its key's namespace."""
        return self.store(
            replace(entry, ns=checkpoint_ns(checkpoint.key), checkpoint=checkpoint), max_bytes
        )

    def touch(self, entry_id: str) -> None:
        """Rule 7: a successful restore bumps last use."""
        self._entries[entry_id] = replace(self._entries[entry_id], last_use=next(self._ticks))

    def set_lru_order(self, ids: Sequence[str]) -> None:
        """Re-rank last use, least recent first: for when the store legitimately
        lost its last-use record (its LMDB accelerator was rebuilt from files)."""
        for entry_id in ids:
            self.touch(entry_id)

    def remove(self, entry_id: str) -> bool:
        """Drop an entry; False if it was not present."""
        return self._entries.pop(entry_id, None) is not None

    def remove_generation_checkpoints(self, key: str) -> tuple[str, ...]:
        gone = tuple(
            e.id for e in self.entries() if e.checkpoint is not None and e.checkpoint.key == key
        )
        for entry_id in gone:
            del self._entries[entry_id]
        return gone

    def evict_to_cap(self, max_bytes: int) -> tuple[str, ...]:
        """Rule 7: remove least recently used entries until total bytes <= cap."""
        evicted: list[str] = []
        by_age = sorted(self._entries.values(), key=lambda e: (e.last_use, e.seq))
        for victim in by_age:
            if self.total_bytes <= max_bytes:
                break
            del self._entries[victim.id]
            evicted.append(victim.id)
        return tuple(evicted)
