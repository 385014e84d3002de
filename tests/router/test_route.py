"""``blockkv route``'s parts in one process: its tokens against mlx-lm's, the
cost model and the ranking it makes of nodes' residency and queues, and what
it does with nodes that misbehave (hostile answers, silence, refusal): a
node's residency it cannot trust is ignored, a node that does not answer is
skipped, and the client always gets some node's own answer.

The fleet of real ``blockkv serve`` processes is tests/system/test_route_fleet.py."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import mlx_lm
import openai
import pytest

from blockkv.model_dir import build_model_dir, sample_text
from blockkv.router.fleet import Follower, Node, read_json
from blockkv.router.placement import MAX_TOKENIZED_BYTES, Router
from blockkv.router.route import BODY_MEMORY, MAX_BODY_BYTES, NODE_HEADER, serve
from blockkv.router.route_tokens import PromptTokenizer
from blockkv.router.scoring import (
    ACTIVE_COST,
    BUCKET_COST,
    DISK_COST,
    Matches,
    Option,
    RestoreCosts,
    Restores,
    Sessions,
    Start,
    order,
    queue_cost,
    start_cost,
)
from blockkv.testing.fleet_processes import Process
from blockkv.testing.models import random_tokens
from blockkv.wire.residency import digest_key, prefix_digests, salt_check

SALT = "route test"
KEY = digest_key(SALT)
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


def test_a_prompt_being_tokenized_holds_up_no_other(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokenizing is per request, not under one lock (#32 case 4: a 64 MiB prompt made a
    2-token request wait 122 s): a tokenization that has not finished (held here until the
    other is done) does not stop another request's."""
    from mlx_lm.server import ResponseGenerator

    tokenize, entered, release = ResponseGenerator._tokenize, threading.Event(), threading.Event()

    def held(self: Any, tokenizer: Any, request: Any, args: Any) -> Any:
        if request.messages[0]["content"] == "long":
            entered.set()
            release.wait(BOUND_S)
        return tokenize(self, tokenizer, request, args)

    monkeypatch.setattr(ResponseGenerator, "_tokenize", held)
    router = PromptTokenizer(str(model_dir))
    long = threading.Thread(target=router.tokens, args=("/v1/chat/completions",
                                                         {"messages": [{"role": "user", "content": "long"}]}))
    long.start()
    try:
        assert entered.wait(BOUND_S)
        short: list[list[int]] = []
        other = threading.Thread(target=lambda: short.append(router.tokens(
            "/v1/chat/completions", {"messages": [{"role": "user", "content": "short"}]})))
        other.start()
        other.join(BOUND_S)
        assert short and long.is_alive()
    finally:
        release.set()
        long.join()


def test_a_start_is_priced_as_the_node_makes_it() -> None:
    """The node's cache restores the longest prefix it finds on its disk or in the bucket
    if that saves a token of prefill per RESTORE_READ_PER_SAVED it reads: the router
    prices that, whatever a cheaper start it might have chosen instead."""
    assert start_cost(1000, Matches()).tier == "cold"
    disk = start_cost(1000, Matches(ram=600, disk=900))
    assert (disk.tier, disk.reused, disk.prefilled) == ("disk", 900, 100)
    assert disk.cost == pytest.approx(900 * DISK_COST + 100)
    bucket = start_cost(1000, Matches(ram=600, disk=900, bucket=999))  # the longest, if dearer than the disk's
    assert (bucket.tier, bucket.reused, bucket.cost) == ("bucket", 999, pytest.approx(999 * BUCKET_COST + 1))
    assert 999 * BUCKET_COST + 1 > 900 * DISK_COST + 100
    cheap = RestoreCosts(disk=0.001, bucket=0.001)
    ram = start_cost(1000, Matches(ram=990, disk=999), cheap)  # 9 tokens saved: the node reads none of 999 ...
    assert (ram.tier, ram.reused, ram.cost) == ("ram", 990, 10.0)
    assert 999 * cheap.disk + 1 < 10.0  # ... however cheap reading them is
    assert start_cost(1000, Matches(ram=940, bucket=999)).tier == "ram"  # 59 * 16 < 999 ...
    assert start_cost(1000, Matches(ram=936, bucket=999)).tier == "bucket"  # ... 63 * 16 >= 999
    measured = start_cost(1000, Matches(ram=100, bucket=999), cheap)
    assert (measured.tier, measured.cost) == ("bucket", pytest.approx(999 * cheap.bucket + 1))


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
    for i in range(3):  # their first tokens came back after the prefills ahead, and ACTIVE_COST per other
        seconds_per_unit = 0.01
        c.started(i, now=c.in_flight[i].sent_at + seconds_per_unit * (3000.0 * (i + 1) + ACTIVE_COST * i))
    assert c.active_cost() == pytest.approx(ACTIVE_COST)  # each remains, still more than b's restore
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


def _conversations(sessions: Sessions, count: int, turns: int, name: str = "c") -> None:
    """``count`` conversations of ``turns`` prompts routed, each prompt holding the last one's digests."""
    for k in range(count):
        for t in range(turns):
            sessions.record([f"{name}{k}/{i}" for i in range(t + 1)])


