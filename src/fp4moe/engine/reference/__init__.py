"""The module path, the CPU reference: per-sequence caches that grow by concatenation (``cache``), a flat
batch's step context (``context``), the model runner that runs the model's modules over a step's chunks
(``model_runner``, also the GPU runner's path for what its fused step does not take), prompt logprobs from the
prefill's hidden states (``prompt_logprobs``), and the greedy comparison of two engines against it
(``compare``). Imports ``engine.device`` and ``engine.request``, and the layers and models below the engine."""
