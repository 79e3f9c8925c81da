"""Tiny random qwen3_5_moe checkpoints built with transformers: the embedded default and the test fixtures.

Each has the real architecture at toy width (3 Gated DeltaNet layers + 1 gated-attention layer per 4,
routed + shared experts, a small vision tower, an MTP head), bf16 weights, a BPE tokenizer trained on the
packaged CPython-docs corpus, a ChatML chat template, and is written sharded with an index in one of the
expert layouts found in the wild.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from fp4moe.data import corpus_text
from fp4moe.formats.checkpoint import ShardedWriter

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# added but not "special" (as in Qwen's tokenizer): they survive decoding, so parsers can see them
MARKUP_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

CHAT_TEMPLATE = (
    # Qwen3.5-style ChatML: tools in a system block, qwen3_coder tool calls, tool results as user turns
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n# Tools\\n<tools>\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- '</tools>\\nCall a function with <tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n"
    "</function>\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- elif message['content'] %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] in ('image', 'image_url') %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{{- '\\n<tool_call>\\n<function=' + call['function']['name'] + '>\\n' }}"
    "{%- for key, value in call['function']['arguments'].items() %}"
    "{{- '<parameter=' + key + '>\\n' }}{{- value if value is string else value | tojson }}{{- '\\n</parameter>\\n' }}"
    "{%- endfor %}"
    "{{- '</function>\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    # Qwen3.5's rule: enable_thinking=false closes an empty reasoning block, else it is left open
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)


PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "size": {"shortest_edge": 32 * 32, "longest_edge": 96 * 96},  # pixels: 2x2 to 6x6 merged tokens
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
}


class CheckpointLayout(enum.Enum):
    """Expert layouts of a whole checkpoint: main layers / MTP block."""

    QWEN3_5 = "qwen3.5"  # fused main experts, per-expert MTP experts (the Qwen3.5 release)
    QWEN3_6 = "qwen3.6"  # fused main experts, fused MTP experts (the Qwen3.6 release)
    RESAVED = "resaved"  # per-expert everywhere (transformers save_pretrained derivatives)


@dataclass
class TinySpec:
    hidden_size: int = 64
    num_layers: int = 4
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    shared_expert_intermediate_size: int = 32
    vocab_size: int = 1024
    tokenizer_vocab: int = 1000
    init_std: float = 0.08
    with_vision: bool = True
    with_mtp: bool = True
    seed: int = 0
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_head_dim: int = 16
    mrope_section: tuple[int, int, int] = (2, 1, 1)  # sums to head_dim * 0.25 / 2

    def __post_init__(self):
        if self.tokenizer_vocab > self.vocab_size:
            raise ValueError(f"tokenizer_vocab {self.tokenizer_vocab} exceeds vocab_size {self.vocab_size}")


QWEN3_5_PRETOKENIZE = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def train_tokenizer(vocab_size: int, text: str | None = None):
    """Byte-level BPE trained on ``text`` (default: the packaged calibration corpus; deterministic, ~1 s)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Qwen3.5's normalizer and pre-tokenizer: transformers' Qwen3_5Tokenizer re-applies them whenever it loads
    # a qwen3_5_moe checkpoint, so a tokenizer trained with another split would encode differently there
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN3_5_PRETOKENIZE), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = corpus_text("calib") if text is None else text
    tok.train_from_iterator((text[i : i + 4096] for i in range(0, len(text), 4096)), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.add_tokens(MARKUP_TOKENS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(spec: TinySpec, token_ids: dict[str, int]):
    from transformers import Qwen3_5MoeConfig

    head_dim = spec.head_dim
    text = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=head_dim,
        linear_key_head_dim=spec.linear_head_dim,
        linear_value_head_dim=spec.linear_head_dim,
        linear_num_key_heads=spec.linear_num_key_heads,
        linear_num_value_heads=spec.linear_num_value_heads,
        moe_intermediate_size=spec.moe_intermediate_size,
        shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        # partial rotary 0.25 of 32 dims = 8 dims = 4 frequencies = sum(mrope_section)
        rope_parameters=dict(
            rope_type="default",
            rope_theta=1e7,
            partial_rotary_factor=0.25,
            mrope_section=list(spec.mrope_section),
            mrope_interleaved=True,
        ),
        max_position_embeddings=8192,
        initializer_range=spec.init_std,
        eos_token_id=token_ids["<|im_end|>"],
        pad_token_id=token_ids["<|endoftext|>"],
    )
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=spec.hidden_size,
        num_position_embeddings=64,
        patch_size=16,
        temporal_patch_size=2,
        spatial_merge_size=2,
        initializer_range=spec.init_std,
    )
    return Qwen3_5MoeConfig(
        text_config=text,
        vision_config=vision if spec.with_vision else None,
        image_token_id=token_ids["<|image_pad|>"],
        video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"],
    )


