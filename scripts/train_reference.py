"""Train the reference qwen3_5_moe model that quality work is measured on (issue 7).

A small model of the real architecture -- 8 layers in the 3:1 Gated DeltaNet / gated attention pattern,
32 routed experts top-4 plus a shared expert, an MTP head trained jointly to predict token t+2 -- trained on
the CPython 3.11 documentation (Debian's python3.11-doc, PSF license) minus the language reference, which
stays held out (it is the packaged ``heldout`` split that ``fp4moe eval`` reads). Written in the original
Qwen3.5 layout (fused experts, per-expert MTP experts, a small random vision tower so the layout is
complete), with its training log, loss curves and SHA-256 checksums.

What it is evidence of: how NVFP4 choices (scale methods, which tensors are quantized) change the outputs
of a model whose weights and activations have learned statistics, on real text. What it is not: evidence
of accuracy on a 35B model or on benchmarks -- it is a 30M-parameter model (61 MB in bf16, small enough to keep) trained for minutes.

    python scripts/make_train_corpus.py                                  # once, needs python3.11-doc
    python scripts/train_reference.py --out .models/reference   # one GPU, 5 min; --seed 0 is the reference
    python scripts/train_reference.py --tiny --max-steps 3 --out /tmp/r   # CPU smoke run (CI)
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gzip
import hashlib
import inspect
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fp4moe.data import corpus_text
from fp4moe.models.tiny import (
    CheckpointLayout,
    TinySpec,
    build_state,
    special_ids,
    tiny_config,
    train_tokenizer,
    write_checkpoint,
)

DEFAULT_CORPUS = Path(__file__).resolve().parents[1] / ".corpus" / "pydocs-train.txt.gz"

REFERENCE_SPEC = TinySpec(
    hidden_size=256,
    num_layers=8,
    num_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=96,
    shared_expert_intermediate_size=96,
    vocab_size=8192,
    tokenizer_vocab=8000,
    init_std=0.02,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_head_dim=64,
    mrope_section=(3, 3, 2),
)
TINY_SPEC = TinySpec(init_std=0.02)
# the reference architecture cut to what 2 CPU cores train in ~15 minutes (no GPU): 4 layers (3 Gated DeltaNet,
# 1 gated attention), 16 experts top-4 + shared, trained on the packaged calibration split
CPU_SPEC = dataclasses.replace(
    REFERENCE_SPEC, hidden_size=128, num_layers=4, num_experts=16, moe_intermediate_size=64,
    shared_expert_intermediate_size=64, vocab_size=4096, tokenizer_vocab=4000, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_head_dim=32, mrope_section=(2, 1, 1),
)  # fmt: skip


class MTPHead(nn.Module):
    """fc(concat(norm(embed(x_{t+1})), norm(h_t))) -> one full-attention decoder layer -> norm; the shared
    lm_head turns it into logits for token t+2. Parameter names match the checkpoint's ``mtp.*``."""

    def __init__(self, text_config):
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
            Qwen3_5MoeDecoderLayer,
            Qwen3_5MoeRMSNorm,
        )

        super().__init__()
        cfg = copy.deepcopy(text_config)
        cfg.layer_types = ["full_attention"]
        cfg.num_hidden_layers = 1
        self.config = cfg
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5MoeRMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5MoeRMSNorm(h, eps=eps)
        self.layers = nn.ModuleList([Qwen3_5MoeDecoderLayer(cfg, 0)])
        self.norm = Qwen3_5MoeRMSNorm(h, eps=eps)

    def forward(self, lm, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """ids [B, S], hidden [B, S, H] (the trunk's final-normed states) -> [B, S-1, H] for tokens 2..S."""
        from transformers.masking_utils import create_causal_mask

        b, s = ids.shape
        e = self.pre_fc_norm_embedding(lm.model.embed_tokens(ids[:, 1:]))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden[:, :-1])], dim=-1))
        pos = torch.arange(0, s - 1, device=ids.device)[None].expand(b, -1)  # of h_t, as vLLM drafts
        cos_sin = lm.model.rotary_emb(x, pos[None].expand(3, b, -1))
        mask = create_causal_mask(**_mask_kwargs(create_causal_mask, self.config, x, pos))
        x = self.layers[0](x, position_embeddings=cos_sin, attention_mask=mask, position_ids=pos)
        return self.norm(x)


