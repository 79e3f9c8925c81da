"""The paged attention kernels (decode, the cache append, prefill over the cached prefix; bf16 and fp8 pages)
against the torch layer attending over each whole sequence. Tolerances (kernel_refs.py): relative L2 error
2e-2 for bf16 outputs; integer outputs exact."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_refs import BF16, DEV, RTOL, rel  # noqa: E402

from fp4moe.engine.reference.cache import DeltaNetStates, KVCache  # noqa: E402
from fp4moe.engine.reference.context import StepContext  # noqa: E402
from fp4moe.kernels import attention as attn_k  # noqa: E402
from fp4moe.kernels import gpu_arch  # noqa: E402
from fp4moe.layers.attention import GatedAttention  # noqa: E402
from fp4moe.layers.rope import RopeConfig, Rotary  # noqa: E402


def _attention_layer(gen, h=4, hkv=2, d=32, hidden=64):
    layer = GatedAttention(hidden, h, hkv, d, 1e-6, layer_id=0)
    for p in layer.parameters():
        p.data = (torch.randn(p.shape, generator=gen) * 0.2).to(BF16)
    return layer.to(DEV)


def _scales(*layers: int, k: float = 0.012, v: float = 0.009) -> dict:
    """Fixed fp8 k/v scales (an fp8 cache's are set before its first write: ``engine.loading.kv_scales``); about
    the amax / 448 of these tests' unit-normal keys and values."""
    return {i: (torch.tensor(k, device=DEV), torch.tensor(v, device=DEV)) for i in layers}


def _by_bits(kv_dtype: str, monkeypatch) -> str:
    """kv_dtype "fp8-bits": an fp8 cache with e4m3 converted by bits (Ampere's path, ``gpu_arch``)."""
    if kv_dtype == "fp8-bits":
        monkeypatch.setattr(gpu_arch, "SOFT_FP8", True)
        return "fp8"
    return kv_dtype


@pytest.mark.parametrize("kv_dtype,max_len", [("auto", 128), ("fp8", 128), ("fp8-bits", 128), ("auto", 96)])
def test_paged_attention_matches_the_layer(kv_dtype, max_len, monkeypatch):
    """Decode attention over pages against the layer, in 4 splits of 32 tokens (3 at ``max_len`` 96: the
    merge's width, a power of two, wider than its splits)."""
    kv_dtype = _by_bits(kv_dtype, monkeypatch)
    gen = torch.Generator().manual_seed(6)
    layer = _attention_layer(gen)
    h, hkv, d, page = 4, 2, 32, 16
    rope = Rotary(RopeConfig(head_dim=d, mrope_section=(2, 1, 1)), DEV)
    lengths = [1, 37, 80]  # prompt lengths; then one decode step each
    kv = KVCache(kv_dtype, _scales(0, k=0.02, v=0.03))  # this layer's values reach ~6
    states = DeltaNetStates(8, 4, 1, 4, 4, BF16, DEV)
    cache_dtype = torch.float8_e4m3fn if kv_dtype == "fp8" else BF16
    pages = 24
    k_cache = torch.randn(pages, page, hkv, d).to(cache_dtype).to(DEV)
    v_cache = torch.randn(pages, page, hkv, d).to(cache_dtype).to(DEV)
    perm = torch.randperm(pages, generator=gen)
    table = torch.zeros(len(lengths), 8, dtype=torch.int32)
    used = 0
    for s, n in enumerate(lengths):
        need = -(-(n + 1) // page)
        table[s, :need] = perm[used : used + need]
        used += need
    table = table.to(DEV)
    w_qkv = torch.cat([layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight])
    kv_scales = torch.ones(2, device=DEV)

    def slot_map(s, positions):
        return (table[s, positions // page].long() * page + positions % page).to(torch.int32)

    for s, n in enumerate(lengths):  # prefill: reference forward; kernel writes the same keys/values
        x = torch.randn(n, 64, generator=gen).to(BF16).to(DEV)
        pos = torch.arange(n, device=DEV)
        cos, sin = rope.cos_sin(pos, BF16)
        layer(x, cos, sin, StepContext([n], [0], [s], kv, states))
        if kv_dtype == "fp8":
            kv_scales = torch.stack(kv.scales[0]).float().to(DEV)
        attn_k.qk_norm_rope_store(
            x @ w_qkv.T, cos, sin, layer.q_norm.weight, layer.k_norm.weight, k_cache, v_cache,
            slot_map(s, pos), kv_scales, 1e-6, (h, hkv, d),
        )  # fmt: skip
    x = torch.randn(len(lengths), 64, generator=gen).to(BF16).to(DEV)
    pos = torch.tensor(lengths, device=DEV)
    cos, sin = rope.cos_sin(pos, BF16)
    ref = layer(x, cos, sin, StepContext([1] * len(lengths), lengths, list(range(len(lengths))), kv, states))
    qkv = x @ w_qkv.T
    slots = torch.cat([slot_map(s, pos[s : s + 1]) for s in range(len(lengths))])
    q = attn_k.qk_norm_rope_store(
        qkv,
        cos,
        sin,
        layer.q_norm.weight,
        layer.k_norm.weight,
        k_cache,
        v_cache,
        slots,
        kv_scales,
        1e-6,
        (h, hkv, d),
    )
    out = attn_k.paged_decode_attention(
        q,
        qkv,
        k_cache,
        v_cache,
        table,
        (pos + 1).to(torch.int32),
        kv_scales,
        max_len=max_len,
        dims=(h, hkv, d),
        min_split=32,
        target_programs=264,  # several splits of 32 tokens, as on the GPU (the interpreter's default: one)
    )
    assert rel(layer.o_proj(out), ref) < RTOL


@pytest.mark.parametrize("dtype", ["auto", "fp8"])
def test_paged_append_step_is_append_per_sequence(dtype):
    """A step's keys/values stored at once (one scatter, the step's device layout) against ``append`` one
    sequence at a time: the same pages, lengths and returned k/v (exact: copies, and the same fp8 rounding
    with the layer's fixed scales), fresh prompts and continuing chunks mixed."""
    from fp4moe.engine.runner.paged_cache import PagedKVCache

    gen = torch.Generator().manual_seed(15)
    caches = [PagedKVCache([3], 64, 4, 2, 8, 6, 64, dtype, BF16, DEV) for _ in range(2)]
    for cache in caches:
        cache.set_scales(_scales(3))
    history = {5: 6, 1: 3}  # slot -> tokens already cached (the rest are fresh)
    for slot, n in history.items():
        k, v = (torch.randn(n, 2, 8, generator=gen).to(BF16).to(DEV) for _ in range(2))
        for cache in caches:
            cache.append(3, slot, k, v)
    slots, lengths = [0, 5, 2, 1], [7, 2, 1, 5]
    cached = [history.get(s, 0) for s in slots]
    k, v = (torch.randn(sum(lengths), 2, 8, generator=gen).to(BF16).to(DEV) for _ in range(2))
    ctx = StepContext(lengths, cached, slots, caches[0], None)
    got = caches[0].append_step(3, ctx, k, v)
    want = [caches[1].append(3, s, k[a:b], v[a:b]) for s, (a, b) in zip(slots, ctx.spans(), strict=True)]
    for (gk, gv), (wk, wv) in zip(got, want, strict=True):
        assert torch.equal(gk.cpu(), wk.cpu()) and torch.equal(gv.cpu(), wv.cpu())
    for slot, n, m in zip(slots, cached, lengths, strict=True):
        assert caches[0].length(3, slot) == caches[1].length(3, slot) == n + m
        rows = [c.rows(slot, 0, n + m) for c in caches]
        for a, b in ((caches[0].k, caches[1].k), (caches[0].v, caches[1].v)):
            flat = (a.shape[0], -1, *a.shape[3:])
            assert torch.equal(a.view(flat)[:, rows[0]].cpu().float(), b.view(flat)[:, rows[1]].cpu().float())


@pytest.mark.parametrize("dtype", ["auto", "fp8", "fp8-bits"])
def test_paged_prefill_attention_is_attend_over_each_whole_cache(dtype, monkeypatch):
    """The paged cache's ``attend_step`` for a step with cached tokens (the paged prefill kernel over every
    row) against the CPU cache's (``attend`` over each sequence's whole k/v, causal from its cached length):
    continuing chunks longer than a program's tokens, a prefix longer than a key tile and spread over pages
    of 4 (tiles cross pages), single-row decodes and a fresh prompt in the same step, GQA groups of 4.
    Relative L2 < 2e-2 per sequence (bf16 probabilities into the value dot, fp32 softmax); the same pages
    and lengths as ``append`` would leave."""
    from fp4moe.engine.runner.paged_cache import PagedKVCache

    dtype = _by_bits(dtype, monkeypatch)
    gen = torch.Generator().manual_seed(16)
    h, hkv, d = 8, 2, 32
    paged = PagedKVCache([3], 256, 4, hkv, d, 6, 512, dtype, BF16, DEV)
    paged.set_scales(_scales(3))
    cpu = KVCache(dtype, {3: tuple(s.cpu() for s in _scales(3)[3])})
    history = {5: 130, 1: 3, 4: 70}  # slot -> tokens already cached
    for slot, n in history.items():
        k, v = (torch.randn(n, hkv, d, generator=gen).to(BF16) for _ in range(2))
        paged.append(3, slot, k.to(DEV), v.to(DEV))
        cpu.append(3, slot, k, v)
    slots, lengths = [0, 5, 1, 4], [9, 37, 1, 1]
    cached = [history.get(s, 0) for s in slots]
    q = torch.randn(sum(lengths), h, d, generator=gen).to(BF16)
    k, v = (torch.randn(sum(lengths), hkv, d, generator=gen).to(BF16) for _ in range(2))
    got = paged.attend_step(
        3, StepContext(lengths, cached, slots, paged, None), q.to(DEV), k.to(DEV), v.to(DEV)
    )
    ctx = StepContext(lengths, cached, slots, cpu, None)
    want = cpu.attend_step(3, ctx, q, k, v)
    for i, (a, b) in enumerate(ctx.spans()):
        assert rel(got[a:b].cpu(), want[a:b]) < RTOL, i
    for slot, n, m in zip(slots, cached, lengths, strict=True):
        assert paged.length(3, slot) == cpu.length(3, slot) == n + m


def test_every_step_merges_its_splits_at_a_warmed_width():
    """The decode split count follows the step's rows and the cache length; the merge kernel compiles one
    variant per power-of-two width, and the warm-up compiles each of ``MERGE_WIDTHS``. Every row count a
    step can have (up to 64 sequences x 3 rows of a speculative round, and past it) at the cache lengths a
    server uses lands on one of them, with at most ``MAX_SPLITS`` splits."""
    from fp4moe.kernels import next_pow2

    for max_len in (1024, 8192, 16384, 65536, 262144, 524288):
        for rows in range(1, 600):
            split = attn_k.split_len_for(max_len, 16, rows * 2, target_programs=264)
            nsplit = -(-max_len // split)
            assert 1 <= nsplit <= attn_k.MAX_SPLITS and next_pow2(nsplit) in attn_k.MERGE_WIDTHS, (
                max_len,
                rows,
            )
    # and the warm-up launches the merge at every width (tiny heads: on the CPU under the interpreter)
    attn_k.warm_decode_merge(torch.zeros(2, 2 * 4 * 32 + 2 * 2 * 32, dtype=BF16, device=DEV), (4, 2, 32))


@pytest.mark.gpu
def test_decode_attention_compiles_nothing_new_after_its_warm_up():
    """After ``warm_decode_merge`` and one decode call, paged decode attention over any number of rows
    compiles no Triton kernel (a served step of 45 rows -- 15 sequences' speculative rounds -- once waited
    1.1 s for the compiler on the H200, issue 20)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from fp4moe.kernels import compiles

    compiles.watch()
    dev, h, hkv, d, page, max_len = torch.device("cuda"), 16, 2, 256, 16, 8192
    pages = max_len // page
    k_cache = torch.randn(pages, page, hkv, d, device=dev).to(torch.float8_e4m3fn)
    v_cache = torch.randn(pages, page, hkv, d, device=dev).to(torch.float8_e4m3fn)
    scales = torch.ones(2, device=dev)
    rows_max = 200
    table = torch.arange(pages, device=dev, dtype=torch.int32).repeat(rows_max, 1)
    qkv_all = torch.randn(rows_max, 2 * h * d + 2 * hkv * d, device=dev, dtype=torch.bfloat16)

    def step(rows: int) -> torch.Tensor:
        q = torch.randn(rows, h, d, device=dev, dtype=torch.bfloat16)
        lens = torch.randint(1, max_len, (rows,), device=dev, dtype=torch.int32)
        return attn_k.paged_decode_attention(
            q, qkv_all[:rows], k_cache, v_cache, table[:rows], lens, scales, max_len, (h, hkv, d)
        )

    attn_k.warm_decode_merge(qkv_all, (h, hkv, d))
    step(1)
    torch.cuda.synchronize()
    compiles.mark()
    for rows in range(2, rows_max + 1):
        assert torch.isfinite(step(rows)).all()
    assert compiles.after_mark() == {}


def test_output_gate_rounds_where_torch_does():
    """The prefill's output gate: the attention output times sigmoid of the gate read out of q_proj's
    query/gate rows, -> [T, H * D]. Against float64 with the same two roundings to bf16 (the sigmoid, then the
    product): bf16 x bf16 is exact in fp32, so only the sigmoid's last fp32 bit can tip a rounding -- at most a
    few elements, by one bf16 step; torch's own path (sigmoid and product in bf16) within RTOL."""
    gen = torch.Generator().manual_seed(11)
    t, h, d = 37, 4, 64
    q_gate = (torch.randn(t, h, 2 * d, generator=gen) * 3).to(BF16)
    gate = q_gate.to(DEV).chunk(2, dim=-1)[1]  # [t, h, d] at stride 2d per head
    out = torch.randn(t, h, d, generator=gen).to(BF16).to(DEV)
    got = attn_k.output_gate(out, gate)
    assert got.shape == (t, h * d) and got.is_contiguous()
    sig = torch.sigmoid(gate.cpu().double()).to(BF16).double()
    want = (out.cpu().double() * sig).to(BF16).reshape(t, -1)
    off = got.cpu() != want
    assert off.sum() <= 4, int(off.sum())
    assert ((got.cpu().float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-30).all()
    torch_path = out.cpu().reshape(t, -1) * torch.sigmoid(gate.cpu().reshape(t, -1))
    assert rel(got.cpu(), torch_path) < RTOL
    with pytest.raises(ValueError, match="must match"):
        attn_k.output_gate(out, gate[:, :2])
