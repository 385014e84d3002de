"""End to end: ``blockkv serve`` (mlx-lm's own server) over loopback, stopped and
started again on the same --cache-dir, reuses the stored system prompt and
answers exactly like a cold greedy run."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx_lm
import pytest
from prometheus_client.parser import text_string_to_metric_families

from blockkv import BlockStore
from blockkv.mlx_lm.demo import Agent
from blockkv.mlx_lm.identity import model_identity
from blockkv.mlx_lm.warm import system_tokens
from blockkv.model_dir import build_model_dir, sample_text
from blockkv.testing.fleet_processes import exited_cleanly, free_port
from blockkv.testing.models import prefill

MAX_TOKENS = 8
# Safety bounds so a broken server fails the test instead of hanging it (not assertions on speed).
START_BOUND_S = 180.0
REQUEST_BOUND_S = 120.0


class Server:
    """One ``blockkv serve`` subprocess on 127.0.0.1, logging to a file (or, without
    ``cache_dir``, one ``mlx_lm server`` for answers to compare with)."""

    def __init__(self, command: list[str], model: Path | str, cache_dir: Path | None, log: Path) -> None:
        self.port = free_port()
        self.log = log
        self.blockkv = cache_dir is not None
        argv = [*command, "--model", str(model), *(["--cache-dir", str(cache_dir)] if self.blockkv else [])]
        argv += ["--host", "127.0.0.1", "--port", str(self.port), "--log-level", "INFO"]
        with open(log, "wb") as out:
            # Ctrl-C must reach it even when the tests run as a background job (`nohup ... &`
            # ignores SIGINT, and an ignored signal stays ignored across exec)
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_default_sigint)
        deadline = time.monotonic() + START_BOUND_S
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"server did not come up:\n{log.read_text()}")
            time.sleep(0.05)  # a refused connect costs nothing: every start waits a poll less

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5):
                return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def chat(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": True}
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=REQUEST_BOUND_S) as response:
            result: dict[str, Any] = json.loads(response.read())
        return result

    def metrics(self) -> dict[str, float]:
        """GET /metrics, parsed by prometheus_client's own parser: sample name{labels} -> value."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=REQUEST_BOUND_S) as response:
            text = response.read().decode()
        return {s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def stop(self, how: signal.Signals = signal.SIGINT) -> str:
        """Ctrl-C as a user would (or SIGTERM as a service manager would); returns the log."""
        self.proc.send_signal(how)
        try:
            code = self.proc.wait(timeout=REQUEST_BOUND_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"server ignored {how.name}:\n{self.log.read_text()}")
        log = self.log.read_text()
        assert not self.blockkv or _spills(log)[1] == 0, log
        assert exited_cleanly(code, log), log
        return log


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _spills(log: str) -> tuple[int, int]:
    """(spills written, spills failed) from the server's shutdown line."""
    closed = re.search(r"blockkv: disk tier closed \(.*\): (\d+) spills(?: \(\d+ not in the bucket yet\))?, "
                       r"(\d+) failed", log)
    assert closed is not None, log
    return int(closed.group(1)), int(closed.group(2))


def _token_ids(response: dict[str, Any]) -> list[int]:
    return [int(t["id"]) for t in response["choices"][0]["logprobs"]["content"]]


def _cached(response: dict[str, Any]) -> int:
    return int(response["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.parametrize(
    "kind",
    [
        "llama",
        # Sliding window (RotatingKVCache, wrapped) and SSM (ArraysCache): only the
        # system-prompt segment mlx-lm's server inserts is an exact boundary to reuse.
        "gemma3",
        "mamba",
    ],
)
def test_restarted_server_reuses_the_system_prompt_from_disk(kind: str, tmp_path: Path) -> None:
    model_dir = build_model_dir(tmp_path / "model", kind)
    cache_dir = tmp_path / "cache"
    system = {"role": "system", "content": sample_text(300, seed=1)}  # over one block (256 tokens)
    loaded = mlx_lm.load(str(model_dir))
    model, tokenizer = loaded[0], loaded[1]
    system_tokens = len(tokenizer.apply_chat_template([system]))

    first = Server([sys.executable, "-m", "blockkv", "serve"], model_dir, cache_dir, tmp_path / "a.log")
    try:
        a = first.chat([system, {"role": "user", "content": sample_text(10, seed=2)}])
        b = first.chat([system, {"role": "user", "content": sample_text(10, seed=3)}])
    finally:
        first_log = first.stop()
    assert _cached(a) == 0 and _cached(b) >= system_tokens  # mlx-lm's RAM tier at work
    assert _spills(first_log)[0] > 0

    conversation = [system, {"role": "user", "content": sample_text(12, seed=4)}]
    second = Server([sys.executable, "-m", "blockkv.node.serve"], model_dir, cache_dir, tmp_path / "b.log")
    try:
        c = second.chat(conversation)
        d = second.chat([system, {"role": "user", "content": sample_text(12, seed=5)}])
    finally:
        log = second.stop()
    restored = [int(n) for n in re.findall(r"blockkv: restored (\d+) of \d+ prompt tokens from disk", log)]
    assert restored == [_cached(c)]  # the first new session reads the system prompt from disk...
    assert _cached(c) >= system_tokens and _cached(d) >= system_tokens  # ...the second finds it in RAM

    cold = Agent(model, tokenizer, None, MAX_TOKENS).ask(conversation, None)
    assert c["usage"]["prompt_tokens"] == cold.prompt_tokens
    assert _token_ids(c) == cold.generated


def test_kv_quantised_server_reuses_its_own_entries_only(tmp_path: Path) -> None:
    """--kv-bits is part of the identity: a quantised server restores its
    QuantizedKVCache entries after a restart; the same model served without
    quantisation does not see them."""
    model_dir = build_model_dir(tmp_path / "model", "llama")
    cache_dir = tmp_path / "cache"
    quantised = ["--kv-bits", "8", "--kv-group-size", "32", "--quantized-kv-start", "0"]
    # a prompt shorter than one block: restored only below the default minimum
    command = [sys.executable, "-m", "blockkv.node.serve", "--min-restore-tokens", "16", *quantised]
    conversation = [
        {"role": "system", "content": sample_text(150, seed=5)},
        {"role": "user", "content": sample_text(10, seed=6)},
    ]
    first = Server(command, model_dir, cache_dir, tmp_path / "a.log")
    try:
        a = first.chat(conversation)
    finally:
        first_log = first.stop()
    assert _spills(first_log)[0] > 0
    second = Server(command, model_dir, cache_dir, tmp_path / "b.log")
    try:
        b = second.chat(conversation)
    finally:
        second.stop()
    plain = Server([sys.executable, "-m", "blockkv.node.serve", "--min-restore-tokens", "16"], model_dir, cache_dir,
                   tmp_path / "c.log")
    try:
        c = plain.chat(conversation)
    finally:
        log = plain.stop(signal.SIGTERM)  # shuts down as cleanly as Ctrl-C
    assert _cached(a) == 0 and _cached(b) == b["usage"]["prompt_tokens"] - 1
    assert _token_ids(b) == _token_ids(a)
    assert _cached(c) == 0 and "restored" not in log
    # each store's directory starts with the model's name and says its KV quantisation
    names = sorted(d.name for d in cache_dir.iterdir() if d.is_dir())
    assert [n.split("_")[:2] for n in names] == [["model", "kv-8bit-g32-s0"], ["model", "kv-off"]]


def test_help_lists_blockkv_and_mlx_lm_flags_and_creates_nothing(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")}
    helps = [
        subprocess.Popen([sys.executable, "-m", "blockkv", "serve", *argv], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
        for argv in (["--help"], ["--model", "x", "--no-such-flag"])
    ]
    (out, err), (_, bad) = (p.communicate(timeout=REQUEST_BOUND_S) for p in helps)
    assert helps[0].returncode == 0, err
    for flag in ("--cache-dir", "--cache-bytes", "--min-restore-tokens", "--model", "--prompt-cache-size",
                 "--kv-bits"):
        assert flag in out
    assert helps[1].returncode == 2 and "--no-such-flag" in bad
    assert list(home.rglob("*")) == []  # neither created the default cache directory


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--cache-bytes", "lots"], "not a size"), (["--min-restore-tokens", "0"], "must be at least 1"),
     (["--cache-bytes", "0"], "at least 1 byte"), (["--cache-bytes", "0.4"], "at least 1 byte"),
     (["--remote", "http://bucket/prefix"], "s3://"), (["--remote", "s3://b/p", "--remote-option", "grace"], "KEY=VALUE"),
     (["--remote", "s3://b/p", "--remote-option", "colour=blue"], "unknown remote option"),
     (["--remote-option", "region=auto"], "without remote"),
     (["--model", "/nonexistent/model"], "no such directory"), (["--model", "./nope"], "no such directory"),
     (["--model", "no such model"], "not a Hugging Face repo id"),
     (["--per-key-cache"], "needs API keys"), (["--cache-bytes", "150%"], "not a share of the disk"),
     (["--cache-dir", "/etc/hosts"], "is a file, not a directory"), (["--api-key-file", "/nonexistent/keys"], "cannot read it")],
)
def test_bad_blockkv_flags_are_usage_errors(tmp_path: Path, argv: list[str], message: str) -> None:
    cache_dir = tmp_path / "kv"
    out = subprocess.run(
        [sys.executable, "-m", "blockkv.node.serve", "--cache-dir", str(cache_dir), *argv],
        capture_output=True, text=True, timeout=REQUEST_BOUND_S,
    )
    assert out.returncode == 2 and message in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and not cache_dir.exists()  # one line, nothing created


def test_warmed_system_prompt_hits_first_and_metrics_count_every_tier(tmp_path: Path) -> None:
    """``blockkv warm`` stores the system prompt the way serve tokenises it, so
    the first request after it (a new process, as after a restart) is a disk
    hit that ``cached_tokens`` counts; the next is a RAM hit; /metrics says so."""
    model_dir = build_model_dir(tmp_path / "model", "mamba")  # an SSM: only an exact boundary is reusable
    cache_dir = tmp_path / "cache"
    system_file = tmp_path / "system.json"
    system = {"role": "system", "content": sample_text(300, seed=1)}
    system_file.write_text(json.dumps([system, {"role": "user", "content": "ignored"}]))
    warm = subprocess.run([sys.executable, "-m", "blockkv", "warm", str(cache_dir), str(system_file), "--model",
                           str(model_dir)], capture_output=True, text=True, timeout=REQUEST_BOUND_S)
    assert warm.returncode == 0, warm.stderr
    server = Server([sys.executable, "-m", "blockkv", "serve"], model_dir, cache_dir, tmp_path / "a.log")
    try:
        before = server.metrics()
        a = server.chat([system, {"role": "user", "content": sample_text(10, seed=2)}])
        b = server.chat([system, {"role": "user", "content": sample_text(10, seed=3)}])
        after = server.metrics()
    finally:
        log = server.stop()
    tokenizer = mlx_lm.load(str(model_dir))[1]
    system_tokens = len(tokenizer.apply_chat_template([system]))
    assert _cached(a) >= system_tokens and _cached(b) >= system_tokens
    assert re.findall(r"blockkv: restored (\d+) of \d+ prompt tokens from disk", log) == [str(_cached(a))]
    assert before['blockkv_hits_total{tier=disk}'] == 0
    assert after['blockkv_hits_total{tier=disk}'] == 1 and after['blockkv_hits_total{tier=ram}'] == 1
    assert after['blockkv_hits_total{tier=bucket}'] == 0
    assert after['blockkv_tokens_restored_total{tier=disk}'] == _cached(a)
    assert after['blockkv_tokens_prefilled_total'] == (a["usage"]["prompt_tokens"] - _cached(a)
                                                       + b["usage"]["prompt_tokens"] - _cached(b))
    assert after['blockkv_restore_seconds_count{tier=disk}'] == 1 and after["blockkv_bytes_read_total"] > 0
    (cap,) = [v for k, v in after.items() if k.startswith("blockkv_disk_cap_bytes")]
    (used,) = [v for k, v in after.items() if k.startswith("blockkv_disk_bytes")]
    assert cap == 16 << 30 and 0 < used <= cap
    assert f"capped at 16.0 GiB per model (the default" in log  # a fresh install says what it chose


def test_an_entry_that_does_not_fit_the_model_is_a_miss_and_the_server_lives(tmp_path: Path) -> None:
    """An entry of another KV layout (two KV heads, the model has one) planted
    under the served model's identity: the request that matches it is answered
    as a miss, with one warning, and every later request is answered too (mlx-lm's
    generation thread died on it, and the server answered nothing after that)."""
    import openai

    model_dir = build_model_dir(tmp_path / "model", "llama")
    wide_dir = build_model_dir(tmp_path / "wide", "llama", overrides={"num_key_value_heads": 2})
    cache_dir = tmp_path / "cache"
    system = {"role": "system", "content": sample_text(300, seed=1)}  # over one block (256 tokens)
    tokenizer = mlx_lm.load(str(model_dir))[1]
    tokens = system_tokens(tokenizer, [system])
    caches, _ = prefill(mlx_lm.load(str(wide_dir))[0], tokens)
    ident = model_identity(model_dir)
    with BlockStore(cache_dir, model_id=ident.model_id, config_fingerprint=ident.config_fingerprint,
                    tokenizer_hash=ident.tokenizer_hash, max_bytes=1 << 30) as store:
        assert store.store(tokens, caches)
    server = Server([sys.executable, "-m", "blockkv", "serve"], model_dir, cache_dir, tmp_path / "a.log")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0,
                               timeout=REQUEST_BOUND_S)
        answers = [client.chat.completions.create(
            model="default_model", messages=[system, {"role": "user", "content": sample_text(10, seed=seed)}],
            max_tokens=MAX_TOKENS, temperature=0.0) for seed in (2, 3, 4)]
    finally:
        log = server.stop()
    assert all(a.choices[0].message.content is not None for a in answers)
    assert answers[0].usage.prompt_tokens_details.cached_tokens == 0  # the planted entry was not served
    assert "restored" not in log and len(re.findall(r"does not fit the model", log)) == 1


@contextlib.contextmanager
def _read_only(directory: Path) -> Iterator[None]:
    """``directory`` read-only for this process: its mode for a user, a read-only
    bind mount for root (whom no mode stops)."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        try:
            yield
        finally:
            directory.chmod(0o755)
        return
    subprocess.run(["mount", "--bind", str(directory), str(directory)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(directory)], check=True)
        yield
    finally:
        subprocess.run(["umount", str(directory)], check=True)


def test_a_read_only_cache_dir_is_refused_at_start(tmp_path: Path) -> None:
    """On a cache directory it cannot write, serve would find nothing to store
    to and run RAM-only; it says so and exits instead."""
    cache_dir = tmp_path / "kv"
    cache_dir.mkdir()
    with _read_only(cache_dir):
        out = subprocess.run([sys.executable, "-m", "blockkv", "serve", "--model", str(tmp_path), "--cache-dir",
                              str(cache_dir)], capture_output=True, text=True, timeout=REQUEST_BOUND_S)
    assert out.returncode == 2 and "is read-only" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
