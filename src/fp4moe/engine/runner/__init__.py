"""The GPU model runner: preallocated paged caches (``paged_cache``), the fused forward over them and its CUDA
graphs (``cuda_runner``), the prefill graphs' shapes (``prompt_buckets``) and the MTP head's first drafts
through graphs (``first_drafts``, part of the runner because its graphs are the runner's). Imports
``engine.device``, ``engine.request`` and ``engine.reference`` (it speaks the reference path's cache
interface and falls back to its model runner); never speculation, the loop or the fronts."""