def _randomize(t: torch.Tensor, gen: torch.Generator, std: float) -> torch.Tensor:
    return torch.randn(t.shape, generator=gen) * std


def build_state(spec: TinySpec, config) -> dict[str, torch.Tensor]:
    """Random weights in transformers' in-memory names (fused experts), plus MTP tensors, fp32."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(spec.seed)
    model = Qwen3_5MoeForConditionalGeneration(config)
    state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(spec.seed + 1)
    for name, t in state.items():
        # norms start at 0 in transformers ((1 + w) form); give them spread so the tests see them
        if name.endswith("layernorm.weight") or name.endswith("norm.weight") and "visual" not in name:
            state[name] = _randomize(t, gen, 0.1)
    if not spec.with_vision:
        state = {k: v for k, v in state.items() if not k.startswith("model.visual.")}
    if spec.with_mtp:
        state.update(_mtp_state(state, config.text_config, gen, spec.init_std))
    return state


def _mtp_state(state, text_config, gen, std) -> dict[str, torch.Tensor]:
    h = text_config.hidden_size
    full = next(i for i, t in enumerate(text_config.layer_types) if t == "full_attention")
    src = f"model.language_model.layers.{full}."
    out = {
        "mtp.fc.weight": torch.randn(h, 2 * h, generator=gen) * std,
        "mtp.pre_fc_norm_embedding.weight": torch.randn(h, generator=gen) * 0.1,
        "mtp.pre_fc_norm_hidden.weight": torch.randn(h, generator=gen) * 0.1,
        "mtp.norm.weight": torch.randn(h, generator=gen) * 0.1,
    }
    for name, t in state.items():
        if name.startswith(src):  # one full-attention decoder layer with its own MoE, fresh weights
            scale = 0.1 if t.ndim == 1 else std
            out["mtp.layers.0." + name[len(src) :]] = torch.randn(t.shape, generator=gen) * scale
    return out


def split_experts(state: dict[str, torch.Tensor], prefix_filter: str) -> dict[str, torch.Tensor]:
    """Rewrite fused experts whose name starts with ``prefix_filter`` into per-expert 2-D tensors."""
    out = {}
    for name, t in state.items():
        if name.startswith(prefix_filter) and name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:].clone()
        elif name.startswith(prefix_filter) and name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t
    return out


def write_tiny_checkpoint(
    out_dir: str | Path,
    layout: CheckpointLayout = CheckpointLayout.QWEN3_5,
    spec: TinySpec | None = None,
    max_shard_bytes: int = 200_000,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write a tiny random qwen3_5_moe checkpoint directory; same weights for every layout."""
    spec = spec or TinySpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(spec.tokenizer_vocab)
    config = tiny_config(spec, special_ids(tokenizer))
    return write_checkpoint(
        out, config, build_state(spec, config), tokenizer, spec, layout, max_shard_bytes, dtype
    )


def special_ids(tokenizer) -> dict[str, int]:
    return {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}


def write_checkpoint(
    out: Path,
    config,
    state: dict[str, torch.Tensor],
    tokenizer,
    spec: TinySpec,
    layout: CheckpointLayout = CheckpointLayout.QWEN3_5,
    max_shard_bytes: int = 200_000,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write ``state`` (transformers' names, fused experts, plus ``mtp.*``) as a checkpoint directory in
    ``layout``, with config, tokenizer, processor and generation files."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ids = special_ids(tokenizer)
    if layout in (CheckpointLayout.QWEN3_5, CheckpointLayout.RESAVED):
        state = split_experts(state, "mtp.")
    if layout is CheckpointLayout.RESAVED:
        state = split_experts(state, "model.")
    writer = ShardedWriter(out, max_shard_bytes=max_shard_bytes)
    for name in sorted(state):
        writer.add(name, state[name].to(dtype))
    writer.close()

    raw = config.to_dict()
    raw["architectures"] = ["Qwen3_5MoeForConditionalGeneration"]
    raw["dtype"] = str(dtype).removeprefix("torch.")
    raw["text_config"].update(
        mtp_num_hidden_layers=1 if spec.with_mtp else 0,
        mtp_use_dedicated_embeddings=False,
        attn_output_gate=True,
        mamba_ssm_dtype="float32",
    )
    (out / "config.json").write_text(json.dumps(raw, indent=2, default=str) + "\n")
    tokenizer.save_pretrained(out)
    if spec.with_vision:  # the image processor of Qwen3.5 (Qwen2-VL style), at toy resolution
        (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "do_sample": False}, indent=2)
        + "\n"
    )
    return out
