"""Checkpoint -> engine model: building the model on the meta device and assigning each tensor once
(``loader``), ``--load-format dummy``'s random weights (``dummy``), and where an fp8 KV cache's scales come
from before the first request (``kv_scales``). Imports ``engine.device``, ``engine.request`` and
``engine.reference`` (the scales are measured through the module path); a sibling of ``engine.runner``,
which it never imports."""
