"""The GPU forward of Qwen3.5-MoE: the torch model's weights (``qwen3_5_moe_model``) through fused kernels
over the engine's paged caches. Every path walks the layers alike (``layers``): residual add + norm in one
kernel, the layer's mixer as the path runs it, the fused router + shared-expert GEMM, the router kernel, the
grouped NVFP4 experts (``kernels.moe_dispatch``) with the shared expert's down projection beside them on a
side stream, and combine + next norm.

- ``rows``: one token per row at any cache position (decode, a speculative verification of T rows per
  sequence): fused projections (``layers.fused_linear``), the fused Gated DeltaNet kernel or q/k-norm-rope-
  store + split-KV paged attention; static shapes, no host syncs -- what the runner captures in CUDA graphs.
- ``prompts``: fresh prompts padded to a common length, device-side indexing only (graph-capturable):
  chunked flash-linear-attention, causal flash attention.
- ``hidden_states``: any step through the modules' own mixers (prefill chunks over cached prefixes, images)
  with the fused MoE between them.
- ``mtp_rows``: the MTP head over rows (its catch-up and drafts).

The projections sharing an input are concatenated once (``FusedLinear``: qkv|z|b|a of Gated DeltaNet, q|k|v of
attention, router|shared gate|shared up|shared gate-scalar of the MoE), the modules' own weights becoming
views into them. Reference: the torch modules (``Qwen3_5MoeModel``); ``tests/engine/test_cuda_runner.py``
compares the runner's outputs with them. The buffers, caches and graphs are the runner's
(``engine.runner.cuda_runner``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp4moe.layers.fused_linear import FusedLinear


class Qwen3_5MoeFused:
    """The fused forward over ``kv`` (paged keys/values) and ``states`` (Gated DeltaNet slots); ``history``:
    the recurrent states after each verified row of a speculative round (None without speculation);
    ``scratch``: the slot padded rows write into; ``with_mtp``: fuse the MTP head's projections too."""

    def __init__(self, model, kv, states, history, scratch: int, with_mtp: bool):
        self.model, self.args = model, model.args
        self.kv, self.states, self.history, self.scratch = kv, states, history, scratch
        self.overlap_shared = True  # the shared expert's down GEMM on a side stream (``moe``)
        self._side: torch.cuda.Stream | None = None
        self._fuse(with_mtp)

    def _fuse(self, with_mtp: bool) -> None:
        from fp4moe.kernels.moe_dispatch import tile_step
        from fp4moe.layers.moe import RoutedExperts

        for experts in self.model.modules():  # NVFP4 experts in the GPU kernels' order (``expert_layout``)
            quantized = isinstance(experts, RoutedExperts) and experts.quantized
            step = tile_step(experts.kernel_weights()) if quantized else 0
            if step:  # (row-major NVFP4 experts where the tensor-core GEMVs run)
                experts.tile_for_kernels(step)
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
        if with_mtp:  # the MTP head's layer (last in the list)
            layer = self.model.mtp.layer
            m, moe = layer.self_attn, layer.mlp
            self.fused.append((
                FusedLinear([m.q_proj, m.k_proj, m.v_proj]),
                FusedLinear([moe.gate, moe.shared_gate_proj, moe.shared_up_proj, moe.shared_expert_gate], pad_to=8),
            ))  # fmt: skip

    def layers(self, h: torch.Tensor, mixer) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer walk every fused path shares: residual add + norm in one kernel, ``mixer(i, layer, x)``
        (attention or Gated DeltaNet, as the path runs them), the fused MoE and the next layer's norm
        (``moe``) -> (residual stream, final-normed hidden) [rows, H] from the embeddings ``h``."""
        from fp4moe.kernels import moe_dispatch, norm

        a, layers = self.args, self.model.layers
        _, x = norm.add_rms_norm(h, None, layers[0].input_layernorm.weight, a.eps)
        # the post-attention norm also writes the MoE input in the Hopper expert GEMMs' K order where they will
        # run (the same answer for every layer: their experts share one shape)
        k_order = moe_dispatch.WGMMA_PREFILL and moe_dispatch.wants_k_order(
            layers[0].mlp.experts.kernel_weights(), h, a.top_k
        )
        for i, layer in enumerate(layers):
            out = mixer(i, layer, x)
            x_k = torch.empty_like(h) if k_order else None
            h, x = norm.add_rms_norm(h, out, layer.post_attention_layernorm.weight, a.eps, x_k=x_k)
            next_w = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else self.model.norm.weight
            h, x = self.moe(layer.mlp, self.fused[i][1], h, x, next_w, x_k)
        return h, x

    def hidden_states(self, ids, positions, ctx, embeds=None) -> torch.Tensor:
        """Any step's rows through the modules' mixers (chunked rule, flash attention over the step's
        context ``ctx``) with the fused pieces between them -> final-normed hidden [rows, H]. The module
        MoE's torch routing, pair sum and shared-expert elementwise ops took ~25 ms of an 8K prefill on the
        H200. The modules' roundings, but for the sum over each token's experts (fp32, rounded once; the CPU
        modules add per expert in bf16, as transformers does) and the mixers' projections, one GEMM each as in
        the prefill graphs (another cuBLAS algorithm than the modules' separate GEMMs may pick)."""
        h = self.model.embed(ids) if embeds is None else embeds
        cos, sin = self.model.rotary.cos_sin(positions, h.dtype)

        # the mixer's projections as one GEMM (``fused``), as the prefill graphs run them
        def mixer(i, layer, x):
            m = layer.self_attn if layer.is_attention else layer.linear_attn
            proj = self.fused[i][0](x).split(m.proj_sizes(), dim=-1)
            return m.mix(*proj, cos, sin, ctx) if layer.is_attention else m.mix(*proj, ctx)

        return self.layers(h, mixer)[1]

    def prompts(self, ids, lens, slots, arange, b: int, t: int, cached=None) -> torch.Tensor:
        """``b`` prompt chunks (token ``ids`` [b * t], lengths ``lens`` [b], slots ``slots`` [b], on the device;
        ``arange``: 0.. at least b * t), each padded to ``t`` rows, with static shapes and device-side
        indexing only (graph-capturable) -> final-normed hidden [b * t, H] (rows past a chunk's length are
        padding). ``cached`` None: fresh prompts; else [b] the tokens each sequence has cached, which its
        chunk continues (a prompt longer than a step, a prefix-cache hit).

        Fresh prompts attend causally within their own rows (flash attention), so the padding after a prompt
        changes none of its rows; a continuing chunk's rows attend over the sequence's pages through the
        paged prefill kernel, which skips the padding. The padding's keys/values go to the scratch page. In
        the Gated DeltaNet layers the padding has decay 1 and write strength 0, so the states after a chunk's
        last row are its final ones (stored in its slot; a continuing chunk starts from the slot's)."""
        model = self.model
        flat = arange[: b * t]
        seq_of, off = flat // t, flat % t
        valid = off < lens[seq_of]
        starts = arange[:b] * t
        first = torch.zeros(b, dtype=torch.long, device=ids.device) if cached is None else cached
        pos = off if cached is None else first[seq_of] + off
        step = _PromptLayout(slots, first, starts.int(), starts + lens, seq_of.int())
        cos, sin = model.rotary.cos_sin(pos, model.embed_tokens.dtype)
        blocks = None if cached is None else self._chunk_blocks(arange, b, t)

        def mixer(i, layer, x):
            proj = self.fused[i][0](x)
            if layer.is_attention:
                return self._prompt_attention(layer.self_attn, proj, cos, sin, step, pos, valid, b, blocks)
            return self._prompt_deltanet(layer.linear_attn, proj, step, valid, b, cached is not None)

        return self.layers(model.embed(ids), mixer)[1]

    def _chunk_blocks(self, arange, b: int, t: int) -> torch.Tensor:
        """The paged prefill kernel's programs for ``b`` chunks of ``t`` rows: (sequence, block) [b * nb, 2]."""
        from fp4moe.kernels.attention import prefill_block_tokens

        a = self.args
        nb = -(-t // prefill_block_tokens(a.num_heads // a.num_kv_heads, self.kv.fp8))
        return torch.stack([arange[:b].repeat_interleave(nb), arange[:nb].repeat(b)], dim=1)

    def _prompt_deltanet(self, m, proj, step, valid, b: int, continuing: bool) -> torch.Tensor:
        from fp4moe.kernels.causal_conv import causal_conv_silu_varlen

        mixed, z, w, d = proj.split(m.proj_sizes(), dim=-1)
        beta, g = m.gates(w, d)
        beta = torch.where(valid[:, None], beta, 0)  # padding writes nothing ...
        g = torch.where(valid[:, None], g, 0)  # ... and decays nothing
        if continuing:  # the slots' states (zeros for the padded sequences: cached 0)
            conv0, rec0 = self.states.gather(m.layer_id, step)
        else:
            conv0, rec0 = mixed.new_zeros(b, m.conv_dim, m.conv_kernel - 1), None
        norm = m.conv_norm(mixed)  # q and k L2-normalised in the conv kernel, not by fla
        qkv, conv = causal_conv_silu_varlen(
            mixed, conv0, m.conv1d_weight, step.token_seq, step.starts, step.ends, m.parts(), norm
        )
        core, rec = m.rule_fresh(qkv, g, beta, b, rec0, normed=bool(norm))
        self.states.scatter(m.layer_id, step, conv, rec)
        return m.output(core, z)

    def _prompt_attention(self, m, proj, cos, sin, step, pos, valid, b: int, blocks=None) -> torch.Tensor:
        from fp4moe.layers.attention import attend_fresh

        kv, page = self.kv, self.kv.page_size
        q, gate, k, v = m.heads(*proj.split(m.proj_sizes(), dim=-1), cos, sin)
        slots = step.slots[step.token_seq.long()]
        # (padding rows may lie past the table's last page -- t > max_model_len -- and are replaced below)
        dest = kv.block_table[slots, (pos // page).clamp(max=kv.max_pages - 1)].long() * page + pos % page
        spare = kv.block_table[self.scratch, 0].long() * page + pos % page
        k, v = kv.store(m.layer_id, torch.where(valid, dest, spare), k, v)
        if blocks is None:
            return m.output(attend_fresh(q, k, v, b), gate)
        from fp4moe.kernels.attention import paged_prefill_attention

        li = kv.index[m.layer_id]
        out = torch.zeros_like(q)  # the padding's rows stay zero (the kernel writes real rows only)
        core = paged_prefill_attention(
            q.contiguous(), kv.k[li], kv.v[li], kv.block_table, step, blocks, kv.scale_t[li],
            (m.num_heads, m.num_kv_heads, m.head_dim), out=out,
        )  # fmt: skip
        return m.output(core, gate)

    def row_geometry(self, pos: torch.Tensor, slots: torch.Tensor):
        """Block-table rows, cache rows written (slot_map) and attention lengths of rows at ``pos``."""
        kv, page = self.kv, self.kv.page_size
        table = kv.block_table.index_select(0, slots)
        slot_map = (table.gather(1, (pos // page).long().unsqueeze(1)).squeeze(1) * page + pos % page).to(
            torch.int32
        )
        return table, slot_map, pos + 1

    def rows(self, ids, pos, slots, rope, tokens_per_seq: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """The target model over rows (token ``ids`` at cache positions ``pos`` of ``slots``, rotary
        positions ``rope`` [3, rows]) -> (residual stream, final-normed hidden) [rows, H]. With
        ``tokens_per_seq`` T > 1 each sequence owns T consecutive rows at consecutive positions (a
        speculative verification): attention rows see the keys of the rows before them, the Gated DeltaNet
        kernel walks them in order and leaves its states in ``history`` instead of the slots."""
        from fp4moe.kernels import gdn_decode as gdn_k

        model, st = self.model, self.states
        geometry = self.row_geometry(pos, slots)
        cos, sin = model.rotary.cos_sin(rope, model.embed_tokens.dtype)

        def mixer(i, layer, x):
            proj = self.fused[i][0](x)
            if layer.is_attention:
                return self.attention(layer.self_attn, i, proj, cos, sin, geometry)
            m, gi = layer.linear_attn, st.index[i]
            core = gdn_k.gdn_decode(
                proj, m.conv1d_weight.view(m.conv_dim, -1), st.ring[gi], st.rec[gi], slots, pos,
                m.A_log, m.dt_bias, m.norm_weight, m.eps, (m.num_k_heads, m.num_v_heads, m.k_dim, m.v_dim),
                tokens_per_seq=tokens_per_seq, history=None if tokens_per_seq == 1 else self.history[gi],
            )  # fmt: skip
            return m.out_proj(core)

        return self.layers(model.embed_tokens[ids], mixer)

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
        out = self.attention(layer.self_attn, mtp.layer_id, mix(x), cos, sin, self.row_geometry(pos, slots))
        if keep is not None:
            h, out = h[keep], out[keep]
        h, x = norm.add_rms_norm(h, out, layer.post_attention_layernorm.weight, a.eps)
        _, x = self.moe(layer.mlp, router, h, x, mtp.norm.weight)
        return x

    def attention(self, m, layer_id: int, proj, cos, sin, geometry) -> torch.Tensor:
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

    def warm_decode_attention(self) -> None:
        """Compiles ``attention``'s paged decode kernels for every count of splits a step can have (it follows
        the step's rows: ``attention.warm_decode_merge``), from a real projection row (its layout is part of
        the kernel's variant)."""
        from fp4moe.kernels import attention as attn_k

        i = next((i for i, layer in enumerate(self.model.layers) if layer.is_attention), None)
        if i is None:
            return
        m = self.model.layers[i].self_attn
        table = self.model.embed_tokens
        x = torch.zeros(1, self.args.hidden_size, dtype=table.dtype, device=table.device)
        attn_k.warm_decode_merge(self.fused[i][0](x), (m.num_heads, m.num_kv_heads, m.head_dim))

    def moe(self, moe, router, h, x, next_w, x_k=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Router + shared expert GEMM, routing, grouped NVFP4 experts, shared down, combine + next norm (``x_k``:
        x in the K order of the Hopper expert GEMMs, ``moe_dispatch.wants_k_order``)."""
        from fp4moe.kernels import moe_router, norm
        from fp4moe.kernels.moe_dispatch import moe_pairs

        a = self.args
        e, k, s_inter = a.num_experts, a.top_k, a.shared_intermediate_size
        rp = router(x)
        # the expert GEMVs behind it start at once and wait (their weights depend on its output): H200, batch-1
        # step 1.6% faster (benchmarks/tune/tune_decode.py)
        topk_ids, topk_w, shared_act = moe_router.route(rp, e, k, s_inter, trigger="start")
        side = self.side_stream(x)
        if side is None:
            routed = moe_pairs(moe.experts.kernel_weights(), x, topk_ids, topk_w, x_k)
            shared = moe.shared_down_proj(shared_act)
        else:  # the shared expert's down GEMM beside the routed experts (which leave SMs idle at small batch)
            main = torch.cuda.current_stream(x.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                shared = moe.shared_down_proj(shared_act)
            try:
                routed = moe_pairs(moe.experts.kernel_weights(), x, topk_ids, topk_w, x_k)
            finally:  # joined also when the experts raise (a capture stopped for a compile ends cleanly)
                main.wait_stream(side)
        return norm.moe_combine(h, routed, k, shared, rp, e + 2 * s_inter, next_w, a.eps)

    def side_stream(self, x: torch.Tensor):
        """A second stream for work that can overlap (GPU only; captured into the graphs as a fork and a
        join); None on the CPU or with ``overlap_shared`` off."""
        if not (x.is_cuda and self.overlap_shared):
            return None
        if self._side is None:
            self._side = torch.cuda.Stream(x.device)
        return self._side


@dataclass
class _PromptLayout:
    """The step layout of graphed prompts, as the Gated DeltaNet states' ``scatter`` and the layers read a
    step's (``engine.reference.context.StepTensors``' fields): each sequence's slot, cached tokens, first row
    and end, and each row's sequence -- all on the device."""

    slots: torch.Tensor
    cached: torch.Tensor
    starts: torch.Tensor
    ends: torch.Tensor
    token_seq: torch.Tensor

    def tensors(self, device) -> _PromptLayout:
        return self
