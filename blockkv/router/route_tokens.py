"""The prompt tokens a ``blockkv serve`` node will see for a request, computed
by the router without the model's weights.

Nothing of mlx-lm's tokenisation is copied: the tokenizer is loaded with
mlx-lm's own ``load_tokenizer`` and the tokenizer config ``mlx_lm server``
builds from the same flags (``--chat-template``, ``--trust-remote-code``,
``--use-default-chat-template``), and a request is tokenized by the server's
own ``ResponseGenerator._tokenize`` with the request built as its handler
builds it. So the router's tokens are the node's, chat template, tools and
``chat_template_kwargs`` included; a request it cannot tokenize (an image, a
malformed body, an mlx-lm that changed) is routed without tokens, by load
alone, and the node answers it as it would anyway.
"""

from __future__ import annotations

import copy
import queue
from types import SimpleNamespace
from typing import Any

CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")
TEXT_PATHS = ("/v1/completions",)
TOKENIZERS = 4  # requests tokenized at once


class PromptTokenizer:
    """mlx-lm's tokenizer for ``model`` (a path or a Hugging Face repo: its
    tokenizer files only are fetched), with the server's chat-template flags."""

    def __init__(self, model: str, *, chat_template: str | None = None, chat_template_args: dict[str, Any] | None = None,
                 use_default_chat_template: bool = False, trust_remote_code: bool = False) -> None:
        from mlx_lm.utils import load_tokenizer

        config: dict[str, Any] = {"trust_remote_code": trust_remote_code}  # as mlx-lm's ModelProvider builds it
        if chat_template:
            config["chat_template"] = chat_template
        self.tokenizer = load_tokenizer(model, config)
        if use_default_chat_template and self.tokenizer.chat_template is None:
            self.tokenizer.chat_template = self.tokenizer.default_chat_template
        self._provider = SimpleNamespace(processor=None,
                                         cli_args=SimpleNamespace(chat_template_args=dict(chat_template_args or {})))
        # a fast tokenizer used from several threads at once can raise: each thread takes one of its own
        # from a pool, so a long prompt being tokenized does not hold up a short one
        self._free: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for _ in range(TOKENIZERS):
            self._free.put(copy.deepcopy(self.tokenizer))

    def tokens(self, path: str, body: Any) -> list[int]:
        """The prompt tokens of a request to ``path`` with JSON ``body`` (raises on
        anything the server would refuse or could not tokenize either)."""
        from mlx_lm.server import CompletionRequest, ResponseGenerator

        if not isinstance(body, dict):
            raise TypeError("the request body is not a JSON object")
        if path in CHAT_PATHS:
            request = CompletionRequest("chat", "", body["messages"], body.get("tools") or None, body.get("role_mapping"))
        elif path in TEXT_PATHS:
            request = CompletionRequest("text", body["prompt"], [], None, None)
        else:
            raise ValueError(f"no prompt in a request to {path}")
        args = SimpleNamespace(chat_template_kwargs=body.get("chat_template_kwargs"))
        tokenizer = self._free.get()
        try:
            prompt = ResponseGenerator._tokenize(SimpleNamespace(model_provider=self._provider), tokenizer,
                                                 request, args)[0]
        finally:
            self._free.put(tokenizer)
        return [int(t) for t in prompt]