def test_a_conversations_turns_are_counted_from_the_digests_it_extends() -> None:
    sessions = Sessions()
    assert sessions.meets(1) == 1.0  # nothing measured: a request in flight is met once
    _conversations(sessions, 60, 8)
    assert sessions.turn(["c7/0"]) == 2 and sessions.turn(["new"]) == 1 and sessions.turn([]) == 1
    assert sessions.meets(1) == pytest.approx(8.0, abs=1.0)  # a new one meets a neighbour on its 8 turns
    assert sessions.meets(8) < 2.0 and sessions.meets(20) == 1.0  # the last turns: met about once
    _conversations(sessions, 200, 1, "single")
    assert sessions.meets(1) == pytest.approx(1.0, abs=0.05)  # single prompts since: forgotten


def test_a_new_session_leaves_the_node_its_family_keeps_busy() -> None:
    """A request in flight is a session that stays where it is served, and so is
    a new one: they would meet on every turn, so a new session of a system
    prompt goes to a node that restores the prompt from the bucket rather than
    join another session on the node holding it (#33 case 1: 48/32/16 requests
    a node before, every session of one system prompt on one node). A later
    turn, with fewer turns left, stays."""
    router = _router(2)
    busy, spare = router.nodes
    system, turn = random_tokens(48 * 32, seed=6), random_tokens(160, seed=7)
    digests = prefix_digests(system + turn, KEY, 32)
    busy.held["RAM"].update(digests[:48])
    busy.held["DISK"].update(digests[:48])  # spilled, so in the bucket too
    busy.remote = spare.remote = True
    busy.begin(1, 160.0, [])
    busy.started(1)  # another session's turn, its prefill done: only the decode is left
    assert ACTIVE_COST < 48 * 32 * BUCKET_COST  # met once, it costs less than a restore
    node, start, _ = router.rank(system + turn)[0]
    assert node is busy and start.tier == "ram"  # nothing measured: met once
    _conversations(router.sessions, 60, 8)
    assert 8 * ACTIVE_COST > 48 * 32 * BUCKET_COST  # on all 8 turns, more
    node, start, _ = router.rank(system + turn)[0]
    assert node is spare and start.tier == "bucket"
    router.sessions.record(digests[:48])  # the prompt was turn 1 of its conversation: the next is turn 2
    later = system + turn + random_tokens(200, seed=8)
    busy.held["RAM"].update(prefix_digests(later, KEY, 32))
    busy.held["DISK"].update(prefix_digests(later, KEY, 32))
    assert router.sessions.turn(prefix_digests(later, KEY, 32)) == 2
    node, start, _ = router.rank(later)[0]
    assert node is busy and start.tier == "ram"  # 7 turns left: less than restoring its 1,700 tokens


