"""``blockkv route``: one OpenAI-compatible address for a fleet of ``blockkv
serve`` nodes. The HTTP front (``route``), the choice of a node
(``placement``), its view of each node (``fleet``), its cost model
(``scoring``) and its tokens (``route_tokens``). Nothing here touches
storage: no import of ``format/``, ``pool/``, ``local/``, ``bucket/``,
``remote/``, the store, ``node/`` or ``mlx_lm/``."""
