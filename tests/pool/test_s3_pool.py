"""S3Pool against a real S3 server process: moto's server on 127.0.0.1.

The shipped PoolTests and BucketTests run against it, and what only a bucket
has: the server itself refusing a second create with 412, keys laid out under
the prefix, configuration from the AWS environment variables, bounded
timeouts, and a byte flipped in the bucket caught by the caller's
verification."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import boto3  # moto's own dependency: a second, independent client to check the server
import mlx.core as mx
import numpy as np
import obstore
import pytest
from botocore.exceptions import ClientError
from moto.server import ThreadedMotoServer
from obstore.store import S3Store

from blockkv.bucket.objects import BucketPool
from blockkv.errors import BlockMissingError, CorruptBlockError
from blockkv.format.blocks import split_entry
from blockkv.format.frame import decode_block, encode_block
from blockkv.format.layout import BLOCK_LAYOUT, META_LAYOUT, Layout
from blockkv.format.rebuild import rebuild
from blockkv.pool.s3 import S3Pool, parse_url
from blockkv.testing.bucket_tests import BucketTests
from blockkv.testing.models import prefill, random_tokens, tiny_model
from blockkv.testing.pool_tests import PoolTests, name_for, payload

CREDENTIALS = {"access_key_id": "testing", "secret_access_key": "testing", "region": "us-east-1"}


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server on a free loopback port, for this module's tests."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def client(s3_endpoint: str) -> Any:
    return boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id="testing",
                        aws_secret_access_key="testing", region_name="us-east-1")


@pytest.fixture
def bucket(client: Any) -> str:
    name = f"blockkv-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    return name


@pytest.fixture
def options(s3_endpoint: str) -> dict[str, str]:
    return {"endpoint_url": s3_endpoint, **CREDENTIALS}


def raw_store(bucket: str, options: dict[str, str]) -> S3Store:
    """The bucket seen without any prefix, beside the pool (to look at or damage its objects)."""
    return S3Store(bucket, endpoint=options["endpoint_url"], access_key_id="testing",
                   secret_access_key="testing", region="us-east-1", client_options={"allow_http": True})


class TestS3Pool(PoolTests):
    object_size = 256 << 10  # every byte crosses loopback HTTP: keep the races quick

    @pytest.fixture
    def pool(self, layout: Layout, bucket: str, options: dict[str, str]) -> S3Pool:
        return S3Pool(f"s3://{bucket}/fleet/fp", layout, options)


class TestBucketProtocolOnMoto(BucketTests):
    @pytest.fixture
    def bucket_pool(self, bucket: str, options: dict[str, str]) -> BucketPool:
        return BucketPool(f"s3://{bucket}/fleet/fp", META_LAYOUT, options)


def test_the_server_itself_refuses_a_second_create(client: Any, bucket: str) -> None:
    """The premise of the pool, checked with another client: the server answers
    If-None-Match: * with 412 and keeps the first bytes."""
    client.put_object(Bucket=bucket, Key="k", Body=b"first", IfNoneMatch="*")
    with pytest.raises(ClientError) as refused:
        client.put_object(Bucket=bucket, Key="k", Body=b"second", IfNoneMatch="*")
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == b"first"


def test_objects_live_under_the_prefix_at_their_layout_location(bucket: str, options: dict[str, str]) -> None:
    pool = S3Pool(f"s3://{bucket}/fleet/fp/blobs", BLOCK_LAYOUT, options)
    data = payload(1000, 1)
    name = name_for(BLOCK_LAYOUT, data)
    assert pool.put_if_absent(name, [data])
    keys = [m["path"] for batch in obstore.list(raw_store(bucket, options)) for m in batch]
    assert keys == [f"fleet/fp/blobs/{name[:2]}/{name}"]


def test_listing_skips_foreign_objects(bucket: str, options: dict[str, str]) -> None:
    pool = S3Pool(f"s3://{bucket}/p", BLOCK_LAYOUT, options)
    data = payload(10, 2)
    name = name_for(BLOCK_LAYOUT, data)
    pool.put_if_absent(name, [data])
    store = raw_store(bucket, options)
    for junk in [f"p/{name[:2]}/{name}.tmp", f"p/zz/{name}", f"p/{name}", "other/x", f"p/{name[:2]}/README"]:
        obstore.put(store, junk, b"junk")
    assert list(pool.list_prefix()) == [name]
    assert list(pool.list_prefix(name[:5])) == [name]


def test_configuration_from_the_aws_environment(bucket: str, options: dict[str, str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", options["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    pool = S3Pool(f"s3://{bucket}/env")
    data = payload(100, 3)
    name = name_for(BLOCK_LAYOUT, data)
    assert pool.put_if_absent(name, [data])
    assert S3Pool(f"s3://{bucket}/env", options=options).get(name) == data


@pytest.mark.parametrize("url", ["bucket/prefix", "s3://", "http://bucket/x", "s3://bucket/p?x=1"])
def test_bad_urls_are_value_errors(url: str) -> None:
    with pytest.raises(ValueError):
        parse_url(url)


def test_bad_options_are_value_errors() -> None:
    with pytest.raises(ValueError, match="endpoint"):
        S3Pool("s3://bucket/p", options={"endpoint": "http://127.0.0.1:1"})
    with pytest.raises(ValueError):
        S3Pool("s3://bucket/p", options={"endpoint_url": "http://127.0.0.1:1"}, timeout=0)


def test_a_server_that_never_answers_fails_within_the_timeout() -> None:
    """Bounded timeouts: a listener that accepts and never replies costs about one timeout, not a hang."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        pool = S3Pool("s3://bucket/p", options={"endpoint_url": endpoint, **CREDENTIALS},
                      timeout=0.5, connect_timeout=0.5, max_retries=0)
        name = name_for(BLOCK_LAYOUT, b"x")
        started = time.monotonic()
        with pytest.raises(Exception) as caught:
            pool.exists(name)
        assert not isinstance(caught.value, BlockMissingError)  # an outage is not a missing name
        assert time.monotonic() - started < 30  # generous: the point is that it returns at all