def test_conversations_not_always_in_flight_are_charged_as_often_as_they_meet() -> None:
    """A pool of 3 clients over 12 conversations (route_bench.py --interleave 4 --pooled,
    issue #44) has each conversation in flight a quarter of the time. Charged as if the
    request in flight on its node met it on every turn left, a later turn left its node for
    another as crowded, restoring its conversation from the bucket (a quarter of the later
    turns moved, and the router lost to round-robin); charged for the turns the nodes' live
    conversations are expected in flight, it stays."""
    router = _router(3)
    a, b, c = router.nodes
    for node in router.nodes:
        node.remote = True
    sessions = router.sessions
    now = time.monotonic()
    for k in range(11):  # 11 others, live on the three nodes, a turn every 8 s
        home = router.nodes[k % 3].url
        for t in range(2):
            sessions.record([f"pool{k}/{i}" for i in range(t + 1)], now - 16 + 8 * t)
            sessions.place(home, now - 16 + 8 * t)
    _conversations(sessions, 60, 8)  # and conversations are 8 turns long
    first = random_tokens(32 * 32, seed=9) + random_tokens(190, seed=10)  # system prompt and a turn
    sessions.record(prefix_digests(first, KEY, 32), now - 8)
    sessions.place(a.url, now - 8)
    later = first + random_tokens(200, seed=11)
    a.held["RAM"].update(prefix_digests(first, KEY, 32))
    a.held["DISK"].update(prefix_digests(first, KEY, 32))  # spilled, so in the bucket: any node restores it
    a.begin(1, 0.0, [])
    a.started(1)  # another conversation's turn in flight on a, its prefill done
    turn = sessions.turn(prefix_digests(later, KEY, 32))
    assert turn == 2 and sessions.meets(turn) > 5.0
    stay = start_cost(len(later), Matches(ram=len(first)))
    move = start_cost(len(later), Matches(bucket=len(later) // 32 * 32))
    # met on every turn left, the one in flight would cost more than restoring elsewhere
    assert stay.cost + queue_cost(0.0, 1, ACTIVE_COST, sessions.meets(turn)) > move.cost
    node, start, _ = router.rank(later, record=True)[0]
    assert node is a and start.tier == "ram"
    company = sessions.company(time.monotonic(), 1)
    assert company is not None and sum(company.values()) == pytest.approx(1.0)  # 1 in flight, shared by 11
    assert company[a.url] == company[b.url] > company[c.url]  # a and b: 4 others live there; c: 3


Answer = tuple[int, bytes] | Callable[[str, bytes], tuple[int, bytes]]


def test_a_node_whose_residency_is_unknown_is_taken_to_start_as_well_as_the_best() -> None:
    """Unknown is not empty (#33 case 2): a node just restarted, whose residency the router has
    not read yet, gets a request when the known node holding the prompt is busier."""
    router = _router(2)
    known, unknown = router.nodes
    unknown.block_size = 0
    prompt = random_tokens(40 * 32, seed=4)
    known.held["RAM"].update(prefix_digests(prompt, KEY, 32))
    assert router.rank(prompt)[0][0] is known  # equal starts, equal queues: fewer routed, then the first
    known.begin(1, 0.0, [])
    node, start, _ = router.rank(prompt)[0]
    assert node is unknown and start.tier == "unknown" and start.cost == router.rank(prompt)[1][1].cost


def test_a_nodes_active_cost_is_measured_from_the_first_tokens_it_streams() -> None:
    """A node where a request in flight delays a new one by far more than ACTIVE_COST
    assumes (shared cores, a slow batch): once its answers show it, a prompt hot there
    goes to an idle node that must prefill it (#33 case 1)."""
    router = _router(2)
    hot, idle = router.nodes
    prompt = random_tokens(20 * 32, seed=5)
    hot.held["RAM"].update(prefix_digests(prompt, KEY, 32))
    hot.begin(1, 100.0, [])
    hot.started(1, now=hot.in_flight[1].sent_at + 1.0)  # alone: 100 units of start in 1 s
    hot.end(1)
    hot.begin(2, 0.0, [])  # in flight, not started, from here on
    assert hot.active_cost() == ACTIVE_COST and router.rank(prompt)[0][0] is hot  # nothing busy measured yet
    hot.begin(3, 100.0, [])
    hot.started(3, now=hot.in_flight[3].sent_at + 8.0)  # beside one other: 7 s later than alone
    hot.end(3)
    assert hot.active_cost() == pytest.approx(700.0)
    assert hot.queue() == (0.0, 1) and router.rank(prompt)[0][0] is idle  # 1 + 700 > 639 to prefill


def test_the_active_cost_is_the_fleets_not_each_nodes() -> None:
    """What a request in flight costs is the server's batching, the same on every
    node: measured per node from a few first tokens each, it scattered 1-100 and
    the node measured lowest took most requests. A node that has timed no busy
    first token of its own is priced as the one that has, each in its own units."""
    router = _router(2)
    low, unmeasured = router.nodes
    for node, seconds in ((low, 1.0), (unmeasured, 2.0)):  # 100 units alone: 0.01 and 0.02 s a unit
        node.begin(1, 100.0, [])
        node.started(1, now=node.in_flight[1].sent_at + seconds)
        node.end(1)
    low.begin(2, 100.0, [])
    low.started(2, now=low.in_flight[2].sent_at + 1.0)  # alone again, and in flight from here on
    low.begin(3, 100.0, [])
    low.started(3, now=low.in_flight[3].sent_at + 1.05)  # 0.05 s beside it: 5 units
    low.end(3)
    assert low.active_cost() == unmeasured.active_cost() == pytest.approx(5.0)
    unmeasured.begin(2, 100.0, [])
    unmeasured.started(2, now=unmeasured.in_flight[2].sent_at + 2.0)
    prompt = random_tokens(10 * 32, seed=6)
    assert router.rank(prompt)[0][0] is unmeasured  # equal costs: the fewer routed, not the lower-measured


def test_a_first_token_that_holds_another_requests_prefill_measures_no_pace() -> None:
    """mlx-lm prefills the requests it has together: a request that another
    joined before its first token, or that was sent behind a prefill not yet
    done, took longer than its own start and the requests in flight make it,
    and would overstate the seconds per unit or understate the active cost."""
    node = _router(1).nodes[0]
    node.begin(1, 100.0, [])
    node.begin(2, 100.0, [])  # joins 1 before its first token, behind its prefill
    node.started(1, now=node.in_flight[1].sent_at + 2.0)
    node.started(2, now=node.in_flight[2].sent_at + 2.0)
    assert node.pace.seconds_per_unit is None and node.active_cost() == ACTIVE_COST
    node.end(1)
    node.end(2)
    node.begin(3, 100.0, [])
    node.started(3, now=node.in_flight[3].sent_at + 1.0)  # alone throughout: measured
    node.begin(4, 100.0, [])  # beside 3, whose prefill is done: measures the active cost
    node.started(4, now=node.in_flight[4].sent_at + 1.5)
    assert node.pace.seconds_per_unit == pytest.approx(0.01) and node.active_cost() == pytest.approx(50.0)


def test_a_restores_cost_is_the_time_a_node_reports_over_its_prefill_pace() -> None:
    """cost = seconds / seconds_per_unit / tokens, smoothed over reports; the
    constants until a tier is measured, within [FLOOR, CEILING]."""
    restores = Restores()
    assert restores.costs() == RestoreCosts(DISK_COST, BUCKET_COST)
    restores.observe("bucket", 1500, 0.01 * 1500 * 0.002, 0.01)  # 1,500 tokens for 3 of prefill
    assert restores.costs().bucket == pytest.approx(0.002) and restores.costs().disk == DISK_COST
    for _ in range(40):  # slower since: the mean follows
        restores.observe("bucket", 1500, 0.01 * 1500 * 0.1, 0.01)
    assert restores.costs().bucket == pytest.approx(0.1, rel=1e-3)
    restores.observe("disk", 1000, 0.0, 0.01)  # too fast to time: never free
    assert restores.costs().disk == Restores.FLOOR
    restores.observe("disk", 3000, 0.01 * 3000 * 0.3, 0.01)  # two reports: their means' ratio
    assert restores.costs().disk == pytest.approx(0.2 * 900 / (0.8 * 1000 + 0.2 * 3000))
    slow = Restores()  # dearer than prefilling: a node would prefill instead
    slow.observe("bucket", 1000, 0.01 * 3000, 0.01)
    assert slow.costs().bucket == Restores.CEILING
    unmeasured = Restores()  # no pace yet, nothing restored, or not a restore tier: nothing learnt
    for tier, tokens, spu in (("bucket", 1500, None), ("bucket", 0, 0.01), ("ram", 1500, 0.01)):
        unmeasured.observe(tier, tokens, 1.0, spu)
    assert unmeasured.costs() == RestoreCosts()


def _restored(node: Node, seq: int, **tiers: tuple[int, float]) -> None:
    """``node`` answers an events poll (no residency change) with these restore counts."""
    assert node.apply_events({"epoch": node.epoch, "seq": seq, "block_size": node.block_size, "resync": False,
                              "batches": [], "restored": {t: {"tokens": n, "seconds": s} for t, (n, s) in tiers.items()}})


def test_a_router_that_learns_restores_are_cheap_sends_a_later_turn_from_a_busy_node_to_an_idle_one() -> None:
    """Issue #44's pooled shape on one machine: a bucket restore of this tiny
    model's KV over loopback costs ~1/1,400 of prefill, not BUCKET_COST. Priced at
    BUCKET_COST, a later turn waits behind a request on the node holding its
    conversation (35.7 % of later turns sent to a busy node, round-robin's 6.5 %);
    once a node has reported what its restores take, busy or not, the router
    restores on an idle one."""
    router = _router(2)
    busy, idle = router.nodes
    for node in router.nodes:
        node.remote, node.epoch, node.block_size = True, "e", 32
    conversation = random_tokens(60 * 32, seed=12)
    later = conversation + random_tokens(170, seed=13)
    digests = prefix_digests(conversation, KEY, 32)
    busy.held["RAM"].update(digests)
    busy.held["DISK"].update(digests)  # spilled, so in the bucket: the idle node restores it
    _restored(busy, 1, bucket=(1920, 0.5))  # before any pace: kept until one is measured
    assert router.restores.costs().bucket == BUCKET_COST and busy.restores_taken == {}
    for node in router.nodes:  # each node's pace: a cold prompt of 1,000 tokens alone in 5 s
        node.begin(1, 1000.0, [], Start(1000.0, "cold", 0, 1000))
        node.started(1, now=node.in_flight[1].sent_at + 5.0)
        node.end(1)
    busy.begin(2, 0.0, [])
    busy.started(2)  # another conversation's turn in flight, its prefill done
    assert ACTIVE_COST < len(conversation) * BUCKET_COST
    node, start, _ = router.rank(later)[0]
    assert node is busy and start.tier == "ram"  # restoring 1,920 tokens at 1/4 costs more than waiting
    busy.begin(3, 0.0, [], Start(170 + 1920 * BUCKET_COST, "bucket", 1920, 170))  # a restore beside request 2
    busy.started(3, now=busy.in_flight[3].sent_at + 0.5)
    busy.end(3)
    assert busy.active_cost() == ACTIVE_COST  # a restore's first token is no measure of the node's pace
    _restored(busy, 2, bucket=(2 * 1920, 0.5 + 0.005 * 1920 / 1400))  # the second took ~1 token's prefill
    seconds_per_unit = busy.pace.seconds_per_unit
    assert router.restores.costs().bucket == pytest.approx((0.5 + 0.005 * 1920 / 1400) / seconds_per_unit / 3840)
    _restored(idle, 1, bucket=(1920, 0.005 * 1920 / 1400))  # every node's reports count: the mean follows
    for seq in range(2, 60):
        _restored(idle, seq, bucket=(seq * 1920, seq * 0.005 * 1920 / 1400))
    assert router.restores.costs().bucket == pytest.approx(1 / 1400, rel=1e-2)
    node, start, _ = router.rank(later)[0]
    assert node is idle and (start.tier, start.reused) == ("bucket", len(conversation))
    idle.epoch = "restarted"  # a new life counts from zero: no negative delta, the next report counts
    _restored(idle, 1, bucket=(1920, 0.5))
    assert router.restores.costs().bucket == pytest.approx(1 / 1400, rel=1e-2)


def test_a_request_whose_first_token_is_not_seen_is_worked_off_at_the_nodes_pace() -> None:
    """A non-streamed answer streams no first token: its prefill counts as queued only
    for as long as the node's measured pace takes to do it, in the queue and in what a
    request routed beside it is expected to wait for."""
    router = _router(1)
    node = router.nodes[0]
    node.begin(1, 500.0, [])
    assert node.queue() == (500.0, 1)  # no pace measured: all of it
    node.started(1, now=node.in_flight[1].sent_at + 5.0)  # alone: 100 units a second
    node.end(1)
    node.begin(2, 300.0, [])  # not streamed: never started
    node.in_flight[2].sent_at -= 2.0  # sent 2 s ago: 200 units done
    assert node.queue()[0] == pytest.approx(100.0, abs=1.0)
    node.begin(3, 100.0, [])
    assert node.in_flight[3].ahead == pytest.approx(100.0, abs=1.0)
    node.started(3, now=node.in_flight[3].sent_at + 2.5)  # behind a prefill not yet done: measures nothing
    assert node.active_cost() == ACTIVE_COST
    node.end(3)
    node.in_flight[2].sent_at -= 10.0
    assert node.queue() == (0.0, 1)  # long since done, though its answer still runs
    node.begin(4, 100.0, [])
    node.started(4, now=node.in_flight[4].sent_at + 1.5)  # 0.5 s later than its own prefill: 50 units
    assert node.active_cost() == pytest.approx(50.0, abs=1.0)


class FakeNode:
    """A misbehaving node on 127.0.0.1: ``answers`` maps a path to (status, body bytes),
    or to a function of the request's path with its query and its body that returns them;
    ``hang`` accepts connections and never answers."""

    def __init__(self, answers: dict[str, Answer] | None = None, hang: bool = False) -> None:
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
                sent = self.rfile.read(int(self.headers["Content-Length"])) if self.command == "POST" else b""
                answer = (answers or {}).get(path, (404, b"Not Found"))
                status, body = answer(self.path, sent) if callable(answer) else answer
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

    def wait_for_hits(self, path: str, count: int = 1, *, alive: Callable[[], bool] = lambda: True,
                      bound: float = BOUND_S) -> bool:
        """Until ``path`` has been asked for ``count`` times: True; False as soon as
        ``alive()`` is false (whatever sends the requests has stopped) or ``bound`` seconds pass."""
        deadline = time.monotonic() + bound
        while self.hits.count(path) < count:
            if not alive() or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

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
        assert fake.wait_for_hits("/blockkv/residency")
        time.sleep(0.2)
        assert node.epoch is None and node.block_size == 0 and node.up  # unknown residency, still a node
    finally:
        follower.stop()


def _events(**over: Any) -> bytes:
    answer = {"epoch": "e1", "seq": 1, "block_size": 32, "resync": False,
              "batches": [{"seq": 1, "ts": 0, "events": []}], **over}
    return json.dumps(answer).encode()


@pytest.mark.parametrize("answer", [
    _events(batches=[{"seq": 1, "ts": 0, "events": 5}]),
    _events(batches=[5]),
    _events(seq=2**64),
    _events().replace(b'"seq": 1,', b'"seq": ' + b"9" * 5000 + b","),  # past Python's int parsing limit
    _events(batches=[{"seq": 1, "events": [{"type": "BlockStored", "medium": "RAM", "block_hashes": 5}]}]),
    _events(restored={"RAM": {"tokens": 1, "seconds": 0.1}}),
    _events(restored={"bucket": {"tokens": -1, "seconds": 0.1}}),
    _events(restored={"disk": {"tokens": 1, "seconds": float("nan")}}),
    _events(restored={"disk": [1, 0.1]}),
])
def test_a_malformed_events_answer_never_stops_the_following(
        answer: bytes, fakes: list[FakeNode], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Each bad answer is one warning and a snapshot later: the node is still followed."""
    monkeypatch.setattr("blockkv.router.fleet.NO_RESIDENCY_RETRY_S", 0.05)
    fake = FakeNode({"/blockkv/residency": (200, _snapshot()), "/blockkv/events": (200, answer)})
    fakes.append(fake)
    node = Node(fake.url)
    follower = Follower(node, KEY)
    follower.start()
    try:
        assert fake.wait_for_hits("/blockkv/events", 3) and follower._thread.is_alive()
        assert node.up
        assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1
    finally:
        follower.stop()


def test_reads_from_a_node_are_bounded_and_another_salt_is_ignored(fakes: list[FakeNode]) -> None:
    big = _snapshot(media={"RAM": ["0" * 16] * 10, "DISK": []})
    fakes.append(FakeNode({"/blockkv/residency": (200, big)}))
    node = Node(fakes[0].url)
    with pytest.raises(ValueError, match="over"):
        read_json(node, "/blockkv/residency", len(big) - 1, 5.0)
    assert node.load_snapshot(json.loads(big), KEY) and set(node.held["RAM"]) == {"0" * 16}
    assert not node.load_snapshot(json.loads(big), digest_key("another salt"))
    assert set(node.held["RAM"]) == set() and node.epoch is None


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


def _status_mib(pid: int, field: str) -> float:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak) of process ``pid``, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise LookupError(field)


class MemoryBound:
    """Watches a process's resident memory and kills it past ``limit_mib``: a router that
    grows without bound fails the test at the bound instead of taking the machine's memory."""

    def __init__(self, process: Process, limit_mib: float) -> None:
        self.process, self.limit_mib = process, limit_mib
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.02) and self.process.proc.poll() is None:
            try:
                if _status_mib(self.process.proc.pid, "VmRSS") > self.limit_mib:
                    self.process.proc.kill()
            except (OSError, LookupError):
                return

    def peak_mib(self) -> float:
        """The process's peak resident memory so far (it must still run)."""
        self._stop.set()
        self._thread.join()
        assert self.process.proc.poll() is None, f"killed at over {self.limit_mib:.0f} MiB resident"
        return _status_mib(self.process.proc.pid, "VmHWM")


def _router_process(model_dir: Path, node: str, log: Path) -> Process:
    router = Process(["route", "--model", str(model_dir), "--node", node, "--fleet-salt", SALT], log)
    router.wait_ready()
    return router


CHAT_ANSWER = json.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}).encode()


