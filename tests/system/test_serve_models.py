"""The models and flags people really run, through real ``blockkv serve``
processes and the ``openai`` client: a first run from a Hugging Face repo id
(a simulated download), ``--draft-model`` and ``--kv-bits`` with
``--quantized-kv-start``: entries reach the disk, a restart restores them, and
every answer is ``mlx_lm server``'s own for the same requests. And the
start-up mistakes that used to hang: one line, exit 2."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from blockkv.model_dir import build_model_dir, sample_text
from tests.system.test_serve import REQUEST_BOUND_S, Server, _spills

MAX_TOKENS = 8
SUPPORT = Path(__file__).resolve().parents[1] / "support"
SERVE = [sys.executable, "-m", "blockkv", "serve", "--min-restore-tokens", "16"]
MLX_LM = [sys.executable, "-m", "mlx_lm", "server"]
DOWNLOAD_S = 3.0  # how long the simulated download of the weights takes


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a tiny llama, a draft model of the same tokenizer and other weights)."""
    root = tmp_path_factory.mktemp("models")
    return build_model_dir(root / "model", "llama"), build_model_dir(root / "draft", "llama", seed=3)


def _conversation(system_words: int, seed: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": sample_text(system_words, seed=seed)},
            {"role": "user", "content": sample_text(8, seed=seed + 1)}]


def _follow_up(conversation: list[dict[str, str]], answer: Any, seed: int) -> list[dict[str, str]]:
    return [*conversation, {"role": "assistant", "content": answer.choices[0].message.content},
            {"role": "user", "content": sample_text(6, seed=seed)}]


def _ask(server: Server, messages: list[dict[str, str]]) -> Any:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0,
                           timeout=REQUEST_BOUND_S)
    return client.chat.completions.create(model="default_model", messages=messages,  # type: ignore[arg-type]
                                          max_tokens=MAX_TOKENS, temperature=0.0)


def _cached(answer: Any) -> int:
    return int(answer.usage.prompt_tokens_details.cached_tokens)


def _restored(log: str) -> list[int]:
    return [int(n) for n in re.findall(r"blockkv: restored (\d+) of \d+ prompt tokens from disk", log)]


def _mlx_lm_answers(model: Path, flags: list[str], requests: list[list[dict[str, str]]], log: Path) -> list[str]:
    """What plain ``mlx_lm server`` answers to each of ``requests`` computed from
    scratch (``--prompt-cache-size 0``: with ``--draft-model`` its RAM tier's
    answer to a follow-up differs from its own cold one, docs/mlx-lm.md)."""
    server = Server([*MLX_LM, "--prompt-cache-size", "0", *flags], model, None, log)
    try:
        return [_ask(server, messages).choices[0].message.content for messages in requests]
    finally:
        server.proc.terminate()
        server.proc.wait(timeout=REQUEST_BOUND_S)


def _run_twice(command: list[str], model: Path | str, cache_dir: Path, tmp_path: Path,
               first: list[list[dict[str, str]]], seed: int) -> tuple[list[Any], list[Any], str]:
    """Answers of a server to ``first``, then of a restarted one to each one's follow-up; its log."""
    server = Server(command, model, cache_dir, tmp_path / "a.log")
    try:
        before = [_ask(server, messages) for messages in first]
    finally:
        log = server.stop()
    written, failed = _spills(log)
    assert written >= len(first) and failed == 0, log
    server = Server(command, model, cache_dir, tmp_path / "b.log")
    try:
        after = [_ask(server, _follow_up(m, a, seed + i)) for i, (m, a) in enumerate(zip(first, before))]
    finally:
        log = server.stop()
    return before, after, log


def test_a_draft_model_entries_reach_the_disk_and_restore_with_mlx_lms_answers(
    models: tuple[Path, Path], tmp_path: Path
) -> None:
    """mlx-lm keeps the draft model's caches one token behind the model's: the
    disk keeps what both hold, and after a restart both are restored from it,
    with mlx-lm's own answer (and the model's greedy answer without a draft)."""
    model, draft = models
    conversation = _conversation(60, seed=1)
    flags = ["--draft-model", str(draft)]
    (a,), (b,), log = _run_twice([*SERVE, *flags], model, tmp_path / "cache", tmp_path, [conversation], seed=10)
    assert _restored(log) == [_cached(b)] and _cached(b) >= a.usage.prompt_tokens
    follow = _follow_up(conversation, a, 10)
    plain = _mlx_lm_answers(model, flags, [conversation, follow], tmp_path / "mlx-lm.log")
    assert [a.choices[0].message.content, b.choices[0].message.content] == plain
    assert _mlx_lm_answers(model, [], [conversation, follow], tmp_path / "no-draft.log") == plain


