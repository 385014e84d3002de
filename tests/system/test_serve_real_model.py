"""On a real model (SmolLM2-135M-Instruct, 4-bit, ``blockkv.real_model``), through
real servers on 127.0.0.1 and the ``openai`` client: ``blockkv serve`` answers a
two-turn chat exactly as ``python -m mlx_lm.server`` does, restores turn 1 from
disk after a restart, and applies the model's own chat template.

MLX's CPU backend prefills this model at a few tokens a second on a small
machine, so the prompts are one short question each: three server processes
and about a hundred prefilled tokens in all. Longer runs are in tools/.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import openai
import pytest
from test_serve import REQUEST_BOUND_S, Server
from tokenizers import Tokenizer

MAX_TOKENS = 10
QUESTIONS = ("What is the capital of France?", "And of Italy?")
# Turn 1's prompt is under one block: restored only with a lower minimum than the default.
BLOCKKV = [sys.executable, "-m", "blockkv", "serve", "--min-restore-tokens", "16"]


@dataclass
class Chat:
    """Turn 1 and turn 2 of one conversation as a server answered them."""

    turns: list[Any]
    log: str
    stores: list[str]  # the cache root's store directories (blockkv only)


def _ask(server: Server, messages: list[dict[str, str]]) -> Any:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0,
                           timeout=REQUEST_BOUND_S)
    return client.chat.completions.create(model="default_model", messages=messages,  # type: ignore[arg-type]
                                          max_tokens=MAX_TOKENS, temperature=0.0, logprobs=True)


def _conversation(turn1_answer: str | None) -> list[dict[str, str]]:
    """Turn 1's messages, or turn 2's when turn 1's answer is given."""
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    if turn1_answer is None:
        return messages
    return [*messages, {"role": "assistant", "content": turn1_answer}, {"role": "user", "content": QUESTIONS[1]}]


def _token_ids(answer: Any) -> list[int]:
    return [int(t.model_extra["id"]) for t in answer.choices[0].logprobs.content]


def _cached(answer: Any) -> int:
    return int(answer.usage.prompt_tokens_details.cached_tokens)


@pytest.fixture(scope="module")
def chats(real_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Chat]:
    """The reference: mlx-lm's own server answering both turns. blockkv: one
    ``blockkv serve`` answering turn 1, stopped, and a new one on the same
    --cache-dir answering turn 2 (built on the reference's turn-1 answer)."""
    tmp = tmp_path_factory.mktemp("real_model")
    reference = Server([sys.executable, "-m", "mlx_lm.server"], real_model, None, tmp / "mlx_lm.log")
    try:
        ref1 = _ask(reference, _conversation(None))
        ref2 = _ask(reference, _conversation(ref1.choices[0].message.content))
    finally:
        reference_log = reference.stop()
    first = Server(BLOCKKV, real_model, tmp / "cache", tmp / "a.log")
    try:
        turn1 = _ask(first, _conversation(None))
    finally:
        first_log = first.stop()
    second = Server(BLOCKKV, real_model, tmp / "cache", tmp / "b.log")
    try:
        turn2 = _ask(second, _conversation(ref1.choices[0].message.content))
    finally:
        second_log = second.stop()
    stores = sorted(d.name for d in (tmp / "cache").iterdir() if d.is_dir())
    return {"mlx_lm": Chat([ref1, ref2], reference_log, []),
            "blockkv": Chat([turn1, turn2], first_log + second_log, stores)}


def test_answers_are_mlx_lm_servers_and_make_sense(chats: dict[str, Chat]) -> None:
    reference, blockkv = chats["mlx_lm"].turns, chats["blockkv"].turns
    for ours, theirs in zip(blockkv, reference, strict=True):
        assert _token_ids(ours) == _token_ids(theirs)
        assert ours.choices[0].message.content == theirs.choices[0].message.content
        assert ours.usage.prompt_tokens == theirs.usage.prompt_tokens
    # the converted weights are the model's (a wrong q/k row order answers nonsense)
    assert "Paris" in reference[0].choices[0].message.content
    assert "Rome" in reference[1].choices[0].message.content


def test_after_a_restart_turn_2_restores_turn_1_from_disk(chats: dict[str, Chat]) -> None:
    turn1, turn2 = chats["blockkv"].turns
    log = chats["blockkv"].log
    assert _cached(turn1) == 0
    assert turn1.usage.prompt_tokens <= _cached(turn2) < turn2.usage.prompt_tokens
    assert re.findall(r"blockkv: restored (\d+) of \d+ prompt tokens from disk", log) == [str(_cached(turn2))]
    # one store, named after the model (the directory name real_model_dir chose)
    assert [name.split("_")[0] for name in chats["blockkv"].stores] == ["SmolLM2-135M-Instruct"]


def test_the_models_chat_template_builds_the_prompt(real_model: Path, chats: dict[str, Chat]) -> None:
    """The template from the GGUF's metadata, rendered here by jinja2 and
    tokenised by ``tokenizers`` alone, is the prompt both servers counted
    (with the default system prompt the template adds)."""
    template = json.loads((real_model / "tokenizer_config.json").read_text())["chat_template"]
    tokenizer = Tokenizer.from_file(str(real_model / "tokenizer.json"))
    reference = chats["mlx_lm"].turns
    for turn, answer in enumerate(reference):
        messages = _conversation(reference[0].choices[0].message.content if turn else None)
        text = jinja2.Template(template).render(messages=messages, add_generation_prompt=True)
        assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
        assert text.endswith(f"{messages[-1]['content']}<|im_end|>\n<|im_start|>assistant\n")
        expected = len(tokenizer.encode(text, add_special_tokens=False).ids)
        assert answer.usage.prompt_tokens == expected
        assert chats["blockkv"].turns[turn].usage.prompt_tokens == expected
