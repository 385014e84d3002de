"""API keys end to end: a ``blockkv serve`` node and a ``blockkv route`` in
front of it, real processes on 127.0.0.1 driven by the ``openai`` client,
with, without and with a wrong key, streaming and not; the router sends the
node its own key (its clients' keys are its own to check); no key shows in a
log, a process's command line or ``/metrics``."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx_lm
import openai
import pytest
from mlx_lm.models.cache import load_prompt_cache

from blockkv.model_dir import build_model_dir, sample_text
from blockkv.router.route import NODE_HEADER
from blockkv.testing.fleet_processes import Process
from blockkv.wire.auth import ApiKeys

BOUND_S = 120.0  # safety bound on a request or a wait (not a timing assertion)
SALT = "auth test"


@dataclass
class Keyed:
    node: Process
    router: Process
    on_command_line: str  # the node's --api-key
    in_file: str  # the node's --api-key-file
    in_env: str  # the node's $BLOCKKV_API_KEY
    node_key: str  # in the node's file too, and the router's --node-api-key-file
    client_key: str  # the router's --api-key
    root: Path  # the node's --cache-dir
    key_file: Path  # the node's --api-key-file
    model: Path

    def secrets(self) -> list[str]:
        return [self.on_command_line, self.in_file, self.in_env, self.node_key, self.client_key]


def _key(name: str) -> str:
    return f"sk-{name}-{secrets.token_hex(12)}"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Keyed]:
    tmp = tmp_path_factory.mktemp("auth")
    model = build_model_dir(tmp / "model", "llama")
    hub = tmp / "hf-hub"  # mlx-lm's /v1/models lists the Hugging Face cache: an empty one
    hub.mkdir()
    cmd, file_key, env_key, node_key, client_key = (_key(n) for n in ("cmd", "file", "env", "node", "client"))
    node_keys, router_node_key = tmp / "node-keys", tmp / "router-node-key"
    node_keys.write_text(f"# the node's keys\n{file_key}\n\n{node_key}\n")
    router_node_key.write_text(node_key + "\n")
    node = Process(["serve", "--model", str(model), "--cache-dir", str(tmp / "kv"), "--fleet-salt", SALT,
                    "--log-level", "DEBUG", "--api-key", cmd, "--api-key-file", str(node_keys)], tmp / "node.log",
                   {"HF_HUB_CACHE": str(hub), "BLOCKKV_API_KEY": env_key})
    router = None
    try:
        node.wait_ready()
        router = Process(["route", "--model", str(model), "--node", node.url, "--fleet-salt", SALT,
                          "--log-level", "DEBUG", "--api-key", client_key, "--node-api-key-file",
                          str(router_node_key)], tmp / "router.log")
        router.wait_ready()
        yield Keyed(node, router, cmd, file_key, env_key, node_key, client_key, tmp / "kv", node_keys, model)
    finally:
        for process in (router, node):
            if process is not None:
                process.stop()


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=BOUND_S)


def _chat(url: str, key: str, stream: bool) -> str:
    messages = [{"role": "system", "content": sample_text(40, seed=1)}, {"role": "user", "content": "hello"}]
    answer = _client(url, key).chat.completions.create(model="default_model", messages=messages, max_tokens=4,
                                                       temperature=0.0, stream=stream)
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
    return answer.choices[0].message.content or ""


def _get(url: str, headers: dict[str, str] | None = None, data: bytes | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=BOUND_S) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _refused(status: int, body: bytes) -> bool:
    return status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"


def test_a_node_answers_each_of_its_keys_and_nothing_else(keyed: Keyed) -> None:
    url = keyed.node.url
    answers = {key: _chat(url, key, stream=False) for key in (keyed.on_command_line, keyed.in_file, keyed.in_env)}
    assert len(set(answers.values())) == 1  # one greedy answer, whichever key asked
    assert _chat(url, keyed.node_key, stream=True) == answers[keyed.in_file]
    for wrong in ("sk-wrong", keyed.on_command_line + "x", keyed.client_key):  # the router's key is not its own
        for stream in (False, True):
            with pytest.raises(openai.AuthenticationError) as refused:
                _chat(url, wrong, stream)
            assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    bearer = {"Authorization": f"Bearer {keyed.in_env}"}
    for path in ("/metrics", "/blockkv/residency", "/blockkv/events?since=0", "/blockkv/health", "/v1/models"):
        assert _refused(*_get(url + path)), path
        assert _refused(*_get(url + path, {"Authorization": f"Basic {keyed.in_env}"})), path
        assert _get(url + path, bearer)[0] == 200, path
    assert _refused(*_get(url + "/v1/chat/completions", {"Content-Type": "application/json"}, b"{}"))
    assert _get(url + "/health") == (200, _get(url + "/health", bearer)[1])  # the probe needs no key
    assert json.loads(_get(url + "/health")[1]) == {"status": "ok"}  # mlx-lm's answer, whole


def test_the_router_checks_its_clients_keys_and_sends_the_nodes_its_own(keyed: Keyed) -> None:
    url = keyed.router.url
    raw = _client(url, keyed.client_key).chat.completions.with_raw_response.create(
        model="default_model", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0.0)
    assert raw.headers[NODE_HEADER] == keyed.node.url and raw.parse().choices
    assert _chat(url, keyed.client_key, stream=True) == _chat(keyed.node.url, keyed.in_file, stream=True)
    for wrong in ("sk-wrong", keyed.node_key, keyed.in_file):  # a node's keys are not the router's clients'
        for stream in (False, True):
            with pytest.raises(openai.AuthenticationError):
                _chat(url, wrong, stream)
    assert _get(url + "/v1/models", {"Authorization": f"Bearer {keyed.client_key}"})[0] == 200
    assert _refused(*_get(url + "/v1/models"))
    deadline = time.monotonic() + BOUND_S  # the router follows the node's residency with its node key
    while not json.loads(_get(url + "/health")[1])["nodes"][keyed.node.url]["residency"]:
        assert time.monotonic() < deadline, keyed.router.log.read_text()
        time.sleep(0.2)


def test_no_key_shows_in_logs_command_lines_or_metrics(keyed: Keyed) -> None:
    _chat(keyed.router.url, keyed.client_key, stream=False)
    _get(keyed.node.url + "/metrics", {"Authorization": "Bearer sk-a-guess"})
    status, metrics = _get(keyed.node.url + "/metrics", {"Authorization": f"Bearer {keyed.node_key}"})
    assert status == 200
    bearer = {"Authorization": f"Bearer {keyed.node_key}"}
    assert _get(keyed.node.url + "/blockkv/events?since=0", bearer)[0] == 200
    logs = keyed.node.log.read_text() + keyed.router.log.read_text()
    assert "POST /v1/chat/completions" in logs and "GET /metrics" in logs  # the access log, without headers
    assert '"GET /blockkv/events?since=0 HTTP/1.1" 200' not in logs  # a router's polls, all day: no line each
    for key in keyed.secrets():
        assert key not in logs and key.encode() not in metrics
    for process, shown in ((keyed.node, keyed.on_command_line), (keyed.router, keyed.client_key)):
        command_line = Path(f"/proc/{process.proc.pid}/cmdline").read_bytes().decode()
        assert [k for k in keyed.secrets() if k in command_line] == [shown]  # only what was typed there
    assert repr(ApiKeys([keyed.node_key])) == "ApiKeys(1 keys)"


def _cached(url: str, key: str, messages: list[dict[str, str]], stream: bool = False) -> tuple[int, str]:
    """(cached_tokens, answer) of one greedy chat."""
    answer = _client(url, key).chat.completions.create(
        model="default_model", messages=messages, max_tokens=4, temperature=0.0, stream=stream,
        **({"stream_options": {"include_usage": True}} if stream else {}))
    if stream:
        chunks = list(answer)
        usage = chunks[-1].usage
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        usage, text = answer.usage, answer.choices[0].message.content or ""
    assert usage is not None and usage.prompt_tokens_details is not None
    return int(usage.prompt_tokens_details.cached_tokens or 0), text


def test_per_key_caches_share_nothing_between_keys_in_ram_or_on_disk(tmp_path: Path) -> None:
    """--per-key-cache: what one key's requests left in RAM or on disk is not
    there for another key's (cached_tokens 0, the same answer), and survives a
    restart for its own; a tenant's key cannot read the residency."""
    model = build_model_dir(tmp_path / "model", "llama")
    a, b, c = _key("tenant-a"), _key("tenant-b"), _key("tenant-c")
    keys = tmp_path / "keys"
    keys.write_text(f"{a}\n{b}\n{c}\n")
    command = ["serve", "--model", str(model), "--cache-dir", str(tmp_path / "kv"), "--per-key-cache",
               "--api-key-file", str(keys), "--log-level", "INFO"]
    system = {"role": "system", "content": sample_text(300, seed=7)}  # over one block (256 tokens)
    first = [system, {"role": "user", "content": sample_text(10, seed=8)}]
    later = [system, {"role": "user", "content": sample_text(10, seed=9)}]
    node = Process(command, tmp_path / "a.log")
    try:
        node.wait_ready()
        cold, answer = _cached(node.url, a, first)
        warm, again = _cached(node.url, a, later, stream=True)
        other, theirs = _cached(node.url, b, first)
        own, _ = _cached(node.url, b, later, stream=True)
        status, body = _get(node.url + "/blockkv/residency", {"Authorization": f"Bearer {a}"})
    finally:
        assert node.stopped_cleanly(), node.log.read_text()
    assert cold == 0 and warm > 0  # a's system prompt, in a's RAM tier
    assert other == 0 and theirs == answer  # not in b's: b prefilled it, and got the same greedy answer
    assert own > 0
    assert status == 403 and b"operator" in body  # a tenant's key reads no residency (per-key digests included)

    restarted = Process(command, tmp_path / "b.log")
    try:
        restarted.wait_ready()
        fresh = [system, {"role": "user", "content": sample_text(10, seed=10)}]
        never, _ = _cached(restarted.url, c, fresh)  # c sent nothing before: a's and b's disk entries are not c's
        mine, _ = _cached(restarted.url, a, fresh)
    finally:
        assert restarted.stopped_cleanly(), restarted.log.read_text()
    assert never == 0
    assert mine > 0 and len(re.findall("restored", restarted.log.read_text())) == 1  # a's own, from disk


