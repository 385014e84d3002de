"""Every change ``blockkv serve`` makes to mlx-lm's server, in one place.

mlx-lm's server (``mlx_lm.server``) runs unchanged: its ``main`` parses its
own flags and starts its threads as usual. For the duration of one ``main``
call blockkv replaces names that module looks up at run time, and only these:

- ``run`` (starts the model provider, the generation thread and the HTTP
  server): the same, after blockkv's own set-up, which needs every mlx-lm flag
  parsed (``on_run``: the cache directory, the KV-quantisation flags).
- ``LRUPromptCache`` (the RAM prompt cache ``run`` builds): a factory of
  ``ResidentPromptCache``, mlx-lm's RAM tier with blockkv's disk tier below it.
- ``_run_http_server`` (serves ``APIHandler``): opens the disk tier first, so
  the first request does not pay the open and a restarted node publishes its
  disk before ``/health`` answers, then serves blockkv's subclass of mlx-lm's
  handler (API keys, ``/metrics``, ``/blockkv/flush``, residency).
- ``ResponseGenerator._is_batchable`` and ``_serve_single``, with
  ``--per-key-cache`` only: each request alone, inside its key's namespace
  (``tenants.py``).

``install`` makes the replacements and returns the function that puts
mlx-lm's names back, in reverse order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from blockkv.node import tenants


@dataclass(frozen=True)
class ServeHooks:
    """What blockkv puts in place of mlx-lm's names."""

    on_run: Callable[[Any], None]  # called with mlx-lm's model provider before its run() starts
    make_cache: Callable[..., Any]  # called as mlx-lm calls LRUPromptCache(max_size, max_bytes)
    handler: Callable[[type], type]  # blockkv's request handler class over mlx-lm's APIHandler
    before_serving: Callable[[], None]  # called once the model is loaded, before the HTTP server answers
    per_key: bool  # --per-key-cache: each request served alone in its key's namespace


class _Replacements:
    """setattr with a memory: ``undo`` restores every replaced name, last first."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    def replace(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def undo(self) -> None:
        while self._saved:
            owner, name, value = self._saved.pop()
            setattr(owner, name, value)


def install(server: Any, hooks: ServeHooks) -> Callable[[], None]:
    """Put ``hooks`` in mlx-lm's server module ``server``; ``ValueError`` if this
    mlx-lm lacks a name blockkv needs (nothing replaced then)."""
    needed = ["run", "LRUPromptCache", "_run_http_server", "APIHandler"]
    if hooks.per_key:
        needed += ["ResponseGenerator._is_batchable", "ResponseGenerator._serve_single"]
    missing = [name for name in needed if not _has(server, name)]
    if missing:
        raise ValueError(f"this mlx-lm's server has no {', '.join(missing)}: blockkv serve needs "
                         "mlx-lm 0.28.1 or newer")
    replacements = _Replacements()
    original_run, original_http = server.run, server._run_http_server

    def run(host: str, port: int, model_provider: Any, *more: Any, **kw: Any) -> Any:
        hooks.on_run(model_provider)
        return original_run(host, port, model_provider, *more, **kw)

    def run_http_server(*args: Any, **kwargs: Any) -> Any:
        hooks.before_serving()
        kwargs["handler_class"] = hooks.handler(kwargs.get("handler_class") or server.APIHandler)
        return original_http(*args, **kwargs)

    replacements.replace(server, "run", run)
    replacements.replace(server, "LRUPromptCache", hooks.make_cache)
    replacements.replace(server, "_run_http_server", run_http_server)
    if hooks.per_key:
        generator = server.ResponseGenerator
        replacements.replace(generator, "_is_batchable", tenants.never_batchable)
        replacements.replace(generator, "_serve_single", tenants.in_namespace(generator._serve_single))
    return replacements.undo


def _has(owner: Any, dotted: str) -> bool:
    for part in dotted.split("."):
        if not hasattr(owner, part):
            return False
        owner = getattr(owner, part)
    return True
