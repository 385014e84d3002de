"""Store identity: derived from the model's files, so distinct models,
revisions, KV quantisations and tokenizers never share entries."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from blockkv.format.layout import fingerprint_dirname
from blockkv.mlx_lm.identity import FingerprintWords, KVQuant, describe_fingerprint, identity_from_key, model_identity
from blockkv.model_dir import build_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("m") / "tiny", seed=0)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_identity_is_deterministic_and_key_forms_agree(model_dir: Path) -> None:
    a = identity_from_key((str(model_dir), None, None))
    assert a == identity_from_key(str(model_dir)) == model_identity(model_dir)
    assert a.model_id == "tiny"
    assert len(a.tokenizer_hash) == 64
    assert a.config_fingerprint.startswith("tiny kv-off template-builtin config-")
    assert describe_fingerprint(a.config_fingerprint) == FingerprintWords("tiny", "off", "builtin")


def test_the_fingerprint_says_model_kv_and_template_in_words(model_dir: Path) -> None:
    """The words are for people and ``blockkv stats``; the digest decides identity."""
    q8 = model_identity(model_dir, kv=KVQuant(bits=8, group_size=32), chat_template="{{ x }}")
    words = describe_fingerprint(q8.config_fingerprint)
    assert words is not None and (words.model_id, words.kv) == ("tiny", "8bit-g32-s0")
    assert len(words.template) == 12 and words.template != "builtin"
    assert fingerprint_dirname(q8.config_fingerprint).startswith("tiny_kv-8bit-g32-s0_template-")
    for other in ("", "my-model@rev3+kv-bf16", "a kv-off template-builtin 1234", "x y z w"):
        assert describe_fingerprint(other) is None


def test_other_weights_change_the_fingerprint(model_dir: Path, tmp_path: Path) -> None:
    other = build_model_dir(tmp_path / "tiny", seed=1)
    a, b = model_identity(model_dir), model_identity(other)
    assert a.config_fingerprint != b.config_fingerprint
    assert a.tokenizer_hash == b.tokenizer_hash  # same training corpus, same tokenizer


def test_config_change_changes_the_fingerprint(model_dir: Path, tmp_path: Path) -> None:
    other = _copy(model_dir, tmp_path / "tiny")
    config = json.loads((other / "config.json").read_text())
    config["rope_theta"] = 1234.0
    (other / "config.json").write_text(json.dumps(config))
    assert model_identity(other).config_fingerprint != model_identity(model_dir).config_fingerprint


def test_kv_quantisation_is_part_of_the_fingerprint(model_dir: Path) -> None:
    plain = model_identity(model_dir).config_fingerprint
    q8 = model_identity(model_dir, kv=KVQuant(bits=8)).config_fingerprint
    q4 = model_identity(model_dir, kv=KVQuant(bits=4)).config_fingerprint
    q8g32 = model_identity(model_dir, kv=KVQuant(bits=8, group_size=32)).config_fingerprint
    assert len({plain, q8, q4, q8g32}) == 4
    # Without quantisation the group size and start do not change any cache.
    assert model_identity(model_dir, kv=KVQuant(None, 32, 100)).config_fingerprint == plain


def test_tokenizer_changes_change_the_tokenizer_hash(model_dir: Path, tmp_path: Path) -> None:
    base = model_identity(model_dir)
    assert model_identity(model_dir, chat_template="{{ x }}").tokenizer_hash != base.tokenizer_hash
    other = _copy(model_dir, tmp_path / "tiny")
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    changed = model_identity(other)
    assert changed.tokenizer_hash != base.tokenizer_hash
    assert changed.config_fingerprint == base.config_fingerprint


def test_adapter_and_draft_change_the_fingerprint(model_dir: Path, tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"rank": 4}))
    (adapter / "adapters.safetensors").write_bytes(b"\0" * 100)
    draft = build_model_dir(tmp_path / "draft", seed=2)
    base = identity_from_key((str(model_dir), None, None)).config_fingerprint
    with_adapter = identity_from_key((str(model_dir), str(adapter), None)).config_fingerprint
    with_draft = identity_from_key((str(model_dir), None, str(draft))).config_fingerprint
    assert len({base, with_adapter, with_draft}) == 3


def test_bad_keys_are_rejected(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="model key"):
        identity_from_key(42)
    with pytest.raises(TypeError, match="model key"):
        identity_from_key((str(model_dir), None, None, None))
    with pytest.raises(TypeError, match="adapter"):
        identity_from_key((str(model_dir), 3, None))
    with pytest.raises(ValueError, match="names no model"):
        identity_from_key((None, None, None))
    with pytest.raises(FileNotFoundError, match="config.json"):
        model_identity(tmp_path)
    with pytest.raises(FileNotFoundError, match="neither a directory"):
        model_identity(tmp_path / "missing" / "model")


def _hf_identity(hub: Path, repo: str) -> dict[str, str]:
    """model_identity(repo) in a fresh interpreter whose Hugging Face cache is ``hub``
    (huggingface_hub reads its cache location once, at import)."""
    code = (
        "import dataclasses, json, sys\n"
        "from blockkv.mlx_lm.identity import model_identity\n"
        "print(json.dumps(dataclasses.asdict(model_identity(sys.argv[1]))))\n"
    )
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code, repo], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, str] = json.loads(out.stdout)
    return result


def test_hugging_face_repo_ids_resolve_offline_and_revisions_differ(
    model_dir: Path, tmp_path: Path
) -> None:
    repo = tmp_path / "hub" / "models--org--tiny"
    for revision in ("a" * 40, "b" * 40):
        _copy(model_dir, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    at_a = _hf_identity(tmp_path / "hub", "org/tiny")
    (repo / "refs" / "main").write_text("b" * 40)
    at_b = _hf_identity(tmp_path / "hub", "org/tiny")
    assert at_a["model_id"] == at_b["model_id"] == "org/tiny"
    assert at_a["config_fingerprint"] != at_b["config_fingerprint"]  # same files, other revision
    assert at_a["tokenizer_hash"] == at_b["tokenizer_hash"] == model_identity(model_dir).tokenizer_hash
