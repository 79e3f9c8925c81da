"""Loading beyond our own quantizer's output: other NVFP4 linears, unequal gate/up scales, tied embeddings,
bf16 compute, limits."""

import json

import pytest
import torch
from test_parity import ATOL, _flat_prefill, _prompts, _ref_logits, _reference  # noqa: I001

from fixtures import load_all, no_eos, rewrite_tensors
from fp4moe.engine.front.llm import LLM
from fp4moe.engine.loading.loader import load_model
from fp4moe.engine.request.sampler import SamplingParams
from fp4moe.formats import nvfp4
from fp4moe.quantize.dequant import dequantized_state_dict

L = "model.language_model.layers."


def _nvfp4_linear(w: torch.Tensor) -> dict[str, torch.Tensor]:
    q = nvfp4.quantize(w.float())
    return {
        "weight": q.packed,
        "weight_scale": q.block_scales,
        "weight_scale_2": nvfp4.weight_scale_2_from_amax(w.float().abs().amax()).reshape(()),
        "input_scale": torch.tensor(0.01),
    }


def test_other_nvfp4_linears_and_unequal_gate_up_scales(checkpoints):
    """A ModelOpt-style checkpoint that also quantizes shared experts and an attention projection, with one
    expert whose gate and up carry different global scales: equals transformers on the decoded weights."""
    path = checkpoints.copy(checkpoints.quantized(), "recipe")
    tensors = load_all(path)
    for module in (
        f"{L}0.mlp.shared_expert.gate_proj",
        f"{L}0.mlp.shared_expert.down_proj",
        f"{L}3.self_attn.o_proj",
    ):
        w = tensors.pop(module + ".weight")
        tensors.update({f"{module}.{k}": v for k, v in _nvfp4_linear(w).items()})
    e = f"{L}1.mlp.experts.2.up_proj.weight_scale_2"
    tensors[e] = tensors[e] * 1.5
    rewrite_tensors(path, tensors)
    model, _ = load_model(path, dtype="float32")
    assert (
        model.layers[0].mlp.shared_gate_proj.nvfp4 is not None
        and model.layers[3].self_attn.o_proj.nvfp4 is not None
    )
    ref = _reference(checkpoints.bf16(), dequantized_state_dict(path))
    prompt = _prompts(seed=21, lengths=(30,))[0]
    ours, _ = _flat_prefill(model, [prompt])
    torch.testing.assert_close(ours, _ref_logits(ref, prompt), atol=ATOL, rtol=0)


def test_fp8_groups_dequantize_for_transformers_and_match_the_engine(checkpoints):
    """An FP8 mix read back as transformers' dense state dict (weight x per-tensor scale; scales dropped) loads
    strictly and matches our engine's weight-only FP8 forward (the vLLM side-by-side's reference)."""
    path = checkpoints.quantized(quantize_extra=("attention:fp8", "deltanet:fp8", "shared:fp8"))
    model, _ = load_model(path, dtype="float32")
    assert (
        model.layers[3].self_attn.q_proj.fp8 is not None
        and model.layers[0].mlp.shared_gate_proj.fp8 is not None
    )
    state = dequantized_state_dict(path)
    assert not any(k.endswith(("weight_scale", "input_scale")) for k in state)
    ref = _reference(checkpoints.bf16(), state)  # strict load inside
    prompt = _prompts(seed=22, lengths=(30,))[0]
    ours, _ = _flat_prefill(model, [prompt])
    torch.testing.assert_close(ours, _ref_logits(ref, prompt), atol=ATOL, rtol=0)


def test_tied_embeddings_declared_at_the_top_level(checkpoints):
    path = checkpoints.copy(checkpoints.bf16(), "tied")
    tensors = load_all(path)
    tensors["lm_head.weight"] = tensors["model.language_model.embed_tokens.weight"].clone()
    rewrite_tensors(path, {k: v for k, v in tensors.items() if k != "lm_head.weight"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (path / "config.json").write_text(json.dumps(cfg))
    model, _ = load_model(path, dtype="float32")
    assert torch.equal(model.lm_head.weight, model.embed_tokens)


def test_bf16_compute_tracks_transformers_bf16(checkpoints):
    """dtype auto = the checkpoint's bf16. bf16 rounding differs between the two implementations' op
    orders, so the check is statistical: logits within a few bf16 steps and argmax agreement."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    path = checkpoints.bf16()
    llm = LLM(path)
    assert llm.model.embed_tokens.dtype == torch.bfloat16
    # eager attention: torch's bf16 CPU SDPA packs for AVX-512 by what the CPU has, then refuses under a
    # lower ATEN_CPU_CAPABILITY ("pack_vnni2 is only supported when avx512 is supported")
    ref = Qwen3_5MoeForConditionalGeneration.from_pretrained(
        str(path), dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    no_eos(ref)
    prompt = _prompts(seed=22, lengths=(100,))[0]
    ours, _ = _flat_prefill(llm.model, [prompt])
    theirs = _ref_logits(ref, prompt)
    assert (ours - theirs).abs().max() < 0.25  # logits are O(3); one bf16 step at 2-4 is 0.016
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.9


def test_max_model_len_above_the_model_is_refused(checkpoints):
    with pytest.raises(ValueError, match="exceeds the model's 8192 positions"):
        LLM(checkpoints.bf16(), dtype="float32", max_model_len=10**6)


def test_single_image_not_in_a_list_and_mixed_batches(checkpoints):
    import numpy as np

    llm = LLM(checkpoints.bf16(), dtype="float32")
    img = np.random.default_rng(9).integers(0, 255, (50, 60, 3), dtype=np.uint8)
    prompt = {
        "prompt": "<|vision_start|><|image_pad|><|vision_end|>Describe.",
        "multi_modal_data": {"image": img},
    }
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    alone = llm.generate(prompt, p)[0].outputs[0].token_ids
    mixed = llm.generate([prompt, "plain text", prompt], p)
    assert [o.outputs[0].token_ids for o in mixed] == [
        alone,
        llm.generate("plain text", p)[0].outputs[0].token_ids,
        alone,
    ]
    many = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, n=2))[0]
    assert [o.token_ids for o in many.outputs] == [alone, alone]
