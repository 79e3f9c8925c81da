"""NVFP4 core: hand-written cases and bit-for-bit conformance with the compressed-tensors package."""

import pytest
import torch

from fp4moe.formats import nvfp4

try:
    import compressed_tensors.compressors.nvfp4.base as ct_nvfp4
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
except ImportError:  # the CPU CI installs it; the GPU machine does not have it
    ct_nvfp4 = None

needs_ct = pytest.mark.skipif(ct_nvfp4 is None, reason="compressed-tensors is not installed")


def test_e2m1_round_half_to_even_and_saturation():
    x = torch.tensor([0.0, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 7.0, 100.0, 0.74, 2.51])
    expected = torch.tensor([0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, 0.5, 3.0])
    assert torch.equal(nvfp4.e2m1_values(nvfp4.e2m1_codes(x)), expected)
    assert torch.equal(nvfp4.e2m1_values(nvfp4.e2m1_codes(-x)), -expected)


def test_e2m1_magnitude_is_the_codes_value_for_every_float_in_range():
    """By bits against the codes' table: float32 from 0 to 6 with a stride (every 2,039th bit pattern), and
    every one within 64 ulps of each grid value, midpoint and power of two, where the rounding changes."""
    top = int(torch.tensor(6.0).view(torch.int32))
    sweep = torch.arange(0, top + 1, 2039, dtype=torch.int32)
    edges = [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 2.0**-126, 2.0**-149]
    near = torch.tensor(edges).view(torch.int32)[:, None] + torch.arange(-64, 65, dtype=torch.int32)
    bits = torch.cat([sweep, near.flatten().clamp(0, top), torch.tensor([0, top], dtype=torch.int32)])
    a = bits.view(torch.float32)
    assert torch.equal(nvfp4.e2m1_magnitude(a), nvfp4.e2m1_values(nvfp4.e2m1_codes(a)))


def test_codes_sign_bit_and_magnitude_table():
    codes = nvfp4.e2m1_codes(torch.tensor([0.5, -0.5, 6.0, -6.0, -0.1, -0.0, 0.0]))
    assert codes.tolist() == [1, 9, 7, 15, 8, 0, 0]
    values = nvfp4.e2m1_values(torch.arange(16, dtype=torch.uint8))
    assert values[:8].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert torch.signbit(values[8]) and values[15] == -6


def test_pack_low_nibble_first_and_round_trip():
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    packed = nvfp4.pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x8F]]
    assert torch.equal(nvfp4.unpack_fp4(packed), codes)
    rand = torch.randint(0, 16, (3, 5, 32), dtype=torch.uint8)
    assert torch.equal(nvfp4.unpack_fp4(nvfp4.pack_fp4(rand)), rand)


def test_pack_rejects_odd_and_wrong_dtype():
    with pytest.raises(nvfp4.NVFP4Error, match="odd"):
        nvfp4.pack_fp4(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(nvfp4.NVFP4Error, match="uint8"):
        nvfp4.pack_fp4(torch.zeros(4, dtype=torch.int32))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_inf_rejected_with_position(bad):
    w = torch.randn(4, 32)
    w[2, 17] = bad
    with pytest.raises(nvfp4.NVFP4Error, match=r"experts.3.*\(2, 17\)"):
        nvfp4.quantize(w, name="experts.3")


def test_group_size_and_rank_errors():
    with pytest.raises(nvfp4.NVFP4Error, match="not divisible by the NVFP4 group size 16"):
        nvfp4.quantize(torch.randn(4, 24))
    with pytest.raises(nvfp4.NVFP4Error, match="matrix"):
        nvfp4.quantize(torch.randn(32))


def test_exactly_representable_block_is_lossless():
    # a block whose max is 6 * s maps every E2M1 value exactly (global scale 448*6/amax)
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6, 6.0])
    w = torch.stack([grid, grid * 2.0])  # [2, 16]
    q = nvfp4.quantize(w)
    torch.testing.assert_close(q.dequantize(), w, rtol=0, atol=0)


def test_batched_equals_per_matrix():
    w = torch.randn(3, 8, 64, dtype=torch.bfloat16)
    q = nvfp4.quantize(w)
    for e in range(3):
        qe = nvfp4.quantize(w[e])
        assert torch.equal(q.packed[e], qe.packed)
        assert torch.equal(q.block_scales[e].view(torch.uint8), qe.block_scales.view(torch.uint8))