def test_a_flipped_byte_in_the_bucket_is_refused_by_the_callers_verification(
        bucket: str, options: dict[str, str]) -> None:
    """The bucket is untrusted: the pool hands back whatever is stored, and
    decode_block refuses a block that no longer hashes to its name."""
    model = tiny_model("llama", dtype=mx.float16)
    tokens = random_tokens(104, seed=7)
    caches, _ = prefill(model, tokens[:100], chunk=64)
    layout = split_entry(caches, block_tokens=32)
    pool = S3Pool(f"s3://{bucket}/fp/blobs", BLOCK_LAYOUT, options)
    for block in layout.blocks:
        assert pool.put_if_absent(block.ref.name, encode_block(block, "zstd"))
    payloads = {name: decode_block(name, pool.get(name)) for name in pool.list_prefix()}
    restored, _ = rebuild(layout.descriptor, payloads)  # through the bucket and back: the same next logits
    _, want = prefill(model, tokens[100:], cache=caches)
    _, got = prefill(model, tokens[100:], cache=restored)
    assert np.array_equal(np.array(want.view(mx.uint8)), np.array(got.view(mx.uint8)))

    victim = layout.blocks[0].ref.name
    key = f"fp/blobs/{victim[:2]}/{victim}"
    store = raw_store(bucket, options)
    damaged = bytearray(obstore.get(store, key).bytes())
    damaged[len(damaged) // 2] ^= 0x01
    obstore.put(store, key, bytes(damaged))  # overwrite in place, as bit rot or a hostile writer would
    assert pool.get(victim) == bytes(damaged)
    with pytest.raises(CorruptBlockError):
        decode_block(victim, pool.get(victim))
    with pytest.raises(CorruptBlockError):
        decode_block(victim, pool.read_into(victim, bytearray(len(damaged))))