def test_a_huge_request_costs_the_router_its_body_and_holds_up_no_other(
        model_dir: Path, fakes: list[FakeNode], tmp_path: Path) -> None:
    """A body at the size limit is not tokenized (#32 case 4: 64 MiB took the router to 12.7 GiB
    and made a 2-token request wait 122 s): the router holds about the body, and a small
    request sent meanwhile is answered while the huge one is still being answered."""
    small_answered = threading.Event()

    def chat(path: str, body: bytes) -> tuple[int, bytes]:
        if len(body) > MAX_TOKENIZED_BYTES:
            small_answered.wait(BOUND_S)  # the huge request's answer waits for the small one
        else:
            small_answered.set()
        return 200, CHAT_ANSWER

    fake = FakeNode({"/v1/chat/completions": chat})
    fakes.append(fake)
    router = _router_process(model_dir, fake.url, tmp_path / "router.log")
    try:
        baseline = _status_mib(router.proc.pid, "VmRSS")
        bound = MemoryBound(router, baseline + 3 * MAX_BODY_BYTES / 2**20)
        words = " ".join(sample_text(200, seed=9).split()[:5])
        huge = json.dumps({"messages": [{"role": "user", "content": ""}]}).encode()
        filler = (words + " ").encode() * ((MAX_BODY_BYTES - len(huge)) // (len(words) + 1))
        huge = huge.replace(b'"content": ""', b'"content": "' + filler + b'"')
        assert MAX_TOKENIZED_BYTES < len(huge) <= MAX_BODY_BYTES
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=BOUND_S)
        results: list[Any] = []
        sender = threading.Thread(target=lambda: results.append(_post_raw(router.url, huge)))
        sender.start()
        assert fake.wait_for_hits("/v1/chat/completions", alive=sender.is_alive)  # the huge request reached the node
        small = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        sender.join(BOUND_S)
        assert small.choices[0].message.content == "ok" and small_answered.is_set()
        assert results and results[0][0] == 200
        assert bound.peak_mib() <= baseline + 3 * MAX_BODY_BYTES / 2**20
    finally:
        router.stop()


