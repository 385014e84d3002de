"""Every change ``blockkv serve`` makes to mlx-lm's server, in one place.

mlx-lm's server (``mlx_lm.server``) runs unchanged: its ``main`` parses its
own flags and starts its threads as usual. For the duration of one ``main``
call blockkv replaces names that module looks up at run time, and only these:

- ``run`` (starts the model provider, the generation thread and the HTTP
  server): the same, after blockkv's own set-up, which needs every mlx-lm flag
  parsed (``on_run``: the cache directory, the KV-quantisation flags).
- ``LRUPromptCache`` (the RAM prompt cache ``run`` builds): a factory of
  ``ResidentPromptCache``, mlx-lm's RAM tier with blockkv's disk tier below it.
- ``_run_http_server`` (serves ``APIHandler`` on a ``ThreadingHTTPServer``):
  opens the disk tier first, so the first request does not pay the open and a
  restarted node publishes its disk before ``/health`` answers, then serves
  blockkv's subclass of mlx-lm's handler (API keys, ``/metrics``,
  ``/blockkv/flush``, residency) on blockkv's bounded server (connections
  capped, header deadlines, idle timeouts: ``wire/bounded_server.py``).
- with ``--per-key-cache`` only (``tenants.py``), so each prompt-cache call
  of the generation thread finds the key of the request it serves:
  ``BatchGenerator`` (the batch ``_generate`` builds): a subclass naming the
  request of every cache list it hands out to be saved;
  ``ResponseGenerator._tokenize``: the same, noting whose request the next
  lookup is for; ``ResponseGenerator._serve_single``: the same, noting whose
  request is served alone. On an mlx-lm outside ``tenants.BATCHED_MLX_LM``
  (whose generation loop was not checked) ``_is_batchable`` is replaced
  instead, by one that serves every request alone.

``install`` makes the replacements and returns the function that puts
mlx-lm's names back, in reverse order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from blockkv.node import tenants

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeHooks:
    """What blockkv puts in place of mlx-lm's names."""

    on_run: Callable[[Any], None]  # called with mlx-lm's model provider before its run() starts
    make_cache: Callable[..., Any]  # called as mlx-lm calls LRUPromptCache(max_size, max_bytes)
    handler: Callable[[type], type]  # blockkv's request handler class over mlx-lm's APIHandler
    server_class: type  # the HTTP server class mlx-lm builds, called as cls(address, handler)
    before_serving: Callable[[], None]  # called once the model is loaded, before the HTTP server answers
    tenancy: tenants.Tenancy | None  # --per-key-cache: whose namespace each cache call is for


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
    batched = hooks.tenancy is not None and _batches_per_key(server)
    if hooks.tenancy is not None:
        needed += ["ResponseGenerator._tokenize", "ResponseGenerator._serve_single"]
        needed += ["BatchGenerator"] if batched else ["ResponseGenerator._is_batchable"]
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
        kwargs["server_class"] = hooks.server_class
        return original_http(*args, **kwargs)

    replacements.replace(server, "run", run)
    replacements.replace(server, "LRUPromptCache", hooks.make_cache)
    replacements.replace(server, "_run_http_server", run_http_server)
    if hooks.tenancy is not None:
        _install_tenancy(server, hooks.tenancy, batched, replacements)
    return replacements.undo


def _batches_per_key(server: Any) -> bool:
    """Whether this mlx-lm's generation loop is one ``tenants.py`` follows; if not,
    per-key caches serve every request alone (one warning)."""
    import mlx_lm

    if tenants.batching_supported(mlx_lm.__version__):
        return True
    log.warning("blockkv serve --per-key-cache: mlx-lm %s is outside the versions whose batching blockkv "
                "follows per key (%s); each request is served alone", mlx_lm.__version__,
                " to ".join(".".join(map(str, v)) for v in tenants.BATCHED_MLX_LM))
    return False


def _install_tenancy(server: Any, tenancy: tenants.Tenancy, batched: bool, replacements: _Replacements) -> None:
    generator = server.ResponseGenerator
    replacements.replace(generator, "_tokenize", tenants.tokenizing(generator._tokenize, tenancy))
    replacements.replace(generator, "_serve_single", tenants.serving_alone(generator._serve_single, tenancy))
    if batched:
        replacements.replace(server, "BatchGenerator",
                             tenants.attributing_batch_generator(server.BatchGenerator, tenancy))
    else:
        replacements.replace(generator, "_is_batchable", tenants.never_batchable)


def _has(owner: Any, dotted: str) -> bool:
    for part in dotted.split("."):
        if not hasattr(owner, part):
            return False
        owner = getattr(owner, part)
    return True
