"""``fp4moe eval``: a model against a reference on held-out text, on our engine (CPU or GPU).

Both models read the same token windows (teacher forcing: each window is one prefill, the logits of every
position kept). Per token, over the full vocabulary and in fp32: perplexity of each model on the next
token, KL(ref || model) (mean, p99, max), and whether both put the same token first. For a model with an
MTP head: its draft acceptance under greedy speculation with one draft, i.e. how often the head's argmax
for token t+2 (fed x_{t+1} and the target's hidden state at t, as in decoding) equals the model's own
argmax at t+2 -- the acceptance rate the first draft position would see.

Text: the packaged held-out split (CPython 3.11 language reference, never used for calibration) unless a
file is given. The two models must share a tokenizer.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from fp4moe.data.windows import consecutive_windows
from fp4moe.engine.reference.context import StepContext
from fp4moe.engine.request.sampler import SamplingParams
from fp4moe.engine.request.sequence import Sequence
from fp4moe.layers.divergence import token_kl, top1_agrees


@dataclass
class ModelScores:
    perplexity: float
    mtp_acceptance: float | None  # None: no MTP head


@dataclass
class EvalResult:
    model: str
    reference: str
    tokens: int
    windows: int
    seq_len: int
    model_scores: ModelScores
    reference_scores: ModelScores
    kl_mean: float
    kl_p99: float
    kl_max: float
    top1_agreement: float
    seconds: float

    def table(self) -> str:
        def acc(s):
            return "-" if s.mtp_acceptance is None else f"{s.mtp_acceptance:.1%}"

        m, r = self.model_scores, self.reference_scores
        return "\n".join(
            [
                f"{self.tokens} held-out tokens in {self.windows} windows of {self.seq_len}",
                "| | perplexity | KL(ref‖model) mean | KL p99 | KL max | top-1 agreement | MTP acceptance |",
                "|---|---|---|---|---|---|---|",
                f"| reference {self.reference} | {r.perplexity:.4f} | | | | | {acc(r)} |",
                f"| model {self.model} | {m.perplexity:.4f} | {self.kl_mean:.5f} | {self.kl_p99:.5f} | "
                f"{self.kl_max:.5f} | {self.top1_agreement:.2%} | {acc(m)} |",
            ]
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


@torch.no_grad()
def window_outputs(llm, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs [n, V] fp32 on the CPU, MTP argmax [n-2] or None) of one window, teacher-forced."""
    runner = llm.runner
    kv, states = runner.new_caches()
    seq = Sequence(-1, list(ids), SamplingParams(max_tokens=1), slot=0)
    hidden, _ = runner.forward([(seq, len(ids))], kv, states)
    logprobs = torch.cat(
        [F.log_softmax(llm.model.compute_logits(h).float(), -1).cpu() for h in hidden.split(256)]
    )
    drafts = None
    mtp = llm.model.mtp
    if mtp is not None:
        n = len(ids)
        x_next = torch.tensor(ids[1:], device=hidden.device)
        ctx = StepContext([n - 1], [0], [0], kv, states)
        h = mtp(llm.model, x_next, hidden[:-1], seq.positions(0, n - 1).to(hidden.device), ctx)
        drafts = torch.cat([llm.model.compute_logits(x).argmax(-1).cpu() for x in h[:-1].split(256)])
    kv.free(0)
    states.free(0)
    return logprobs, drafts


def evaluate(
    model: str | Path,
    reference: str | Path,
    text: str | None = None,
    seq_len: int = 512,
    limit: int = 4096,
    device: str = "cpu",
    dtype: str = "auto",
    progress: bool = True,
) -> EvalResult:
    from tqdm import tqdm

    from fp4moe.data import corpus_text
    from fp4moe.engine.front.llm import LLM

    start = time.perf_counter()
    # one sequence of seq_len at a time: on a GPU each engine sizes its caches for just that
    ref_llm = LLM(
        reference, dtype=dtype, device=device, max_num_seqs=1, max_model_len=seq_len, cuda_graphs=False
    )
    llm = LLM(model, dtype=dtype, device=device, max_num_seqs=1, max_model_len=seq_len, cuda_graphs=False)
    for which, m in (("model", llm), ("reference", ref_llm)):
        if m.tokenizer is None:
            raise ValueError(f"the {which} {m.path} has no tokenizer")
    if llm.tokenizer.get_vocab() != ref_llm.tokenizer.get_vocab():
        raise ValueError("the model and the reference have different tokenizers; eval needs the same one")
    text = text if text is not None else corpus_text("heldout")
    windows = consecutive_windows(llm.tokenizer(text)["input_ids"], seq_len, limit)
    nll = {"model": 0.0, "reference": 0.0}
    accepted = {"model": 0, "reference": 0}
    drafted = 0
    kls, agree, count = [], 0, 0
    for ids in tqdm(windows, desc="eval windows", unit="window", disable=not progress):
        ref_lp, ref_drafts = window_outputs(ref_llm, ids)
        lp, drafts = window_outputs(llm, ids)
        target = torch.tensor(ids[1:])
        nll["reference"] -= float(ref_lp[:-1].gather(1, target[:, None]).sum())
        nll["model"] -= float(lp[:-1].gather(1, target[:, None]).sum())
        kls.append(token_kl(ref_lp, lp))
        agree += int(top1_agrees(ref_lp, lp).sum())
        count += len(ids)
        drafted += len(ids) - 2
        for name, d, own in (("model", drafts, lp), ("reference", ref_drafts, ref_lp)):
            if d is not None:
                accepted[name] += int((d == own[1:-1].argmax(-1)).sum())
    kl = torch.cat(kls)
    predicted = sum(len(w) - 1 for w in windows)

    def scores(name: str, m) -> ModelScores:
        acc = accepted[name] / drafted if m.model.mtp is not None and drafted else None
        return ModelScores(math.exp(nll[name] / predicted), acc)

    return EvalResult(
        model=str(model),
        reference=str(reference),
        tokens=count,
        windows=len(windows),
        seq_len=seq_len,
        model_scores=scores("model", llm),
        reference_scores=scores("reference", ref_llm),
        kl_mean=float(kl.mean()),
        kl_p99=float(torch.quantile(kl.double(), 0.99)),
        kl_max=float(kl.max()),
        top1_agreement=agree / count,
        seconds=time.perf_counter() - start,
    )
