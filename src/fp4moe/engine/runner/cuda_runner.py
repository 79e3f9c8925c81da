"""The GPU model runner: preallocated paged caches, the model's fused GPU forward over them
(``models.qwen3_5_moe_fused``), and CUDA graphs of it.

A step in which every sequence decodes one token runs ``decode_forward`` (the fused forward's ``rows``: no
host syncs, static shapes), captured once per batch-size bucket and replayed. Fresh text prompts replay a
captured prefill graph per (prompts, padded length) bucket (``prompt_forward``), and chunks that continue a
cached prefix (the tail of a prompt longer than a step, a prefix-cache hit) one of the same buckets over the
pages (``chunk_graphs``); the rest of a step -- chunks longer than a graph's rows, images -- runs the modules'
mixers with the fused MoE between them (``hidden_states``), and a step that mixes chunks with decodes keeps
the decodes on the graph (``run``).
Every Triton kernel is launched with programmatic dependent launch on Hopper (``kernels.pdl_args``), so
launches overlap the tails of the kernels ahead of them. The runner owns the caches (``PagedKVCache``,
``SlotStates``, the speculative rounds' ``history``), the graphs' input buffers and the graphs.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from fp4moe.engine.device.memory import kv_bytes_per_token, kv_pages
from fp4moe.engine.device.transfer import upload
from fp4moe.engine.reference.model_runner import ModelRunner
from fp4moe.engine.request.sequence import Sequence
from fp4moe.engine.runner import prompt_buckets
from fp4moe.engine.runner.first_drafts import FirstDrafts
from fp4moe.engine.runner.paged_cache import PagedKVCache, SlotStates
from fp4moe.engine.runner.prompt_buckets import PROMPT_GRAPH_SEQS, PROMPT_GRAPH_TOKENS
from fp4moe.kernels import compiles
from fp4moe.layers.attention import cudnn_length
from fp4moe.layers.rope import Rotary
from fp4moe.models.qwen3_5_moe_fused import Qwen3_5MoeFused

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class CudaModelRunner(ModelRunner):
    def __init__(
        self,
        model,
        image_token_id: int | None,
        device: torch.device,
        kv_cache_dtype: str = "auto",
        *,
        max_num_seqs: int = 64,
        max_model_len: int = 8192,
        num_pages: int | None = None,
        page_size: int = 64,
        gpu_memory_utilization: float = 0.9,
        cuda_graphs: bool = True,
        spec_tokens: int = 0,
        prefill_graph_tokens: int = PROMPT_GRAPH_TOKENS[-1],
    ):
        super().__init__(model, image_token_id, device, kv_cache_dtype)
        # prefill attention through flash attention, never cuDNN's: cuDNN builds (runtime-compiles) a plan for
        # every new sequence length, and a server meets new lengths all the time (the H200's served TTFT was
        # 1.8-4.6 s, its profile's largest share inside scaled_dot_product_attention)
        torch.backends.cuda.enable_cudnn_sdp(False)
        if spec_tokens and model.mtp is None:
            raise ValueError("speculative decoding needs the checkpoint's MTP head (mtp.* tensors)")
        a = model.args
        self.args, self.max_num_seqs, self.max_model_len = a, max_num_seqs, max_model_len
        self.scratch = max_num_seqs  # slot (and page) that padded batch rows write into
        layers = model.layers
        self.attn_ids = [i for i, layer in enumerate(layers) if layer.is_attention]
        self.gdn_ids = [i for i, layer in enumerate(layers) if not layer.is_attention]
        kv_layers = self.attn_ids + ([model.mtp.layer_id] if model.mtp is not None else [])
        dtype = model.embed_tokens.dtype
        self.states = SlotStates(
            self.gdn_ids, max_num_seqs + 1, a.conv_dim, a.conv_kernel, a.linear_num_value_heads,
            a.linear_key_head_dim, a.linear_value_head_dim, dtype, device, ring_len=a.conv_kernel + spec_tokens,
        )  # fmt: skip
        self.spec_tokens = spec_tokens
        self.history = None  # Gated DeltaNet states after each verified token (speculative decoding)
        if spec_tokens:
            self.history = torch.zeros(
                len(self.gdn_ids), max_num_seqs * (spec_tokens + 1), a.linear_num_value_heads,
                a.linear_key_head_dim, a.linear_value_head_dim, device=device,
            )  # fmt: skip
        if num_pages is None:
            free, total = torch.cuda.mem_get_info(device)
            # (the MTP head's layer keeps keys/values too)
            per_token = kv_bytes_per_token(a, kv_cache_dtype, model.embed_tokens.dtype) * len(kv_layers)
            per_token //= len(self.attn_ids)
            num_pages = kv_pages(
                free, total, per_token, gpu_memory_utilization, max_num_seqs, max_model_len, page_size
            )
        self.kv = PagedKVCache(
            kv_layers, num_pages + 1, page_size, a.num_kv_heads, a.head_dim, max_num_seqs + 1, max_model_len,
            kv_cache_dtype, dtype, device,
        )  # fmt: skip
        self.kv.reserve(
            self.scratch, 2 * spec_tokens + 2
        )  # padded rows of a speculative round write here too
        if model.rotary is None:
            model.rotary = Rotary(a.rope, device)
        self.fwd = Qwen3_5MoeFused(model, self.kv, self.states, self.history, self.scratch, bool(spec_tokens))
        self.cuda_graphs = cuda_graphs
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self._capture_stream = None  # graph_of's side stream
        self.buf_ids = torch.zeros(max_num_seqs, dtype=torch.long, device=device)
        self.buf_pos = torch.zeros(max_num_seqs, dtype=torch.int32, device=device)
        self.buf_slots = torch.full((max_num_seqs,), self.scratch, dtype=torch.int32, device=device)
        self.buf_rope = torch.zeros(
            3, max_num_seqs, dtype=torch.long, device=device
        )  # rotary (mRoPE) positions
        self.last_hidden: torch.Tensor | None = None  # the last decode step's final-normed hidden states
        self.fused_prefill = True  # prefill chunks with the fused pieces (``hidden_states``)
        # fresh prompts through captured graphs (``prompt_forward``): inputs, and the graphs by padded length
        # (rows of one graph at most: its inputs below are sized once, before any capture reads them)
        self.max_prompt_graph_tokens = top = prefill_graph_tokens
        self.use_prompt_graphs = True  # off: fresh prompts take the module path too (the warm-up compiles it)
        self.prompt_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # chunks over cached prefixes, by the same buckets: a 93-token chunk after an 8K prompt took 138 ms
        # through the module path on the H200, all of it the host enqueueing 18 ms of kernels
        # (benchmarks/chunk_profile.py)
        self.chunk_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._prompt_pool = None
        self.direct_captures = 0  # prefill graphs captured without an eager run first (``_capture_prompt``)
        self.prompt_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.prompt_rows = torch.arange(top, device=device)
        self.prompt_len = torch.zeros(PROMPT_GRAPH_SEQS[-1], dtype=torch.long, device=device)
        self.prompt_slot = torch.full((PROMPT_GRAPH_SEQS[-1],), self.scratch, dtype=torch.long, device=device)
        self.prompt_cached = torch.zeros(PROMPT_GRAPH_SEQS[-1], dtype=torch.long, device=device)
        # the MTP head's first drafts after a prompt, through graphs of the prefill graphs' buckets
        self.first_drafts = (
            FirstDrafts(self, spec_tokens, top, PROMPT_GRAPH_SEQS[-1]) if spec_tokens else None
        )

    # ---- set-up -------------------------------------------------------------------------------------

    def new_caches(self):
        return self.kv, self.states

    def set_kv_scales(self, scales) -> None:
        """An fp8 cache's scales {layer: (k, v)} (``engine.loading.kv_scales``): into the tensor the graphs read."""
        self.kv.set_scales(scales)

    def capacity_tokens(self) -> int:
        """Tokens the scheduler may reserve: every page but the scratch one, less a partly filled last
        page per sequence."""
        pages = self.kv.k.shape[1] - 1 - self.max_num_seqs
        return max(0, pages * self.kv.page_size)

    # ---- module path (prefill, chunks, verification) ------------------------------------------------

    def fusable_decode(self, batch: list[tuple[Sequence, int]], kv) -> bool:
        """Whether ``batch`` is one decode token per sequence that the fused step can take."""
        decode = all(n == 1 and 0 < s.num_cached == s.num_tokens - 1 for s, n in batch)
        decode = decode and len(batch) <= self.max_num_seqs
        decode = decode and all(s.image_embeds is None or s.num_cached >= len(s.prompt_ids) for s, _ in batch)
        # an fp8 cache's scales are set at start-up (engine.loading.kv_scales), before any step: this holds from then on
        decode = decode and (not kv.fp8 or all(layer in kv.scales for layer in self.attn_ids))
        return decode and kv is self.kv

    @torch.no_grad()
    def run(self, batch: list[tuple[Sequence, int]], kv, states, keep=None):
        """As ``ModelRunner.run``, the logits of decoding rows on the device (``LLM.sample_all`` takes the
        greedy ones' argmax there). A step that mixes prefill chunks with decodes runs the chunks through the
        module path and the decodes through the fused step (its graph): the decodes never pay for the
        module path (the served profile's largest share, issue 20)."""
        decode = [(s, n) for s, n in batch if self.fusable_decode([(s, n)], kv)]
        if not decode or len(decode) > self.max_num_seqs:
            return super().run(batch, kv, states, keep)
        rest = [(s, n) for s, n in batch if not self.fusable_decode([(s, n)], kv)]
        done = super().run(rest, kv, states, keep) if rest else []
        seqs = [s for s, _ in decode]
        starts = [s.num_cached for s in seqs]
        logits, hidden = self.decode_step(seqs, keep_hidden=keep is not None, host=False)
        if keep is not None:
            for i, (seq, start) in enumerate(zip(seqs, starts, strict=True)):
                keep(seq, start, hidden[i : i + 1])
        return done + [(s, logits[i]) for i, s in enumerate(seqs)]

    @torch.no_grad()
    def decode_step(
        self,
        seqs: list[Sequence],
        keep_hidden: bool = True,
        host: bool = True,
        tokens: torch.Tensor | None = None,
    ):
        """The fused step for ``seqs`` (each decoding its next token; ``fusable_decode`` holds) -> (logits
        [b, V] fp32 on the host (``host`` False: bf16 on the device, a copy), final-normed hidden states [b, H]
        on the device -- a copy: the MTP head's inputs -- or None). ``tokens`` [b] on the device: the tokens
        at the sequences' ``num_cached`` positions, sampled by the step before and not yet on the host (the
        engine's async scheduling); None: read from the sequences."""
        rope = None  # rotary positions are the cache positions unless a prompt held images
        if any(s.prompt_positions is not None for s in seqs):
            rope = torch.cat([s.positions(s.num_cached, s.num_cached + 1) for s in seqs], dim=1)
        if tokens is None:
            tokens = [s.token(s.num_cached) for s in seqs]
        logits = self.decode_logits([s.slot for s in seqs], tokens, [s.num_cached for s in seqs], rope)
        hidden = self.last_hidden.clone() if keep_hidden else None
        for s in seqs:
            s.num_cached += 1
        return (logits.float().cpu() if host else logits.clone()), hidden

    def hidden_states(self, ids, positions, ctx, embeds=None) -> torch.Tensor:
        """The module path's mixers with the fused MoE between them (``Qwen3_5MoeFused.hidden_states``);
        ``fused_prefill`` False: the modules throughout."""
        if not self.fused_prefill:
            return super().hidden_states(ids, positions, ctx, embeds)
        return self.fwd.hidden_states(ids, positions, ctx, embeds)

    # ---- fresh prompts through graphs ---------------------------------------------------------------

    @torch.no_grad()
    def forward(self, batch: list[tuple[Sequence, int]], kv, states):
        """As ``ModelRunner.forward``; the step's fresh text prompts (or first chunks) and its text chunks over
        cached prefixes replay a captured prefill graph (``prompt_forward``) instead of enqueueing the layers'
        kernels one by one from Python, and only the rest (longer chunks, images) go through the module path."""
        groups = [(g, b, False) for g, b in self._prompt_groups(batch, kv)]
        groups += [(g, b, True) for g, b in self._prompt_groups(batch, kv, continuing=True)]
        if not groups:
            return super().forward(batch, kv, states)
        pieces = {}
        for group, bucket, continuing in groups:
            hidden = self._run_prompt_graph([batch[i] for i in group], *bucket, continuing=continuing)
            pieces |= dict(zip(group, hidden, strict=True))
        rest = [i for i in range(len(batch)) if i not in pieces]
        if rest:
            hidden, spans = super().forward([batch[i] for i in rest], kv, states)
            pieces |= {i: hidden[a:b] for i, (a, b) in zip(rest, spans, strict=True)}
        ordered = [pieces[i] for i in range(len(batch))]
        ends = list(accumulate(len(p) for p in ordered))
        return torch.cat(ordered), [(e - len(p), e) for e, p in zip(ends, ordered, strict=True)]

    def _prompt_groups(
        self, batch: list[tuple[Sequence, int]], kv, continuing: bool = False
    ) -> list[tuple[list[int], tuple[int, int]]]:
        """The step's fresh prompts (``continuing``: its chunks over cached prefixes; indices into ``batch``)
        that a prefill graph can take, in groups that one graph each takes, each with its graph: the fewest
        rows and replays (``prompt_buckets.partition``)."""
        fits = self._chunk_graph_fits if continuing else self._prompt_graph_fits
        fresh = sorted(
            (i for i, (seq, n) in enumerate(batch) if fits(seq, n, kv)), key=lambda i: -batch[i][1]
        )
        fresh = [i for i in fresh if self.prompt_bucket([batch[i][1]]) is not None]
        parts = prompt_buckets.partition([batch[i][1] for i in fresh], self._bucket)
        return [([fresh[j] for j in group], shape) for group, shape in parts]

    def whole_prompts(self) -> bool:
        """Fresh prompts go through graphs, continuing chunks longer than a graph's rows through the module
        path: split none that a step can take whole."""
        return self.cuda_graphs and self.use_prompt_graphs and self.fused_prefill

    def prompt_bucket(self, lens: list[int]) -> tuple[int, int] | None:
        """The graph (sequences, rows each) that takes fresh prompts of ``lens`` tokens, or None."""
        if not (self.cuda_graphs and self.use_prompt_graphs):
            return None
        return self._bucket(max(lens), len(lens))

    def _bucket(self, longest: int, count: int) -> tuple[int, int] | None:
        """``prompt_bucket`` of ``count`` prompts, the longest ``longest`` tokens (``prompt_buckets.bucket``)."""
        return prompt_buckets.bucket(longest, count, self.max_num_seqs, self.max_prompt_graph_tokens)

    def _prompt_graph_fits(self, seq: Sequence, n: int, kv) -> bool:
        """Whether a fresh text prompt (or its first chunk) can take a prefill graph."""
        return seq.num_cached == 0 and self._text_graph_fits(seq, n, kv)

    def _chunk_graph_fits(self, seq: Sequence, n: int, kv) -> bool:
        """Whether a text chunk over a cached prefix can take a prefill graph: every attention layer holds
        exactly the prefix (else the module path appends each at its length)."""
        return (
            seq.num_cached > 0
            and self._text_graph_fits(seq, n, kv)
            and all(kv.length(layer, seq.slot) == seq.num_cached for layer in self.attn_ids)
        )

    def _text_graph_fits(self, seq: Sequence, n: int, kv) -> bool:
        """What both kinds of prefill graph need: the runner's caches and fused prefill, text positions, more
        than one token, and an fp8 cache's scales set."""
        return (
            kv is self.kv
            and self.fused_prefill
            and n >= 2  # one token: the recurrent rule in fp32, as the module path takes it
            and seq.image_embeds is None
            and seq.prompt_positions is None
            # an fp8 cache's scales come from the first prefill that writes each layer (the module path)
            and (not kv.fp8 or all(layer in kv.scales for layer in self.attn_ids))
        )

    def _run_prompt_graph(
        self, batch: list[tuple[Sequence, int]], b: int, t: int, continuing: bool = False
    ) -> list[torch.Tensor]:
        """Replay the prefill graph of ``b`` sequences x ``t`` rows for the fresh prompts of ``batch``
        (``continuing``: for their chunks over cached prefixes) -> each one's final-normed hidden [n, H]
        (views of one copy). Their pages are reserved here; the graph writes them and the slots' states."""
        for seq, n in batch:
            self.kv.reserve(seq.slot, seq.num_cached + n)
        graphs = self.chunk_graphs if continuing else self.prompt_graphs
        if (b, t) not in graphs:
            self._capture_prompt(b, t, continuing)
        host = torch.zeros(b * t + 3 * b, dtype=torch.long)
        lens, slots, cached = host[b * t :].split(b)
        slots.fill_(self.scratch)  # unused sequences: no rows, the scratch slot
        for i, (seq, n) in enumerate(batch):
            host[i * t : i * t + n] = torch.tensor(seq.tokens(seq.num_cached, seq.num_cached + n))
            lens[i], slots[i], cached[i] = n, seq.slot, seq.num_cached
        dev = upload(host, self.device)
        self.prompt_ids[: b * t].copy_(dev[: b * t])
        self.prompt_len[:b].copy_(dev[b * t : b * t + b])
        self.prompt_slot[:b].copy_(dev[b * t + b : b * t + 2 * b])
        self.prompt_cached[:b].copy_(dev[b * t + 2 * b :])
        graph, hidden = graphs[(b, t)]
        graph.replay()
        hidden = hidden.clone()
        for seq, n in batch:
            self.kv.advance(seq.slot, seq.num_cached + n, self.attn_ids)
        return [hidden[i * t : i * t + n] for i, (_, n) in enumerate(batch)]

    def _capture_prompt(self, b: int, t: int, continuing: bool = False) -> None:
        """Capture the prefill graph of ``b`` x ``t`` rows (``continuing``: of chunks over cached prefixes);
        the warm-up run and the capture have no real row (every length 0), so they write only the scratch
        slot and page."""
        self.prompt_len.zero_()
        self.prompt_slot.fill_(self.scratch)
        self.prompt_cached.zero_()
        self.prompt_ids.zero_()
        if self._prompt_pool is None and self.device.type == "cuda":
            self._prompt_pool = torch.cuda.graph_pool_handle()
        graphs = self.chunk_graphs if continuing else self.prompt_graphs
        fn = lambda: self.prompt_forward(b, t, continuing)  # noqa: E731
        # Captured straight away where nothing in it would compile (the earlier graphs and the warm-up's
        # module path met its kernels' variants): the eager run before a capture was ~40% of each one's
        # 0.2-0.4 s, at ~150 prefill graphs a full-size start-up. Not fresh prompts whose attention takes
        # a cuDNN plan (a new shape builds one, never tried inside a capture); not the pool's first graph
        # (a capture dropped while no other graph holds the pool frees the pool: PyTorch then refuses it).
        live = self.prompt_graphs or self.chunk_graphs
        if self.device.type == "cuda" and live and (continuing or not cudnn_length(t)):
            try:
                with compiles.forbidden():
                    graphs[(b, t)] = self.graph_of(fn, pool=self._prompt_pool, warm=False)
                self.direct_captures += 1
                return
            except compiles.CompileWanted:
                pass  # that capture ended cleanly and is dropped: run it eagerly first
        graphs[(b, t)] = self.graph_of(fn, pool=self._prompt_pool)

    def capture_prompts(self, chunk_seqs: int | None = None, tick=None) -> None:
        """Capture every prefill graph ahead of serving (else each is captured on first use, compiling
        kernels for its shapes on a user's request), of fresh prompts and of chunks over cached prefixes:
        all that ``prompt_bucket`` can choose, also the padded ones larger than a step's token budget (three
        prompts of 65 tokens in a 256-token step take 4 x 96 rows: the GPU no-compile test met that one);
        with speculation, the first drafts' graphs of the same buckets. ``chunk_seqs``: chunks' graphs only
        of that many sequences or fewer (None: all). Without a prefix cache a step continues one prompt at
        most (the scheduler splits one at a time), so 1 leaves out 83 of the 115 chunk graphs at the
        full-size defaults; with one, every admitted request that hits the cache continues its prompt.
        ``tick``: called after each graph captured."""
        buckets = self._prompt_graph_buckets()
        for b, t, continuing in self._pending_prompt_graphs(buckets, chunk_seqs):
            self._capture_prompt(b, t, continuing)
            if tick is not None:
                tick()
        if self.first_drafts is not None:
            self.first_drafts.capture(buckets, tick)

    def pending_prompt_captures(self, chunk_seqs: int | None = None) -> int:
        """How many graphs ``capture_prompts(chunk_seqs)`` would capture now (the warm-up's progress bar)."""
        buckets = self._prompt_graph_buckets()
        drafts = len(self.first_drafts.pending(buckets)) if self.first_drafts is not None else 0
        return len(self._pending_prompt_graphs(buckets, chunk_seqs)) + drafts

    def _prompt_graph_buckets(self) -> list[tuple[int, int]]:
        """Every (sequences, rows) shape ``prompt_bucket`` can choose."""
        return [
            (b, t)
            for t in PROMPT_GRAPH_TOKENS
            for b in PROMPT_GRAPH_SEQS
            if self.prompt_bucket([t] * b) == (b, t)
        ]

    def _pending_prompt_graphs(self, buckets, chunk_seqs: int | None) -> list[tuple[int, int, bool]]:
        """(sequences, rows, continuing) of the prefill graphs of ``buckets`` not captured yet: fresh prompts'
        of every bucket, chunks' of ``chunk_seqs`` sequences or fewer (None: all)."""
        return [
            (b, t, continuing)
            for continuing, graphs, most in (
                (False, self.prompt_graphs, None),
                (True, self.chunk_graphs, chunk_seqs),
            )
            for b, t in buckets
            if (b, t) not in graphs and (most is None or b <= most)
        ]

    def prompt_forward(self, b: int, t: int, continuing: bool = False) -> torch.Tensor:
        """``b`` fresh prompts (``continuing``: chunks after ``prompt_cached`` tokens) from the graph inputs
        (``prompt_ids``, ``prompt_len``, ``prompt_slot``), each padded to ``t`` rows -> final-normed hidden
        [b * t, H] (``Qwen3_5MoeFused.prompts``)."""
        ids, lens, slots = self.prompt_ids[: b * t], self.prompt_len[:b], self.prompt_slot[:b]
        cached = self.prompt_cached[:b] if continuing else None
        return self.fwd.prompts(ids, lens, slots, self.prompt_rows, b, t, cached)

    # ---- fused decode -------------------------------------------------------------------------------

    def decode_logits(
        self, slots: list[int], tokens, positions: list[int], rope_positions=None
    ) -> torch.Tensor:
        """One decode token for each slot (token at ``positions``); ``rope_positions`` [3, B] when rotary
        positions differ from the cache positions (after an image). Returns logits [B, V] (GPU, bf16) --
        with graphs, a view of the graph's output buffer, overwritten by the next step; ``last_hidden`` is
        the step's final-normed hidden states, likewise."""
        b = len(slots)
        for slot, pos in zip(slots, positions, strict=True):
            self.kv.reserve(slot, pos + 1)
        bucket = self.graph_bucket(b)
        if bucket is not None and bucket not in self.graphs:
            self._capture(bucket)  # before the live inputs go in: the warm-up really runs a step
        self._load_inputs(slots, tokens, positions, rope_positions)
        if bucket is not None:
            graph, (logits, hidden) = self.graphs[bucket]
            graph.replay()
        else:
            logits, hidden = self.decode_forward(b)
        logits, self.last_hidden = logits[:b], hidden[:b]
        for slot, pos in zip(slots, positions, strict=True):
            # the target's layers only: the MTP layer's keys/values are the head's, written as it catches up
            self.kv.advance(slot, pos + 1, self.attn_ids)
        return logits

    def _load_inputs(self, slots: list[int], tokens, positions: list[int], rope_positions) -> None:
        """The step's inputs into the graphs' buffers (rows past ``len(slots)`` point at the scratch slot):
        one host tensor, one copy from pinned memory that does not wait for the GPU (four pageable copies,
        each a stream sync, did before), then device copies into the buffers."""
        b, m = len(slots), self.max_num_seqs
        host = torch.zeros(6, m, dtype=torch.long)
        host[0].fill_(self.scratch)
        host[0, :b] = torch.tensor(slots)
        host[1, :b] = torch.tensor(positions)
        if not isinstance(tokens, torch.Tensor):
            host[2, :b] = torch.tensor(tokens)
        host[3:, :b] = host[1, :b] if rope_positions is None else torch.as_tensor(rope_positions)
        dev = upload(host, self.device)
        self.buf_slots.copy_(dev[0])
        self.buf_pos.copy_(dev[1])
        self.buf_ids.copy_(dev[2])
        self.buf_rope.copy_(dev[3:])
        if isinstance(tokens, torch.Tensor):  # already on the device (a speculative round's drafts)
            self.buf_ids[:b] = tokens

    def _capture(self, b: int) -> None:
        """Warm up (compiles the kernels) and capture bucket ``b``; every row points at the scratch slot,
        so the warm-up step writes nothing a live sequence reads."""
        self.buf_slots.fill_(self.scratch)
        self.buf_pos.zero_()
        self.buf_rope.zero_()
        self.buf_ids.zero_()
        self.graphs[b] = self.graph_of(lambda: self.decode_forward(b))

    def graph_bucket(self, b: int) -> int | None:
        """The captured batch size that serves ``b`` rows, or None where graphs are off or ``b`` is too big."""
        bucket = next((g for g in GRAPH_BATCH_SIZES if g >= b), None)
        return bucket if self.cuda_graphs and bucket is not None and bucket <= self.max_num_seqs else None

    def graph_of(self, fn, pool=None, warm: bool = True) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Run ``fn`` once (compiles its kernels; ``warm`` False: not), then capture it in a CUDA graph that
        shares the runner's memory pool (or ``pool``); returns the graph and ``fn``'s output buffer.

        Captured as ``torch.cuda.graph`` does it (a side stream, ``capture_begin``/``capture_end``) less its
        flushes: before every capture it empties the allocator's device and pinned-host caches (and may
        ``gc.collect()``), so the next warm-up run allocates all its activations and ``upload``'s pinned
        buffers afresh -- at the 158 captures of a full-size start-up, seconds of ``cudaMalloc`` and
        ``cudaHostAlloc``. vLLM turns the same flushes off while it captures."""
        if warm:
            fn()
            torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        if pool is None:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            pool = self._pool
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._capture_stream):
            graph.capture_begin(pool=pool)
            try:
                out = fn()
            finally:
                graph.capture_end()
        return graph, out

    def capture(self, batch_sizes=None, tick=None) -> None:
        """Capture the decode graphs ahead of serving (else each bucket is captured on first use), and compile
        the decode attention for the row counts of eager steps (mixed steps, rounds) no graph has. ``tick``:
        called after each graph captured."""
        for b in self._pending_decode_graphs(batch_sizes):
            self._capture(b)
            if tick is not None:
                tick()
        self.fwd.warm_decode_attention()

    def pending_captures(self, batch_sizes=None) -> int:
        """How many graphs ``capture(batch_sizes)`` would capture now (the warm-up's progress bar)."""
        return len(self._pending_decode_graphs(batch_sizes))

    def _pending_decode_graphs(self, batch_sizes) -> list[int]:
        return [
            b
            for b in batch_sizes or [g for g in GRAPH_BATCH_SIZES if g <= self.max_num_seqs]
            if b not in self.graphs
        ]

    def decode_forward(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode step over the first ``b`` rows of the static buffers -> (logits [b, V] bf16,
        final-normed hidden [b, H])."""
        _, x = self.forward_rows(self.buf_ids[:b], self.buf_pos[:b], self.buf_slots[:b], self.buf_rope[:, :b])
        return self.model.lm_head(x), x

    def forward_rows(self, ids, pos, slots, rope, tokens_per_seq: int = 1):
        """``Qwen3_5MoeFused.rows`` over the runner's caches -> (residual stream, final-normed hidden)."""
        return self.fwd.rows(ids, pos, slots, rope, tokens_per_seq)

    def mtp_rows(self, ids, hidden, pos, slots, rope, keep=None) -> torch.Tensor:
        """``Qwen3_5MoeFused.mtp_rows``: the MTP head over rows, its keys/values into the runner's pages."""
        return self.fwd.mtp_rows(ids, hidden, pos, slots, rope, keep)
