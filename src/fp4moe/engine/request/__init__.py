"""What a request is: its sampling parameters and the sampler's arithmetic (``sampler``), the sequence being
generated (``sequence``), and the request side of a model that needs no weights -- tokenizer, chat template,
prompt checks, images into pixels (``prompts``, ``multimodal``). Imports ``engine.device`` only (and
``fp4moe.errors``)."""
