"""A process stopped (SIGSTOP: Ctrl-Z, a debugger, a suspended laptop) inside
an index transaction of a store, the worst moment for everyone else on the
root: for the stopped-holder tests and tools/stopped_bench.py.

The holder opens the store with the identity it is given, stores an entry
(seed 1), then stops itself inside a transaction: "write" holds the
directory lock and a write transaction, as a store's index write does;
"read" a read transaction, as a query's. Continued, it ends the transaction,
stores another entry (seed 2) and prints whether it landed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path
from typing import Any

from blockkv.testing.models import prefill, random_tokens, tiny_model

MODES = ("write", "read")
HOLDER_SEEDS = (1, 2)  # what the holder stores: before it stops, and once continued
_TOKENS = 40

_HOLDER = textwrap.dedent(f"""
    import json, os, signal, sys
    from blockkv import BlockStore
    from blockkv.testing.models import prefill, random_tokens, tiny_model

    def store(s, seed):
        tokens = random_tokens({_TOKENS}, seed=seed)
        return s.store(tokens, prefill(tiny_model("llama"), tokens)[0])

    def stop(txn):
        print("in-txn", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)

    s = BlockStore(sys.argv[1], **json.loads(sys.argv[3]))
    assert store(s, 1)
    if sys.argv[2] == "write":
        with s._keeper.locked(2.0, 0.0):
            s._keeper.index._env.write(stop)
    else:
        s._keeper.index._env.read(stop)
    print("stored" if store(s, 2) else "not stored", flush=True)
    s.close()
""")


def holder_caches(seed: int) -> tuple[list[int], list[Any]]:
    """The tokens and caches the holder stores as ``seed``."""
    tokens = random_tokens(_TOKENS, seed=seed)
    return tokens, prefill(tiny_model("llama"), tokens)[0]


def stopped_in_txn(root: Path, mode: str, ident: dict[str, Any]) -> subprocess.Popen[str]:
    """The holder on ``root`` (a ``BlockStore(root, **ident)``), once it has
    stopped itself inside a ``mode`` transaction."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(root), mode, json.dumps(ident)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None
    first = holder.stdout.readline().strip()
    if first != "in-txn":
        holder.kill()
        holder.wait()
        raise RuntimeError(f"the holder did not reach its transaction (it said {first!r})")
    _, status = os.waitpid(holder.pid, os.WUNTRACED)
    if not os.WIFSTOPPED(status):
        raise RuntimeError("the holder exited instead of stopping")
    return holder


def continued(holder: subprocess.Popen[str], timeout: float) -> str:
    """SIGCONT the holder and wait for it: "stored" or "not stored" (its second entry)."""
    holder.send_signal(signal.SIGCONT)
    out, _ = holder.communicate(timeout=timeout)
    return out.strip()


def ended(holder: subprocess.Popen[str] | None) -> None:
    """Kill the holder if it still runs (a stopped process dies of SIGKILL too)."""
    if holder is not None and holder.poll() is None:
        holder.kill()
        holder.wait()


def serve_store_options(model_dir: Path) -> dict[str, Any]:
    """The ``BlockStore`` options of ``blockkv serve --model model_dir``'s store
    (its default cap and block size): a holder on the same root shares its index."""
    from blockkv.mlx_lm.identity import model_identity
    from blockkv.mlx_lm.prompt_cache import DEFAULT_CACHE_BYTES

    ident = model_identity(model_dir)
    return dict(model_id=ident.model_id, config_fingerprint=ident.config_fingerprint,
                tokenizer_hash=ident.tokenizer_hash, max_bytes=DEFAULT_CACHE_BYTES, block_tokens=256)


def scrape(url: str, timeout: float) -> dict[str, float]:
    """``GET /metrics`` of the server at ``url``: each sample's value by name, summed over labels."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=timeout) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals
