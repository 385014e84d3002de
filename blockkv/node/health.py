"""``GET /blockkv/health`` and ``GET /v1/models`` on ``blockkv serve``: what a
user of the disk tier needs to know, beside mlx-lm's answers.

- ``/health`` is mlx-lm's own, body and code (its clients, and mlx-lm's own
  test suite, compare the body whole), as long as the disk tier is on or not
  opened yet; while it is off (a cache directory it cannot open) the body
  also says so: ``"disk_tier": {"state": "off", "why": ...}``, with mlx-lm's
  code (the node still serves, from RAM). ``/blockkv/health`` answers the
  same code and ``status``, and ``disk_tier`` always: ``{"state": "on" |
  "off" | "not open yet", "why": ...}`` for the default model.
- ``/v1/models``: mlx-lm 0.32.2 sends its 200 headers, then lists the Hugging
  Face cache, which raises when there is no such directory: the client gets an
  empty body. Without that directory the answer is mlx-lm's own list with no
  downloaded repo in it: the served ``--model`` directory, if it is one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

PATH = "/blockkv/health"


def health_handler(base: type, disk_tier: Callable[[], tuple[str, str | None]]) -> type:
    """mlx-lm's request handler class ``base`` with the two answers above."""

    class HealthHandler(base):  # type: ignore[misc, valid-type]
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path not in (PATH, "/health"):
                return super().do_GET()
            state, why = disk_tier()
            if path == "/health" and state != "off":
                return super().do_GET()  # mlx-lm's answer, byte for byte
            healthy = self.response_generator.is_healthy
            body = {"status": "ok" if healthy else "unavailable", "disk_tier": {"state": state, "why": why}}
            self._answer_json(200 if healthy else 503, body)
            return None

        def handle_models_request(self) -> None:
            from huggingface_hub import constants

            if Path(constants.HF_HUB_CACHE).is_dir():
                return super().handle_models_request()
            model = self.response_generator.cli_args.model
            local = [] if model is None or not Path(model).exists() else [str(Path(model).resolve())]
            data = [{"id": m, "object": "model", "created": self.created} for m in local]
            self._answer_json(200, {"object": "list", "data": data})
            return None

        def _answer_json(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self._set_completion_headers(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()

    return HealthHandler