def _post_raw(url: str, body: bytes) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=BOUND_S) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


FLOOD = 600_000  # new digests per events answer: 11 MiB, under the 16 MiB an answer may take


def test_an_event_flood_costs_the_router_a_bounded_memory(
        model_dir: Path, fakes: list[FakeNode], tmp_path: Path) -> None:
    """A node whose every events answer stores 600k new digests (#32 case 5: the router grew
    ~1.4 GiB in 90 s, linearly): the router keeps at most MAX_DIGESTS of them and still answers."""
    def events(path: str, body: bytes) -> tuple[int, bytes]:
        since = int(path.split("since=")[1].split("&")[0])
        digests = [f"{i:016x}" for i in range(since * FLOOD, (since + 1) * FLOOD)]
        batch = {"seq": since + 1, "ts": 0, "events": [
            {"type": "BlockStored", "block_hashes": digests, "medium": "RAM"}]}
        return 200, json.dumps({"epoch": "e1", "seq": since + 1, "block_size": 32, "resync": False,
                                "batches": [batch]}).encode()

    fake = FakeNode({"/blockkv/residency": (200, _snapshot()), "/blockkv/events": events,
                     "/v1/chat/completions": (200, CHAT_ANSWER)})
    fakes.append(fake)
    router = _router_process(model_dir, fake.url, tmp_path / "router.log")
    try:
        baseline = _status_mib(router.proc.pid, "VmRSS")
        limit = baseline + 400  # MAX_DIGESTS kept (~40 MiB) and one answer being parsed (~150 MiB)
        bound = MemoryBound(router, limit)
        flooded = fake.wait_for_hits("/blockkv/events", 12, alive=lambda: router.proc.poll() is None,
                                     bound=4 * BOUND_S)
        assert router.proc.poll() is None, f"killed at over {limit:.0f} MiB resident"
        assert flooded
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=BOUND_S)
        assert client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}]).choices
        assert bound.peak_mib() <= limit
        assert "Traceback" not in (tmp_path / "router.log").read_text()
    finally:
        router.stop()


