"""The MTP head's draft vocabulary (``engine.spec.draft_vocab``): which ids it holds, the lm_head's rows for them in
every weight format (``Linear.rows``: the same outputs as the full lm_head's columns, fp32 on the CPU, 1e-6 for
the matmul's blocking), and the head's draft logits (-inf outside the ids, argmax among them). That outputs
do not change with it is tests/engine/test_spec_decode.py's."""

from __future__ import annotations

import types

import pytest
import torch

from fp4moe.engine.spec.draft_vocab import draft_token_ids
from fp4moe.formats import fp8, nvfp4
from fp4moe.layers.linear import Linear
from fp4moe.models.qwen3_5_moe_model import MTPHead


def test_draft_ids_are_the_lowest_the_special_and_the_eos_ones():
    tok = types.SimpleNamespace(all_special_ids=[990, 5], added_tokens_decoder={995: None, 2000: None})
    ids = draft_token_ids(1000, 16, tok, extra_ids=[998])
    assert ids.tolist() == [*range(16), 990, 995, 998]  # 2000 lies past the vocabulary
    assert draft_token_ids(10, 64).tolist() == list(range(10))
    with pytest.raises(ValueError, match="at least one"):
        draft_token_ids(10, 0)


def _linear(kind: str, gen) -> Linear:
    out_f, in_f = 48, 64
    w = torch.randn(out_f, in_f, generator=gen)
    lin = Linear(in_f, out_f)
    if kind == "dense":
        lin.weight.data = w
    elif kind == "nvfp4":
        lin.use_nvfp4()
        q = nvfp4.quantize(w)
        lin.nvfp4.packed, lin.nvfp4.block_scales = q.packed, q.block_scales
        lin.nvfp4.decode_scale = (1 / q.global_scale).float()
    else:
        lin.use_fp8()
        scale = w.abs().max() / 448
        lin.fp8.weight, lin.fp8.scale = fp8.encode(w, scale), scale
    return lin


def _within_summation_order(got, want, x, lin, ids) -> None:
    """``got`` and ``want`` are the same fp32 dot products summed in orders the BLAS picks per matrix width
    (and per CPU): each within K u sum|x_i w_i| of the exact value (K terms, u = 2^-24), so within twice that
    of each other. The weights as ``lin`` computes with them: ``lin(I)`` is exact (one product per sum)."""
    w = lin(torch.eye(x.shape[-1])).T  # [out, in]
    bound = 2 * x.shape[-1] * 2**-24 * (x.abs() @ w.abs().T)[:, ids]
    assert ((got - want).abs() <= bound).all(), ((got - want).abs() - bound).max()


@pytest.mark.parametrize("kind", ["dense", "nvfp4", "fp8"])
def test_rows_of_a_linear_are_its_output_columns(kind):
    gen = torch.Generator().manual_seed(0)
    lin = _linear(kind, gen)
    ids = torch.tensor([0, 3, 17, 47])
    x = torch.randn(5, 64, generator=gen)
    _within_summation_order(lin.rows(ids)(x), lin(x)[:, ids], x, lin, ids)


def test_draft_logits_are_the_lm_heads_on_the_draft_ids_and_minus_inf_elsewhere():
    gen = torch.Generator().manual_seed(1)
    vocab, hidden = 48, 64
    model = types.SimpleNamespace(
        lm_head=_linear("dense", gen), args=types.SimpleNamespace(vocab_size=vocab),
        embed_tokens=torch.empty(vocab, hidden),
    )  # fmt: skip
    head = MTPHead.__new__(MTPHead)
    torch.nn.Module.__init__(head)
    head.draft_ids = head.draft_head = None
    h = torch.randn(6, hidden, generator=gen)
    full = model.lm_head(h)
    assert torch.equal(head.logits(model, h), full) and torch.equal(head.greedy(model, h), full.argmax(-1))
    ids = torch.tensor([1, 4, 9, 30, 31])
    head.use_draft_vocab(model, ids)
    got = head.logits(model, h)
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[ids] = False
    assert got.shape == full.shape and torch.isinf(got[:, outside]).all() and (got[:, outside] < 0).all()
    _within_summation_order(got[:, ids], full[:, ids], h, model.lm_head, ids)
    assert torch.equal(head.greedy(model, h), got.argmax(-1))
    assert set(head.greedy(model, h).tolist()) <= set(ids.tolist())