def _adversarial(kind: str, gen: torch.Generator) -> torch.Tensor:
    shape = (32, 128)
    if kind == "normal":
        return torch.randn(shape, generator=gen)
    if kind == "heavy_tailed":  # student-t like: normal / sqrt(chi2)
        return torch.randn(shape, generator=gen) / (torch.rand(shape, generator=gen) ** 2 + 1e-3)
    if kind == "ties":  # values on exact E2M1 midpoints after scaling: block max 6 -> unit scale
        mids = torch.tensor(
            [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 6.0, -6.0]
        )
        return mids.repeat(shape[0], shape[1] // 16)[:, torch.randperm(shape[1], generator=gen)] * 1.0
    if kind == "zeros_and_zero_blocks":
        w = torch.randn(shape, generator=gen)
        w[:, :16] = 0.0
        w[3] = 0.0
        w[5, 40:56] = -0.0
        w[7, ::3] = 0.0
        return w
    if kind == "all_zero":
        return torch.zeros(shape)
    if kind == "tiny_amax":
        return torch.randn(shape, generator=gen) * 1e-30
    if kind == "huge_amax":
        return torch.randn(shape, generator=gen) * 1e30
    if kind == "one_outlier":
        w = torch.randn(shape, generator=gen) * 1e-3
        w[11, 77] = 50.0
        return w
    raise AssertionError(kind)


KINDS = [
    "normal",
    "heavy_tailed",
    "ties",
    "zeros_and_zero_blocks",
    "all_zero",
    "tiny_amax",
    "huge_amax",
    "one_outlier",
]


def _ct_compress(w: torch.Tensor, observer_dtype: torch.dtype = torch.float32):
    """compressed-tensors' own scale computation and compressor. llm-compressor's observer feeds
    min/max in the weight's dtype, which rounds the global scale to bf16 for bf16 weights; we keep
    float32, so the default here observes in float32 (the block and packing math is the same)."""
    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    gs = generate_gparam(w.min().to(observer_dtype), w.max().to(observer_dtype))
    groups = w.unflatten(-1, (w.shape[-1] // 16, 16))
    scale, _ = calculate_qparams(
        groups.amin(-1).float(), groups.amax(-1).float(), scheme.weights, global_scale=gs
    )
    out = ct_nvfp4.NVFP4PackedCompressor.compress(
        {"weight": w, "weight_scale": scale, "weight_global_scale": gs}, scheme
    )
    return out, scheme


@needs_ct
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", KINDS)
def test_bit_identical_to_compressed_tensors(kind, dtype):
    gen = torch.Generator().manual_seed(KINDS.index(kind))
    w = _adversarial(kind, gen).to(dtype)
    ours = nvfp4.quantize(w)
    theirs, scheme = _ct_compress(w)
    if dtype == torch.bfloat16:  # also with llm-compressor's bf16-rounded global scale, given to us
        bf16_theirs, _ = _ct_compress(w, observer_dtype=torch.bfloat16)
        bf16_ours = nvfp4.quantize(w, global_scale=bf16_theirs["weight_global_scale"])
        assert torch.equal(bf16_ours.packed, bf16_theirs["weight_packed"])
        assert torch.equal(
            bf16_ours.block_scales.view(torch.uint8), bf16_theirs["weight_scale"].view(torch.uint8)
        )
    assert torch.equal(ours.packed, theirs["weight_packed"]), "packed bytes differ"
    assert torch.equal(ours.block_scales.view(torch.uint8), theirs["weight_scale"].view(torch.uint8)), (
        "block scales differ"
    )
    assert torch.equal(ours.global_scale.reshape(1), theirs["weight_global_scale"].float().reshape(1))
    # and their decompressor reads our bytes as the values our dequantizer gives
    dec = ct_nvfp4.NVFP4PackedCompressor.decompress(
        {
            "weight_packed": ours.packed,
            "weight_scale": ours.block_scales,
            "weight_global_scale": ours.global_scale.reshape(1),
        },
        scheme,
    )["weight"]
    torch.testing.assert_close(dec.float(), ours.dequantize(dec.dtype).float(), rtol=0, atol=0)


@pytest.mark.parametrize("seed", range(8))
def test_modelopt_and_ct_decodes_match_an_independent_float64_decode(seed):
    """Both decoders against the codes' real values computed here in float64, from the OCP E2M1 table, the
    nibbles (low first), the e4m3 block scales and each convention's own global scale: ModelOpt's code *
    (block * s2) and ours, code * (block / gs), each round twice in fp32 (the scale, then the product with the
    code: relative error at most 2u, u = 2^-24). And the real values are the source's within NVFP4's step (at
    most one unit of the block's scale: the E2M1 grid's widest half-gap, between 4 and 6)."""
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(seed)) * 3
    q = nvfp4.quantize(w)
    s2 = nvfp4.weight_scale_2_from_amax(w.abs().amax())
    magnitudes = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
    table = torch.cat([magnitudes, -magnitudes])  # code 8 + m: the sign bit
    packed = q.packed.long()
    values = table[torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)]  # [16, 64]
    block = q.block_scales.double().repeat_interleave(16, dim=-1)
    two_roundings = 2 * 2**-24 * (1 + 1e-6)
    modelopt = nvfp4.dequantize_modelopt(q.packed, q.block_scales, s2).double()
    torch.testing.assert_close(modelopt, values * block * s2.double(), rtol=two_roundings, atol=0)
    ct = q.dequantize().double()
    torch.testing.assert_close(ct, values * block / q.global_scale.double(), rtol=two_roundings, atol=0)
    assert (
        (values * block / q.global_scale.double() - w.double()).abs() <= block / q.global_scale.double()
    ).all()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_quantize_is_bit_identical_to_cpu(kind):
    gen = torch.Generator().manual_seed(7)
    w = _adversarial(kind, gen).to(torch.bfloat16)
    # a batch of "experts", large enough that e4m3 rounding boundaries are hit (CUDA's scalar division
    # by reciprocal flipped ~0.2% of codes before nvfp4._div)
    w3 = torch.stack([w, w * 0.5, -w, *(torch.randn(61, *w.shape, generator=gen).to(torch.bfloat16))])
    cpu = nvfp4.quantize(w3)
    gpu = nvfp4.quantize(w3.cuda())
    assert torch.equal(gpu.packed.cpu(), cpu.packed)
    assert torch.equal(gpu.block_scales.cpu().view(torch.uint8), cpu.block_scales.view(torch.uint8))
    assert torch.equal(gpu.global_scale.cpu(), cpu.global_scale)
    torch.testing.assert_close(gpu.dequantize().cpu(), cpu.dequantize(), rtol=0, atol=0)