def test_kv_bits_entries_before_and_past_the_quantised_start_restore_with_mlx_lms_answers(
    models: tuple[Path, Path], tmp_path: Path
) -> None:
    """--kv-bits with --quantized-kv-start 100: a short conversation's entry is
    KVCache, a long one's QuantizedKVCache; a restarted server restores each,
    under a store directory that names the settings."""
    model, _ = models
    flags = ["--kv-bits", "8", "--kv-group-size", "32", "--quantized-kv-start", "100"]
    short, long = _conversation(15, seed=2), _conversation(150, seed=4)
    before, after, log = _run_twice([*SERVE, *flags], model, tmp_path / "cache", tmp_path, [short, long], seed=20)
    assert before[0].usage.prompt_tokens + MAX_TOKENS < 100 < before[1].usage.prompt_tokens
    assert _restored(log) == [_cached(b) for b in after]
    assert all(_cached(b) >= a.usage.prompt_tokens for a, b in zip(before, after))
    follow = [_follow_up(m, a, 20 + i) for i, (m, a) in enumerate(zip([short, long], before))]
    plain = _mlx_lm_answers(model, flags, [short, long, *follow], tmp_path / "mlx-lm.log")
    assert [r.choices[0].message.content for r in before + after] == plain
    (directory,) = [d.name for d in (tmp_path / "cache").iterdir() if d.is_dir()]
    assert directory.startswith("model_kv-8bit-g32-s100_")


def _get(server: Server, path: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=REQUEST_BOUND_S) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_first_run_from_a_repo_id_stores_from_its_first_request(
    models: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--model owner/name`` on a first run: the server answers /health (mlx-lm's
    body; /blockkv/health adds the disk tier's state) while
    mlx-lm downloads the model (config first, weights 3 s later), its disk tier
    opens once the model is loaded, so the first request's entry reaches the
    disk, under the identity a later run (the snapshot all there) finds again.
    With no Hugging Face cache directory, /v1/models is valid JSON."""
    model, _ = models
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hf-cache"))
    snapshot = tmp_path / "hf" / "models--owner--tiny" / "snapshots" / ("0" * 40)
    conversation = _conversation(40, seed=6)

    def command(delay: float) -> list[str]:
        return [sys.executable, str(SUPPORT / "download_node.py"), str(model), str(snapshot), str(delay), "--",
                "--min-restore-tokens", "16"]

    server = Server(command(DOWNLOAD_S), "owner/tiny", tmp_path / "cache", tmp_path / "a.log")
    try:
        assert _get(server, "/v1/models") == (200, {"object": "list", "data": []})
        assert _get(server, "/health") == (200, {"status": "ok"})  # mlx-lm's answer, whole
        status, health = _get(server, "/blockkv/health")
        assert status == 200 and health["disk_tier"] == {"state": "not open yet", "why": None}
        a = _ask(server, conversation)
        assert _get(server, "/blockkv/health")[1] == {"status": "ok", "disk_tier": {"state": "on", "why": None}}
    finally:
        log = server.stop()
    assert _spills(log)[0] >= 1 and "cannot open cache" not in log  # each segment boundary is an entry
    server = Server(command(0.0), "owner/tiny", tmp_path / "cache", tmp_path / "b.log")
    try:
        b = _ask(server, _follow_up(conversation, a, 30))
    finally:
        log = server.stop()
    assert _restored(log) == [_cached(b)] and _cached(b) >= a.usage.prompt_tokens


def test_a_port_in_use_or_a_missing_local_model_is_one_line_and_exit_2(
    models: tuple[Path, Path], tmp_path: Path
) -> None:
    model, _ = models
    (tmp_path / "models").mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [(["--model", str(model), "--port", str(port)], f"cannot listen on 127.0.0.1:{port}"),
                 (["--model", "models/nope"], "--model models/nope: no such directory")]
        for argv, message in cases:
            out = subprocess.run([*SERVE, "--cache-dir", str(tmp_path / "kv"), *argv], capture_output=True,
                                 text=True, timeout=REQUEST_BOUND_S, cwd=tmp_path, check=False)
            assert out.returncode == 2 and message in out.stderr, out.stderr
            assert len(out.stderr.strip().splitlines()) == 1, out.stderr
            assert not (tmp_path / "kv").exists()
