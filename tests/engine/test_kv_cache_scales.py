"""An fp8 KV cache's scales are fixed when the engine starts (``engine.loading.kv_scales``): the checkpoint's
calibrated ones where it has them, else calibrated on the packaged text; so a request's answer is the same
bit for bit whatever the engine served before it (the scales once came from the first prefill)."""

from __future__ import annotations

import pytest
import torch
from runner_cases import DEV, _fused

from fp4moe.engine.front.llm import LLM
from fp4moe.engine.loading import kv_scales
from fp4moe.engine.request.sampler import SamplingParams
from fp4moe.engine.request.sequence import Sequence
from fp4moe.formats.checkpoint import CheckpointReader

PREFIX = "model.language_model.layers."
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
PROMPT = {"prompt_token_ids": [(7 * i + 3) % 200 + 5 for i in range(120)]}


def _answer(llm, before: list[list[int]]):
    """The test prompt's tokens and logprobs after the engine served ``before``, each request in turn on
    one engine core, as a server runs them (``LLM.generate`` makes a core, and caches, per call)."""
    core = llm.new_core()

    def serve(prompt, params):
        (seq,) = llm.make_sequences(prompt, params)
        core.add([seq])
        while core.has_work():
            core.step()
        return seq

    for ids in before:
        serve({"prompt_token_ids": ids}, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    seq = serve(PROMPT, GREEDY)
    return seq.output_ids, [(r.token_id, r.logprob, r.top_logprobs) for r in seq.logprobs]


def _engine(path, fused: bool):
    llm = LLM(path, dtype="bfloat16", device=DEV, kv_cache_dtype="fp8")
    if fused and DEV == "cpu":
        _fused(llm, "fp8")  # the GPU runner's paged cache and fused decode, under Triton's interpreter
    return llm


@pytest.mark.parametrize("fused", [False, True], ids=["cpu-path", "gpu-runner"])
def test_an_answer_does_not_depend_on_the_requests_before_it(checkpoints, fused):
    """The same greedy request with logprobs on a fresh engine and on engines that first served a one-token
    prompt, and a long one with larger keys: bit-identical tokens and logprobs (under the first-request rule
    the one-token prompt's scales clipped the test prompt: logprobs moved by up to ~2e-3)."""
    if fused:
        pytest.importorskip("triton")
    path = checkpoints.bf16()
    fresh = _answer(_engine(path, fused), [])
    assert _answer(_engine(path, fused), [[9]]) == fresh
    assert _answer(_engine(path, fused), [[(13 * i) % 250 + 1 for i in range(200)], [9]]) == fresh


def test_the_checkpoint_scales_are_used_and_the_rest_calibrated(checkpoints):
    path = checkpoints.quantized(kv_cache_quant_algo="FP8")
    llm = LLM(path, dtype="bfloat16", device="cpu", kv_cache_dtype="fp8")
    reader = CheckpointReader(path)
    attention = [i for i, layer in enumerate(llm.model.layers) if layer.is_attention]
    for i in attention:
        for got, kind in zip(llm.runner.kv_scales[i], "kv", strict=True):
            assert torch.equal(got, reader.get(f"{PREFIX}{i}.self_attn.{kind}_proj.{kind}_scale"))
    mtp = llm.model.mtp.layer_id  # quantize does not run the MTP head: its layer is calibrated at start
    assert set(llm.runner.kv_scales) == {*attention, mtp}
    assert f"the checkpoint's; layers [{mtp}] calibrated at start-up" in llm.kv_scales_source


def test_startup_calibration_is_the_amax_of_what_the_bf16_cache_holds(checkpoints):
    """``calibrate``'s scales against the keys/values a bf16 engine caches for the same tokens (read back
    from its cache after the prefill): amax x HEADROOM / 448, exactly."""
    path = checkpoints.bf16()
    llm = LLM(path, dtype="float32", device="cpu")
    ids = kv_scales.calibration_ids(llm.tokenizer, llm.model.args.vocab_size, 300)
    scales = kv_scales.calibrate(llm.model, ids, torch.device("cpu"))
    assert len(ids) == 300
    kv, states = llm.runner.new_caches()
    seq = Sequence(-1, list(ids), SamplingParams(max_tokens=1), slot=0)
    llm.runner.forward([(seq, len(ids))], kv, states)
    for (layer, _), (k, v) in kv._kv.items():
        want = torch.stack([x.abs().amax() for x in (k, v)]).float() * kv_scales.HEADROOM / 448
        assert torch.equal(torch.stack(scales[layer]), want), layer
    assert set(scales) == {layer for layer, _ in kv._kv} | {llm.model.mtp.layer_id}
