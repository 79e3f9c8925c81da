"""The fronts over the engine loop, side by side: ``LLM`` (offline: load, build the core, ``generate`` /
``stream`` / ``chat``), ``AsyncEngine`` (the core on a thread of the server's process), ``EngineProcess`` (the
core in a process of its own), the ``EngineConfig`` they share, the start-up warm-up and precompilation
(``warmup``). The top room: it may import every room below; only the server, the CLI, eval and bench import
it."""
