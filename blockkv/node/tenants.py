"""``blockkv serve --per-key-cache``: each API key's requests read and write
only that key's prompt cache, so no tenant learns from ``cached_tokens`` or
the time to a first token what another sent.

The request handler tags each completion request with its key's namespace
(``auth.namespace_of``: a digest, not the key); mlx-lm's generation thread
serves it inside ``PersistentPromptCache.serving(ns)``, where the RAM tier
keys entries ``(model, ns)`` and the stores run with ``isolate_namespaces``.
mlx-lm's batch generator saves a request's caches after the request has left
its hands, with nothing that says whose they were; so with per-key caches
every request is served on its own (mlx-lm's sequential path, as it serves
requests with images or a seed): the isolation costs the batching.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from blockkv.wire.auth import namespace_of

NAMESPACE_ATTRIBUTE = "blockkv_namespace"


def tagging_handler(base: type) -> type:
    """mlx-lm's handler class ``base`` (checked by ``auth.with_keys``) tagging
    each completion request with the namespace of the key that sent it."""

    class TaggingHandler(base):  # type: ignore[misc, valid-type]
        def handle_completion(self, request: Any, stop_words: Any) -> Any:
            setattr(request, NAMESPACE_ATTRIBUTE, namespace_of(self.api_key))
            return super().handle_completion(request, stop_words)

    return TaggingHandler


def never_batchable(self: Any, args: Any) -> bool:
    """``ResponseGenerator._is_batchable`` under per-key caches: no request joins a batch."""
    return False


def in_namespace(serve_single: Callable[..., Any]) -> Callable[..., Any]:
    """mlx-lm's ``ResponseGenerator._serve_single`` serving each request inside
    its key's namespace (``hooks.py`` puts it in place)."""

    def serve(self: Any, request: Any, stream: Any) -> Any:
        ns = getattr(request[1], NAMESPACE_ATTRIBUTE, None)
        if ns is None:  # not tagged: no key to isolate it by, so nothing to serve it from
            request[0].put(RuntimeError("blockkv: a request without a key under --per-key-cache"))
            return None
        with self.prompt_cache.serving(ns):
            return serve_single(self, request, stream)

    return serve
