"""tools/restart_bench.py replays the same prompts in every phase: each turn's
messages extend the previous turn's, and the texts are the sizes asked for."""

from __future__ import annotations

from pathlib import Path

from tool_scripts import load

from blockkv.model_dir import build_model_dir


def test_each_turn_extends_the_last_and_texts_have_the_sizes_asked(tmp_path: Path) -> None:
    bench = load("restart_bench")
    texts = bench.Texts(build_model_dir(tmp_path / "model", "llama"))
    shape = bench.Shape(models=["demo"], system_tokens=300, tool_tokens=200)
    turns = bench.session(texts, shape, 3)
    assert [len(m) for m in turns] == [3, 5, 7]  # system, task, tool result; then an assistant line and a result each
    for earlier, later in zip(turns, turns[1:]):
        assert later[: len(earlier)] == earlier
    assert abs(texts.count(turns[0][0]["content"]) - 300) <= 8
    assert abs(texts.count(turns[2][-1]["content"].split(": ", 1)[1]) - 200) <= 8
    assert texts.of(200, seed=5) == texts.of(200, seed=5)  # the same prompts in every phase and run


def test_every_model_has_a_session_and_a_document_and_the_real_one_is_built(real_model: Path, tmp_path: Path) -> None:
    bench = load("restart_bench")
    for shape in (bench.Shape(models=list(bench.MODELS)), bench.QUICK):
        assert set(shape.turns) == set(shape.long_tokens) == set(bench.MODELS)
    assert bench.build_model("smollm2-135m", tmp_path / "unused") == real_model
    assert not (tmp_path / "unused").exists()
