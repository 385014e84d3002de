"""In-memory prefix index of one namespace: a radix trie over token sequences.

``find`` must be a pure index lookup that stays fast at 100k entries, so a
linear scan computing a common prefix per entry is out. Each trie node keeps,
in insertion order, the sequence number of every item stored in its subtree;
the seed's rules then reduce to walking the prompt once and asking, deepest
level first, for the first eligible item.

What it holds per item is bounded whatever the item's length (issue #45): an
edge's label is a range of some item below it (``src``, ``start``, ``stop``),
read through ``tokens_of`` when a walk compares it, so the tokens can stay
paged in the index; a node's items are an array of 8-byte sequence numbers.
An item costs a node or two, its sequence number in each node on its path
(one per item it continues or shares a branch point with) and a few
dictionary slots. Without a ``tokens_of`` the trie keeps each item's tokens
itself (tools and tests).
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar

import numpy as np

_NUMPY_MIN = 32  # below this a Python loop beats numpy's call overhead


class Indexed(Protocol):
    """What the trie needs to know of an item."""

    @property
    def id(self) -> str: ...
    @property
    def length(self) -> int: ...
    @property
    def trimmable(self) -> bool: ...
    @property
    def minimum_reusable_offset(self) -> int: ...


T = TypeVar("T", bound=Indexed)
TokensOf = Callable[[str], "np.ndarray | None"]  # an item's tokens by id; None if no longer there


def common_prefix_length(a: np.ndarray, b: np.ndarray, start: int = 0) -> int:
    """Length of the common prefix of ``a`` and ``b[start:]``."""
    m = min(len(a), len(b) - start)
    if m <= 0:
        return 0
    if a.dtype == b.dtype and a[:m].tobytes() == b[start : start + m].tobytes():
        return m  # the common case on a trie edge: the whole label matches (one memcmp)
    if m < _NUMPY_MIN:
        for i in range(m):
            if a[i] != b[start + i]:
                return i
        return m
    diff = np.flatnonzero(a[:m] != b[start : start + m])
    return int(diff[0]) if len(diff) else m


class _Node:
    """An edge and the node it leads to. The label is ``src``'s tokens
    ``[start:stop]`` (depths: every item below has the same tokens there)."""

    __slots__ = ("below", "children", "ending", "key", "parent", "src", "start", "stop")

    def __init__(self, src: str, start: int, stop: int, key: int, parent: _Node | None,
                 below: array | None = None) -> None:
        self.src, self.start, self.stop, self.key, self.parent = src, start, stop, key, parent
        self.children: dict[int, _Node] = {}
        self.ending: list[int] = []  # sequence numbers of the items whose tokens end here
        self.below = below if below is not None else array("q")  # every item in the subtree, ascending

    def holds(self, seq: int) -> bool:
        i = bisect_left(self.below, seq)
        return i < len(self.below) and self.below[i] == seq


class PrefixIndex(Generic[T]):
    """Radix trie of items keyed by their token sequences (one namespace)."""

    def __init__(self, tokens_of: TokensOf | None = None) -> None:
        self._root = _Node("", 0, 0, -1, None)
        self._kept: dict[str, np.ndarray] | None = {} if tokens_of is None else None
        self._tokens_of = tokens_of if tokens_of is not None else self._kept_tokens
        self._items: dict[int, T] = {}  # by sequence number: insertion order
        self._where: dict[str, tuple[int, _Node]] = {}  # id -> (sequence number, node its tokens end at)
        self._next = 0

    def _kept_tokens(self, item_id: str) -> np.ndarray | None:
        assert self._kept is not None
        return self._kept.get(item_id)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._items.values()))

    def _source(self, node: _Node, tokens_of: TokensOf) -> np.ndarray | None:
        """The tokens of an item below ``node``: its ``src``'s, or if they are gone
        (removed by another process, not yet followed) another's below it; None
        if none is there. Every label from the root to ``node`` is a range of them."""
        tokens = tokens_of(node.src)
        if tokens is None:
            for seq in node.below:
                tokens = tokens_of(self._items[seq].id)
                if tokens is not None:
                    node.src = self._items[seq].id
                    break
        return tokens

    def _label(self, node: _Node, tokens_of: TokensOf) -> np.ndarray:
        """The node's edge label (``_source``); empty if no item's tokens are there."""
        tokens = self._source(node, tokens_of)
        return tokens[node.start : node.stop] if tokens is not None else np.empty(0, np.uint32)

    def add(self, item: T, tokens: np.ndarray, tokens_of: TokensOf | None = None) -> None:
        """Insert ``item``; later inserts rank after earlier ones on ties."""
        if item.id in self._where:
            raise ValueError(f"item {item.id} is already indexed")
        read = tokens_of or self._tokens_of
        seq, self._next = self._next, self._next + 1
        self._items[seq] = item
        if self._kept is not None:
            self._kept[item.id] = tokens
        node, depth = self._root, 0
        node.below.append(seq)
        while depth < len(tokens):
            key = int(tokens[depth])
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(item.id, depth, len(tokens), key, node)
                child.below.append(seq)
                node = child
                break
            label = self._label(child, read)
            if not len(label):
                raise LookupError(f"the tokens of every item under {child.src} are gone")
            m = common_prefix_length(label, tokens, depth)
            if m < len(label):  # split the edge at m
                mid = _Node(child.src, child.start, child.start + m, key, node, array("q", child.below))
                child.start += m
                child.key, child.parent = int(label[m]), mid
                mid.children[child.key] = child
                node.children[key] = child = mid
            child.below.append(seq)
            node, depth = child, depth + m
        node.ending.append(seq)
        self._where[item.id] = (seq, node)

    def remove(self, item_id: str) -> None:
        """Forget an item; needs none of its tokens (they may be gone already)."""
        found = self._where.pop(item_id, None)
        if found is None:
            return
        seq, node = found
        del self._items[seq]
        if self._kept is not None:
            del self._kept[item_id]
        node.ending.remove(seq)
        n: _Node | None = node
        while n is not None:
            del n.below[bisect_left(n.below, seq)]
            parent = n.parent
            if parent is not None and not n.below:
                del parent.children[n.key]
            elif n.src == item_id and n.below:
                n.src = self._items[n.below[0]].id  # any item below has the same tokens on this edge
            n = parent

    def _descend(self, tokens: np.ndarray, read: TokensOf) -> tuple[list[tuple[int, _Node]], tuple[int, _Node] | None]:
        """The nodes ``tokens`` fully match, with their depths (root first), and,
        when the match ends inside an edge, that edge's node with the match depth.

        The edges the tokens' keys lead down are found first, then checked at
        once against one item below the deepest of them (every label on the way
        is a range of its tokens): one read of an item's tokens a lookup, not
        one per edge, when they are paged. An edge with no item's tokens there
        matches nothing."""
        path = [(0, self._root)]
        chain: list[_Node] = []
        node = self._root
        while node.stop < len(tokens):  # a node's depth is its label's stop
            child = node.children.get(int(tokens[node.stop]))
            if child is None:
                break
            chain.append(child)
            node = child
        source: np.ndarray | None = None
        while chain:
            source = self._source(chain[-1], read)
            if source is not None:
                break
            chain.pop()
        if source is None:
            return path, None
        m = common_prefix_length(source[: chain[-1].stop], tokens)
        for child in chain:
            if m < child.stop:
                return path, ((m, child) if m > child.start else None)
            path.append((child.stop, child))
        return path, None

    def _walk(self, prompt: np.ndarray, read: TokensOf) -> tuple[list[tuple[int, _Node, _Node | None]], int]:
        """Levels of the prompt's path, deepest first: (depth, node, excluded child).

        Every item under ``node`` but not under ``excluded`` shares exactly
        ``depth`` leading tokens with the prompt. Also returns the match depth.
        """
        path, partial = self._descend(prompt, read)
        below: list[_Node | None] = [*(n for _, n in path[1:]), partial[1] if partial else None]
        levels = [(depth, node, child) for (depth, node), child in zip(path, below)]
        if partial is not None:
            levels.append((partial[0], partial[1], None))
        return levels[::-1], levels[-1][0]

    def find(self, prompt: np.ndarray, tokens_of: TokensOf | None = None) -> tuple[T, int] | None:
        """The seed's ``find`` rule: longest usable prefix, capped at len-1.

        Skip p == 0, p below an item's minimum reusable offset, and an item
        longer than p that cannot trim; on equal p the earliest item wins.
        """
        cap = len(prompt) - 1
        best: int | None = None
        best_p = 0
        levels, _ = self._walk(prompt, tokens_of or self._tokens_of)
        for depth, node, excluded in levels:
            p = min(depth, cap)
            if p <= 0 or p < best_p:
                break
            for seq in node.below:  # ascending: the first eligible is the earliest
                item = self._items[seq]
                if p < item.minimum_reusable_offset or (item.length > p and not item.trimmable):
                    continue
                if excluded is not None and excluded.holds(seq):
                    continue
                if best is None or seq < best:
                    best, best_p = seq, p
                break
        return (self._items[best], best_p) if best is not None else None

    def prefixes_of(self, tokens: np.ndarray, tokens_of: TokensOf | None = None) -> list[T]:
        """Items whose tokens are a prefix of ``tokens`` (equal included), shortest first."""
        path, _ = self._descend(tokens, tokens_of or self._tokens_of)
        return [self._items[seq] for _, node in path for seq in node.ending]

    def exact(self, tokens: np.ndarray, tokens_of: TokensOf | None = None) -> T | None:
        """The latest item whose tokens are ``tokens``."""
        path, _ = self._descend(tokens, tokens_of or self._tokens_of)
        depth, node = path[-1]
        return self._items[node.ending[-1]] if depth == len(tokens) and node.ending else None

    def has_durable_prefix(self, tokens: np.ndarray, tokens_of: TokensOf | None = None) -> bool:
        """Some item has ``tokens`` as a prefix and can be cut back to exactly it."""
        n = len(tokens)
        levels, depth = self._walk(tokens, tokens_of or self._tokens_of)
        if depth < n:
            return False
        _, node, _ = levels[0]
        return any(
            n >= item.minimum_reusable_offset and (item.length == n or item.trimmable)
            for item in map(self._items.__getitem__, node.below)
        )
