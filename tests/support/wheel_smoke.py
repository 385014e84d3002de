"""CI's smoke run of the built wheel, in a fresh venv and outside the checkout:
the package imports from site-packages, says it is typed, keeps its moved
paths, and stores and restores a real mlx-lm cache bit-exact."""

from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path

import blockkv
from blockkv import BlockStore
from blockkv.testing.models import prefill, random_tokens, tiny_model
from blockkv.testing.stateful import live_bits


def main() -> int:
    package = Path(blockkv.__file__).parent
    assert "site-packages" in str(package), f"imported from {package}, not the installed wheel"
    assert (package / "py.typed").is_file(), "py.typed is not in the wheel"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from blockkv.testing.model_dir import build_model_dir  # noqa: F401 - the 0.1 path
    assert any(w.category is DeprecationWarning for w in caught), "no DeprecationWarning for a moved path"
    from blockkv.mlx_lm import PersistentPromptCache  # noqa: F401 - the public adapter imports

    tokens = random_tokens(40)
    caches, _ = prefill(tiny_model("llama"), tokens)
    with tempfile.TemporaryDirectory() as root:
        with BlockStore(root, model_id="smoke", config_fingerprint="smoke", tokenizer_hash="smoke",
                        max_bytes=1 << 30) as store:
            assert store.store(tokens, caches)
            match = store.find(tokens + [1])
            assert match is not None and match.prefix_len == len(tokens)
            loaded = store.restore(match.entry)
            assert loaded is not None
            assert [live_bits(c) for c in loaded.caches] == [live_bits(c) for c in caches], "restored bits differ"
    print(f"wheel smoke: blockkv {blockkv.__version__} from {package}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