def test_export_flush_takes_the_conversation_a_running_server_just_served(keyed: Keyed, tmp_path: Path) -> None:
    """``blockkv export --flush URL latest``: the server finishes its write-behind
    (POST /blockkv/flush, behind the key) and the file holds the conversation
    it just answered, its prompt as mlx-lm tokenized it, loadable by mlx-lm."""
    messages = [{"role": "system", "content": sample_text(120, seed=31)}, {"role": "user", "content": "go on"}]
    answer = _client(keyed.node.url, keyed.in_file).chat.completions.create(
        model="default_model", messages=messages, max_tokens=4, temperature=0.0)
    assert answer.usage is not None
    out = tmp_path / "live.safetensors"
    export = [sys.executable, "-m", "blockkv", "export", str(keyed.root), "latest", "-o", str(out), "--flush",
              keyed.node.url]
    refused = subprocess.run(export, capture_output=True, text=True, timeout=BOUND_S,
                             env={**os.environ, "BLOCKKV_API_KEY": "sk-wrong"})
    assert refused.returncode == 1 and "API key was refused" in refused.stderr and not out.exists()
    done = subprocess.run([*export, "--api-key-file", str(keyed.key_file)], capture_output=True, text=True,
                          timeout=BOUND_S)
    assert done.returncode == 0, done.stderr
    caches, metadata = load_prompt_cache(str(out), return_metadata=True)
    tokens = json.loads(metadata["blockkv_tokens"])
    prompt = mlx_lm.load(str(keyed.model))[1].apply_chat_template(messages, add_generation_prompt=True)
    assert len(prompt) == answer.usage.prompt_tokens and tokens[: len(prompt)] == prompt
    assert len(tokens) > len(prompt) and caches[0].offset == len(tokens)  # the answer's tokens too