def _listen_backlog(port: int) -> int:
    """The listen backlog of the socket listening on ``port`` (``ss``'s Send-Q of a listener)."""
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    return int(out.split()[2])


def test_idle_connections_time_out_and_connections_at_once_are_capped(
        model_dir: Path, fakes: list[FakeNode], tmp_path: Path) -> None:
    """Idle and half-sent connections are closed (headers by --header-timeout, a body by
    --client-timeout), one past --max-connections requests being served is answered 503 at
    once in OpenAI's error shape, and the listen backlog takes a burst of 64 clients (#32
    case 8: 373 idle connections stayed open, a thread each; backlog 5)."""
    release = threading.Event()

    def held(path: str, body: bytes) -> tuple[int, bytes]:
        release.wait(BOUND_S)
        return 200, CHAT_ANSWER

    fake = FakeNode({"/v1/chat/completions": held})
    fakes.append(fake)
    router = Process(["route", "--model", str(model_dir), "--node", fake.url, "--client-timeout", "3",
                      "--header-timeout", "3", "--max-connections", "4"], tmp_path / "router.log")
    router.wait_ready()
    try:
        assert _listen_backlog(router.port) >= 64
        idle = [socket.create_connection(("127.0.0.1", router.port), timeout=BOUND_S) for _ in range(3)]
        idle[0].sendall(b"POST /v1/chat/completions HTTP/1.0\r\nContent-Length: 100\r\n\r\n{")  # body half sent
        idle[1].sendall(b"GET /v1/mod")  # request line half sent
        idle[2].sendall(b"GET /health HTTP/1.0\r\n")  # headers half sent
        for s in idle:
            with s:
                assert s.recv(1 << 16) == b""  # closed by the router (a timeout here would raise)
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=BOUND_S)
        results: list[Any] = []
        senders = [threading.Thread(target=lambda: results.append(client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}]))) for _ in range(4)]
        for sender in senders:
            sender.start()
        try:
            assert fake.wait_for_hits("/v1/chat/completions", 4)  # four requests being served: every slot
            with pytest.raises(openai.APIStatusError, match="every connection slot is serving a request") as e:
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            assert e.value.status_code == 503
        finally:
            release.set()
            for sender in senders:
                sender.join(BOUND_S)
        assert len(results) == 4 and client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}]).choices
        assert "Traceback" not in (tmp_path / "router.log").read_text()
    finally:
        router.stop()


