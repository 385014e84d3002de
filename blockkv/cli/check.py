"""``check``: verify every header, refcount and block hash of a root's
fingerprints or a bucket's, and with ``--repair`` fix what it finds. Without
``--repair`` it only looks (the directory is not even opened as a store).

Both variants end in the same report: the findings, whose foreign headers are,
what a repair did, and what is left for ``gc``.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tqdm import tqdm

from blockkv.cli.common import (
    EXIT_OK,
    EXIT_PROBLEMS,
    check_root,
    emit_json,
    fp_json,
    gc_hint,
    label,
    select_fingerprints,
    where_key,
)
from blockkv.cli.remote import open_bucket, remote_fingerprints
from blockkv.cli.stores import DEFAULT_GC_GRACE, open_store
from blockkv.errors import BlockKVError, LockTimeout
from blockkv.fs import FileLayer
from blockkv.human import format_size
from blockkv.local.directory import Directory, FingerprintDir, read_identity
from blockkv.local.directory_check import check_directory
from blockkv.local.index import read_only_block_rows
from blockkv.local.locks import each_wait_at_most
from blockkv.records import CheckReport


@contextmanager
def block_progress(desc: str, enabled: bool | None) -> Iterator[Callable[[int, int], None]]:
    """A tqdm bar on stderr driven by the store's ``progress(done, total)``
    callback; shown on a terminal unless ``enabled`` forces it on or off."""
    with tqdm(
        desc=desc, unit="block", file=sys.stderr, disable=None if enabled is None else not enabled
    ) as bar:

        def update(done: int, total: int) -> None:
            if bar.total != total:
                bar.total = total
            bar.update(done - bar.n)

        yield update


# CheckReport's finding lists, with how one finding reads in the human report.
PROBLEMS = {
    "corrupt_headers": "corrupt header",
    "corrupt_blocks": "corrupt block",
    "dangling": "dangling entry (needs a missing or corrupt block)",
    "orphan_blocks": "orphan block (nothing references it)",
    "refcount_mismatches": "refcount mismatch (block, index says, headers say)",
    "unreadable": "unreadable file (a transient error such as EMFILE or EIO: not proof of corruption; an unreadable "
                  "block nothing references is also an orphan, which --repair deletes)",
    "oversized_blocks": "block file longer than its own frame allows (not read, so not convicted; "
                        "kept unless nothing references it)",
    "newer_headers": "header of a newer blockkv format (kept, never served; blocks are not swept while it is here)",
    "bad_headers": "bad header (names a good block with another namespace key or size; the block is kept)",
    "unsealed_headers": "header not sealed with the fleet key (never served; left for an operator)",
    "suspect_blocks": "block that does not verify, without proof it is bad (kept; a lying header looks the same)",
}


def check_one(
    fp: FingerprintDir, repair: bool, progress: Callable[[int, int], None], wait: float
) -> CheckReport:
    """Without ``repair``: the store's read-only inspection of the files and a
    read-only view of the index, so checking changes nothing (the directory is
    not even opened as a store). With it: the store's own check-and-repair; a
    missing index, which opening the store rebuilds, is reported as repaired."""
    try:
        with each_wait_at_most(wait):  # every wait: the locks, the index's, the repair's open
            return _check_one(fp, repair, progress, wait)
    except LockTimeout:
        raise LockTimeout(f"a writer holds {fp.path} (its directory or index lock, for more than {wait:g} s: a "
                          "stopped or very slow process); try again, or give --wait more seconds") from None


def _check_one(fp: FingerprintDir, repair: bool, progress: Callable[[int, int], None], wait: float) -> CheckReport:
    directory = Directory(fp.path, read_identity(fp.path), FileLayer())
    rows = read_only_block_rows(directory.index_dir)  # busy is LockTimeout, never "no index"
    if not repair:
        return check_directory(directory, lock_timeout=wait, progress=progress)
    with open_store(fp) as store:
        opened = list(store.recovery)  # what opening had to fix: rebuilding a lost index deletes corrupt headers
        report: CheckReport = store.check(repair=True, progress=progress)
    report.actions[0:0] = opened  # a missing index among them: opening the store rebuilt it, and said so
    report.index_missing = rows is None
    return report


def cmd_check(args: argparse.Namespace) -> int:
    """Verify every header and block hash; with ``--repair``, fix what it finds."""
    results: list[tuple[Any, CheckReport, list[dict[str, Any]]]] = []
    if args.remote:
        where, unreadable = args.remote, check_remote(args, results)
    else:
        root = check_root(args.root)
        where = str(root)
        fps = select_fingerprints(
            root, args.fingerprint, args.all, mutating="check --repair" if args.repair else None
        )
        for fp in fps:
            with block_progress(f"check {fp.path.name}", args.progress) as progress:
                report = check_one(fp, args.repair, progress, args.wait)
            results.append((fp, report, foreign_owners(fp, report.foreign_headers)))
        # Directories the store skips because their IDENTITY does not read: a problem
        # to report (never to repair: whose data it is cannot be known).
        unreadable = [] if args.fingerprint else [d.name for d in unreadable_dirs(root, fps)]
    problems = bool(unreadable) or any(not report.clean for _, report, _ in results)
    if args.json:
        emit_json(
            {
                where_key(args): where,
                "repair": args.repair,
                "clean": not problems,
                "unreadable_dirs": [str(Path(where) / d) if not args.remote else f"{where}/{d}"
                                    for d in unreadable],
                "fingerprints": [
                    {**fp_json(fp), "clean": r.clean, "report": r.to_json(), "foreign_owners": owners,
                     "blocks_awaiting_gc": awaiting_gc(fp)[0] if not args.remote else None,
                     "bytes_awaiting_gc": awaiting_gc(fp)[1] if not args.remote else None}
                    for fp, r, owners in results
                ],
            }
        )
        return EXIT_PROBLEMS if problems else EXIT_OK
    for fp, report, owners in results:
        found = [(what, item) for kind, what in PROBLEMS.items() for item in getattr(report, kind, ())]
        count = len(found) + report.index_missing
        status = "ok" if not count else f"{count} problem{'' if count == 1 else 's'}"
        print(
            f"{label(fp_json(fp))}: {status} "
            f"({report.entries} entries, {report.blocks} blocks verified)"
        )
        if report.index_missing:
            print("  index missing or unusable (rebuild-index or check --repair rebuilds it)")
        for what, item in found:
            print(f"  {what}: {item if isinstance(item, str) else ' '.join(map(str, item))}")
        for owner in owners:
            print(f"  {owner['entries']} foreign entries (kept, never served here) {owner_note(owner, fp)}")
        for action in report.actions:
            print(f"  repaired: {action}")
        if args.remote and getattr(report, "waiting_for_copy", None):
            print(f"  {len(report.waiting_for_copy)} block(s) asked of the fleet (a node holding a good copy "
                  "uploads it); their entries are removed if none comes back within the grace period")
        if args.remote and report.in_flight:
            print(f"  {len(report.in_flight)} block(s) named by no header: stores in progress, or garbage "
                  "'blockkv gc --remote' deletes after the grace period (not problems)")
        waiting, size = awaiting_gc(fp) if not args.remote else (0, 0)
        if waiting:
            print(f"{gc_hint(fp.path.name, waiting, DEFAULT_GC_GRACE)}; they hold {format_size(size)}")
    for d in unreadable:
        print(f"{d}: unreadable IDENTITY, so not checked; left alone")
    return EXIT_PROBLEMS if problems else EXIT_OK


def check_remote(args: argparse.Namespace, results: list[tuple[Any, CheckReport, list[dict[str, Any]]]]) -> list[str]:
    """``check --remote``: each chosen fingerprint directory in the bucket,
    verified (``bucket.bucket_check.check_bucket``; without ``--repair`` no write)
    into ``results``; returns the directories whose IDENTITY does not read."""
    from blockkv.bucket.bucket_check import check_bucket

    unreadable: list[str] = []
    for fp in remote_fingerprints(args, mutating="check --repair" if args.repair else None, unreadable=unreadable):
        with open_bucket(args, fp) as bucket, block_progress(f"check {fp.name}", args.progress) as progress:
            report = check_bucket(bucket, fp.identity, progress, repair=args.repair)
            identities = []
            for name in report.foreign_headers:
                try:
                    identities.append(bucket.fetch_header(name).header.identity)
                except BlockKVError:
                    continue  # gone or damaged since check read it
        results.append((fp, report, owner_rows(identities)))
    return [] if args.fingerprint else unreadable


def foreign_owners(fp: FingerprintDir, rels: Sequence[str]) -> list[dict[str, Any]]:
    """Whose the foreign headers ``check`` found are: one row per identity."""
    directory = Directory(fp.path, read_identity(fp.path), FileLayer())
    identities = []
    for rel in rels:
        try:
            identities.append(directory.read_header(fp.path / rel).identity)
        except (BlockKVError, OSError):
            continue  # gone or damaged since check read it
    return owner_rows(identities)


def owner_note(owner: dict[str, Any], fp: Any) -> str:
    """Whose foreign entries are, against the directory's own identity, and what tells them apart."""
    if owner["tokenizer_hash"] == fp.tokenizer_hash:
        return (f"belong to model {owner['model_id']!r} (this directory's: {fp.model_id!r}), with the same "
                f"tokenizer {fp.tokenizer_hash[:12]}: two stores share this fingerprint under different model "
                "ids; give each its own config_fingerprint")
    return (f"belong to model {owner['model_id']!r} with tokenizer {owner['tokenizer_hash'][:12]} (this "
            f"directory's: {fp.tokenizer_hash[:12]}): two stores share this fingerprint with different "
            "tokenizers or chat templates; give each its own config_fingerprint")


