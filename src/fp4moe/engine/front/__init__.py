"""The fronts over the engine loop, side by side: ``LLM`` (offline: load, build the core, ``generate`` /
``stream`` / ``chat``), ``AsyncEngine`` (the core on a thread of the server's process), ``EngineProcess`` (the
core in a process of its own), the ``EngineConfig`` they share, the start-up warm-up and precompilation
(``warmup``). The top room: it may import every room below; of the packages, eval, the server and the CLI
import it (the engine's other rooms never do)."""
