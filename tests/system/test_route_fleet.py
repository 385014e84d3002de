"""``blockkv route`` in front of a real fleet: three ``blockkv serve`` processes
(mlx-lm's server, a tiny random-weight model, each its own --cache-dir) on one
bucket of a real S3 server (moto's), the router as its own process, all on
127.0.0.1, driven by the ``openai`` client as a user would.

Sessions sharing two system prompts, several turns each, streaming and not:
every answer is the one a direct request to a node gives, every later turn
lands on the node that served the earlier ones, the router's tokens are the
node's (the node's own residency digests contain them), and a restarted
router relearns all of it from the nodes. Then a node is killed mid-run: the
router answers from the others, and what the dead node had acknowledged is
restored from the bucket rather than prefilled."""

from __future__ import annotations

import itertools
import signal
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bucket_node
import openai
import pytest
from test_bucket import endpoint, make_bucket, server  # noqa: F401 - moto's server fixtures

from blockkv.bucket.bucket import Bucket
from blockkv.bucket.bucket_reader import list_bucket_fingerprints
from blockkv.model_dir import build_model_dir, sample_text
from blockkv.router.route import NODE_HEADER
from blockkv.router.route_tokens import PromptTokenizer
from blockkv.testing.fleet_processes import Process
from blockkv.wire.residency import digest_key, prefix_digests

SALT = "fleet test"
MAX_TOKENS = 6
BOUND_S = 60.0  # safety bound for waits (not a timing assertion)


@dataclass
class Fleet:
    model: Path
    url: str
    s3: dict[str, str]
    nodes: list[Process]
    roots: dict[str, Path]
    router: Process
    tokenizer: PromptTokenizer
    logs: Path
    key: bytes = field(default_factory=lambda: digest_key(SALT))

    def start_router(self) -> None:
        args = ["route", "--model", str(self.model), "--fleet-salt", SALT, "--log-level", "DEBUG"]
        self.router = Process([*args, *(a for n in self.nodes for a in ("--node", n.url))],
                              self.logs / f"router-{time.monotonic_ns()}.log")
        self.router.wait_ready()
        deadline = time.monotonic() + BOUND_S  # it has read every live node's snapshot
        while not all(s["residency"] for s in self.router.get("/health")["nodes"].values()):
            assert time.monotonic() < deadline, self.router.log.read_text()
            time.sleep(0.1)

    def client(self, base: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=(base or self.router.url) + "/v1", api_key="unused", max_retries=0,
                             timeout=BOUND_S)

    def node(self, url: str) -> Process:
        return next(n for n in self.nodes if n.url == url)

    def bucket_headers(self) -> set[str]:
        fps, _ = list_bucket_fingerprints(self.url, self.s3)
        return {name for fp in fps for name in Bucket(self.url, fp.name, self.s3).list_headers()}


def _pending_spills(node: Process) -> float:
    """The node's entries handed to its disk tier and not written yet (its /metrics)."""
    with urllib.request.urlopen(node.url + "/metrics", timeout=BOUND_S) as response:
        lines = response.read().decode().splitlines()
    return float(next(line.split()[1] for line in lines if line.startswith("blockkv_pending_spills ")))


def _headers_under(root: Path, kind: str) -> set[str]:
    return {f"{p.parent.name}/{p.name}" for p in root.glob(f"*/{kind}/*/*.bkv")}


