"""``blockkv serve`` on a first run from a Hugging Face repo id, offline.

``python download_node.py SOURCE SNAPSHOT DELAY -- SERVE ARGS...`` replaces
``mlx_lm.utils.snapshot_download`` (what mlx-lm's load and blockkv's identity
both call) with a download of the model directory SOURCE into SNAPSHOT (a
``.../snapshots/<commit>`` directory, as huggingface_hub lays it out): the
config and tokenizer files at once, the weights DELAY seconds later, as a real
download's files arrive one after another. A lookup with ``local_files_only``
finds the snapshot as soon as its directory exists, half downloaded or not,
as huggingface_hub's does (it links each file into the snapshot as it
completes): an identity hashed then would lack the weights. Then it runs ``blockkv serve`` with SERVE ARGS (``--model owner/name`` ...).
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import mlx_lm.utils
from huggingface_hub.errors import LocalEntryNotFoundError

from blockkv.mlx_lm.identity import _WEIGHT_SUFFIXES


def fake_download(source: Path, snapshot: Path, delay: float) -> Any:
    done = threading.Event()
    lock = threading.Lock()

    def snapshot_download(repo_id: str, *, local_files_only: bool = False, **kwargs: Any) -> str:
        if local_files_only:
            if not snapshot.is_dir():
                raise LocalEntryNotFoundError(f"{repo_id} is not downloaded yet")
            return str(snapshot)
        with lock:
            if not done.is_set():
                snapshot.mkdir(parents=True, exist_ok=True)
                files = sorted(source.iterdir(), key=lambda p: p.name.endswith(_WEIGHT_SUFFIXES))
                for path in files:
                    if path.name.endswith(_WEIGHT_SUFFIXES):
                        time.sleep(delay)
                    shutil.copy2(path, snapshot / path.name)
                done.set()
        return str(snapshot)

    return snapshot_download


def main(argv: list[str]) -> int:
    source, snapshot, delay, separator, *rest = argv
    assert separator == "--", argv
    mlx_lm.utils.snapshot_download = fake_download(Path(source), Path(snapshot), float(delay))
    from blockkv.node.serve import main as serve

    return serve(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
