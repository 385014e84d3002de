"""``POST /blockkv/flush`` on ``blockkv serve``: finish writing what the server
holds, so ``blockkv export`` (or ``ls``) run beside it sees every conversation.

The disk tier writes behind (``store_async``): a conversation's last turn may
still be in flight when someone exports it, and the export would miss it.
The endpoint waits for every spill started so far (``PersistentPromptCache.flush``)
and answers how many entries were written; it sits behind the API key like
every path but ``/health``. ``request_flush`` is the client side, for
``blockkv export --flush``.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from blockkv.wire.auth import bearer

PATH = "/blockkv/flush"
MAX_ANSWER_BYTES = 1 << 16


def flush_handler(base: type, caches: Callable[[], list[Any]]) -> type:
    """mlx-lm's request handler class ``base`` answering ``POST /blockkv/flush``."""

    class FlushHandler(base):  # type: ignore[misc, valid-type]
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            if self.path.split("?", 1)[0] != PATH:
                return super().do_POST()
            for cache in caches():
                cache.flush()
            stats = [cache.tier_stats for cache in caches()]
            body = json.dumps({"spills": sum(s["spills"] for s in stats),
                               "spill_failures": sum(s["spill_failures"] for s in stats),
                               "pending_spills": sum(s["pending_spills"] for s in stats)}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return None

    return FlushHandler


def request_flush(url: str, key: str | None, timeout: float) -> dict[str, Any]:
    """Ask the server at ``url`` (``http://HOST:PORT``) to flush; its answer.
    ``OSError`` naming the server if it cannot (refused, 401, not a blockkv serve)."""
    request = urllib.request.Request(url.rstrip("/") + PATH, data=b"", method="POST", headers=bearer(key))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer = json.loads(response.read(MAX_ANSWER_BYTES))
    except urllib.error.HTTPError as e:
        why = "the API key was refused (--api-key-file, $BLOCKKV_API_KEY)" if e.code == 401 else f"HTTP {e.code}"
        raise OSError(f"{url} did not flush: {why}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise OSError(f"{url} did not flush: {getattr(e, 'reason', e)}") from None
    if not isinstance(answer, dict):
        raise OSError(f"{url} did not flush: an answer that is not blockkv serve's")
    return answer
