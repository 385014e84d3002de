"""The radix trie against the seed's rules written as a plain scan (small alphabet: lots of sharing)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockkv.local.prefix_index import PrefixIndex


@dataclass(frozen=True)
class Item:
    id: str
    tokens: tuple[int, ...]
    trimmable: bool
    minimum_reusable_offset: int

    @property
    def length(self) -> int:
        return len(self.tokens)


def lcp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def scan_find(items: list[Item], prompt: tuple[int, ...]) -> tuple[str, int] | None:
    """The seed's find, verbatim: first item with the longest usable p wins."""
    best, best_len = None, 0
    for e in items:
        p = min(lcp(e.tokens, prompt), len(prompt) - 1)
        if p == 0 or p <= best_len or p < e.minimum_reusable_offset:
            continue
        if e.length - p > 0 and not e.trimmable:
            continue
        best, best_len = e, p
    return (best.id, best_len) if best else None


def scan_durable(items: list[Item], tokens: tuple[int, ...]) -> bool:
    return any(
        e.length >= len(tokens) and len(tokens) >= e.minimum_reusable_offset
        and e.tokens[: len(tokens)] == tokens and (e.length == len(tokens) or e.trimmable)
        for e in items
    )


seqs = st.lists(st.integers(0, 3), min_size=1, max_size=12).map(tuple)
items_st = st.lists(st.tuples(seqs, st.booleans(), st.integers(0, 4)), max_size=12)


@pytest.mark.parametrize("paged", [False, True], ids=["kept", "paged"])
@settings(max_examples=300, deadline=None)
@given(items_st, st.lists(st.integers(0, 30), max_size=6), st.lists(seqs, min_size=1, max_size=6))
def test_trie_agrees_with_the_scan(paged: bool, specs: list, removals: list[int], prompts: list) -> None:
    """Kept: the trie holds the tokens. Paged: it reads them from a table that
    forgets a removed item's tokens before the trie does (as the index does)."""
    table: dict[str, np.ndarray] = {}
    trie: PrefixIndex[Item] = PrefixIndex(table.get if paged else None)
    live: list[Item] = []
    for i, (tokens, trimmable, mro) in enumerate(specs):
        item = Item(f"e{i}", tokens, trimmable, min(mro, len(tokens)))
        table[item.id] = np.array(tokens, np.uint32)
        trie.add(item, np.array(tokens, np.uint32))
        live.append(item)
    for r in removals:
        if live:
            victim = live.pop(r % len(live))
            del table[victim.id]
            trie.remove(victim.id)
    assert len(trie) == len(live) and [e.id for e in trie] == [e.id for e in live]
    for prompt in prompts + [e.tokens for e in live]:
        arr = np.array(prompt, np.uint32)
        found = trie.find(arr)
        assert (None if found is None else (found[0].id, found[1])) == scan_find(live, prompt)
        assert trie.has_durable_prefix(arr) == scan_durable(live, prompt)
        same = [e.id for e in live if e.tokens == prompt]
        exact = trie.exact(arr)
        assert (exact.id if exact else None) == (same[-1] if same else None)
        assert [e.id for e in trie.prefixes_of(arr)] == sorted(
            (e.id for e in live if prompt[: e.length] == e.tokens),
            key=lambda i: (len(next(e for e in live if e.id == i).tokens), int(i[1:])))
