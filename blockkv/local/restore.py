"""Reading one entry back: its header, then only the blocks that cover the
prefix, each read into its destination arrays and verified on the way.

A verified token block is read in runs of about 512 KiB into a per-thread
staging buffer that stays in the CPU cache, hashed there in one call and
copied out with one call per tensor: xxhash and blake3 release the GIL only
for inputs over 64 KiB and numpy releases it for a copy, so the two reading
threads verify at once. Read straight into the arrays instead, a block lands
in 32 KiB pieces (a head's rows of one tensor), each hashed under the GIL, and
the threads' checks ran one at a time. Unverified reads and whole-tensor
state blocks are read straight into the arrays.

``EntryRead`` reads and raises; it deletes nothing. What a failure proves
(``culprit`` names the header or the block being read) is the store's to
judge: only proof of corruption drops an entry.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from blockkv.errors import BlockKVError, BlockMissingError, CorruptBlockError
from blockkv.format.blocks import STAGE_BYTES, staging_buffer
from blockkv.format.frame import decode_block
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
                 io: ThreadPoolExecutor) -> None:
        self._dir = directory
        self._pool = directory.pool
        self._identity = identity
        self._entry = entry
        self._verify = verify
        self._io = io
        self._key: bytes | None = None  # the header's (``ParsedEntry.key``), once it is read
        self._reading = ""  # "header" while the header is read: its file gone is proof too
        self._corrupt: list[tuple[BaseException, str]] = []  # (error, block) to quarantine
        self.bytes_read = 0  # the header and the blocks the restore needs, as stored

    def run(self, cut: int | None) -> tuple[Header, list[Any], dict[str, Any]]:
        """The header and the caches (cut to ``cut`` tokens when given), materialised."""
        self._reading = "header"
        data = self._dir.header_bytes(self._entry.ns, self._entry.id)
        self.bytes_read += len(data)
        parsed = ParsedEntry.parse(data)
        self._reading = ""
        if parsed.header.identity != self._identity or parsed.header.ns != self._entry.ns:
            raise IndexDisagrees("the header on disk is not the one indexed")
        self._key = parsed.key
        caches, attachments = parsed.rebuild(cut, self._fill_all, self._stored_bytes)
        # materialise here: a lazy array built on a worker thread cannot be
        # evaluated from the caller's thread (restore_async)
        mx.eval([v for _, v in tree_flatten([c.state for c in caches] + list(attachments.values()))
                 if isinstance(v, mx.array)])
        return parsed.header, caches, attachments

    def culprit(self, exc: BaseException) -> str:
        """What ``exc`` was raised reading: "header", a block's name, or ""."""
        return self._reading or next((name for e, name in self._corrupt if e is exc), "")

    def _fill(self, target: Target) -> Target:
        """Read a block into its destination and verify it on the way (staged
        for a verified token block, see the module's docstring); a frame that
        is not the expected uncompressed one (zstd, or damage) is read whole
        and decoded, which names what is wrong."""
        name = target.ref.name
        try:
            prefix = bytearray(len(target.frame_prefix))
            head = memoryview(prefix)
            staged = bool(self._verify and target.parts)
            check = target.check(full=self._verify == "full", key=self._key,
                                 payload=partial(self._payload, name) if staged else None) if self._verify else None
            if check is not None and staged:
                read = self._read_staged(target, head, check)
            else:
                read = self._pool.read_exact(name, [head, *target.pieces], None if check is None else _feeder(check, head))
            if read and prefix == target.frame_prefix:
                if check is not None:
                    check.finish()
            else:
                target.scatter(decode_block(name, self._pool.read(name), verify=bool(self._verify), key=self._key))
        except CorruptBlockError as exc:
            self._corrupt.append((exc, name))
            raise
        return target

    def _read_staged(self, target: Target, head: memoryview, check: Check) -> bool:
        """The block's frame header into ``head``, then its payload run by run
        into this thread's staging buffer, each run hashed there and copied
        into the destination parts (rows a cut drops are hashed, not copied)."""
        runs = _staged_runs(target.parts)
        stage = staging_buffer(max((n for n, _ in runs), default=0))
        whole = memoryview(stage)
        todo = iter(runs)

        def copy_out(run: Sequence[memoryview]) -> None:
            for buffer in run:
                if buffer is head:
                    continue
                check.update(buffer)
                offset = 0
                for view, rows in next(todo)[1]:
                    heads, kept, row = view.shape
                    size = heads * rows * row
                    np.copyto(view, stage[offset : offset + size].reshape(heads, rows, row)[:, :kept])
                    offset += size

        return self._pool.read_exact(target.ref.name, [head, *(whole[:n] for n, _ in runs)], copy_out, run_bytes=1)

    def _payload(self, name: str) -> memoryview:
        """A block's payload read again, unverified: what a staged check's blake3
        confirmation of an xxh3 mismatch hashes (a frame that does not parse is
        proof enough)."""
        return decode_block(name, self._pool.read(name), verify=False, key=self._key)

    def _fill_all(self, targets: Iterator[Target]) -> Iterator[Target]:
        # every target made before the first read: made beside the reading threads, the
        # slicing fought them for the GIL (272 MiB warm, alternating: 70-87 ms -> 58-74 ms);
        # two threads: one block's read overlaps another's check
        return self._io.map(self._fill, list(targets))

    def _stored_bytes(self, name: str) -> int:
        """Bytes on disk of a block the restore needs, for ``ParsedEntry.rebuild``
        to bound what it allocates; a block that is not a regular file is missing."""
        try:
            st = os.lstat(self._pool.path(name))
        except FileNotFoundError:
            raise BlockMissingError(f"block {name} is not in the pool") from None
        if not stat.S_ISREG(st.st_mode):
            raise BlockMissingError(f"block {name} is not a regular file")
        self.bytes_read += st.st_size
        return st.st_size


def _staged_runs(parts: Sequence[tuple[np.ndarray, int]]) -> list[tuple[int, list[tuple[np.ndarray, int]]]]:
    """A token block's parts (``Target.parts``) in runs of at most ``STAGE_BYTES``
    payload bytes (a part split by heads when it is larger; one head's rows
    larger than that make a run of their own): ``(payload bytes, parts)``."""
    runs: list[tuple[int, list[tuple[np.ndarray, int]]]] = []
    run: list[tuple[np.ndarray, int]] = []
    size = 0
    for view, rows in parts:
        heads, _, row = view.shape
        per_head = rows * row
        if not per_head:
            continue
        step = max(1, STAGE_BYTES // per_head)
        for lo in range(0, heads, step):
            chunk = view[lo : lo + step]
            n = chunk.shape[0] * per_head
            if run and size + n > STAGE_BYTES:
                runs.append((size, run))
                run, size = [], 0
            run.append((chunk, rows))
            size += n
    if run:
        runs.append((size, run))
    return runs


def _feeder(check: Check, skip: memoryview) -> Callable[[Sequence[memoryview]], None]:
    """What ``read_exact`` hands each run of filled buffers to: the block's
    check, fed every buffer but ``skip`` (the frame's header) while the
    bytes are still in the CPU cache."""

    def feed(run: Sequence[memoryview]) -> None:
        for piece in run:
            if piece is not skip:
                check.update(piece)

    return feed
