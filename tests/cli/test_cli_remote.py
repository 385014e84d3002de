"""``blockkv ls/stats/check/gc/evict --remote`` as users run them (the installed
console script, a subprocess) against a real S3 server process (moto's, on
127.0.0.1) holding entries built from real mlx-lm KVCache objects in the
bucket layout every node writes (tests/support/bucket_node.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import bucket_node as node
import obstore
from test_bucket import endpoint, make_bucket, raw_store, server, server_clock  # noqa: F401 - moto's server fixtures
from test_cli import parsed, run_all

from blockkv.bucket.bucket import Bucket
from blockkv.format.blocks import namespace_key
from blockkv.format.layout import ns_dirname
from blockkv.testing.moto_clock import ServerClock

GRACE = 9.0  # the shortest a 1 s request timeout allows: the test waits it out once
TIMING = ["--remote-option", f"grace={GRACE}", "--remote-option", "timeout=1"]  # as the nodes would run


def env_for(server_url: str) -> dict[str, str]:
    """The standard AWS variables, as a node's service file would set them."""
    return {**os.environ, "AWS_ENDPOINT_URL": server_url, "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}


def snapshot(server_url: str, bucket_name: str) -> dict[str, tuple[int, Any, Any]]:
    """Every object in the bucket: size, ETag and Last-Modified (a rewrite changes the last)."""
    raw = raw_store(server_url, bucket_name)
    return {m["path"]: (m["size"], m["e_tag"], m["last_modified"]) for batch in obstore.list(raw) for m in batch}


def key_of(kind: str, name: str) -> str:
    return f"fleet/{node.FP_DIR}/{kind}/" + (f"{name[:2]}/{name}" if kind == "blobs" else name)


def fill(bucket: Bucket) -> dict[str, Any]:
    """Three entries sharing a 32-token system prompt (two namespaces, the
    tenant's uploaded by a ``--per-key-cache`` node: its blocks named with its
    namespace's key), the first restored since by another node, and the blocks
    of a store abandoned before its header."""
    bucket.ensure_identity(node.IDENTITY)
    entries = {}
    for seed, ns in [(1, ""), (2, "tenant-a"), (3, "")]:
        name, header, layout, caches = node.entry(64, seed=seed, shared=32, ns=ns, keyed=bool(ns))
        node.upload(bucket, name, header, layout, namespace_key(ns) if ns else None)
        entries[name] = dict(ns=ns, tokens=64, layout=layout, caches=caches, header=len(header))
        time.sleep(1.1)  # Last-Modified has one-second resolution: a definite order
    first = next(iter(entries))
    bucket.touch(first)  # used again, by another node: now the most recent
    garbage = node.entry(32, seed=99)[2]
    node.put_blocks(bucket.begin_store(), garbage)
    return dict(entries=entries, first=first, garbage=sorted(b.ref.name for b in garbage.blocks))


def entry_id(name: str) -> str:
    return name.rpartition("/")[2].removesuffix(".bkv")


def test_ls_stats_and_check_read_the_bucket_and_write_nothing(endpoint: str) -> None:  # noqa: F811
    bucket_name = make_bucket(endpoint)
    bucket = node.open_bucket(endpoint, bucket_name)
    filled = fill(bucket)
    before = snapshot(endpoint, bucket_name)
    url = f"s3://{bucket_name}/fleet"
    options = ["--remote-option", f"endpoint_url={endpoint}", "--remote-option", "access_key_id=testing",
               "--remote-option", "secret_access_key=testing", "--remote-option", "region=us-east-1"]
    ls, stats, check, human = run_all(
        ["ls", "--remote", url, "--json", *options],  # options on the command line...
        ["stats", "--remote", url, "--json"],  # ...or from the environment
        ["check", "--remote", url, "--json"],
        ["stats", "--remote", url],
        env=env_for(endpoint),
    )
    assert snapshot(endpoint, bucket_name) == before  # not one PUT or DELETE

    entries = filled["entries"]
    rows = parsed(ls)["entries"]
    assert parsed(ls)["remote"] == url
    assert [r["id"] for r in rows] == [entry_id(n) for n in [*list(entries)[1:], filled["first"]]]  # LRU first
    for row in rows:
        (name,) = [n for n in entries if entry_id(n) == row["id"]]
        assert (row["ns"], row["tokens"], row["blocks"]) == (
            entries[name]["ns"], entries[name]["tokens"], len(entries[name]["layout"].blocks))
        assert row["fingerprint"] == node.FP_DIR and row["model_id"] == node.IDENTITY.model_id

    objects = {k: v[0] for k, v in before.items()}
    referenced = {b.ref.name for e in entries.values() for b in e["layout"].blocks}
    (fp,) = parsed(stats)["fingerprints"]
    assert fp["dir"] == f"{url}/{node.FP_DIR}" and fp["entries"] == 3
    assert fp["blocks"] == len(referenced) < sum(len(e["layout"].blocks) for e in entries.values())  # shared
    assert fp["disk_bytes"] == sum(e["header"] for e in entries.values()) + sum(
        objects[key_of("blobs", b)] for b in referenced)
    assert fp["logical_bytes"] > fp["disk_bytes"]
    assert fp["unreferenced_blocks"] == len(filled["garbage"])
    assert fp["unreferenced_bytes"] == sum(objects[key_of("blobs", b)] for b in filled["garbage"])
    assert [ns["ns"] for ns in fp["namespaces"]] == ["", "tenant-a"]
    assert fp["corrupt_headers"] == [] and fp["dangling_entries"] == [] and fp["foreign_entries"] == []

    report = parsed(check)
    assert report["clean"] and report["remote"] == url
    (fp,) = report["fingerprints"]
    assert fp["report"]["entries"] == 3 and fp["report"]["blocks"] == len(referenced)  # read: garbage is not
    assert fp["report"]["in_flight"] == filled["garbage"]  # named by no header: not a finding
    assert human.returncode == 0 and "3 entries" in human.stdout and "in the bucket" in human.stdout
    assert f"{len(filled['garbage'])} block(s)" in human.stdout


def test_check_reports_damage_in_the_bucket_and_repair_acts_only_on_proof(
        endpoint: str, server_clock: ServerClock) -> None:  # noqa: F811
    """A flipped block, a deleted one and a header that does not read. Without
    a fleet key a block that does not hash to its name is proven bad only once
    every header reads and it is older than the grace period (no store in
    flight can have named it with a key nobody has seen); an entry missing a
    block is removed only after the fleet had a grace period to send a good
    copy back (``wanted/``). The server's clock is stepped instead of waited for."""
    bucket_name = make_bucket(endpoint)
    bucket = node.open_bucket(endpoint, bucket_name)
    filled = fill(bucket)
    entries = filled["entries"]
    names = list(entries)
    raw = raw_store(endpoint, bucket_name)
    own = [b.ref.name for b in entries[names[2]]["layout"].blocks]
    others = {b.ref.name for n in names[:2] for b in entries[n]["layout"].blocks}
    flipped, deleted = [b for b in own if b not in others][:2]  # only the third entry's
    damaged = bytearray(obstore.get(raw, key_of("blobs", flipped)).bytes())
    damaged[-5] ^= 0x10
    obstore.put(raw, key_of("blobs", flipped), bytes(damaged))
    obstore.delete(raw, key_of("blobs", deleted))
    junk = f"{ns_dirname('')}/{'e' * 32}.bkv"
    obstore.put(raw, key_of("entries", junk), b"BKVHDR\x00\x00 not a header")
    before = snapshot(endpoint, bucket_name)
    url = f"s3://{bucket_name}/fleet"
    check, stats, human, unnamed = run_all(
        ["check", "--remote", url, "--json", *TIMING], ["stats", "--remote", url, "--json"],
        ["check", "--remote", url, *TIMING], ["check", "--remote", url, "--repair"], env=env_for(endpoint))
    assert snapshot(endpoint, bucket_name) == before  # a check writes nothing

    (fp,) = parsed(check, expect=1)["fingerprints"]
    assert not fp["clean"]
    assert fp["report"]["corrupt_blocks"] == [] and fp["report"]["suspect_blocks"] == [flipped]
    assert fp["report"]["corrupt_headers"] == [junk]
    assert fp["report"]["dangling"] == [entry_id(names[2])]
    assert fp["report"]["entries"] == 3
    (fp,) = parsed(stats)["fingerprints"]
    assert fp["entries"] == 2 and fp["dangling_entries"] == [entry_id(names[2])]  # missing a block
    assert fp["corrupt_headers"] == [junk]
    assert human.returncode == 1 and f"without proof it is bad (kept; a lying header looks the same): {flipped}" in human.stdout
    assert unnamed.returncode == 2 and "--all" in unnamed.stderr  # a repair changes the bucket for every node

    def repair() -> dict[str, Any]:
        (proc,) = run_all(["check", "--remote", url, "--repair", "--all", "--json", *TIMING], env=env_for(endpoint))
        (fp,) = parsed(proc, expect=1)["fingerprints"]
        return fp["report"]

    first = repair()  # no proof yet: the gap is asked of the fleet, nothing is deleted
    assert first["actions"] == [] and first["waiting_for_copy"] == [deleted]
    assert key_of("blobs", flipped) in snapshot(endpoint, bucket_name)
    assert key_of("entries", names[2]) in snapshot(endpoint, bucket_name)
    assert f"fleet/{node.FP_DIR}/wanted/{deleted}" in snapshot(endpoint, bucket_name)

    obstore.delete(raw, key_of("entries", junk))  # every header reads now
    server_clock.step(GRACE + 2)  # and the flipped block is older than the grace period
    second = repair()
    assert second["corrupt_blocks"] == [flipped]
    assert second["actions"] == [f"deleted corrupt block {flipped} and asked the fleet for a good copy"]
    assert second["waiting_for_copy"] == sorted([flipped, deleted])  # one asked just now: the entry waits
    assert key_of("blobs", flipped) not in snapshot(endpoint, bucket_name)

    server_clock.step(GRACE + 2)  # no node sent a good copy back within a grace period
    third = repair()
    assert third["actions"] == [f"removed entry {entry_id(names[2])} (header {names[2]}): a block it needs has "
                                "been missing for a grace period and no node had a good copy"]
    (again,) = run_all(["check", "--remote", url, "--json", *TIMING], env=env_for(endpoint))
    (fp,) = parsed(again)["fingerprints"]  # clean: what the broken entry shared, the others still name
    assert fp["clean"] and fp["report"]["entries"] == 2 and fp["report"]["in_flight"] == filled["garbage"]
    for name in names[:2]:  # the entries that were sound still restore bit-exact
        assert list(node.raw_state(node.restore(bucket, name))) == list(node.raw_state(entries[name]["caches"]))


def test_evict_and_gc_against_the_bucket(endpoint: str) -> None:  # noqa: F811
    """Fleet-wide LRU eviction removes the least recently used headers (a dry run
    nothing); gc deletes only unreferenced blocks older than the grace period;
    every remaining entry restores bit-exact."""
    bucket_name = make_bucket(endpoint)
    bucket = node.open_bucket(endpoint, bucket_name)
    filled = fill(bucket)
    entries, first = filled["entries"], filled["first"]
    names = list(entries)
    url = f"s3://{bucket_name}/fleet"
    env = env_for(endpoint)
    listed = bucket.list_headers()
    sizes = {i.name: i.size for i in bucket.blocks.list_info()}
    keep = {first, names[2]}  # the touched first entry and the newest store
    blocks_kept = {b.ref.name for n in keep for b in entries[n]["layout"].blocks}
    target = sum(listed[n].size for n in keep) + sum(sizes[b] for b in blocks_kept)
    before = snapshot(endpoint, bucket_name)
    dry, told, unnamed, both, gc_young = run_all(
        ["evict", "--remote", url, "--to", str(target), "--all", "--dry-run", "--json"],
        ["evict", "--remote", url, "--to", str(target), "--all", "--dry-run"],
        ["gc", "--remote", url],  # changes the bucket: must name a fingerprint or say --all
        ["gc", str(Path.cwd()), "--remote", url, "--all"],
        ["gc", "--remote", url, "-f", node.FP_DIR, "--json", *TIMING],  # everything is young yet
        env=env,
    )
    (fp,) = parsed(dry)["fingerprints"]
    assert fp["headers"] == [names[1]] and [e["id"] for e in fp["entries"]] == [entry_id(names[1])]
    assert told.returncode == 0 and "once uploaded more than 3600 s ago" in told.stdout  # bucket gc goes by age
    assert unnamed.returncode == 2 and "--all" in unnamed.stderr
    assert both.returncode == 2 and "not both" in both.stderr
    (run,) = parsed(gc_young)["fingerprints"]
    assert run["blocks_deleted"] == 0 and run["young"] == len(filled["garbage"]) and run["headers"] == 3
    assert {k for k in snapshot(endpoint, bucket_name) if "/blobs/" in k or "/entries/" in k} == {
        k for k in before if "/blobs/" in k or "/entries/" in k}

    (evicted,) = run_all(["evict", "--remote", url, "--to", str(target), "--all", "--json"], env=env)
    (fp,) = parsed(evicted)["fingerprints"]
    assert fp["headers"] == [names[1]] and fp["bucket_bytes_after"] <= target < fp["bucket_bytes_before"]
    assert set(bucket.list_headers()) == keep
    freed = {b.ref.name for b in entries[names[1]]["layout"].blocks} - blocks_kept

    until = bucket.server_now() + GRACE + 1.5  # every garbage block older than the grace period
    while bucket.server_now() <= until:
        time.sleep(0.5)
    (swept,) = run_all(["gc", "--remote", url, "--all", "--json", *TIMING], env=env)
    (run,) = parsed(swept)["fingerprints"]
    assert run["blocks_deleted"] == len(freed) + len(filled["garbage"]) and run["young"] == 0
    assert {i.name for i in bucket.blocks.list_info()} == blocks_kept
    for name in keep:
        assert list(node.raw_state(node.restore(bucket, name))) == list(node.raw_state(entries[name]["caches"]))


def test_bad_remote_arguments_are_usage_errors(endpoint: str) -> None:  # noqa: F811
    bucket_name = make_bucket(endpoint)
    node.open_bucket(endpoint, bucket_name).ensure_identity(node.IDENTITY)
    cases = [
        (["stats", "--remote", "http://not-s3/x"], "s3://"),
        (["ls", "--remote", "s3://b/p", "--remote-option", "colour=blue"], "unknown remote option"),
        (["ls", "--remote", "s3://b/p", "--remote-option", "novalue"], "KEY=VALUE"),
        (["gc", "--remote", f"s3://{bucket_name}/fleet", "--all", "--remote-option", "grace=5"], "grace"),
        (["gc", "--remote", f"s3://{bucket_name}/fleet", "--all", "--grace", "5"], "the fleet's"),
        (["ls", "--remote", f"s3://{bucket_name}/fleet", "-f", "no-such-model"], "no fingerprint"),
    ]
    for (argv, message), proc in zip(cases, run_all(*(argv for argv, _ in cases), env=env_for(endpoint))):
        assert proc.returncode == 2 and message in proc.stderr, (argv, proc.stderr)
    typo, right = run_all(["ls", "--remote", f"s3://{bucket_name}/flet"],
                          ["ls", "--remote", f"s3://{bucket_name}/fleet"], env=env_for(endpoint))
    assert typo.returncode == 0 and "no blockkv store under" in typo.stderr  # an empty fleet, or a typo: it asks
    assert right.returncode == 0 and "no blockkv store" not in right.stderr
