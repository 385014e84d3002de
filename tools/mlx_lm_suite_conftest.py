"""conftest.py of mlx-lm's ``tests/test_server.py`` run by ``tools/mlx_lm_server_suite.py``.

Copied beside the suite. Without ``$BLOCKKV_SUITE_CACHE_DIR`` it does nothing
(the suite runs against plain ``mlx_lm.server``), but for
``$BLOCKKV_SUITE_DRAFT_ALONE`` (``_draft_served_alone``). With it, the suite's
servers become ``blockkv serve``'s: the suite builds its servers in-process
from names of its own module (``DummyModelProvider``, ``LRUPromptCache``,
``APIHandler``, ``http.server.HTTPServer``), so those names are replaced by
what ``blockkv serve`` puts in place of mlx-lm's (``serve._Node``: the
persistent prompt cache, blockkv's handler, its bounded HTTP server), built
from blockkv serve's own flags with that ``--cache-dir``. Every
``insert_cache`` is counted, per model key and per test, and written with the
caches' tier counts to ``$BLOCKKV_SUITE_REPORT`` once the caches are closed.
"""

from __future__ import annotations

import json
import os
import types
from collections import Counter
from typing import Any

CACHE_DIR = os.environ.get("BLOCKKV_SUITE_CACHE_DIR")
REPORT = os.environ.get("BLOCKKV_SUITE_REPORT")
DRAFT_ALONE = bool(os.environ.get("BLOCKKV_SUITE_DRAFT_ALONE"))

_caches: list[Any] = []
_inserts: Counter[str] = Counter()  # model key -> insert_cache calls with tokens
_inserts_by_test: Counter[str] = Counter()
_keys: list[tuple[Any, Any, list[int], Any]] = []  # (cache, model key, tokens, cache list) of each insert with tokens
_current_test = {"id": "(collection)"}
_cut_by: Counter[int] = Counter()  # entries on disk by how many tokens of mlx-lm's key their caches lacked


class _ServeView:
    """The suite's model provider as ``blockkv serve``'s node sees mlx-lm's:
    the suite's provider has no model path in its flags, only in its key."""

    def __init__(self, provider: Any) -> None:
        self._provider = provider
        flags = {k: v for k, v in vars(provider.cli_args).items() if not k.startswith("__")}
        flags.update(model=provider.model_key[0] if provider.model_key else None, host="127.0.0.1", port=0)
        self.cli_args = types.SimpleNamespace(**flags)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._provider, name)


def _bare_view() -> types.SimpleNamespace:
    """What the node sees before the suite made any provider (its LRUPromptCache unit tests)."""
    cli = types.SimpleNamespace(model=None, adapter_path=None, draft_model=None, kv_bits=None, kv_group_size=64,
                                quantized_kv_start=0, chat_template=None, host="127.0.0.1", port=0)
    return types.SimpleNamespace(cli_args=cli, model_key=None, model=None, draft_model=None)


def _counting(cache: Any) -> Any:
    insert = cache.insert_cache

    def insert_cache(model: Any, tokens: Any, prompt_cache: Any, *args: Any, **kwargs: Any) -> Any:
        if len(tokens):
            _inserts[repr(model)] += 1
            _inserts_by_test[_current_test["id"]] += 1
            _keys.append((cache, model, [int(t) for t in tokens], prompt_cache))
        return insert(model, tokens, prompt_cache, *args, **kwargs)

    cache.insert_cache = insert_cache
    return cache


def _serve_through_blockkv(module: Any) -> None:
    from blockkv.node import serve

    flags = ["--cache-dir", str(CACHE_DIR), *os.environ.get("BLOCKKV_SUITE_SERVE_FLAGS", "").split()]
    args, rest = serve._own_parser().parse_known_args(flags)
    keys, options, _ = serve._checked(args, rest)
    node = serve._Node(args, options, keys, publish=True)
    node.model_provider = _bare_view()

    class Provider(module.DummyModelProvider):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            node.on_run(_ServeView(self))

    def make_cache(*a: Any, **kw: Any) -> Any:
        cache = _counting(node.make_cache(*a, **kw))
        _caches.append(cache)
        return cache

    module.DummyModelProvider = Provider
    module.LRUPromptCache = make_cache
    module.APIHandler = node.handler(module.APIHandler)
    module.http = types.SimpleNamespace(server=types.SimpleNamespace(HTTPServer=node.server_class()))


def _draft_served_alone(module: Any) -> None:
    """mlx-lm's ``ModelProvider`` serves a model with a draft alone (``is_batchable``
    False); the suite's provider leaves it batchable, where the draft is never used."""

    class Provider(module.DummyModelProvider):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.is_batchable = self.draft_model is None

    module.DummyModelProvider = Provider


def pytest_collection_modifyitems(session: Any, config: Any, items: list[Any]) -> None:
    for module in {item.module for item in items if getattr(item, "module", None) is not None}:
        if DRAFT_ALONE:
            _draft_served_alone(module)
        if CACHE_DIR:
            _serve_through_blockkv(module)


def pytest_runtest_setup(item: Any) -> None:
    _current_test["id"] = item.nodeid


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    if not CACHE_DIR or not REPORT:
        return
    for cache in _caches:
        cache.flush()
    layers: dict[tuple[int, str], int] = {}
    short = [_shortfall(cache, model, tokens, caches, layers) for cache, model, tokens, caches in _keys]
    totals: Counter[str] = Counter()
    for cache in _caches:
        cache.close()  # waits for every write-behind spill
        totals.update(cache.tier_stats)
    with open(REPORT, "w") as f:
        json.dump({"inserts": dict(_inserts), "inserts_by_test": dict(_inserts_by_test),
                   "tier_stats": dict(totals), "caches": len(_caches),
                   "not_on_disk": [s for s in short if s is not None],
                   "inserts_by_caches": dict(Counter(str(len(c)) for _, _, _, c in _keys)),
                   "entries_by_caches": dict(Counter(str(n) for n in layers.values())),
                   "on_disk_short_of_the_key_by": {str(k): v for k, v in sorted(_cut_by.items())}}, f, indent=1)


def _shortfall(cache: Any, model: Any, tokens: list[int], prompt_cache: Any,
              layers: dict[tuple[int, str], int]) -> dict | None:
    """None if an entry on disk of as many caches as the insert (a draft model's
    entry holds the model's and the draft's) starts with the tokens every one of
    its caches holds (a draft's lags mlx-lm's key; the entry may be the insert's
    own, or a longer one superseding it); else how much of them it holds at
    most. ``layers`` remembers each entry's cache count (read by restoring it)."""
    caches = len(prompt_cache)
    held_by_all = min([len(tokens), *(c.offset for c in prompt_cache if isinstance(getattr(c, "offset", None), int))])
    store = cache.store_for(model)
    if store is None:
        return {"model": repr(model), "tokens": len(tokens), "on_disk": 0, "why": "no store for this model key"}
    held = 0
    for entry in store.entries():
        if (id(store), entry.id) not in layers:
            restored = store.restore(entry)
            layers[(id(store), entry.id)] = len(restored.caches) if restored is not None else -1
        if layers[(id(store), entry.id)] != caches:
            continue
        stored = entry.token_array.tolist()
        common = next((i for i, (a, b) in enumerate(zip(stored, tokens)) if a != b), min(len(stored), len(tokens)))
        held = max(held, common)
    _cut_by[len(tokens) - held_by_all] += held >= held_by_all
    if held >= held_by_all:
        return None
    return {"model": repr(model), "tokens": len(tokens), "held_by_all": held_by_all, "caches": caches, "on_disk": held}
