"""Issue #22 case 8: the fleet's GC must not lose blocks under headers
already written when the S3 server's clock steps (NTP stepping the host of a
self-hosted server). The server is moto's on 127.0.0.1 and its clock steps
through its seam (blockkv.testing.moto_clock); nodes are BlockStores with
their own roots; caches are real mlx-lm caches compared bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import remote_node as node
from test_bucket import endpoint, make_bucket, server, server_clock  # noqa: F401 - the server fixtures

from blockkv.bucket.bucket import Bucket
from blockkv.format.layout import fingerprint_dirname, header_name
from blockkv.testing.moto_clock import ServerClock

FP_DIR = fingerprint_dirname(node.IDENT["config_fingerprint"])
GRACE = float(node.TIMING["grace"])


@pytest.fixture
def bucket_name(endpoint: str) -> str:  # noqa: F811
    return make_bucket(endpoint)


def collector(endpoint: str, bucket_name: str) -> Bucket:  # noqa: F811
    """Another handle on the fleet's directory, running GC as ``blockkv gc --remote`` would."""
    timing = {k: float(v) if k != "max_retries" else int(v) for k, v in node.TIMING.items()}
    return Bucket(f"s3://{bucket_name}/fleet", FP_DIR, {"endpoint_url": endpoint, **node.CREDENTIALS}, **timing)


def test_a_forward_step_while_a_header_is_written_loses_no_block_under_it(
        tmp_path: Path, endpoint: str, bucket_name: str, server_clock: ServerClock) -> None:  # noqa: F811
    """The store has checked its blocks and passed its deadline; while its header
    PUT is in flight the server's clock jumps forward by more than the grace
    period, a GC run marks (by the jumped clock every block of the store is
    garbage past the grace period, and the header is not listed yet), the PUT
    lands, and the run sweeps. The store must not return True over missing blocks."""
    gc = collector(endpoint, bucket_name)
    conv = node.conversation(1)
    swept: list = []
    with node.open_node(tmp_path / "a", endpoint, bucket_name) as a:
        original = a.remote.headers.put_if_absent

        def header_put_racing_a_gc_run(name: str, parts: list) -> bool:  # an ordering seam, the bucket is real
            server_clock.step(GRACE + 2)
            plan = gc.gc_mark()
            created = original(name, parts)
            swept.append(gc.gc_sweep(plan))
            return created

        a.remote.headers.put_if_absent = header_put_racing_a_gc_run  # type: ignore[method-assign]
        assert a.store(*conv)
        a.remote.headers.put_if_absent = original  # type: ignore[method-assign]
        entry = a.find_exact(conv[0]).entry
    assert swept and set(entry.blocks) <= set(swept[0].deleted)  # the premise: the run deleted them all
    assert header_name("", entry.id) in gc.list_headers()
    with node.open_node(tmp_path / "b", endpoint, bucket_name) as b:
        loaded = b.restore(b.find_exact(conv[0]).entry)
        assert loaded is not None and node.kv_bits(loaded.caches, len(conv[0])) == node.kv_bits(conv[1], len(conv[0]))
    gc.close()


def test_a_gc_run_that_sees_the_clock_step_back_deletes_nothing(
        tmp_path: Path, endpoint: str, bucket_name: str, server_clock: ServerClock) -> None:  # noqa: F811
    """A backward step during a sweep would reopen a window writers saw close."""
    gc = collector(endpoint, bucket_name)
    with node.open_node(tmp_path / "a", endpoint, bucket_name) as a:
        assert a.store(*node.conversation(2))
        a.remote.headers.delete(header_name("", a.entries()[0].id))  # its blocks are garbage now
    server_clock.step(GRACE + 2)  # and old enough to condemn
    plan = gc.gc_mark()
    assert plan.doomed
    server_clock.step(-10)
    report = gc.gc_sweep(plan)
    assert report.deleted == [] and report.clock_stepped
    server_clock.step(10)
    assert sorted(gc.gc().deleted) == sorted(plan.doomed)  # the next run, its clock steady, sweeps them
    gc.close()