class Trickler:
    """Slowloris: ``count`` unauthenticated clients, each sending one byte of a
    request's headers per ``pause`` seconds and reconnecting whenever the router
    closes it, until stopped."""

    def __init__(self, port: int, count: int, pause: float) -> None:
        self.port, self.pause = port, pause
        self.connects = 0
        self.closed = 0  # connections the router closed on them
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(count)]
        for thread in self._threads:
            thread.start()

    def _count(self, field: str) -> None:
        with self._lock:
            setattr(self, field, getattr(self, field) + 1)

    def _run(self) -> None:
        line = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\nX-Pad: " + b"a" * 10_000
        while not self._stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=BOUND_S) as sock:
                    self._count("connects")
                    sock.settimeout(self.pause)
                    for byte in line:
                        sock.sendall(bytes([byte]))
                        try:
                            if sock.recv(1 << 16) == b"":
                                break
                        except TimeoutError:
                            pass
                        if self._stop.is_set():  # stopped: a held connection ends within one pause
                            break
            except OSError:
                pass
            self._count("closed")

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(BOUND_S)


def test_clients_trickling_their_headers_never_keep_a_keyed_request_out(
        model_dir: Path, fakes: list[FakeNode], tmp_path: Path) -> None:
    """#43: 8 unauthenticated clients trickling a header byte per half --client-timeout held
    every --max-connections slot, and keyed requests got 503. With 8x --max-connections of
    them (64), keyed requests are answered: a new connection drops the oldest still sending
    its headers, and none holds a slot past --header-timeout."""
    fake = FakeNode({"/v1/chat/completions": (200, CHAT_ANSWER)})
    fakes.append(fake)
    keys = tmp_path / "keys"
    keys.write_text("the router's client key\n")
    router = Process(["route", "--model", str(model_dir), "--node", fake.url, "--api-key-file", str(keys),
                      "--max-connections", "8", "--client-timeout", "2"], tmp_path / "router.log")
    router.wait_ready()
    tricklers = Trickler(router.port, 64, pause=1.0)
    try:
        deadline = time.monotonic() + BOUND_S
        while tricklers.connects < 64 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tricklers.connects >= 64  # all of them in, and the slots long full
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="the router's client key", max_retries=0,
                               timeout=BOUND_S)
        for _ in range(3):
            t0 = time.monotonic()
            assert client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}]).choices
            print(f"keyed request answered in {time.monotonic() - t0:.3f} s amid {tricklers.connects} trickling "
                  f"connections, {tricklers.closed} closed by the router")
        assert tricklers.closed > 0  # the router made room by closing theirs
    finally:
        tricklers.stop()
        router.stop()


