"""The GPU model runner: preallocated paged caches, a fused decode step, and CUDA graphs of it.

Prefill and chunked prefill run the model's own mixer modules (their GPU branches: flash attention,
flash-linear-attention's chunked delta rule) over the paged caches, with the decode step's fused MoE,
add-norm and combine between them (``hidden_states``); the speculator's unfused verification runs the
modules throughout. A step in which every sequence decodes one token runs ``decode_forward`` instead: per
layer one fused projection (cuBLAS, or our GEMV at one row), one fused Gated DeltaNet kernel or the
q/k-norm-rope-store + split-KV attention kernels, the output projection, add+norm, the fused
router/shared-expert projection, router, align (none at up to 4 tokens), the two NVFP4 expert kernels
(per-pair GEMVs up to 4 tokens, grouped GEMMs above) with the shared-expert down projection beside them on
a side stream, and combine+next norm -- no host syncs, static shapes, so the whole step is captured once
per batch-size bucket and replayed. Every Triton kernel is launched with programmatic dependent launch on
Hopper (``kernels.pdl_args``), so launches overlap the tails of the kernels ahead of them; the short kernels
ahead of a one-row GEMV and the in_proj GEMV ahead of the Gated DeltaNet kernel let the next kernel start at
once, the expert gate/up GEMV lets the down GEMV start once it has seen the router finish, and those
kernels load their first weight tile (or their states) before they wait.

The projections sharing an input are concatenated once at start-up (qkv|z|b|a of Gated DeltaNet, q|k|v of
attention, router|shared gate|shared up|shared gate-scalar of the MoE; per weight format: FusedLinear), and
the modules' own weights become views into them: no extra memory.
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from fp4moe.engine.context import StepTensors
from fp4moe.engine.model_runner import ModelRunner
from fp4moe.engine.paged_cache import PagedKVCache, SlotStates
from fp4moe.engine.sequence import Sequence
from fp4moe.engine.transfer import upload
from fp4moe.layers.rope import Rotary

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# prompt lengths with a captured prefill graph (a fresh prompt pads up to the next one): one eager 512-token
# prefill enqueued for 177 ms on the H200 against 28 ms of kernels (benchmarks/prefill_batch.py): a served
# single stream's time to first token was that host work. From 256 rows on, each length is at most 25% above
# the one before, so a prompt pads by less than a quarter (it was up to a half: 64 prompts of ~520 tokens ran in
# 768-row slots, two-thirds of each prefill graph's rows real)
PROMPT_GRAPH_TOKENS = (16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512, 576, 640, 768, 896, 1024, 1280, 1536,
                       1792, 2048)  # fmt: skip
PROMPT_GRAPH_SEQS = (1, 2, 4, 8, 16, 32, 64, 128)  # fresh prompts in one step (each padded to the longest)
# a prefill graph replay's cost beyond its rows, in rows (H200, full size: 512 rows 31 ms, 4,608 rows 102 ms,
# 8,192 rows 164 ms -- about 20 ms and 17.5 us a row): ``_prompt_groups`` weighs padding against replays
REPLAY_ROWS = 1024


class FusedLinear:
    """Several Linears over the same input as one GEMM per weight format: the dense weights concatenated,
    and the NVFP4 (or FP8) ones concatenated when they share one decode scale -- vLLM's fused groups do,
    and ``fp4moe quantize`` writes them so -- else run one by one. The Linears' own tensors become views
    into the concatenations (no extra memory); outputs come back in the Linears' order. ``pad_to``: when
    every Linear is bf16, zero rows pad the weight to a multiple of that many outputs (the output has the
    extra columns): cuBLAS runs an odd width -- the router + shared-expert group's 1,281 -- through an
    unaligned kernel (H200: cutlass ``align1``, 10 us at 16 rows, 23 us at 3). ``trigger``: when our
    one-row GEMV lets the kernel behind it start (``kernels.pdl_args``)."""

    def __init__(self, linears: list, pad_to: int = 1, trigger: str = ""):
        self.sizes = [lin.out_features for lin in linears]
        self.linears = linears
        kinds: dict[str, list[int]] = {}
        for i, lin in enumerate(linears):
            kinds.setdefault(
                "nvfp4" if lin.nvfp4 is not None else "fp8" if lin.fp8 is not None else "dense", []
            ).append(i)
        self.parts = []  # (indices into linears, function of x)
        for kind, idx in kinds.items():
            group = [linears[i] for i in idx]
            if kind == "dense":
                pad = -sum(self.sizes) % pad_to if len(kinds) == 1 else 0
                self.parts.append((idx, _dense_part(group, pad, trigger)))
            elif kind == "nvfp4" and _same([lin.nvfp4.decode_scale for lin in group]):
                self.parts.append((idx, _nvfp4_part(group)))
            elif kind == "fp8" and _same([lin.fp8.scale for lin in group]):
                self.parts.append((idx, _fp8_part(group)))
            else:
                self.parts.extend(([i], linears[i]) for i in idx)
        self.ordered = [i for idx, _ in self.parts for i in idx] == list(range(len(linears)))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        outs = [fn(x) for _, fn in self.parts]
        if self.ordered:
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        pieces: list[torch.Tensor | None] = [None] * len(self.linears)
        for (idx, _), out in zip(self.parts, outs, strict=True):
            for i, piece in zip(idx, out.split([self.sizes[i] for i in idx], dim=-1), strict=True):
                pieces[i] = piece
        return torch.cat(pieces, dim=-1)


def _same(scales: list[torch.Tensor]) -> bool:
    return all(torch.equal(scales[0], s) for s in scales[1:])


def _concat_into(modules: list, name: str, pad: int = 0) -> torch.Tensor:
    """Concatenate ``module.<name>`` along dim 0 (then ``pad`` zero rows) and make each module's tensor a
    view of the result."""
    parts = [getattr(m, name).data for m in modules]
    whole = torch.cat(parts + [parts[0].new_zeros(pad, *parts[0].shape[1:])] * bool(pad))
    start = 0
    for m in modules:
        n = getattr(m, name).shape[0]
        view = whole[start : start + n]
        param = isinstance(getattr(m, name), nn.Parameter)
        setattr(m, name, nn.Parameter(view, requires_grad=False) if param else view)
        start += n
    return whole


def _few_rows_kernel(x: torch.Tensor) -> bool:
    """Whether bf16 projections of 2-4 rows take the grouped kernel (on the GPU; tests switch it on for
    the interpreter)."""
    return x.is_cuda


def _dense_part(linears: list, pad: int = 0, trigger: str = ""):
    from fp4moe.kernels.nvfp4_gemm import bf16_linear
    from fp4moe.kernels.nvfp4_gemv import bf16_gemv, gemv_fits

    weight = _concat_into(linears, "weight", pad)
    unpadded = weight[: weight.shape[0] - pad]

    def run(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if (
            2 <= rows <= 4
            and weight.dtype == torch.bfloat16
            and x.shape[-1] % 16 == 0
            and _few_rows_kernel(x)
        ):
            # 2-4 rows (a batch-1 speculative verification, small batches): cuBLAS was up to 5x slower than
            # at 1 row on the unpadded router GEMM, and is 1.1x slower on the padded one (H200,
            # benchmarks/tune_dense.py); the grouped kernel is not
            return bf16_linear(x.reshape(rows, -1), weight).view(*x.shape[:-1], -1)
        if rows == 1 and gemv_fits(x, unpadded):  # our GEMV (router group 3.6 us against cuBLAS's 4.6)
            return bf16_gemv(x.reshape(1, -1), unpadded, trigger=trigger).view(*x.shape[:-1], -1)
        return F.linear(x, unpadded if rows == 1 else weight)  # (one row: unpadded, as cuBLAS was faster)

    return run


def _nvfp4_part(linears: list):
    from fp4moe.kernels.nvfp4_gemm import nvfp4_linear

    qs = [lin.nvfp4 for lin in linears]
    packed, scales, decode = _concat_into(qs, "packed"), _concat_into(qs, "block_scales"), qs[0].decode_scale
    return lambda x: nvfp4_linear(x.reshape(-1, x.shape[-1]), packed, scales, decode).view(*x.shape[:-1], -1)


def _fp8_part(linears: list):
    from fp4moe.kernels.nvfp4_gemm import fp8_linear

    qs = [lin.fp8 for lin in linears]
    weight, scale = _concat_into(qs, "weight"), qs[0].scale
    return lambda x: fp8_linear(x.reshape(-1, x.shape[-1]), weight, scale).view(*x.shape[:-1], -1)


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
            num_pages = self._pages_from_memory(len(kv_layers), page_size, gpu_memory_utilization)
        self.kv = PagedKVCache(
            kv_layers, num_pages + 1, page_size, a.num_kv_heads, a.head_dim, max_num_seqs + 1, max_model_len,
            kv_cache_dtype, dtype, device,
        )  # fmt: skip
        self.kv.reserve(
            self.scratch, 2 * spec_tokens + 2
        )  # padded rows of a speculative round write here too
        if model.rotary is None:
            model.rotary = Rotary(a.rope, device)
        self._fuse()
        self.cuda_graphs = cuda_graphs
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.buf_ids = torch.zeros(max_num_seqs, dtype=torch.long, device=device)
        self.buf_pos = torch.zeros(max_num_seqs, dtype=torch.int32, device=device)
        self.buf_slots = torch.full((max_num_seqs,), self.scratch, dtype=torch.int32, device=device)
        self.buf_rope = torch.zeros(
            3, max_num_seqs, dtype=torch.long, device=device
        )  # rotary (mRoPE) positions
        self.last_hidden: torch.Tensor | None = None  # the last decode step's final-normed hidden states
        self.overlap_shared = True  # the shared expert's down GEMM on a side stream (``_moe``)
        self.fused_prefill = True  # prefill chunks with the fused pieces (``hidden_states``)
        self._side: torch.cuda.Stream | None = None
        # fresh prompts through captured graphs (``prompt_forward``): inputs, and the graphs by padded length
        # (rows of one graph at most: its inputs below are sized once, before any capture reads them)
        self.max_prompt_graph_tokens = top = prefill_graph_tokens
        self.use_prompt_graphs = True  # off: fresh prompts take the module path too (the warm-up compiles it)
        self.prompt_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._prompt_pool = None
        self.prompt_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.prompt_rows = torch.arange(top, device=device)
        self.prompt_len = torch.zeros(PROMPT_GRAPH_SEQS[-1], dtype=torch.long, device=device)
        self.prompt_slot = torch.full((PROMPT_GRAPH_SEQS[-1],), self.scratch, dtype=torch.long, device=device)

    # ---- set-up -------------------------------------------------------------------------------------

    def _pages_from_memory(self, kv_layers: int, page_size: int, utilization: float) -> int:
        """Pages that fit in utilization x total memory after the weights, states (allocated already) and an
        activation reserve (a prefill chunk of 8K tokens measured ~3 GB at full size; 4 GiB kept)."""
        from fp4moe.engine.memory import cache_budget_tokens, kv_bytes_per_token

        free, total = torch.cuda.mem_get_info(self.device)
        per_token = kv_bytes_per_token(self.args, self.kv_cache_dtype, self.model.embed_tokens.dtype)
        per_token = per_token * kv_layers // len(self.attn_ids)  # the MTP layer keeps keys/values too
        tokens = cache_budget_tokens(
            total, total - free + (4 << 30), utilization, per_token, 0, self.max_num_seqs
        )
        want = (self.max_num_seqs * -(-self.max_model_len // page_size)) + 1
        if tokens < 16 * page_size:
            raise ValueError(
                f"not enough GPU memory for a KV cache: {tokens * per_token / 2**30:.1f} GiB left"
            )
        return int(min(want, tokens // page_size))

    def _fuse(self) -> None:
        self.fused = []  # (mixer projections, router + shared expert) per layer
        for layer in self.model.layers:
            if layer.is_attention:
                m = layer.self_attn
                mix = FusedLinear([m.q_proj, m.k_proj, m.v_proj])
            else:
                m = layer.linear_attn
                # the Gated DeltaNet kernel behind it loads its states while the projection runs
                mix = FusedLinear([m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a], trigger="start")
            moe = layer.mlp
            router = FusedLinear(
                [moe.gate, moe.shared_gate_proj, moe.shared_up_proj, moe.shared_expert_gate], pad_to=8
            )
            self.fused.append((mix, router))
        if self.spec_tokens:  # the MTP head's layer (last in the list)
            layer = self.model.mtp.layer
            m, moe = layer.self_attn, layer.mlp
            self.fused.append((
                FusedLinear([m.q_proj, m.k_proj, m.v_proj]),
                FusedLinear([moe.gate, moe.shared_gate_proj, moe.shared_up_proj, moe.shared_expert_gate], pad_to=8),
            ))  # fmt: skip

    def new_caches(self):
        return self.kv, self.states

    def reset_kv_scales(self) -> None:
        if self.kv.fp8:
            self.kv.scales.clear()  # graphs read the scale tensor, which the first real prefill fills in place

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
        # an fp8 cache's scales are set by the first prefill that writes each layer (the module path)
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
        """The module path's layers (their mixers run as modules: chunked rule, flash attention) with the
        decode step's fused pieces between them: residual add + norm in one kernel, the fused router +
        shared-expert GEMM, the router kernel, the grouped experts and the combine + next norm (``_moe``).
        The module MoE's torch routing, pair sum and shared-expert elementwise ops took ~25 ms of an 8K
        prefill on the H200. Same roundings as the modules, but for the sum over each token's experts:
        fp32, rounded once (the CPU modules add per expert in bf16, as transformers does). ``fused_prefill``
        False: the modules throughout."""
        if not self.fused_prefill:
            return super().hidden_states(ids, positions, ctx, embeds)
        h = self.model.embed(ids) if embeds is None else embeds
        cos, sin = self.model.rotary.cos_sin(positions, h.dtype)

        def mixer(i, layer, x):
            return layer.self_attn(x, cos, sin, ctx) if layer.is_attention else layer.linear_attn(x, ctx)

        return self._layers(h, mixer)[1]

    def _layers(self, h: torch.Tensor, mixer) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer walk every fused path shares: residual add + norm in one kernel, ``mixer(i, layer, x)``
        (attention or Gated DeltaNet, as the path runs them), the fused MoE and the next layer's norm
        (``_moe``) -> (residual stream, final-normed hidden) [rows, H] from the embeddings ``h``."""
        from fp4moe.kernels import norm

        a, layers = self.args, self.model.layers
        _, x = norm.add_rms_norm(h, None, layers[0].input_layernorm.weight, a.eps)
        for i, layer in enumerate(layers):
            out = mixer(i, layer, x)
            h, x = norm.add_rms_norm(h, out, layer.post_attention_layernorm.weight, a.eps)
            next_w = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else self.model.norm.weight
            h, x = self._moe(layer.mlp, self.fused[i][1], h, x, next_w)
        return h, x

    # ---- fresh prompts through graphs ---------------------------------------------------------------

    @torch.no_grad()
    def forward(self, batch: list[tuple[Sequence, int]], kv, states):
        """As ``ModelRunner.forward``; the step's fresh text prompts (or first chunks) replay a captured
        prefill graph (``prompt_forward``) instead of enqueueing the layers' kernels one by one from Python,
        and only the rest (continuing chunks, images) go through the module path."""
        groups = self._prompt_groups(batch, kv)
        if not groups:
            return super().forward(batch, kv, states)
        pieces = {}
        for group, bucket in groups:
            pieces |= dict(
                zip(group, self._run_prompt_graph([batch[i] for i in group], *bucket), strict=True)
            )
        rest = [i for i in range(len(batch)) if i not in pieces]
        if rest:
            hidden, spans = super().forward([batch[i] for i in rest], kv, states)
            pieces |= {i: hidden[a:b] for i, (a, b) in zip(rest, spans, strict=True)}
        ordered = [pieces[i] for i in range(len(batch))]
        ends = list(accumulate(len(p) for p in ordered))
        return torch.cat(ordered), [(e - len(p), e) for e, p in zip(ends, ordered, strict=True)]

    def _prompt_groups(
        self, batch: list[tuple[Sequence, int]], kv
    ) -> list[tuple[list[int], tuple[int, int]]]:
        """The step's fresh prompts (indices into ``batch``) in groups that one prefill graph each takes, each
        with its graph (``prompt_bucket``): the partition of the prompts, longest first, into consecutive
        groups with the fewest rows, counting each replay as ``REPLAY_ROWS`` more (dynamic programming over
        where the groups end). Fifteen prompts of 466-530 tokens take one 16 x 576 graph (9,216 rows; they
        took two 8 x 576 ones and a 1 x 512: 232 ms on the H200, where one replay of 9,216 rows runs at about
        20 ms + 17.5 us a row); a 20-token prompt beside a 1,000-token one joins its graph (1,004 rows of
        padding against a replay of its own: about even); a 600-token one beside a 2,000-token one does not."""
        fresh = sorted(
            (i for i, (seq, n) in enumerate(batch) if self._prompt_graph_fits(seq, n, kv)),
            key=lambda i: -batch[i][1],
        )
        fresh = [i for i in fresh if self.prompt_bucket([batch[i][1]]) is not None]
        # best[k]: (cost, rows, first index of the last group) of the first k prompts. Some best partition
        # has every group but the last full (as many prompts as its graph's sequences): the next group's first
        # prompt moves into a group with room at no cost there (it is no longer) and none in its own group
        # (one prompt fewer, its longest no longer). So groups end at full sizes, or at the last prompt.
        n = len(fresh)
        best: list[tuple[float, int, int]] = [(0.0, 0, 0)]
        for k in range(1, n + 1):
            options = []
            for size in range(1, k + 1) if k == n else (b for b in PROMPT_GRAPH_SEQS if b <= k):
                j = k - size  # the group is fresh[j:k]; its longest prompt is fresh[j]
                bucket = self._bucket(batch[fresh[j]][1], size)
                if bucket is None:
                    break  # nor will a larger group (more prompts, none shorter) fit a graph
                rows = bucket[0] * bucket[1]
                options.append((best[j][0] + rows + REPLAY_ROWS, best[j][1] + rows, j))
            best.append(min(options))  # never empty: a prompt alone has a bucket
        groups, k = [], len(fresh)
        while k:
            j = best[k][2]
            groups.append((fresh[j:k], self.prompt_bucket([batch[i][1] for i in fresh[j:k]])))
            k = j
        return groups[::-1]

    def whole_prompts(self) -> bool:
        """Fresh prompts go through graphs, their continuing chunks through the module path: split none that
        a step can take whole."""
        return self.cuda_graphs and self.use_prompt_graphs and self.fused_prefill

    def prompt_bucket(self, lens: list[int]) -> tuple[int, int] | None:
        """The graph (sequences, rows each) that takes fresh prompts of ``lens`` tokens, or None."""
        if not (self.cuda_graphs and self.use_prompt_graphs):
            return None
        return self._bucket(max(lens), len(lens))

    def _bucket(self, longest: int, count: int) -> tuple[int, int] | None:
        """``prompt_bucket`` of ``count`` prompts, the longest ``longest`` tokens (``_prompt_groups`` asks it
        for every group it weighs: bisection, not a scan)."""
        i, j = bisect_left(PROMPT_GRAPH_TOKENS, longest), bisect_left(PROMPT_GRAPH_SEQS, count)
        if i == len(PROMPT_GRAPH_TOKENS) or j == len(PROMPT_GRAPH_SEQS):
            return None
        t, b = PROMPT_GRAPH_TOKENS[i], PROMPT_GRAPH_SEQS[j]
        return None if b > self.max_num_seqs or b * t > self.max_prompt_graph_tokens else (b, t)

    def _prompt_graph_fits(self, seq: Sequence, n: int, kv) -> bool:
        return (
            kv is self.kv
            and self.fused_prefill
            and seq.num_cached == 0
            and n >= 2  # one token: the recurrent rule in fp32, as the module path takes it
            and seq.image_embeds is None
            and seq.prompt_positions is None
            # an fp8 cache's scales come from the first prefill that writes each layer (the module path)
            and (not kv.fp8 or all(layer in kv.scales for layer in self.attn_ids))
        )

    def _run_prompt_graph(self, batch: list[tuple[Sequence, int]], b: int, t: int) -> list[torch.Tensor]:
        """Replay the prefill graph of ``b`` sequences x ``t`` rows for the fresh prompts of ``batch`` ->
        each one's final-normed hidden [n, H] (views of one copy). Their pages are reserved here; the graph
        writes them and the slots' states."""
        for seq, n in batch:
            self.kv.reserve(seq.slot, n)
        if (b, t) not in self.prompt_graphs:
            self._capture_prompt(b, t)
        host = torch.zeros(b * t + 2 * b, dtype=torch.long)
        host[b * t + b :] = self.scratch  # unused sequences: no rows, the scratch slot
        for i, (seq, n) in enumerate(batch):
            host[i * t : i * t + n] = torch.tensor(seq.tokens(0, n))
            host[b * t + i], host[b * t + b + i] = n, seq.slot
        dev = upload(host, self.device)
        self.prompt_ids[: b * t].copy_(dev[: b * t])
        self.prompt_len[:b].copy_(dev[b * t : b * t + b])
        self.prompt_slot[:b].copy_(dev[b * t + b :])
        graph, hidden = self.prompt_graphs[(b, t)]
        graph.replay()
        hidden = hidden.clone()
        for seq, n in batch:
            self.kv.advance(seq.slot, n, self.attn_ids)
        return [hidden[i * t : i * t + n] for i, (_, n) in enumerate(batch)]

    def _capture_prompt(self, b: int, t: int) -> None:
        """Capture the prefill graph of ``b`` x ``t`` rows; the warm-up run and the capture have no real row
        (every length 0), so they write only the scratch slot and page."""
        self.prompt_len.zero_()
        self.prompt_slot.fill_(self.scratch)
        self.prompt_ids.zero_()
        if self._prompt_pool is None and self.device.type == "cuda":
            self._prompt_pool = torch.cuda.graph_pool_handle()
        self.prompt_graphs[(b, t)] = self.graph_of(lambda: self.prompt_forward(b, t), pool=self._prompt_pool)

    def capture_prompts(self) -> None:
        """Capture every prefill graph ahead of serving (else each is captured on first use, compiling
        kernels for its shapes on a user's request): all that ``prompt_bucket`` can choose, also the padded
        ones larger than a step's token budget (three prompts of 65 tokens in a 256-token step take 4 x 96
        rows: the GPU no-compile test met that one)."""
        for t in PROMPT_GRAPH_TOKENS:
            for b in PROMPT_GRAPH_SEQS:
                if self.prompt_bucket([t] * b) == (b, t) and (b, t) not in self.prompt_graphs:
                    self._capture_prompt(b, t)

    def prompt_forward(self, b: int, t: int) -> torch.Tensor:
        """``b`` fresh prompts (lengths ``prompt_len``, slots ``prompt_slot``, on the device), each padded to
        ``t`` rows, with static shapes and device-side indexing only (graph-capturable) -> final-normed
        hidden [b * t, H] (rows past a prompt's length are padding). The layers as ``hidden_states`` runs
        them (fused projections, fused MoE). Attention is causal within each prompt's rows, so the padding
        after a prompt changes none of its rows, and the padding's keys/values go to the scratch page; in
        the Gated DeltaNet layers the padding has decay 1 and write strength 0, so the states after a
        prompt's last row are its final ones (stored in its slot)."""
        model, dev = self.model, self.device
        flat = self.prompt_rows[: b * t]
        seq_of, pos = flat // t, flat % t
        lens = self.prompt_len[:b]
        valid = pos < lens[seq_of]
        starts = self.prompt_rows[:b] * t
        zero = torch.zeros(b, dtype=torch.long, device=dev)
        step = _Prompts(
            StepTensors(self.prompt_slot[:b], zero, starts.int(), starts + lens, seq_of.int(), zero, zero)
        )
        cos, sin = model.rotary.cos_sin(pos, model.embed_tokens.dtype)

        def mixer(i, layer, x):
            proj = self.fused[i][0](x)
            if layer.is_attention:
                return self._prompt_attention(layer.self_attn, proj, cos, sin, step, pos, valid, b)
            return self._prompt_deltanet(layer.linear_attn, proj, step, valid, b)

        return self._layers(model.embed(self.prompt_ids[: b * t]), mixer)[1]

    def _prompt_deltanet(self, m, proj, step, valid, b: int) -> torch.Tensor:
        from fp4moe.kernels.causal_conv import causal_conv_silu_varlen

        mixed, z, w, d = proj.split([m.conv_dim, m.value_size, m.num_v_heads, m.num_v_heads], dim=-1)
        beta, g = m.gates(w, d)
        beta = torch.where(valid[:, None], beta, 0)  # padding writes nothing ...
        g = torch.where(valid[:, None], g, 0)  # ... and decays nothing
        t = step.t
        conv0 = mixed.new_zeros(b, m.conv_dim, m.conv_kernel - 1)
        qkv, conv = causal_conv_silu_varlen(mixed, conv0, m.conv1d_weight, t.token_seq, t.starts, t.ends)
        core, rec = m.rule_fresh(qkv, g, beta, b)
        self.states.scatter(m.layer_id, step, conv, rec)
        return m.output(core, z)

    def _prompt_attention(self, m, proj, cos, sin, step, pos, valid, b: int) -> torch.Tensor:
        from fp4moe.layers.attention import attend_fresh

        kv, page = self.kv, self.kv.page_size
        hd, kvd = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
        q, gate, k, v = m.heads(*proj.split([2 * hd, kvd, kvd], dim=-1), cos, sin)
        slots = step.t.slots[step.t.token_seq.long()]
        # (padding rows may lie past the table's last page -- t > max_model_len -- and are replaced below)
        dest = kv.block_table[slots, (pos // page).clamp(max=kv.max_pages - 1)].long() * page + pos % page
        spare = kv.block_table[self.scratch, 0].long() * page + pos % page
        k, v = kv.store(m.layer_id, torch.where(valid, dest, spare), k, v)
        return m.output(attend_fresh(q, k, v, b), gate)

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

    def graph_of(self, fn, pool=None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Run ``fn`` once (compiles its kernels), then capture it in a CUDA graph that shares the runner's
        memory pool (or ``pool``); returns the graph and ``fn``'s output buffer."""
        fn()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        if pool is None:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            pool = self._pool
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return graph, out

    def capture(self, batch_sizes=None) -> None:
        """Capture the decode graphs ahead of serving (else each bucket is captured on first use)."""
        for b in batch_sizes or [g for g in GRAPH_BATCH_SIZES if g <= self.max_num_seqs]:
            if b not in self.graphs:
                self._capture(b)

    def decode_forward(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode step over the first ``b`` rows of the static buffers -> (logits [b, V] bf16,
        final-normed hidden [b, H])."""
        _, x = self.forward_rows(self.buf_ids[:b], self.buf_pos[:b], self.buf_slots[:b], self.buf_rope[:, :b])
        return self.model.lm_head(x), x

    def _row_geometry(self, pos: torch.Tensor, slots: torch.Tensor):
        """Block-table rows, cache rows written (slot_map) and attention lengths of rows at ``pos``."""
        kv, page = self.kv, self.kv.page_size
        table = kv.block_table.index_select(0, slots)
        slot_map = (table.gather(1, (pos // page).long().unsqueeze(1)).squeeze(1) * page + pos % page).to(
            torch.int32
        )
        return table, slot_map, pos + 1

    def forward_rows(
        self, ids, pos, slots, rope, tokens_per_seq: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The target model over rows (token ``ids`` at cache positions ``pos`` of ``slots``, rotary
        positions ``rope`` [3, rows]) -> (residual stream, final-normed hidden) [rows, H]. With
        ``tokens_per_seq`` T > 1 each sequence owns T consecutive rows at consecutive positions (a
        speculative verification): attention rows see the keys of the rows before them, the Gated DeltaNet
        kernel walks them in order and leaves its states in ``self.history`` instead of the slots."""
        from fp4moe.kernels import gdn_decode as gdn_k

        model, st = self.model, self.states
        geometry = self._row_geometry(pos, slots)
        cos, sin = model.rotary.cos_sin(rope, model.embed_tokens.dtype)

        def mixer(i, layer, x):
            proj = self.fused[i][0](x)
            if layer.is_attention:
                return self._attention(layer.self_attn, i, proj, cos, sin, geometry)
            m, gi = layer.linear_attn, st.index[i]
            core = gdn_k.gdn_decode(
                proj, m.conv1d_weight.view(m.conv_dim, -1), st.ring[gi], st.rec[gi], slots, pos,
                m.A_log, m.dt_bias, m.norm_weight, m.eps, (m.num_k_heads, m.num_v_heads, m.k_dim, m.v_dim),
                tokens_per_seq=tokens_per_seq, history=None if tokens_per_seq == 1 else self.history[gi],
            )  # fmt: skip
            return m.out_proj(core)

        return self._layers(model.embed_tokens[ids], mixer)

    def mtp_rows(self, ids, hidden, pos, slots, rope, keep=None) -> torch.Tensor:
        """The MTP head over rows: token ``ids`` after each row's target (or own) final-normed ``hidden`` at
        ``pos`` (the hidden state's position) -> the head's normed output [rows, H]; its keys/values go
        into the MTP layer's pages. ``keep`` (row indices): every row's keys/values are stored, but only
        these rows go on through the MoE and come back."""
        from fp4moe.kernels import norm

        model, mtp, a = self.model, self.model.mtp, self.args
        layer = mtp.layer
        e = mtp.pre_fc_norm_embedding(model.embed_tokens[ids])
        h = mtp.fc(torch.cat([e, mtp.pre_fc_norm_hidden(hidden)], dim=-1))
        cos, sin = model.rotary.cos_sin(rope, model.embed_tokens.dtype)
        mix, router = self.fused[-1]
        _, x = norm.add_rms_norm(h, None, layer.input_layernorm.weight, a.eps)
        out = self._attention(layer.self_attn, mtp.layer_id, mix(x), cos, sin, self._row_geometry(pos, slots))
        if keep is not None:
            h, out = h[keep], out[keep]
        h, x = norm.add_rms_norm(h, out, layer.post_attention_layernorm.weight, a.eps)
        _, x = self._moe(layer.mlp, router, h, x, mtp.norm.weight)
        return x

    def _attention(self, m, layer_id: int, proj, cos, sin, geometry) -> torch.Tensor:
        """q/k norm + rotary + cache store, paged decode attention, o_proj."""
        from fp4moe.kernels import attention as attn_k

        kv = self.kv
        table, slot_map, seq_lens = geometry
        li = kv.index[layer_id]
        dims = (m.num_heads, m.num_kv_heads, m.head_dim)
        q = attn_k.qk_norm_rope_store(
            proj, cos, sin, m.q_norm.weight, m.k_norm.weight, kv.k[li], kv.v[li], slot_map,
            kv.scale_t[li], m.q_norm.eps, dims,
        )  # fmt: skip
        core = attn_k.paged_decode_attention(
            q, proj, kv.k[li], kv.v[li], table, seq_lens, kv.scale_t[li], kv.max_len, dims
        )
        return m.o_proj(core)

    def _moe(self, moe, router, h, x, next_w) -> tuple[torch.Tensor, torch.Tensor]:
        """Router + shared expert GEMM, routing, grouped NVFP4 experts, shared down, combine + next norm."""
        from fp4moe.kernels import moe_router, norm
        from fp4moe.kernels.moe_dispatch import moe_pairs

        a = self.args
        e, k, s_inter = a.num_experts, a.top_k, a.shared_intermediate_size
        rp = router(x)
        # the expert GEMVs behind it start at once and wait (their weights depend on its output): H200, batch-1
        # step 1.6% faster (benchmarks/tune_decode.py)
        topk_ids, topk_w, shared_act = moe_router.route(rp, e, k, s_inter, trigger="start")
        side = self._side_stream(x)
        if side is None:
            routed = moe_pairs(moe.experts.kernel_weights(), x, topk_ids, topk_w)
            shared = moe.shared_down_proj(shared_act)
        else:  # the shared expert's down GEMM beside the routed experts (which leave SMs idle at small batch)
            main = torch.cuda.current_stream(x.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                shared = moe.shared_down_proj(shared_act)
            routed = moe_pairs(moe.experts.kernel_weights(), x, topk_ids, topk_w)
            main.wait_stream(side)
        return norm.moe_combine(h, routed, k, shared, rp, e + 2 * s_inter, next_w, a.eps)

    def _side_stream(self, x: torch.Tensor):
        """A second stream for work that can overlap (GPU only; captured into the graphs as a fork and a
        join); None on the CPU or with ``overlap_shared`` off."""
        if not (x.is_cuda and self.overlap_shared):
            return None
        if self._side is None:
            self._side = torch.cuda.Stream(x.device)
        return self._side


class _Prompts:
    """The step layout of graphed prompts (``StepContext``'s ``tensors`` only, for ``SlotStates.scatter``):
    each sequence's slot, rows, length, all on the device, nothing cached."""

    def __init__(self, t: StepTensors):
        self.t = t

    def tensors(self, device) -> StepTensors:
        return self.t
