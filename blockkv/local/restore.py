"""Reading one entry back: its header, then only the blocks that cover the
prefix, each read straight into its destination array and verified there.

``EntryRead`` reads and raises; it deletes nothing. What a failure proves
(``culprit`` names the header or the block being read) is the store's to
judge: only proof of corruption drops an entry.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from blockkv.errors import BlockKVError, BlockMissingError, CorruptBlockError
from blockkv.format.codec import device_buffers
from blockkv.format.frame import decode_block, frame_layout, max_frame_bytes
from blockkv.format.header import Header, Identity
from blockkv.format.rebuild import Check, ParsedEntry, Target
from blockkv.local.directory import Directory
from blockkv.records import Entry


class IndexDisagrees(BlockKVError):
    """The header at an entry's path is valid but not the one its index row
    describes: nothing proves either wrong, so restore misses and deletes nothing."""


class EntryRead:
    """One restore of ``entry``: ``run`` rebuilds its caches; ``io`` reads and checks blocks."""

    def __init__(self, directory: Directory, identity: Identity, entry: Entry, verify: bool | str,
                 io: ThreadPoolExecutor, alloc: ThreadPoolExecutor | None = None) -> None:
        """``io`` reads and checks the blocks; ``alloc`` (one long-lived thread)
        allocates the destination arrays. glibc keeps a thread's freed chunks in
        that thread's arena for its next allocations, while the main arena hands
        large freed buffers back to the kernel: allocated on one thread, a
        handle's restores reuse the pages of its earlier ones instead of
        faulting in fresh ones (272 MiB alternating with mlx-lm's load: 3,992
        -> 32 faults, 120 -> 105 ms of CPU). Without ``alloc``, the caller's thread."""
        self._dir = directory
        self._pool = directory.pool
        self._identity = identity
        self._entry = entry
        self._verify = verify
        self._io = io
        self._alloc = alloc
        self._key: bytes | None = None  # the header's (``ParsedEntry.key``), once it is read
        self._reading = ""  # "header" while the header is read: its file gone is proof too
        self._failed: list[tuple[BaseException, str]] = []  # (error, block): a corrupt or missing block
        self.bytes_read = 0  # the header and the blocks the restore needs, as stored

    def run(self, cut: int | None) -> tuple[Header, list[Any], dict[str, Any]]:
        """The header and the caches (cut to ``cut`` tokens when given), materialised."""
        self._reading = "header"
        data = self._dir.header_bytes(self._entry.ns, self._entry.id)
        self.bytes_read += len(data)
        parsed = ParsedEntry.parse(data)
        self._reading = ""
        if (parsed.header.identity != self._identity or parsed.header.ns != self._entry.ns
                or not _same_tokens(parsed.header, self._entry)):
            raise IndexDisagrees("the header on disk is not the one indexed")
        self._key = parsed.key
        caches, attachments = parsed.rebuild(cut, self._fill_all, self._stored_bytes, self._allocate)
        evaluate(caches, attachments)
        return parsed.header, caches, attachments

    def _allocate(self, specs: Sequence[tuple[str, tuple[int, ...]]]) -> list[tuple[mx.array, np.ndarray]]:
        if self._alloc is None:
            return device_buffers(specs)
        return self._alloc.submit(device_buffers, specs).result()

    def culprit(self, exc: BaseException) -> str:
        """What ``exc`` was raised reading: "header", a block's name, or ""."""
        return self._reading or next((name for e, name in self._failed if e is exc), "")

    def _fill(self, target: Target) -> Target:
        """Read a block straight into its destination and verify it there; a
        frame that is not the expected uncompressed one (zstd, or damage)
        is read whole and decoded, which names what is wrong."""
        name = target.ref.name
        try:
            prefix = bytearray(len(target.frame_prefix))
            head = memoryview(prefix)
            check = target.check(full=self._verify == "full", key=self._key) if self._verify else None
            feed = None if check is None else _feeder(check, head)
            if self._pool.read_exact(name, [head, *target.pieces], feed) and prefix == target.frame_prefix:
                if check is not None:
                    check.finish()
            else:  # never more than the largest frame the header's raw size allows: a 2 GiB file is not read
                data = self._pool.read(name, max_frame_bytes(target.ref.raw_bytes))
                payload, layout = decode_block(name, data, verify=bool(self._verify), key=self._key), frame_layout(data)
                if not self._verify and not target.fits(payload, layout):
                    decode_block(name, data, key=self._key)  # the block against its name before the header is blamed
                target.scatter(payload, layout)
        except (CorruptBlockError, BlockMissingError) as exc:
            self._failed.append((exc, name))
            raise
        return target

    def _fill_all(self, targets: Iterator[Target]) -> Iterator[Target]:
        # every target made before the first read: made beside the reading threads, the
        # slicing fought them for the GIL (272 MiB warm, alternating: 70-87 ms -> 58-74 ms);
        # several reading threads (executors.py): one block's read overlaps another's check
        return self._io.map(self._fill, list(targets))

    def _stored_bytes(self, name: str) -> int:
        """Bytes on disk of a block the restore needs, for ``ParsedEntry.rebuild``
        to bound what it allocates; a block that is not a regular file is missing."""
        try:
            st = os.lstat(self._pool.path(name))
        except FileNotFoundError:
            st = None
        if st is None or not stat.S_ISREG(st.st_mode):
            missing = BlockMissingError(f"block {name} is not in the pool" if st is None else
                                        f"block {name} is not a regular file")
            self._failed.append((missing, name))
            raise missing
        self.bytes_read += st.st_size
        return st.st_size


def _same_tokens(header: Header, entry: Entry) -> bool:
    """Whether the header states the tokens ``entry`` was found by (a header
    rewritten under a live index, its digest valid: its caches would be
    served for other tokens). An entry whose tokens cannot be read now agrees
    with nothing."""
    try:
        return len(header.tokens) == entry.length and np.array_equal(header.tokens, entry.token_array)
    except KeyError:
        return False


def evaluate(caches: list[Any], attachments: dict[str, Any]) -> None:
    """Materialise rebuilt caches here: a lazy array built on a worker thread
    cannot be evaluated from the caller's thread (restore_async)."""
    mx.eval([v for _, v in tree_flatten([c.state for c in caches] + list(attachments.values()))
             if isinstance(v, mx.array)])


def _feeder(check: Check, skip: memoryview) -> Callable[[Sequence[memoryview]], None]:
    """What ``read_exact`` hands each run of filled buffers to: the block's
    check, fed every buffer but ``skip`` (the frame's header) while the
    bytes are still in the CPU cache."""

    def feed(run: Sequence[memoryview]) -> None:
        for piece in run:
            if piece is not skip:
                check.update(piece)

    return feed