def test_maximal_bodies_on_every_connection_cost_the_router_its_body_budget(
        model_dir: Path, fakes: list[FakeNode], tmp_path: Path) -> None:
    """#43: each connection could pin a 64 MiB body (6 clients pinned 384 MiB; 16 GiB at the
    default 256 connections). 256 connections sending maximal bodies at once: the router holds
    at most --body-memory (256 MiB by default) of them, answers the rest 503 in OpenAI's shape,
    and still answers an ordinary request. Its resident memory stays under its size at rest
    plus the budget plus 64 MiB (threads, buffers)."""
    fake = FakeNode({"/v1/chat/completions": (200, CHAT_ANSWER)})
    fakes.append(fake)
    router = _router_process(model_dir, fake.url, tmp_path / "router.log")
    try:
        baseline = _status_mib(router.proc.pid, "VmRSS")
        limit = baseline + BODY_MEMORY / 2**20 + 64
        bound = MemoryBound(router, limit)
        body = memoryview(bytes(MAX_BODY_BYTES - 1))  # all but the last byte: the router holds it, waiting
        head = b"POST /v1/chat/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % MAX_BODY_BYTES
        answers: list[bytes] = []
        held: list[socket.socket] = []

        def send() -> None:
            sock = socket.create_connection(("127.0.0.1", router.port), timeout=BOUND_S)
            try:
                sock.sendall(head)
                sock.sendall(body)
                held.append(sock)  # the whole body but a byte went in: the router holds it
            except OSError:
                answers.append(_received(sock))
                sock.close()

        senders = [threading.Thread(target=send) for _ in range(256)]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join(4 * BOUND_S)
        assert not any(sender.is_alive() for sender in senders)
        print(f"bodies held {len(held)}, refused {len(answers)}; peak {bound.peak_mib():.0f} MiB of {limit:.0f}")
        assert 1 <= len(held) <= BODY_MEMORY // MAX_BODY_BYTES and len(held) + len(answers) == 256
        assert any(b'"body_memory_full"' in a for a in answers)
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=BOUND_S)
        assert client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}]).choices
        assert bound.peak_mib() <= limit
        for sock in held:
            sock.close()
    finally:
        router.stop()


def _received(sock: socket.socket) -> bytes:
    """What the router answered on ``sock`` before it closed it (b"" if the reset lost it)."""
    try:
        return sock.recv(1 << 16)
    except OSError:
        return b""


def test_a_node_refusing_the_routers_key_is_the_routers_error_naming_its_flag(fakes: list[FakeNode]) -> None:
    """#43: a wrong --node-api-key-file handed clients the node's 401 (telling them to fix
    their own key) while /health said ok. Now /health is 503 naming the flag, and a request
    is the router's 502 naming it, in OpenAI's error shape."""
    refusing = FakeNode({path: (401, b'{"error": {"message": "Incorrect API key"}}')
                         for path in ("/blockkv/residency", "/v1/chat/completions")})
    fakes.append(refusing)
    router = Router([refusing.url], None, SALT, node_timeout=5.0, node_key="a stale key")
    server = serve(router, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    router.start()
    front = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert refusing.wait_for_hits("/blockkv/residency")
        deadline = time.monotonic() + BOUND_S
        while not (health := _post(front, None, "/health"))[0] == 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        status, _, body = health
        assert status == 503 and "--node-api-key-file" in json.loads(body)["status"]
        assert json.loads(body)["nodes"][refusing.url]["key_refused"] is True
        client = openai.OpenAI(base_url=front + "/v1", api_key="unused", max_retries=0, timeout=BOUND_S)
        with pytest.raises(openai.APIStatusError, match="--node-api-key-file") as e:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 502 and e.value.code == "node_key_refused"
    finally:
        router.stop()
        server.shutdown()
        server.server_close()


def test_only_recent_homes_are_walked_for_the_company_of_a_request() -> None:
    """``Sessions.company`` runs under the router's choosing lock on every request:
    it counts the conversations placed within twice the gap between turns, and
    stops at the first older home instead of walking all it remembers."""
    sessions = Sessions()
    now = time.monotonic()
    for k in range(Sessions.LIMIT):  # conversations long gone, oldest first as place() keeps them
        sessions.record([f"old{k}/0"], now - 600 + k * 0.01)
        sessions.place("http://old", now - 600 + k * 0.01)
    for k in range(3):  # three live conversations, one turn each so far...
        sessions.record([f"live{k}/0"], now - 1.5)
        sessions.place(f"http://n{k}", now - 1.5)
    sessions.record(["live0/0", "live0/1"], now - 0.5)  # ...and live0's second turn: a gap of 1 s
    sessions.place("http://n0", now - 0.5)
    _conversations(sessions, 60, 8)
    company = sessions.company(now, 3)
    assert company == {"http://n0": 1.0, "http://n1": 1.0, "http://n2": 1.0}
    walked = list(sessions._recent(now - 2.0))
    assert len(walked) == 3  # the 4,093 old homes left are never visited