def owner_rows(identities: Sequence[Any]) -> list[dict[str, Any]]:
    """One row per identity of foreign headers, with how many there are."""
    owners: Counter[tuple[str, str, str]] = Counter(
        (i.model_id, i.config_fingerprint, i.tokenizer_hash) for i in identities
    )
    return [
        {"model_id": m, "config_fingerprint": c, "tokenizer_hash": t, "entries": n}
        for (m, c, t), n in sorted(owners.items())
    ]


def awaiting_gc(fp: FingerprintDir) -> tuple[int, int]:
    """(blocks, bytes) the index counts as referenced by nothing (freed by
    eviction or removal, or by a repair): what ``gc`` deletes once the grace
    period passes. Read without a lock or a write, as ``check`` looks."""
    try:
        found = read_only_block_rows(fp.path / "index") or {}
    except LockTimeout:  # busy since the check: nothing to say
        found = {}
    rows = [row for row in found.values() if row.refs == 0]
    return len(rows), sum(row.size for row in rows)


def unreadable_dirs(root: Path, readable: Sequence[FingerprintDir]) -> list[Path]:
    """Directories holding an IDENTITY file that ``list_fingerprints`` could not use."""
    known = {fp.path for fp in readable}
    return sorted(d for d in root.iterdir() if (d / "IDENTITY").is_file() and d not in known)
