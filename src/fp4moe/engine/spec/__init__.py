"""Speculative decoding with the checkpoint's MTP head: the speculator that drafts, verifies and accepts
(``spec_decode``), the fused round on the GPU runner (``cuda_spec``) and its rejection sampling as tensor code
(``spec_sampling``), when to draft and when to back off (``spec_policy``, ``spec_cost``), its counters
(``spec_stats``) and the draft vocabulary (``draft_vocab``). Imports the rooms below it (``device``,
``request``, ``reference``, ``runner``); the loop drives it, it never imports the loop."""
