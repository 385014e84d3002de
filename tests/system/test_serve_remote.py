"""End to end over a bucket: two ``blockkv serve`` processes (mlx-lm's own
server, real HTTP on 127.0.0.1), each with its own --cache-dir, sharing one
bucket on a real S3 server process (moto's). A conversation the first served
is restored from the bucket by the second, which answers exactly like a cold
greedy run."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import bucket_node as node
import mlx_lm
import pytest
from test_bucket import endpoint, make_bucket, server  # noqa: F401 - moto's server fixtures
from test_serve import MAX_TOKENS, Server, _cached, _spills, _token_ids

from blockkv.bucket.bucket import Bucket
from blockkv.bucket.bucket_reader import list_bucket_fingerprints
from blockkv.mlx_lm import PersistentPromptCache
from blockkv.mlx_lm.demo import Agent
from blockkv.model_dir import build_model_dir, sample_text


def test_a_second_server_restores_from_the_bucket_what_the_first_served(endpoint: str, tmp_path: Path) -> None:  # noqa: F811
    model_dir = build_model_dir(tmp_path / "model", "llama")
    url = f"s3://{make_bucket(endpoint)}/fleet"
    options = [f"endpoint_url={endpoint}", *(f"{k}={v}" for k, v in node.CREDENTIALS.items())]
    command = [sys.executable, "-m", "blockkv", "serve", "--remote", url,
               *(arg for option in options for arg in ("--remote-option", option))]
    system = {"role": "system", "content": sample_text(300, seed=1)}  # over one block (256 tokens)
    conversation = [system, {"role": "user", "content": sample_text(12, seed=4)}]
    loaded = mlx_lm.load(str(model_dir))
    model, tokenizer = loaded[0], loaded[1]
    s3 = {"endpoint_url": endpoint, **node.CREDENTIALS}

    def headers_in_bucket() -> set[str]:
        fps, _ = list_bucket_fingerprints(url, s3)
        return {name for fp in fps for name in Bucket(url, fp.name, s3).list_headers()}

    def restored_anywhere() -> set[str]:
        """Entries some node restored from its store: their fleet-wide last-use marks."""
        fps, _ = list_bucket_fingerprints(url, s3)
        return {i.name.removeprefix("used/") for fp in fps for i in Bucket(url, fp.name, s3).meta.list_info("used/")}

    first_dir, second_dir = tmp_path / "a", tmp_path / "b"
    first = Server(command, model_dir, first_dir, tmp_path / "a.log")
    second = None
    try:
        second = Server(command, model_dir, second_dir, tmp_path / "b.log")  # two servers on one bucket
        try:
            a = first.chat(conversation)
        finally:
            first_log = first.stop()  # flushes its write-behind spills: every one is in the bucket now
        uploaded = headers_in_bucket()
        assert uploaded and not restored_anywhere()  # the first only stored
        assert not any(second_dir.glob("*/entries/*/*.bkv"))  # nothing of its own: a restore comes from the bucket
        b = second.chat(conversation)
        metrics = second.metrics()
    finally:
        if first.proc.poll() is None:
            first.proc.kill()
        second_log = second.stop() if second is not None else ""
    assert _spills(first_log)[0] > 0
    assert _cached(a) == 0
    restored = [int(n) for n in
                re.findall(r"blockkv: restored (\d+) of \d+ prompt tokens from the bucket", second_log)]
    system_tokens = len(tokenizer.apply_chat_template([system]))
    assert restored == [_cached(b)] and _cached(b) >= system_tokens, second_log  # restored, not prefilled
    assert restored_anywhere() & uploaded  # the second restored the first's entry, and told the fleet
    assert metrics["blockkv_hits_total{tier=bucket}"] == 1 and metrics["blockkv_hits_total{tier=disk}"] == 0
    assert metrics["blockkv_tokens_restored_total{tier=bucket}"] == _cached(b)
    assert metrics["blockkv_restore_seconds_count{tier=bucket}"] == 1
    assert any(second_dir.glob("*/entries/*/*.bkv"))  # and keeps what it restored in its local tier

    cold = Agent(model, tokenizer, None, MAX_TOKENS).ask(conversation, None)
    assert b["usage"]["prompt_tokens"] == a["usage"]["prompt_tokens"] == cold.prompt_tokens
    assert _token_ids(b) == _token_ids(a) == cold.generated


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [(dict(remote="http://bucket/prefix"), ValueError), (dict(remote=b"s3://b/p"), TypeError),
     (dict(remote="s3://b/p", remote_options={"colour": "blue"}), ValueError),
     (dict(remote_options={"region": "auto"}), ValueError)],
)
def test_a_wrong_remote_is_refused_when_the_cache_is_made(tmp_path: Path, kwargs: dict, error: type) -> None:
    """A store opens on first use and only logs what goes wrong then: a wrong
    remote must fail at construction instead of leaving every model RAM-only."""
    with pytest.raises(error):
        PersistentPromptCache(cache_dir=tmp_path, **kwargs)


def test_spills_kept_locally_through_a_bucket_outage_are_counted_as_stored(tmp_path: Path) -> None:
    """A bucket nobody answers for: the server starts on its local tier, and
    its shutdown line counts what it stored there (and says the bucket lacks
    it), not as failures; a server started afterwards restores it from disk."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once closed
    model_dir = build_model_dir(tmp_path / "model", "llama")
    options = [f"endpoint_url={dead}", "timeout=2", "connect_timeout=1", "max_retries=0",
               *(f"{k}={v}" for k, v in node.CREDENTIALS.items())]
    command = [sys.executable, "-m", "blockkv", "serve", "--remote", "s3://down/fleet",
               *(arg for option in options for arg in ("--remote-option", option))]
    system = {"role": "system", "content": sample_text(300, seed=1)}
    first = Server(command, model_dir, tmp_path / "kv", tmp_path / "a.log")
    try:
        first.chat([system, {"role": "user", "content": sample_text(12, seed=4)}])
    finally:
        log = first.stop(signal.SIGTERM)
    spilled, failed = _spills(log)
    assert spilled > 0 and failed == 0, log
    assert re.search(rf"{spilled} spills \({spilled} not in the bucket yet\)", log), log
    second = Server([sys.executable, "-m", "blockkv", "serve"], model_dir, tmp_path / "kv", tmp_path / "b.log")
    try:
        later = second.chat([system, {"role": "user", "content": sample_text(12, seed=5)}])
    finally:
        second.stop(signal.SIGTERM)
    assert _cached(later) > 0


def test_no_credentials_is_said_at_start_not_ridden_out_as_an_outage(tmp_path: Path) -> None:
    """No key given and no instance metadata service to give one: exit 2 with one
    line saying so, before anything is created (obstore's error was a 403 from
    the metadata service, which serve took for a bucket outage)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once closed
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["AWS_METADATA_ENDPOINT"] = dead  # obstore's last resort, answering nothing
    cache_dir = tmp_path / "kv"
    out = subprocess.run([sys.executable, "-m", "blockkv", "serve", "--model", str(tmp_path), "--cache-dir",
                          str(cache_dir), "--remote", "s3://team/fleet", "--remote-option", f"endpoint_url={dead}",
                          "--remote-option", "connect_timeout=2", "--remote-option", "max_retries=0"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2 and "no credentials for s3://team/fleet" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and not cache_dir.exists()