@pytest.fixture(scope="module")
def fleet(server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:  # noqa: F811
    tmp = tmp_path_factory.mktemp("fleet")
    host, port = server.get_host_and_port()
    moto = f"http://{host}:{port}"
    model = build_model_dir(tmp / "model", "llama")
    hub = tmp / "hf-hub"  # mlx-lm's /v1/models lists the Hugging Face cache: an empty one
    hub.mkdir()
    url = f"s3://{make_bucket(moto)}/fleet"
    s3 = {"endpoint_url": moto, **bucket_node.CREDENTIALS}
    remote = ["--remote", url, "--remote-option", "sync_interval=1",
              *(a for k, v in s3.items() for a in ("--remote-option", f"{k}={v}"))]
    roots = {}
    nodes = []
    for i in range(3):
        root = tmp / f"node{i}"
        node = Process(["serve", "--model", str(model), "--cache-dir", str(root), "--fleet-salt", SALT,
                        "--log-level", "INFO", *remote], tmp / f"node{i}.log", {"HF_HUB_CACHE": str(hub)})
        nodes.append(node)
        roots[node.url] = root
    for node in nodes:
        node.wait_ready()
    fleet = Fleet(model, url, s3, nodes, roots, None, PromptTokenizer(str(model)), tmp)  # type: ignore[arg-type]
    try:
        fleet.start_router()
        yield fleet
    finally:
        for process in [fleet.router, *nodes]:
            if process is not None:
                process.stop()


@dataclass
class Turn:
    messages: list[dict[str, str]]
    stream: bool
    node: str
    content: str
    prompt_tokens: int
    cached: int


def _ask(fleet: Fleet, messages: list[dict[str, str]], stream: bool) -> Turn:
    """One chat through the router with the openai client; checks the node's tokens are the router's."""
    raw = fleet.client().chat.completions.with_raw_response.create(
        model="default_model", messages=messages, max_tokens=MAX_TOKENS, temperature=0.0, stream=stream,
        **({"stream_options": {"include_usage": True}} if stream else {}))
    node = raw.headers[NODE_HEADER]
    parsed = raw.parse()
    if stream:
        chunks = list(parsed)
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = next(c.usage for c in chunks if c.usage is not None)
    else:
        content, usage = parsed.choices[0].message.content, parsed.usage
    tokens = fleet.tokenizer.tokens("/v1/chat/completions", {"messages": messages})
    assert usage.prompt_tokens == len(tokens)
    # the node cached what it computed: its RAM residency holds the router's digests of the prompt
    wanted, deadline = set(prefix_digests(tokens, fleet.key)), time.monotonic() + BOUND_S
    while not wanted <= set(fleet.node(node).get("/blockkv/residency")["media"]["RAM"]):
        assert time.monotonic() < deadline, f"{node} does not hold the router's tokens"
        time.sleep(0.05)
    return Turn([*messages], stream, node, content, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens)


def _converse(fleet: Fleet, sessions: list[list[dict[str, str]]], turns: range,
              record: dict[int, list[Turn]]) -> None:
    """Every session's next turn, round by round, alternating streaming and not."""
    for t in turns:
        for s, messages in enumerate(sessions):
            messages.append({"role": "user", "content": sample_text(15, seed=1000 * s + t)})
            turn = _ask(fleet, messages, stream=(s + t) % 2 == 1)
            record.setdefault(s, []).append(turn)
            messages.append({"role": "assistant", "content": turn.content})


def _same_as_direct(fleet: Fleet, record: dict[int, list[Turn]], nodes: list[Process]) -> None:
    """Every routed answer equals a direct (non-streamed) request to a node."""
    for i, turn in enumerate(t for turns in record.values() for t in turns):
        direct = fleet.client(nodes[i % len(nodes)].url).chat.completions.create(
            model="default_model", messages=turn.messages, max_tokens=MAX_TOKENS, temperature=0.0)
        assert direct.choices[0].message.content == turn.content


def test_sessions_stay_on_their_node_and_answer_as_a_node_does(fleet: Fleet) -> None:
    systems = [{"role": "system", "content": sample_text(250, seed=s)} for s in (1, 2)]
    sessions = [[systems[s % 2]] for s in range(4)]
    record: dict[int, list[Turn]] = {}
    _converse(fleet, sessions, range(3), record)
    for s, turns in record.items():
        assert {t.node for t in turns} == {turns[0].node}, (s, [t.node for t in turns])
        for before, after in itertools.pairwise(turns):
            assert after.cached >= before.prompt_tokens  # the whole conversation so far came from the node
    # sessions of one system prompt share its node; the other prompt's went to an idle one
    assert record[0][0].node == record[2][0].node != record[1][0].node == record[3][0].node
    assert record[2][0].cached > 0 and record[3][0].cached > 0  # the system prompt was hot there

    fleet.router.stop()  # a new router knows only what the nodes publish
    fleet.start_router()
    _converse(fleet, sessions, range(3, 4), record)
    assert all(len({t.node for t in turns}) == 1 for turns in record.values())
    assert record[0][-1].cached >= record[0][-2].prompt_tokens

    models = fleet.client().models.with_raw_response.list()
    direct = fleet.client(models.headers[NODE_HEADER]).models.list()
    assert [m.id for m in models.parse().data] == [m.id for m in direct.data] == [str(fleet.model.resolve())]
    text = fleet.client().completions.with_raw_response.create(model="default_model", prompt="agent tool call",
                                                               max_tokens=MAX_TOKENS, temperature=0.0)
    assert text.headers[NODE_HEADER] and text.parse().usage.prompt_tokens == len(
        fleet.tokenizer.tokens("/v1/completions", {"prompt": "agent tool call"}))
    _same_as_direct(fleet, record, fleet.nodes)


def _raw(url: str, request: bytes) -> bytes:
    """``request`` sent as it is (no client would send it): the whole answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=BOUND_S) as s:
        s.sendall(request)
        s.shutdown(socket.SHUT_WR)
        return b"".join(iter(lambda: s.recv(1 << 16), b""))


def test_a_clients_malformed_request_is_the_clients_error(fleet: Fleet) -> None:
    """A path no node could be sent, or a body that is not UTF-8: 400 from the router, no node
    marked down, no request left charged to a node, no traceback (#32 case 7)."""
    body = '{"messages": [{"role": "user", "content": "caf\u00e9"}]}'.encode("latin-1")
    requests = [b"GET /v1/models\x01 HTTP/1.0\r\n\r\n", b"GET /v1/models\xff HTTP/1.0\r\n\r\n",
                b"POST /v1/chat/completions\x7f HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}",
                b"POST /v1/chat/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)]
    for request in requests:
        for _ in range(8):  # more failures than the seven in a row that back a node off for 30 s
            assert _raw(fleet.router.url, request).startswith(b"HTTP/1.0 400 "), request
    nodes = fleet.router.get("/health")["nodes"]
    assert all(n["up"] and n["in_flight"] == 0 for n in nodes.values()), nodes
    assert _ask(fleet, [{"role": "user", "content": "still served"}], stream=False).content
    assert "Traceback" not in fleet.router.log.read_text()


def test_a_stream_its_node_cut_raises_in_the_client_and_the_node_restarted_is_served_at_once(
        fleet: Fleet) -> None:
    """A node SIGKILLed mid-stream: the router ends the relayed stream with an error event,
    so the ``openai`` client raises instead of taking the partial answer for a whole one,
    and the router logs it (#33 case 4). Restarted, the node publishes its disk before it
    answers /health, and the conversations on its disk go back to it (#33 case 2)."""
    systems = [{"role": "system", "content": sample_text(250, seed=s)} for s in (5, 6, 7)]
    sessions = [[systems[s]] for s in range(3)]
    record: dict[int, list[Turn]] = {}
    _converse(fleet, sessions, range(2), record)
    digests = {s: set(prefix_digests(fleet.tokenizer.tokens("/v1/chat/completions", {"messages": turns[-1].messages}),
                                     fleet.key)) for s, turns in record.items()}
    deadline = time.monotonic() + BOUND_S  # each conversation is on its node's disk
    while not all(digests[s] <= set(fleet.node(turns[-1].node).get("/blockkv/residency")["media"]["DISK"])
                  for s, turns in record.items()):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    eos = fleet.tokenizer.tokenizer.eos_token_id
    messages = [{"role": "user", "content": sample_text(40, seed=77)}]
    with fleet.client().chat.completions.with_streaming_response.create(
            model="default_model", messages=messages, max_tokens=100_000, temperature=0.0, stream=True,
            extra_body={"logit_bias": {str(eos): -1000.0}}) as response:  # long enough to be cut
        index = next(i for i, n in enumerate(fleet.nodes) if n.url == response.headers[NODE_HEADER])
        chunks = iter(response.parse())
        assert next(chunks).choices is not None
        victim = fleet.nodes[index]
        victim.proc.kill()
        victim.proc.wait()
        with pytest.raises(openai.APIError, match="cut short"):
            for _ in chunks:
                pass
    assert "ended without [DONE]" in fleet.router.log.read_text()
    mine = [s for s, turns in record.items() if turns[-1].node == victim.url]
    on_disk = {d for s in mine for d in digests[s]}
    node = fleet.nodes[index] = victim.restarted(fleet.logs / f"node{index}-restarted.log")
    node.wait_ready()
    residency = node.get("/blockkv/residency")  # before any request reached it
    assert residency["remote"] is True and on_disk <= set(residency["media"]["DISK"])
    deadline = time.monotonic() + BOUND_S  # the router has read its new life
    while not (state := fleet.router.get("/health")["nodes"][node.url])["up"] or not state["residency"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    _converse(fleet, sessions, range(2, 3), record)
    for s in mine:
        assert record[s][-1].node == node.url and record[s][-1].cached >= record[s][-2].prompt_tokens


def test_a_router_stopped_with_requests_in_flight_finishes_them(fleet: Fleet) -> None:
    """SIGTERM with answers being relayed: the router stops accepting, relays every answer
    in flight to its end, then exits; no node logs a broken pipe (#33 case 3)."""
    eos = fleet.tokenizer.tokenizer.eos_token_id
    client = fleet.client()

    def ask(i: int) -> str:
        stream = client.chat.completions.create(
            model="default_model", messages=[{"role": "user", "content": sample_text(30, seed=500 + i)}],
            max_tokens=200, temperature=0.0, stream=i % 2 == 0, extra_body={"logit_bias": {str(eos): -1000.0}})
        if i % 2:
            return stream.choices[0].finish_reason
        return [c.choices[0].finish_reason for c in stream if c.choices][-1]

    with ThreadPoolExecutor(4) as pool:
        answers = [pool.submit(ask, i) for i in range(4)]
        deadline = time.monotonic() + BOUND_S
        while sum(n["in_flight"] for n in fleet.router.get("/health")["nodes"].values()) < 4:
            assert time.monotonic() < deadline and not any(a.done() for a in answers)
            time.sleep(0.02)
        fleet.router.proc.send_signal(signal.SIGTERM)
        assert [a.result() for a in answers] == ["length"] * 4  # every answer whole
    assert fleet.router.proc.wait(BOUND_S) == 0
    for node in fleet.nodes:  # an event wakes the long poll the router left: its answer has no reader
        for i in range(2):
            fleet.client(node.url).chat.completions.create(
                model="default_model", max_tokens=1, messages=[{"role": "user", "content": f"wake {i}"}])
        assert "BrokenPipeError" not in node.log.read_text() and "Traceback" not in node.log.read_text()
    fleet.start_router()


def test_a_node_reachable_from_other_hosts_publishes_residency_only_with_a_salt(fleet: Fleet) -> None:
    """Unsalted digests on a port other hosts reach would tell anyone whether a guessed
    prompt is cached: without a salt such a node serves, but publishes nothing (#32 case 13)."""
    node = Process(["serve", "--model", str(fleet.model), "--cache-dir", str(fleet.logs / "open-node")],
                   fleet.logs / "open-node.log", {"BLOCKKV_FLEET_SALT": ""}, host="0.0.0.0")
    try:
        node.wait_ready()
        with pytest.raises(urllib.error.HTTPError, match="404"):
            node.get("/blockkv/residency")
        assert fleet.client(node.url).chat.completions.create(
            model="default_model", max_tokens=1, messages=[{"role": "user", "content": "served"}]).choices
        assert "no --fleet-salt" in node.log.read_text()
    finally:
        node.stop()


def test_a_node_killed_mid_run_loses_nothing_it_acknowledged(fleet: Fleet) -> None:
    systems = [{"role": "system", "content": sample_text(250, seed=s)} for s in (3, 4)]
    sessions = [[systems[s]] for s in range(2)]
    record: dict[int, list[Turn]] = {}
    _converse(fleet, sessions, range(2), record)
    victim = fleet.node(record[0][-1].node)
    survivors = [n for n in fleet.nodes if n is not victim]
    mine = {s for s, turns in record.items() if turns[-1].node == victim.url}

    # everything the victim stored is acknowledged (in the bucket): a request after the last turn's
    # (mlx-lm inserts an answer's cache once it is sent) and its spills written, then its entries uploaded
    fleet.client(victim.url).chat.completions.create(model="default_model", max_tokens=1,
                                                     messages=[{"role": "user", "content": "after"}])
    deadline = time.monotonic() + BOUND_S
    while _pending_spills(victim) or not (
            acknowledged := _headers_under(fleet.roots[victim.url], "entries")) <= fleet.bucket_headers():
        assert time.monotonic() < deadline
        time.sleep(0.2)
    victim.proc.kill()  # kill -9: no flush, no goodbye
    victim.proc.wait()
    deadline = time.monotonic() + BOUND_S
    while not all(acknowledged <= _headers_under(fleet.roots[n.url], "remote-headers")
                  | _headers_under(fleet.roots[n.url], "entries") for n in survivors):  # listed, or restored
        assert time.monotonic() < deadline
        # a lookup lists the bucket in the background once the last listing began more than
        # sync_interval (1 s) ago; one that began before the victim's upload landed saw none of it,
        # so keep looking up until a later listing has run
        time.sleep(1.1)
        for node in survivors:
            fleet.client(node.url).chat.completions.create(model="default_model", max_tokens=1,
                                                           messages=[{"role": "user", "content": "list"}])

    _converse(fleet, sessions, range(2, 4), record)
    for s in mine:
        moved = record[s][2:]
        assert {t.node for t in moved} == {moved[0].node} and moved[0].node != victim.url
        assert moved[0].cached >= record[s][1].prompt_tokens  # restored from the bucket, not prefilled
    assert all(t.node != victim.url for turns in record.values() for t in turns[2:])
    _same_as_direct(fleet, record, survivors)
