"""``blockkv serve``: mlx-lm's own server with blockkv as its disk tier
(``serve``: its flags, the checks before mlx-lm starts, the node's caches and
handler), every name of mlx-lm's server it replaces (``hooks``), per-key
caches that keep batching (``tenants``), what it holds for a router
(``journal``, served by ``residency_endpoint``), ``/health``'s disk tier
(``health``), ``GET /metrics`` (``metrics``) and ``POST /blockkv/flush``
(``flush``)."""
