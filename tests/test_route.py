"""``blockkv route``'s parts in one process: its tokens against mlx-lm's, the
cost model and the ranking it makes of nodes' residency and queues, and what
it does with nodes that misbehave (hostile answers, silence, refusal): a
node's residency it cannot trust is ignored, a node that does not answer is
skipped, and the client always gets some node's own answer.

The fleet of real ``blockkv serve`` processes is tests/test_route_fleet.py."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import mlx_lm
import pytest

from blockkv.serving.digests import fleet_key, prefix_digests, salt_check
from blockkv.serving.fleet import Follower, Node, read_json
from blockkv.serving.route import NODE_HEADER, Router, serve
from blockkv.serving.route_tokens import PromptTokenizer
from blockkv.serving.scoring import (
    ACTIVE_COST,
    BUCKET_COST,
    DISK_COST,
    Matches,
    Option,
    Start,
    order,
    start_cost,
)
from blockkv.testing.model_dir import build_model_dir, sample_text
from blockkv.testing.models import random_tokens

SALT = "route test"
KEY = fleet_key(SALT)
BOUND_S = 30.0  # safety bound for waits on threads (not a timing assertion)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("route") / "model", "llama")


def test_the_routers_tokens_are_mlx_lms(model_dir: Path) -> None:
    """What the router tokenizes equals what mlx-lm makes of the same request
    (the fleet test checks it against running nodes too)."""
    tokenizer = mlx_lm.load(str(model_dir))[1]
    router = PromptTokenizer(str(model_dir))
    system = {"role": "system", "content": sample_text(50, seed=1)}
    chat = [system, {"role": "user", "content": sample_text(9, seed=2)},
            {"role": "assistant", "content": sample_text(5, seed=3)}, {"role": "user", "content": "next"}]
    assert router.tokens("/v1/chat/completions", {"messages": chat}) == tokenizer.apply_chat_template(
        chat, add_generation_prompt=True)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]}]
    assert router.tokens("/chat/completions", {"messages": parts}) == tokenizer.apply_chat_template(
        [{"role": "user", "content": "a b"}], add_generation_prompt=True)
    assert router.tokens("/v1/completions", {"prompt": "plain text"}) == tokenizer.encode("plain text")
    overridden = PromptTokenizer(str(model_dir), chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert overridden.tokens("/v1/chat/completions", {"messages": chat}) == tokenizer.encode(
        "".join(m["content"] for m in chat), add_special_tokens=False)
    for path, body in [("/v1/chat/completions", {"prompt": "x"}), ("/v1/completions", ["x"]), ("/v1/models", {})]:
        with pytest.raises((KeyError, TypeError, ValueError)):
            router.tokens(path, body)


def test_the_cheapest_start_reads_the_best_tier() -> None:
    assert start_cost(1000, Matches()) .tier == "cold"
    ram = start_cost(1000, Matches(ram=600, disk=900, bucket=999))
    assert (ram.tier, ram.reused) == ("disk", 900) and ram.cost == pytest.approx(900 * DISK_COST + 100)
    assert start_cost(1000, Matches(ram=990, disk=999)).tier == "ram"  # 9 tokens are not worth 999 restored
    bucket = start_cost(1000, Matches(ram=100, bucket=999))
    assert (bucket.tier, bucket.cost) == ("bucket", pytest.approx(999 * BUCKET_COST + 1))


def _router(n: int, **nodes: Any) -> Router:
    router = Router([f"http://127.0.0.1:{9 + i}" for i in range(n)], None, SALT, 5.0)
    for node in router.nodes:
        node.block_size = 32
    return router


def test_ranking_follows_residency_then_leaves_a_buried_hot_node() -> None:
    router = _router(3)
    a, b, c = router.nodes
    system, turn = random_tokens(64 * 32, seed=1), random_tokens(200, seed=2)
    prompt = system + turn
    digests = prefix_digests(prompt, KEY, 32)
    assert router.rank(prompt)[0][0] is a  # nothing anywhere: the first of equals
    b.held["DISK"].update(digests[:64])
    assert router.rank(prompt)[0][0] is b
    c.held["RAM"].update(digests[:64])
    assert [n for n, *_ in router.rank(prompt)][:2] == [c, b]
    for i in range(3):  # c is busy with long prefills: the system prompt is worth restoring elsewhere
        c.begin(i, 3000.0, [])
    assert router.rank(prompt)[0][0] is b
    for i in range(3):
        c.started(i)  # their first tokens came back: ACTIVE_COST each remains, still more than b's restore
    assert 3 * ACTIVE_COST > 64 * 32 * DISK_COST and router.rank(prompt)[0][0] is b
    c.end(0)
    c.end(1)  # one request in flight costs less than restoring the system prompt on b
    assert ACTIVE_COST < 64 * 32 * DISK_COST and router.rank(prompt)[0][0] is c
    c.end(2)
    assert c.queue() == (0.0, 0)
    c.failed("refused")  # down: skipped; its disk is not the bucket unless it has one
    assert c not in [n for n, *_ in router.rank(prompt)]
    c.held["DISK"].update(digests)
    assert router.rank(prompt)[0][2] == digests and router.rank(prompt)[0][1].tier == "disk"
    c.remote = True  # what a node on the bucket stored, any node can restore
    b.held["DISK"].clear()
    best = router.rank(prompt)[0][1]
    assert (best.tier, best.reused) == ("bucket", len(digests) * 32)


def test_the_cheapest_node_leads_and_ties_go_to_the_least_busy() -> None:
    def option(cost: float, in_flight: int = 0, routed: int = 0) -> Option:
        return Option(Start(cost, "cold", 0), 0.0, in_flight, routed)

    assert order([option(100), option(90), option(95)]) == [1, 2, 0]
    assert order([option(90, 1), option(90, 0, 5), option(90, 0, 2)]) == [2, 1, 0]
    assert order([]) == []


def test_a_routed_prompt_counts_as_hot_until_events_confirm_it() -> None:
    router = _router(2)
    a, b = router.nodes
    prompt = random_tokens(40 * 32, seed=3)
    digests = prefix_digests(prompt, KEY, 32)
    b.routed = 1  # a tie goes to the node with fewer routed: a
    node, start, ds = router.rank(prompt)[0]
    assert node is a and start.tier == "cold"
    a.begin(7, start.cost, ds)
    assert router.rank(prompt + [1])[0][0] is b  # a's queue holds the whole prefill: prefilling in parallel is sooner
    a.end(7)
    assert router.rank(prompt + [1])[0][0] is a and router.rank(prompt + [1])[0][1].tier == "ram"
    a.epoch = "e"
    assert a.apply_events({"epoch": "e", "seq": 1, "block_size": 32, "resync": False, "batches": [
        {"seq": 1, "ts": 0, "events": [{"type": "BlockStored", "block_hashes": digests, "medium": "RAM"}]}]})
    assert a.predicted == {} and router.rank(prompt + [1])[0][1].reused == len(prompt)
    a.begin(8, 1.0, digests[:1])
    a.abandon(8)  # never reached the node
    assert a.predicted == {} and a.queue() == (0.0, 0)


class FakeNode:
    """A misbehaving node on 127.0.0.1: ``answers`` maps a path to (status, body bytes);
    ``hang`` accepts connections and never answers."""

    def __init__(self, answers: dict[str, tuple[int, bytes]] | None = None, hang: bool = False) -> None:
        self.hits: list[str] = []
        if hang:
            self.sock = socket.socket()
            self.sock.bind(("127.0.0.1", 0))
            self.sock.listen(16)
            self.port = self.sock.getsockname()[1]
            self.server = None
            return
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self) -> None:
                path = self.path.split("?")[0]
                fake.hits.append(path)
                if self.command == "POST":
                    self.rfile.read(int(self.headers["Content-Length"]))
                status, body = (answers or {}).get(path, (404, b"Not Found"))
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
        else:
            self.sock.close()


@pytest.fixture
def fakes() -> Iterator[list[FakeNode]]:
    made: list[FakeNode] = []
    yield made
    for fake in made:
        fake.close()


def _snapshot(**over: Any) -> bytes:
    snap = {"epoch": "e1", "seq": 0, "block_size": 32, "salt_check": salt_check(KEY), "remote": False,
            "media": {"RAM": [], "DISK": []}, **over}
    return json.dumps(snap).encode()


@pytest.mark.parametrize("status, answer", [
    (200, _snapshot(media={"RAM": ["not hex at all!!"], "DISK": []})),
    (200, _snapshot(media={"RAM": [{"a": 1}]})),
    (200, _snapshot(block_size=0)),
    (200, _snapshot(seq=-1)),
    (200, _snapshot(epoch="x" * 65)),
    (200, b"[" * 100_000),  # nested past the JSON parser's recursion limit
    (200, b"{not json"),
    (404, b"Not Found"),  # a plain mlx_lm server
])
def test_a_node_whose_residency_is_not_as_published_is_routed_without_it(
        status: int, answer: bytes, fakes: list[FakeNode]) -> None:
    fake = FakeNode({"/blockkv/residency": (status, answer)})
    fakes.append(fake)
    node = Node(fake.url)
    follower = Follower(node, KEY)
    follower.start()
    try:
        deadline = time.monotonic() + BOUND_S
        while "/blockkv/residency" not in fake.hits and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        assert node.epoch is None and node.block_size == 0 and node.up  # unknown residency, still a node
    finally:
        follower.stop()


def test_reads_from_a_node_are_bounded_and_another_salt_is_ignored(fakes: list[FakeNode]) -> None:
    big = _snapshot(media={"RAM": ["0" * 16] * 10, "DISK": []})
    fakes.append(FakeNode({"/blockkv/residency": (200, big)}))
    node = Node(fakes[0].url)
    with pytest.raises(ValueError, match="over"):
        read_json(node, "/blockkv/residency", len(big) - 1, 5.0)
    assert node.load_snapshot(json.loads(big), KEY) and node.held["RAM"] == {"0" * 16}
    assert not node.load_snapshot(json.loads(big), fleet_key("another salt"))
    assert node.held["RAM"] == set() and node.epoch is None


def _post(url: str, body: dict[str, Any] | None, path: str = "/v1/chat/completions"
          ) -> tuple[int, dict[str, str], bytes]:
    """POST ``body`` to ``url + path`` (GET if None): status, headers, body."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=BOUND_S) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_a_silent_or_refusing_node_is_skipped_and_the_answer_is_a_nodes_own(fakes: list[FakeNode]) -> None:
    silent = FakeNode(hang=True)
    answer = b'{"id": "from the live node", "choices": []}'
    live = FakeNode({"/v1/chat/completions": (200, answer)})
    fakes.extend([silent, live])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once closed
    router = Router([silent.url, refused, live.url], None, SALT, node_timeout=1.0)
    for node in router.nodes:
        node.routed = 0
    server = serve(router, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    front = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        status, headers, body = _post(front, {"messages": [{"role": "user", "content": "hi"}]})
        assert (status, body, headers[NODE_HEADER]) == (200, answer, live.url)  # byte for byte, and who answered
        assert [n.up for n in router.nodes] == [False, False, True]
        assert [n.url for n, *_ in router.rank(None)] == [live.url]  # skipped during their backoff
        live.close()
        fakes.remove(live)
        status, _, body = _post(front, {"messages": [{"role": "user", "content": "hi"}]})
        assert status == 503 and b"no blockkv serve node answered" in body
        status, _, body = _post(front, None, "/health")  # a balancer in front must not send here
        assert status == 503 and json.loads(body)["status"] == "no node up"
    finally:
        server.shutdown()
        server.server_close()
