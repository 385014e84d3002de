"""The commands that shrink or rebuild a store: ``gc`` (blocks no entry
references), ``rebuild-index`` (the LMDB index from the files) and ``evict``
(least recently used entries down to a size), each on a root's fingerprints
and, but for ``rebuild-index``, on a bucket's (``gc --remote``: mark and sweep;
``evict --remote``: fleet-wide LRU).

They change a store, or with ``--remote`` the bucket every node shares, so
each needs a fingerprint named (``-f``) or ``--all``; a local store is opened
through ``blockkv.cli.stores``, so that what a command deletes is what it reports.
``evict --dry-run`` opens no store: opening one recovers the directory (a
dead writer's temp files reaped, a corrupt header removed), and a dry run
leaves the root byte for byte as it was; it plans from the read-only view
``ls`` and ``stats`` use, with the store's own LRU rule.
"""

from __future__ import annotations

import argparse
from typing import Any

from blockkv.cli.common import (
    EXIT_OK,
    EXIT_PROBLEMS,
    check_root,
    emit_json,
    entry_json,
    fp_json,
    gc_hint,
    label,
    select_fingerprints,
    show_ns,
)
from blockkv.cli.remote import open_bucket, remote_fingerprints
from blockkv.cli.stores import DEFAULT_GC_GRACE, open_store
from blockkv.human import format_size, format_time, render_table
from blockkv.local.catalog import footprint, lru_plan
from blockkv.local.directory import DiskUsage, FingerprintDir, disk_usage
from blockkv.local.reader import read_directory
from blockkv.records import Entry


def cmd_gc(args: argparse.Namespace) -> int:
    """Delete blocks no entry references once they are older than the grace period."""
    if args.remote:
        return gc_remote(args)
    root = check_root(args.root)
    out: list[dict[str, Any]] = []
    for fp in select_fingerprints(root, args.fingerprint, args.all, mutating="gc"):
        with open_store(fp, gc_grace=args.grace) as store:
            deleted = store.gc()
        disk = disk_usage(fp.path).total
        out.append({**fp_json(fp), "blocks_deleted": deleted, "disk_bytes": disk})
    if args.json:
        emit_json({"root": str(root), "fingerprints": out})
        return EXIT_OK
    for fp_out in out:
        print(
            f"{label(fp_out)}: deleted {fp_out['blocks_deleted']} unreferenced block(s); "
            f"{format_size(fp_out['disk_bytes'])} on disk"
        )
    return EXIT_OK


def cmd_rebuild_index(args: argparse.Namespace) -> int:
    """Rebuild the LMDB accelerator from the header and block files on disk."""
    root = check_root(args.root)
    out: list[dict[str, Any]] = []
    for fp in select_fingerprints(root, args.fingerprint, args.all, mutating="rebuild-index"):
        with open_store(fp) as store:
            out.append({**fp_json(fp), "entries_indexed": store.rebuild_index()})
    if args.json:
        emit_json({"root": str(root), "fingerprints": out})
        return EXIT_OK
    for fp_out in out:
        print(f"{label(fp_out)}: index rebuilt, {fp_out['entries_indexed']} entries indexed")
    return EXIT_OK


def cmd_evict(args: argparse.Namespace) -> int:
    """Remove least-recently-used entries until a fingerprint's bytes on disk are
    at most ``--to``; ``--dry-run`` lists them and deletes nothing."""
    if args.remote:
        return evict_remote(args)
    root = check_root(args.root)
    out: list[dict[str, Any]] = []
    for fp in select_fingerprints(root, args.fingerprint, args.all, mutating="evict"):
        if args.dry_run:
            before, gone = planned_eviction(fp, args.to)
            after, released, grace = before, 0, DEFAULT_GC_GRACE
        else:
            with open_store(fp) as store:
                usage, blocks_before = disk_usage(fp.path), store.block_count
                gone = store.evict_to(entries_target(args.to, usage))
                released, grace = blocks_before - store.block_count, store.gc_grace
            before, after = usage.total, disk_usage(fp.path).total
        out.append(
            {**fp_json(fp), "target_bytes": args.to, "disk_bytes_before": before,
             "disk_bytes_after": after, "blocks_released": released, "gc_grace": grace,
             "entries": [entry_json(e) for e in gone]}
        )
    if args.json:
        emit_json({"root": str(root), "dry_run": args.dry_run, "fingerprints": out})
        return EXIT_OK
    verb = "would remove" if args.dry_run else "removed"
    for fp_out in out:
        gone = fp_out["entries"]
        was = format_size(fp_out["disk_bytes_before"])
        if not gone and fp_out["disk_bytes_before"] <= args.to:
            print(f"{label(fp_out)}: nothing to remove, {was} on disk is within {format_size(args.to)}")
            continue
        if not gone:
            print(f"{label(fp_out)}: nothing to remove: its entries fit in {format_size(args.to)}; the rest of the "
                  f"{was} on disk is its LMDB index and blocks no entry references (which 'blockkv gc -f "
                  f"{fp_out['fingerprint']}' deletes once unreferenced for {fp_out['gc_grace']:g} s)")
            continue
        now = "" if args.dry_run else f" -> {format_size(fp_out['disk_bytes_after'])}"
        print(
            f"{label(fp_out)}: {verb} {len(gone)} entries to reach {format_size(args.to)} "
            f"(on disk {was}{now})"
        )
        print(
            render_table(
                ["  NAMESPACE", "ENTRY", "TOKENS", "BYTES", "LAST USE"],
                [
                    ["  " + show_ns(e["ns"]), e["id"], str(e["tokens"]),
                     format_size(e["nbytes"]), format_time(e["last_use"])]
                    for e in gone
                ],
                right={2, 3},
            )
        )
        if fp_out["blocks_released"]:
            print(gc_hint(fp_out["fingerprint"], fp_out["blocks_released"], fp_out["gc_grace"]))
    return EXIT_OK


