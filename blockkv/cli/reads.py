"""``stats`` and ``ls``: what a cache root or a bucket holds, per fingerprint,
namespace and entry. They only look, through the read-only views
(``blockkv.local.reader``, ``blockkv.bucket.bucket_reader``), so they never write,
rename, delete or lock, even on a damaged directory.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from blockkv.cli.common import (
    EXIT_OK,
    check_root,
    emit_json,
    entry_json,
    fp_json,
    select_fingerprints,
    show_ns,
    where_key,
)
from blockkv.cli.remote import open_bucket, remote_fingerprints
from blockkv.human import format_ratio, format_size, format_time, render_table
from blockkv.local.catalog import footprint
from blockkv.local.directory import disk_usage
from blockkv.local.reader import DirectoryView, read_directory
from blockkv.records import Entry


def cmd_stats(args: argparse.Namespace) -> int:
    """Per fingerprint and namespace: what is stored, what it costs, how well it dedups."""
    where, views = looked_at(args)
    report = [fingerprint_stats(args, fp, view) for fp, view in views]
    if args.json:
        emit_json({where_key(args): where, "fingerprints": report})
        return EXIT_OK
    logical = sum(r["logical_bytes"] for r in report)
    disk = sum(r["disk_bytes"] for r in report)
    stored = sum(r["entry_bytes"] for r in report)
    print(
        f"{where}: {len(report)} fingerprint(s), {sum(r['entries'] for r in report)} "
        f"entries, {format_size(disk)} {'in the bucket' if args.remote else 'on disk'}, "
        f"{format_size(logical)} logical (dedup {format_ratio(logical, stored)})"
    )
    rows: list[list[str]] = []
    for fpr in report:
        cap = fpr["cap_bytes"]
        cap_text = "-" if cap is None else (
            f"{format_size(cap)} ({100 * fpr['disk_bytes'] / max(cap, 1):.0f}%)"
        )
        rows.append(
            [fpr["fingerprint"], fpr["model_id"], or_dash(fpr["kv_quantisation"]),
             or_dash(fpr["chat_template"]), "*", str(fpr["entries"]),
             format_size(fpr["logical_bytes"]), format_size(fpr["disk_bytes"]),
             format_ratio(fpr["logical_bytes"], fpr["entry_bytes"]), str(fpr["blocks"]),
             format_time(fpr["oldest_use"]), format_time(fpr["newest_use"]),
             cap_text]
        )
        rows.extend(
            ["", "", "", "", show_ns(ns["ns"]), str(ns["entries"]), format_size(ns["logical_bytes"]),
             "", "", str(ns["blocks"]), format_time(ns["oldest_use"]),
             format_time(ns["newest_use"]), ""]
            for ns in fpr["namespaces"]
        )
    if rows:
        print()
        print(
            render_table(
                ["FINGERPRINT", "MODEL", "KV", "TEMPLATE", "NAMESPACE", "ENTRIES", "LOGICAL",
                 "IN BUCKET" if args.remote else "ON DISK", "DEDUP", "BLOCKS", "OLDEST USE", "NEWEST USE", "CAP (USED)"],
                rows,
                right={5, 6, 7, 8, 9},
            )
        )
    notes = [(fpr, note) for fpr in report for note in unservable_notes(fpr)]
    if notes:
        print()
    for fpr, note in notes:
        print(f"{fpr['fingerprint']}: {note}")
    for fpr in report:
        if fpr.get("unreferenced_blocks"):
            print(f"{fpr['fingerprint']}: {fpr['unreferenced_blocks']} block(s), "
                  f"{format_size(fpr['unreferenced_bytes'])}, named by no header (stores in progress, or "
                  "garbage 'blockkv gc --remote' deletes after the grace period)")
    return EXIT_OK


def fingerprint_stats(args: argparse.Namespace, fp: Any, view: Any) -> dict[str, Any]:
    """``stats`` of one fingerprint, local (``DirectoryView``) or in a bucket (``BucketView``)."""
    entries, logical = view.entries, view.logical_bytes
    # on disk: the directory's files' apparent size (docs/cli.md); in a bucket: its headers and referenced blocks
    disk = view.disk_bytes if args.remote else disk_usage(fp.path).total
    stored = view.disk_bytes if args.remote else footprint(entries, view.block_sizes)
    by_ns: dict[str, list[Entry]] = {}
    for e in entries:
        by_ns.setdefault(e.ns, []).append(e)
    return {
        **fp_json(fp),
        **usage(entries),
        "disk_bytes": disk,
        "logical_bytes": logical,
        "entry_bytes": stored,  # the entries' headers and blocks, each block once: what dedup is against
        "dedup_ratio": logical / stored if stored else None,
        "blocks": view.blocks,
        "cap_bytes": args.cap,
        **unservable(view),
        "namespaces": [{"ns": ns, **usage(group)} for ns, group in sorted(by_ns.items())],
        # in a bucket: blocks no header names (stores in progress, or garbage for gc --remote)
        **({"unreferenced_blocks": view.unreferenced_blocks,
            "unreferenced_bytes": view.unreferenced_bytes} if args.remote else {}),
    }


def looked_at(args: argparse.Namespace) -> tuple[str, list[tuple[Any, Any]]]:
    """Where ``ls``/``stats`` look (a root's path or a bucket's URL) and, per
    chosen fingerprint, a read-only view (``DirectoryView`` or ``BucketView``)."""
    if not args.remote:
        root = check_root(args.root)
        fps = select_fingerprints(root, args.fingerprint, args.all, mutating=None)
        return str(root), [(fp, read_directory(fp.path)) for fp in fps]
    from blockkv.bucket.bucket_reader import read_bucket

    views = []
    for fp in remote_fingerprints(args, mutating=None):
        with open_bucket(args, fp) as bucket:
            views.append((fp, read_bucket(bucket, fp.identity)))
    return args.remote, views


def unservable(view: DirectoryView) -> dict[str, Any]:
    """What a directory holds that its store will not serve, for ``stats``."""
    return {
        "foreign_entries": [
            {"model_id": i.model_id, "tokenizer_hash": i.tokenizer_hash, "entries": n}
            for i, n in sorted(view.foreign.items(), key=lambda item: item[0].tokenizer_hash)
        ],
        "corrupt_headers": view.corrupt_headers,
        "dangling_entries": view.dangling,
    }


def unservable_notes(fpr: dict[str, Any]) -> list[str]:
    notes = [
        f"{f['entries']} entries of another "
        f"{'model id' if f['tokenizer_hash'] == fpr['tokenizer_hash'] else 'tokenizer or chat template'} "
        f"({f['model_id']}, tokenizer {f['tokenizer_hash'][:12]}): kept, never served here"
        for f in fpr["foreign_entries"]
    ]
    if fpr["corrupt_headers"] or fpr["dangling_entries"]:
        notes.append(
            f"{len(fpr['corrupt_headers'])} corrupt header(s), {len(fpr['dangling_entries'])} entries "
            "missing a block: not counted; 'blockkv check' lists them"
        )
    return notes


def usage(entries: Sequence[Entry]) -> dict[str, Any]:
    """Counts shared by a fingerprint's row and its namespaces' rows. Blocks are
    the distinct blocks referenced (a block shared by two namespaces counts in both)."""
    uses = [e.last_use for e in entries]
    return {
        "entries": len(entries),
        "logical_bytes": sum(e.nbytes for e in entries),
        "blocks": len({name for e in entries for name in e.blocks}),
        "oldest_use": min(uses, default=None),
        "newest_use": max(uses, default=None),
    }


def cmd_ls(args: argparse.Namespace) -> int:
    """Entries in eviction order (least recently used first), so the top of the
    list is what ``evict`` would remove first."""
    where, views = looked_at(args)
    rows: list[dict[str, Any]] = []
    for fp, view in views:
        about = fp_json(fp)
        rows.extend(
            {"fingerprint": about["fingerprint"], "model_id": fp.model_id,
             "kv_quantisation": about["kv_quantisation"], "chat_template": about["chat_template"],
             **entry_json(e)}
            for e in view.entries
            if args.namespace is None or e.ns in args.namespace
        )
    rows.sort(key=lambda r: r["last_use"])
    if args.json:
        emit_json({where_key(args): where, "entries": rows})
        return EXIT_OK
    print(
        render_table(
            ["FINGERPRINT", "MODEL", "KV", "TEMPLATE", "NAMESPACE", "ENTRY", "TOKENS", "BYTES",
             "LAST USE", "TRIMMABLE", "CHECKPOINT"],
            [
                [r["fingerprint"], r["model_id"], or_dash(r["kv_quantisation"]),
                 or_dash(r["chat_template"]), show_ns(r["ns"]), r["id"], str(r["tokens"]),
                 format_size(r["nbytes"]), format_time(r["last_use"]),
                 "yes" if r["trimmable"] else "no",
                 r["checkpoint"]["key"] if r["checkpoint"] else "-"]
                for r in rows
            ],
            right={6, 7},
        )
    )
    return EXIT_OK


def or_dash(value: str | None) -> str:
    return "-" if value is None else value
