"""BucketTests: what the bucket protocol needs of an S3-compatible server.

``PoolTests`` checks the pool protocol (create once, ranged reads, listing,
deletes, races) on any backend; the fleet's protocol (docs/scale-out.md)
rests on more, which only the server can give, and some servers do not:

- **conditional PUT**: ``If-None-Match: *`` refused (412) once the name
  exists, ``If-Match`` honoured (a replace of a copy proven bad touches no
  other copy);
- **listing**: every finished PUT listed with its size, ``Last-Modified``
  and ETag, a finished DELETE gone from the next listing;
- **ETags**: the ETag a PUT answers is the one HEAD and LIST report, it
  changes with the bytes, and where it is a plain MD5 it is the body's (a
  MANIFEST record is proven by it);
- **clock**: ``Last-Modified`` is the server's time of the PUT, moving
  forward at real speed (GC and stores compare only server times).

Point it at a server before a fleet uses it: subclass and define a
``bucket_pool`` fixture that builds a ``BucketPool`` on an empty prefix::

    class TestMyServer(BucketTests):
        @pytest.fixture
        def bucket_pool(self):
            return BucketPool(f"s3://my-bucket/conformance/{uuid.uuid4().hex}", META_LAYOUT,
                              {"endpoint_url": "https://s3.example.com"})

``tests/pool/test_s3_pool.py`` runs it against moto's S3 server.
"""

from __future__ import annotations

import hashlib
import re
import time
import uuid

import pytest

from blockkv.bucket.clock import no_backward_step, no_forward_step, precise, read_clock
from blockkv.bucket.objects import BucketPool
from blockkv.errors import BlockMissingError

_MD5 = re.compile(r"[0-9a-f]{32}")


def probe_name() -> str:
    """A fresh name of ``META_LAYOUT``'s (a clock probe's)."""
    return f"clock/{uuid.uuid4().hex}"


class BucketTests:
    """Subclasses provide the ``bucket_pool`` fixture (a ``BucketPool`` with ``META_LAYOUT`` on an empty prefix)."""

    clock_wait = 2.5  # seconds between two clock readings: more than Last-Modified's one-second resolution

    @pytest.fixture
    def bucket_pool(self) -> BucketPool:
        raise NotImplementedError("a BucketTests subclass defines the bucket_pool fixture")

    # -- conditional PUT -----------------------------------------------------------
    def test_a_second_create_is_refused_and_the_first_bytes_stay(self, bucket_pool: BucketPool) -> None:
        name = probe_name()
        assert bucket_pool.put_if_absent(name, [b"first"]) is True
        assert bucket_pool.put_if_absent(name, [b"second"]) is False
        assert bucket_pool.get(name) == b"first"

    def test_if_match_replaces_only_the_copy_it_names(self, bucket_pool: BucketPool) -> None:
        name = probe_name()
        first = bucket_pool.put_overwrite(name, [b"first"])
        second = bucket_pool.put_overwrite(name, [b"second"])
        assert bucket_pool.put_if_match(name, [b"stale"], first) is False  # the copy it named is gone
        assert bucket_pool.get(name) == b"second"
        assert bucket_pool.put_if_match(name, [b"third"], second) is True
        assert bucket_pool.get(name) == b"third"
        assert bucket_pool.put_if_match(probe_name(), [b"x"], second) is False  # nothing there to replace

    # -- listing ---------------------------------------------------------------------
    def test_a_listing_shows_every_put_with_its_size_time_and_etag(self, bucket_pool: BucketPool) -> None:
        made = {}
        for i in range(5):
            name = probe_name()
            etag = bucket_pool.put_overwrite(name, [bytes([i]) * (100 + i)])
            made[name] = (100 + i, etag)
        listed = {o.name: o for o in bucket_pool.list_info("clock/")}
        assert set(listed) == set(made)
        for name, (size, etag) in made.items():
            head = bucket_pool.info(name)
            assert listed[name].size == head.size == size
            assert listed[name].etag == head.etag == etag
            assert listed[name].last_modified == head.last_modified > 0

    def test_a_delete_is_gone_from_the_next_listing(self, bucket_pool: BucketPool) -> None:
        names = [probe_name() for _ in range(3)]
        for name in names:
            bucket_pool.put_if_absent(name, [b"x"])
        bucket_pool.delete_many(names[:2])
        assert [o.name for o in bucket_pool.list_info("clock/")] == names[2:]
        with pytest.raises(BlockMissingError):
            bucket_pool.info(names[0])

    # -- ETags -----------------------------------------------------------------------
    def test_an_etag_follows_the_bytes(self, bucket_pool: BucketPool) -> None:
        name = probe_name()
        one = bucket_pool.put_overwrite(name, [b"one"])
        two = bucket_pool.put_overwrite(name, [b"two"])
        assert one and two and one != two
        assert bucket_pool.info(name).etag == two
        again = bucket_pool.put_overwrite(name, [b"one"])
        if _MD5.fullmatch(again):  # a plain MD5, as a MANIFEST record's proof takes it: it must be the body's
            assert again == one == hashlib.md5(b"one", usedforsecurity=False).hexdigest()

    # -- the clock -------------------------------------------------------------------
    def test_last_modified_moves_forward_at_real_speed(self, bucket_pool: BucketPool) -> None:
        name = probe_name()

        def stamp() -> float:
            bucket_pool.put_overwrite(name, [b""])
            return bucket_pool.last_modified(name)

        a = read_clock(stamp)
        time.sleep(self.clock_wait)
        b = read_clock(stamp)
        assert b.server >= a.server
        assert no_backward_step(a, b), "the server's clock stepped back"
        if precise(a, b):  # quick enough readings bound a forward step too
            assert no_forward_step(a, b), "the server's clock stepped forward"