def entries_target(target: int, usage: DiskUsage) -> int:
    """What a directory's entries (headers and referenced blocks) may hold for
    its files to fit in ``target`` bytes once gc has deleted the blocks they
    free: the index and bookkeeping files stay whatever goes."""
    return max(0, target - usage.outside_entries)


def planned_eviction(fp: FingerprintDir, target: int) -> tuple[int, list[Entry]]:
    """What ``evict`` would remove to bring ``fp`` down to ``target`` bytes on
    disk, from the files alone (``read_directory``), with the store's LRU rule
    over the directory identity's entries of either mode (``catalog.lru_plan``);
    and the bytes on disk now. Changes nothing."""
    usage, view = disk_usage(fp.path), read_directory(fp.path)
    total = footprint(view.entries, view.block_sizes)
    last_use = {e.id: e.last_use for e in view.entries}
    return usage.total, lru_plan(view.entries, last_use, view.block_sizes, total, entries_target(target, usage))


def gc_remote(args: argparse.Namespace) -> int:
    """``gc --remote``: one mark-and-sweep run per fingerprint directory in the
    bucket (``Bucket.gc``), safe beside every node storing and other runs."""
    out: list[dict[str, Any]] = []
    for fp in remote_fingerprints(args, mutating="gc"):
        with open_bucket(args, fp) as bucket:
            report = bucket.gc()
            grace = bucket.grace
        out.append({**fp_json(fp), "blocks_deleted": len(report.deleted), "headers": report.headers,
                    "blocks": report.blocks, "young": report.young, "stopped_early": report.stopped_early,
                    "unreadable_headers": report.unreadable_headers, "gc_grace": grace})
    problems = any(o["unreadable_headers"] for o in out)
    if args.json:
        emit_json({"remote": args.remote, "fingerprints": out})
        return EXIT_PROBLEMS if problems else EXIT_OK
    for o in out:
        print(
            f"{label(o)}: deleted {o['blocks_deleted']} unreferenced block(s) of {o['blocks']} "
            f"({o['headers']} entries); {o['young']} unreferenced kept for now (younger than "
            f"{o['gc_grace']:g} s)"
        )
        if o["stopped_early"]:
            print("  the sweep window closed first: the next run deletes the rest")
        if o["unreadable_headers"]:
            print(f"  {len(o['unreadable_headers'])} header(s) do not read, so their blocks are unknown "
                  "and nothing was deleted ('blockkv check --remote' lists them)")
    return EXIT_PROBLEMS if problems else EXIT_OK


def evict_remote(args: argparse.Namespace) -> int:
    """``evict --remote``: fleet-wide LRU (``Bucket.evict_to``) until each chosen
    fingerprint directory's headers and referenced blocks fit in ``--to``; last
    use is every node's (``used/`` marks). The blocks go with a later ``gc --remote``."""
    from blockkv.bucket.bucket_reader import read_bucket

    out: list[dict[str, Any]] = []
    for fp in remote_fingerprints(args, mutating="evict"):
        with open_bucket(args, fp) as bucket:
            view = read_bucket(bucket, fp.identity)
            gone = bucket.evict_plan(args.to) if args.dry_run else bucket.evict_to(args.to)
            after = view.disk_bytes if args.dry_run else read_bucket(bucket, fp.identity).disk_bytes
            grace = bucket.grace
        ids = {name.rpartition("/")[2].removesuffix(".bkv") for name in gone}
        out.append(
            {**fp_json(fp), "target_bytes": args.to, "bucket_bytes_before": view.disk_bytes,
             "bucket_bytes_after": after, "gc_grace": grace, "headers": gone,
             "entries": [entry_json(e) for e in view.entries if e.id in ids]}
        )
    if args.json:
        emit_json({"remote": args.remote, "dry_run": args.dry_run, "fingerprints": out})
        return EXIT_OK
    verb = "would remove" if args.dry_run else "removed"
    for o in out:
        was = format_size(o["bucket_bytes_before"])
        if not o["headers"]:
            print(f"{label(o)}: nothing to remove, {was} in the bucket is within {format_size(args.to)}")
            continue
        now = "" if args.dry_run else f" -> {format_size(o['bucket_bytes_after'])}"
        print(f"{label(o)}: {verb} {len(o['headers'])} entries to reach {format_size(args.to)} "
              f"(in the bucket {was}{now})")
        print(render_table(
            ["  NAMESPACE", "ENTRY", "TOKENS", "BYTES", "LAST USE"],
            [["  " + show_ns(e["ns"]), e["id"], str(e["tokens"]), format_size(e["nbytes"]),
              format_time(e["last_use"])] for e in o["entries"]],
            right={2, 3},
        ))
        print(f"  their blocks: 'blockkv gc --remote' deletes those no entry references once uploaded more than "
              f"{o['gc_grace']:g} s ago (bucket gc goes by a block's age, not by when it lost its last entry)")
    return EXIT_OK
