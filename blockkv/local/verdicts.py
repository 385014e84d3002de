"""What a block that failed a read proves, decided again under the directory lock.

A restore hashes its blocks without the lock. By the time it holds the lock
to act on a failure, the copy it hashed may be gone: another handle may have
quarantined it and a store written a good copy under the same name (and an
entry been acknowledged on it). And under namespace isolation a block is
named with the key of the namespace that stored it, so a header naming it
from another namespace makes a good block fail under that header's key. So
a verdict is never carried over a wait: under the lock the block is read
again and hashed under every key an indexed entry names it with, and only a
block that fails under all of them now is convicted (design.md, "Deletion
rule"). Every block a verdict is about is read through ``judge_file``,
no further than its own frame allows.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from blockkv.errors import BlockMissingError, OversizedError
from blockkv.format.blocks import block_naming_key, namespace_key
from blockkv.format.frame import FRAME_HEAD_BYTES, Judgement, Verdict, frame_bound, judge_block
from blockkv.format.header import Identity
from blockkv.pool.local import LocalPool
from blockkv.records import Entry


class Finding(enum.Enum):
    CORRUPT = "fails its name under every key that names it"  # quarantine it and every entry needing it
    GONE = "is not there"  # the entries needing it dangle
    NOT_ITS_KEY = "is good under another entry's key"  # the header that named it under its own is wrong
    GOOD = "verifies now"  # the failure was about a copy that is gone: nothing is proven
    UNREADABLE = "cannot be read now"  # EIO, EMFILE, MemoryError, oversized: nothing is proven


def judge_file(pool: LocalPool, name: str, keys: Iterable[bytes | None]) -> Verdict:
    """Block file ``name`` as it is now, judged under ``keys``
    (``frame.judge_block``) and read no further than its own frame's fixed
    header allows (``frame.frame_bound``): an orphan has no entry's header to
    say its size. A file whose first bytes are no frame's header, or longer
    than the fixed length of its raw frame, is BROKEN unread (``decode_block``
    would say so of the whole). One longer than its zstd frame can be is
    ``OversizedError``, unread and not convicted: its size is no proof (a
    padded zstd frame decodes to the same bytes). BlockMissingError if it is
    gone."""
    head = pool.read_head(name, FRAME_HEAD_BYTES)
    bound = frame_bound(head)
    if bound is None:
        return Verdict(Judgement.BROKEN)
    try:
        data = pool.read(name, bound.most)
    except OversizedError:
        if bound.exact:
            return Verdict(Judgement.BROKEN)
        raise
    return judge_block(name, data, keys)


def judge_now(pool: LocalPool, name: str, key: bytes | None, others: Iterable[bytes | None]) -> Finding:
    """Block ``name`` as it is now, for a header that names it with ``key``;
    ``others``: the keys the other entries referencing it name it with. Under
    the lock those are all the keys an indexed entry names it with, so a block
    that verifies under none of them is corrupt for every entry that needs it."""
    try:
        verdict = judge_file(pool, name, [key, *others])
    except BlockMissingError:
        return Finding.GONE
    except Exception:  # noqa: BLE001 - not proof of anything
        return Finding.UNREADABLE
    if not verdict.good:
        return Finding.CORRUPT
    return Finding.GOOD if verdict.key == key else Finding.NOT_ITS_KEY


def keys_naming(name: str, identity: Identity, own: Iterable[Entry], foreign: Iterable[Entry]) -> list[bytes | None]:
    """The keys the entries referencing block ``name`` name it with: ours by
    our identity's mode; an unserved entry's (our other mode's, or another
    identity's) is not known here, so both."""
    keys = [block_naming_key(identity, e.ns) for e in own if name in e.blocks]
    for e in foreign:
        if name in e.blocks:
            keys += [None, namespace_key(e.ns)]
    return keys