def _mask_kwargs(fn, config, x: torch.Tensor, pos: torch.Tensor) -> dict:
    """create_causal_mask's arguments across transformers 5.x (it renamed input_embeds, cache_position,
    past_key_values / cache between releases)."""
    params = inspect.signature(fn).parameters
    kw = dict(config=config, attention_mask=None, position_ids=pos)
    kw["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = x
    for name in ("cache", "past_key_values"):
        if name in params:
            kw[name] = None
    if "cache_position" in params:
        kw["cache_position"] = pos[0]
    return kw


def _copy(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


def load_corpus(path: Path | None) -> str:
    if path is None:
        path = DEFAULT_CORPUS
    if not path.exists():
        raise SystemExit(f"{path} not found: run scripts/make_train_corpus.py first (or pass --corpus FILE)")
    data = path.read_bytes()
    return (gzip.decompress(data) if path.suffix == ".gz" else data).decode("utf-8")


def batches(tokens: torch.Tensor, seq_len: int, batch: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, len(tokens) - seq_len - 1, (batch,), generator=gen)
        yield torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])


@torch.no_grad()
def heldout_eval(lm, mtp, tokens: torch.Tensor, seq_len: int, windows: int, device, autocast) -> dict:
    lm.eval(), mtp.eval()
    nll, count, agree, drafted = 0.0, 0, 0, 0
    for i in range(windows):
        ids = tokens[i * seq_len : (i + 1) * seq_len][None].to(device)
        if ids.shape[1] < seq_len:
            break
        with autocast():
            hidden = lm.model(input_ids=ids).last_hidden_state
            logits = lm.lm_head(hidden).float()
            draft = lm.lm_head(mtp(lm, ids, hidden)).float().argmax(-1)  # [1, S-1]: tokens 2..S
        nll += float(F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum"))
        count += ids.shape[1] - 1
        agree += int((draft[0, :-1] == logits[0, 1:-1].argmax(-1)).sum())
        drafted += ids.shape[1] - 2
    lm.train(), mtp.train()
    return {
        "heldout_ppl": math.exp(nll / max(count, 1)),
        "mtp_acceptance": agree / max(drafted, 1),
        "tokens": count,
    }


def checkpoint_state(spec: TinySpec, config, lm, mtp) -> dict[str, torch.Tensor]:
    """The full checkpoint state: random vision tower from the tiny builder, the trained rest."""
    state = build_state(spec, config)
    for k, v in lm.model.state_dict().items():
        state[f"model.language_model.{k}"] = v.detach().float().cpu()
    state["lm_head.weight"] = lm.lm_head.weight.detach().float().cpu()
    for k, v in mtp.state_dict().items():
        state[f"mtp.{k}"] = v.detach().float().cpu()
    return state


def plot(curve: list[dict], evals: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([c["step"] for c in curve], [c["loss"] for c in curve], label="train loss (next token)")
    ax.plot([c["step"] for c in curve], [c["mtp_loss"] for c in curve], label="train loss (MTP, token t+2)")
    periodic = [e for e in evals if "val_ppl" in e]
    if periodic:
        steps = [e["step"] for e in periodic]
        ax.plot(
            steps, [math.log(e["val_ppl"]) for e in periodic], "o-", label="validation loss (picks the step)"
        )
        ax.plot(
            steps, [math.log(e["heldout_ppl"]) for e in periodic], "s-", label="held-out loss (16 windows)"
        )
    final = [e for e in evals if "val_ppl" not in e]
    if final:
        ax.plot([final[-1]["step"]], [math.log(final[-1]["heldout_ppl"])], "k*", markersize=12,
                label=f"kept checkpoint, held-out (64 windows): ppl {final[-1]['heldout_ppl']:.1f}")  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--out", required=True, help="checkpoint directory to write (replaced only when complete)"
    )
    ap.add_argument("--corpus", type=Path, help=f"training text, .txt or .txt.gz (default {DEFAULT_CORPUS})")
    ap.add_argument(
        "--minutes",
        type=float,
        default=5.0,
        help="training time budget (default 5: on an H200 the validation loss is lowest after ~4 minutes; "
        "later steps overfit the 2.65 M-token corpus)",
    )
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: by time only)")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per training sequence (default 512)")
    ap.add_argument("--batch", type=int, default=32, help="sequences per step (default 32)")
    ap.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate (default 2e-3)")
    ap.add_argument("--warmup", type=int, default=200, help="linear warm-up steps (default 200)")
    ap.add_argument(
        "--mtp-weight", type=float, default=0.3, help="weight of the MTP head's loss (default 0.3)"
    )
    ap.add_argument("--aux-weight", type=float, default=0.01, help="router load-balancing loss weight (0.01)")
    ap.add_argument("--eval-every", type=int, default=200, help="held-out evaluation period in steps")
    ap.add_argument("--seed", type=int, default=0, help="seed of data order and initialisation (default 0)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--tiny", action="store_true", help="the tiny test spec and the packaged corpus (smoke run)"
    )
    ap.add_argument(
        "--cpu-spec",
        action="store_true",
        help="a reduced reference (4 layers, hidden 128, 16 experts) on the packaged calibration split, "
        "for a bounded CPU run where no GPU is at hand",
    )
    ap.add_argument(
        "--moe-intermediate-size", type=int, default=None,
        help="routed and shared experts' width instead of the reference's 96 (128 fits vLLM's Marlin tiles, "
        "which need multiples of 64: benchmarks/vllm_side_by_side.py trains its MTP check model with it)",
    )  # fmt: skip
    args = ap.parse_args(argv)

    # flash-linear-attention's backward of the gated delta rule is wrong on Hopper with Triton < 3.7.1 (fla
    # refuses to run it), so training takes transformers' torch path: hide fla before transformers looks
    sys.modules.setdefault("fla", None)
    from transformers import Qwen3_5MoeForCausalLM
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    spec = TINY_SPEC if args.tiny else CPU_SPEC if args.cpu_spec else REFERENCE_SPEC
    if args.moe_intermediate_size:
        i = args.moe_intermediate_size
        spec = dataclasses.replace(spec, moe_intermediate_size=i, shared_expert_intermediate_size=i)
    text = corpus_text("calib") if args.tiny or (args.cpu_spec and args.corpus is None) else load_corpus(args.corpus)
    t0 = time.time()
    tokenizer = train_tokenizer(spec.tokenizer_vocab, text)
    config = tiny_config(spec, special_ids(tokenizer))
    text_cfg = config.text_config
    text_cfg.router_aux_loss_coef = args.aux_weight
    lm = Qwen3_5MoeForCausalLM(text_cfg).to(device)
    mtp = MTPHead(text_cfg).to(device)
    for module in mtp.modules():  # transformers' init for the head too
        lm._init_weights(module)
    tokens = torch.tensor(tokenizer(text)["input_ids"])
    # the last 2% of the training text picks the checkpoint; the held-out split (the language reference,
    # what fp4moe eval reads) is only reported, never used for a choice
    n_val = max(2 * args.seq_len, len(tokens) // 50)
    tokens, val = tokens[:-n_val], tokens[-n_val:]
    held = torch.tensor(tokenizer(corpus_text("heldout"))["input_ids"])
    print(f"corpus {len(text):,} chars -> {len(tokens):,} tokens; held-out {len(held):,} tokens; "
          f"parameters {sum(p.numel() for p in lm.parameters()) / 1e6:.1f}M + MTP "
          f"{sum(p.numel() for p in mtp.parameters()) / 1e6:.1f}M; tokenizer {time.time() - t0:.0f} s", flush=True)  # fmt: skip
    params = list(lm.parameters()) + list(mtp.parameters())
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda",
    )  # fmt: skip

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    gen = torch.Generator().manual_seed(args.seed)
    data = batches(tokens, args.seq_len, args.batch, gen)
    budget = args.minutes * 60
    total_steps = args.max_steps or 10**9
    curve, evals = [], []
    best = None  # (held-out perplexity, step, lm state, mtp state): the text is small, so keep the best
    start = time.time()
    step = 0
    while step < total_steps and time.time() - start < budget:
        if step >= 20 and step % 20 == 0 and not args.max_steps:  # size the schedule from the time so far
            per_step = (time.time() - start) / step  # evaluations included
            total_steps = max(step + 1, int(budget / per_step))
        frac = (step - args.warmup) / max(1, total_steps - args.warmup)
        scale = (
            step / args.warmup
            if step < args.warmup
            else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
        )
        for g in opt.param_groups:
            g["lr"] = args.lr * scale
        ids = next(data).to(device)
        with autocast():
            trunk = lm.model(input_ids=ids[:, :-1], output_router_logits=True)
            logits = lm.lm_head(trunk.last_hidden_state)
            main_loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
            aux = load_balancing_loss_func(
                trunk.router_logits, text_cfg.num_experts, text_cfg.num_experts_per_tok
            )
            mtp_logits = lm.lm_head(mtp(lm, ids[:, :-1], trunk.last_hidden_state))  # predicts ids[:, 2:]
            mtp_loss = F.cross_entropy(mtp_logits.float().flatten(0, 1), ids[:, 2:].flatten())
            loss = main_loss + args.mtp_weight * mtp_loss + args.aux_weight * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 10 == 0 or step == 1:
            curve.append(dict(step=step, seconds=time.time() - start, loss=main_loss.item(), mtp_loss=mtp_loss.item(),
                              aux=aux.item(), lr=args.lr * scale))  # fmt: skip
            c = curve[-1]
            print(f"step {step:5d}  {c['seconds']:6.0f} s  loss {c['loss']:.3f}  mtp {c['mtp_loss']:.3f}  "
                  f"aux {c['aux']:.3f}  lr {c['lr']:.2e}", flush=True)  # fmt: skip
        if step % args.eval_every == 0:
            v = heldout_eval(lm, mtp, val, args.seq_len, 16, device, autocast)
            evals.append(
                dict(
                    step=step,
                    val_ppl=v["heldout_ppl"],
                    **heldout_eval(lm, mtp, held, args.seq_len, 16, device, autocast),
                )
            )
            print(f"  validation ppl {v['heldout_ppl']:.2f}; held-out: {evals[-1]}", flush=True)
            if best is None or v["heldout_ppl"] < best[0]:
                best = (v["heldout_ppl"], step, _copy(lm), _copy(mtp))
    last = heldout_eval(lm, mtp, val, args.seq_len, 16, device, autocast)["heldout_ppl"]
    kept = step
    if best is not None and best[0] < last:
        kept = best[1]
        print(f"keeping step {kept} (validation perplexity {best[0]:.2f} < {last:.2f} at the end)")
        lm.load_state_dict(best[2])
        mtp.load_state_dict(best[3])
    final = dict(step=kept, **heldout_eval(lm, mtp, held, args.seq_len, 64, device, autocast))
    evals.append(final)
    print(f"final held-out (64 windows): {final}", flush=True)

    out = Path(args.out)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write_checkpoint(tmp, config, checkpoint_state(spec, config, lm.cpu(), mtp.cpu()), tokenizer, spec,
                     CheckpointLayout.QWEN3_5, max_shard_bytes=15 << 20)  # fmt: skip
    log = dict(args={k: str(v) for k, v in vars(args).items()}, spec=vars(spec), steps=step, kept_step=kept,
               train_seconds=time.time() - start, device=str(device), torch=torch.__version__,
               corpus_tokens=len(tokens), heldout=final, curve=curve, evals=evals)  # fmt: skip
    (tmp / "training_log.json").write_text(json.dumps(log, indent=2, default=str) + "\n")
    plot(curve, evals, tmp / "loss.png")
    sums = [
        f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.name}"
        for f in sorted(tmp.iterdir())
        if f.is_file()
    ]
    (tmp / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
