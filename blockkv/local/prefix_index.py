"""In-memory prefix index of one namespace: a radix trie over token sequences.

``find`` must be a pure index lookup that stays fast at 10k entries, so a
linear scan computing a common prefix per entry is out. Each trie node keeps,
in insertion order, every item stored in its subtree; the seed's rules then
reduce to walking the prompt once and asking, deepest level first, for the
first eligible item.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
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


@dataclass(eq=False, slots=True)
class _Node(Generic[T]):
    label: np.ndarray
    children: dict[int, _Node[T]] = field(default_factory=dict)
    ending: dict[str, T] = field(default_factory=dict)  # items whose tokens end here
    below: dict[str, T] = field(default_factory=dict)  # every item in the subtree, insertion order


class PrefixIndex(Generic[T]):
    """Radix trie of items keyed by their token sequences (one namespace)."""

    def __init__(self) -> None:
        self._root: _Node[T] = _Node(np.empty(0, np.uint32))
        self._tokens: dict[str, np.ndarray] = {}
        self._seq: dict[str, int] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self._tokens)

    def __iter__(self) -> Iterator[T]:
        return iter(self._root.below.values())

    def add(self, item: T, tokens: np.ndarray) -> None:
        """Insert ``item``; later inserts rank after earlier ones on ties."""
        if item.id in self._tokens:
            raise ValueError(f"item {item.id} is already indexed")
        self._tokens[item.id] = tokens
        self._seq[item.id] = self._next
        self._next += 1
        node, depth = self._root, 0
        node.below[item.id] = item
        while depth < len(tokens):
            child = node.children.get(int(tokens[depth]))
            if child is None:
                child = _Node(tokens[depth:])
                node.children[int(tokens[depth])] = child
                child.below[item.id] = item
                child.ending[item.id] = item
                return
            m = common_prefix_length(child.label, tokens, depth)
            if m < len(child.label):  # split the edge at m
                mid: _Node[T] = _Node(child.label[:m], below=dict(child.below))
                child.label = child.label[m:]
                mid.children[int(child.label[0])] = child
                node.children[int(tokens[depth])] = mid
                child = mid
            child.below[item.id] = item
            node, depth = child, depth + m
        node.ending[item.id] = item

    def remove(self, item_id: str) -> None:
        tokens = self._tokens.pop(item_id, None)
        if tokens is None:
            return
        del self._seq[item_id]
        path = [self._root]
        node, depth = self._root, 0
        while depth < len(tokens):
            node = node.children[int(tokens[depth])]
            path.append(node)
            depth += len(node.label)
        node.ending.pop(item_id, None)
        for n in path:
            n.below.pop(item_id, None)
        for parent, child in zip(reversed(path[:-1]), reversed(path[1:])):
            if child.below:
                break
            del parent.children[int(child.label[0])]

    def _descend(self, tokens: np.ndarray) -> tuple[list[tuple[int, _Node[T]]], tuple[int, _Node[T]] | None]:
        """The nodes ``tokens`` fully match, with their depths (root first), and,
        when the match ends inside an edge, that edge's node with the match depth."""
        path = [(0, self._root)]
        node, depth = self._root, 0
        while depth < len(tokens):
            child = node.children.get(int(tokens[depth]))
            if child is None:
                break
            m = common_prefix_length(child.label, tokens, depth)
            if m < len(child.label):
                return path, (depth + m, child)
            node, depth = child, depth + m
            path.append((depth, node))
        return path, None

    def _walk(self, prompt: np.ndarray) -> tuple[list[tuple[int, _Node[T], _Node[T] | None]], int]:
        """Levels of the prompt's path, deepest first: (depth, node, excluded child).

        Every item under ``node`` but not under ``excluded`` shares exactly
        ``depth`` leading tokens with the prompt. Also returns the match depth.
        """
        path, partial = self._descend(prompt)
        below: list[_Node[T] | None] = [n for _, n in path[1:]] + [partial[1] if partial else None]
        levels = [(depth, node, child) for (depth, node), child in zip(path, below)]
        if partial is not None:
            levels.append((partial[0], partial[1], None))
        return levels[::-1], levels[-1][0]

    def find(self, prompt: np.ndarray) -> tuple[T, int] | None:
        """The seed's ``find`` rule: longest usable prefix, capped at len-1.

        Skip p == 0, p below an item's minimum reusable offset, and an item
        longer than p that cannot trim; on equal p the earliest item wins.
        """
        cap = len(prompt) - 1
        best: T | None = None
        best_p = 0
        levels, _ = self._walk(prompt)
        for depth, node, excluded in levels:
            p = min(depth, cap)
            if p <= 0 or p < best_p:
                break
            skip = excluded.below if excluded is not None else {}
            for item in node.below.values():  # insertion order: the first eligible is the earliest
                if item.id in skip or p < item.minimum_reusable_offset:
                    continue
                if item.length > p and not item.trimmable:
                    continue
                if best is None or self._seq[item.id] < self._seq[best.id]:
                    best, best_p = item, p
                break
        return (best, best_p) if best is not None else None

    def prefixes_of(self, tokens: np.ndarray) -> list[T]:
        """Items whose tokens are a prefix of ``tokens`` (equal included), shortest first."""
        path, _ = self._descend(tokens)
        return [item for _, node in path for item in node.ending.values()]

    def has_durable_prefix(self, tokens: np.ndarray) -> bool:
        """Some item has ``tokens`` as a prefix and can be cut back to exactly it."""
        n = len(tokens)
        levels, depth = self._walk(tokens)
        if depth < n:
            return False
        _, node, _ = levels[0]
        return any(
            n >= item.minimum_reusable_offset and (item.length == n or item.trimmable)
            for item in node.below.values()
        )
