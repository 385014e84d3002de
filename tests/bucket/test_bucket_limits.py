"""Issue #22 case 6: nothing is read from the bucket, or from a node's
``remote-headers/``, without a limit known before the read. Objects far
larger than what they claim to be are planted in a real bucket (moto's
server on 127.0.0.1) and a real file is planted in a node's header cache;
a node opened as its own process (tests/support/remote_node.py ``open``) must cost
about what it costs without them: its peak resident memory is compared with
that of the same node opened on the bucket before the plants."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import obstore
import pytest
import remote_node as node
from test_bucket import endpoint, make_bucket, raw_store, server  # noqa: F401 - the server fixtures

from blockkv.bucket.manifest import MANIFEST_MIN
from blockkv.format.header import MAX_HEADER_BYTES
from blockkv.format.layout import fingerprint_dirname, header_name

NODE = str(Path(__file__).parents[1] / "support" / "remote_node.py")
FP_DIR = fingerprint_dirname(node.IDENT["config_fingerprint"])
PLANTED = 48 << 20  # a MANIFEST, a block, an IDENTITY: far above their limits
HUGE_HEADER = MAX_HEADER_BYTES + (16 << 20)  # above the format's cap for a header
ALLOWED = 64  # MiB of peak memory over the unplanted run: well under one planted object


def open_node(root: Path, endpoint: str, bucket: str, out: Path) -> dict:  # noqa: F811
    proc = subprocess.run([sys.executable, NODE, "open", str(root), endpoint, bucket, "0", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


needs_proc = pytest.mark.skipif(sys.platform != "linux", reason="measures peak memory from /proc/self/status (Linux)")


@needs_proc
def test_planted_oversized_objects_cost_a_node_nothing(tmp_path: Path, endpoint: str) -> None:  # noqa: F811
    bucket = make_bucket(endpoint)
    raw = raw_store(endpoint, bucket)
    tokens, caches = node.conversation(1)
    with node.open_node(tmp_path / "writer", endpoint, bucket) as writer:
        assert writer.store(tokens, caches)
        entry = writer.find_exact(tokens).entry
        data = writer.remote.headers.get(header_name("", entry.id))
        for _ in range(MANIFEST_MIN + 2):  # enough headers that a fresh node reads the MANIFEST first
            writer.remote.headers.put_if_absent(header_name("", uuid.uuid4().hex), [data])
    before = open_node(tmp_path / "before", endpoint, bucket, tmp_path / "before.json")
    assert before["restored"] >= 1 and before["error"] is None

    prefix = f"fleet/{FP_DIR}"
    block = entry.blocks[-1]
    obstore.put(raw, f"{prefix}/entries/{header_name('', uuid.uuid4().hex)}", b"\0" * HUGE_HEADER)
    obstore.put(raw, f"{prefix}/MANIFEST", b"\0" * PLANTED)
    obstore.put(raw, f"{prefix}/blobs/{block[:2]}/{block}", b"\0" * PLANTED)
    cached = tmp_path / "after" / FP_DIR / "remote-headers" / header_name("", entry.id)
    cached.parent.mkdir(parents=True)
    with open(cached, "wb") as f:  # a sparse file: costs the disk nothing, a reader everything
        f.truncate(HUGE_HEADER)
    after = open_node(tmp_path / "after", endpoint, bucket, tmp_path / "after.json")
    print("peak RSS MiB before", before["maxrss_mib"], "after", after["maxrss_mib"])
    assert after["error"] is None
    assert after["maxrss_mib"] - before["maxrss_mib"] < ALLOWED


@needs_proc
def test_a_planted_identity_is_one_clear_error_and_costs_nothing(tmp_path: Path, endpoint: str) -> None:  # noqa: F811
    clean, planted = make_bucket(endpoint), make_bucket(endpoint)
    before = open_node(tmp_path / "before", endpoint, clean, tmp_path / "before.json")
    obstore.put(raw_store(endpoint, planted), f"fleet/{FP_DIR}/IDENTITY", b"{" * PLANTED)
    after = open_node(tmp_path / "after", endpoint, planted, tmp_path / "after.json")
    print("peak RSS MiB before", before["maxrss_mib"], "after", after["maxrss_mib"])
    assert "IDENTITY" in after["error"] and "\n" not in after["error"]
    assert after["maxrss_mib"] - before["maxrss_mib"] < ALLOWED


@pytest.mark.parametrize("size", [0, 1])
def test_the_limit_is_exact(endpoint: str, size: int) -> None:  # noqa: F811
    """A ranged read of ``limit + 1`` bytes: an object of exactly the limit reads,
    one byte more is refused (an empty object reads as empty)."""
    from blockkv.errors import OversizedError
    from blockkv.bucket.objects import BucketPool
    from blockkv.format.layout import META_LAYOUT

    bucket = make_bucket(endpoint)
    pool = BucketPool(f"s3://{bucket}/fleet/x", META_LAYOUT, {"endpoint_url": endpoint, **node.CREDENTIALS})
    pool.put_overwrite("IDENTITY", [b"a" * (10 + size)])
    if size:
        with pytest.raises(OversizedError):
            pool.get_limited("IDENTITY", 10)
    else:
        assert pool.get_limited("IDENTITY", 10)[0] == b"a" * 10
    pool.put_overwrite("MANIFEST", [b""])
    assert pool.get_limited("MANIFEST", 10)[0] == b""
