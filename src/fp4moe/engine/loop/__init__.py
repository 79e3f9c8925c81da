"""The engine loop: ``EngineCore`` (one synchronous ``step()``: schedule, run, sample, hand out tokens; async
scheduling), the continuous-batching ``scheduler``, the ``prefix_cache`` the core restores prompts from, and
the ``step_trace``. The core owns the collaborators it is given (scheduler, runner, sampler, speculator) and
never imports a front. Imports the rooms below it (``device``, ``request``, ``reference``; runner and
speculator are handed in, not imported)."""
