"""qwen3_5_moe as data: config fields, layer types, and the role of every checkpoint tensor.

Covers Qwen3.5/Qwen3.6-35B-A3B (``Qwen3_5MoeForConditionalGeneration``: ``model.language_model.*``,
``model.visual.*``, ``lm_head``, ``mtp.*``) and text-only re-saves (``model.layers.*``). Routed experts
come in three on-disk layouts, detected per block (main layers and MTP separately):
- fused 3-D ``mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows first) + ``mlp.experts.down_proj`` [E, H, I];
- per-expert 2-D ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (transformers re-saves; Qwen3.5 MTP).
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fp4moe.errors import UserError
from fp4moe.formats.checkpoint import CheckpointError, CheckpointReader, not_a_checkpoint
from fp4moe.layers.rope import RopeConfig

SUPPORTED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

# The text config of the real Qwen3.5/3.6-35B-A3B (../shared/REFERENCE.md): full-size shapes for
# benchmarks and memory arithmetic without the weights.
REAL_TEXT_CONFIG = dict(
    num_hidden_layers=40,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 10,
    hidden_size=2048,
    vocab_size=248320,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    rms_norm_eps=1e-6,
    max_position_embeddings=262144,
    rope_parameters=dict(
        rope_type="default",
        rope_theta=1e7,
        partial_rotary_factor=0.25,
        mrope_section=[11, 11, 10],
        mrope_interleaved=True,
    ),
)


def layer_types_of(text: dict) -> list[str]:
    """``layer_types`` from a text config, or the default pattern: every ``full_attention_interval``-th
    layer (4) is gated attention, the rest Gated DeltaNet."""
    if text.get("layer_types"):
        return list(text["layer_types"])
    interval = int(text.get("full_attention_interval", 4))
    return [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(int(text["num_hidden_layers"]))
    ]


class UnsupportedModelError(UserError, ValueError):
    pass


class ExpertLayout(enum.Enum):
    FUSED = "fused"
    PER_EXPERT = "per-expert"


class Role(enum.Enum):
    ROUTED_EXPERT = "routed_expert"
    ROUTER = "router"
    SHARED_EXPERT = "shared_expert"
    SHARED_EXPERT_GATE = "shared_expert_gate"
    ATTENTION = "attention"
    DELTANET = "deltanet"
    NORM = "norm"
    EMBED = "embed"
    LM_HEAD = "lm_head"
    VISION = "vision"
    MTP = "mtp"
    OTHER = "other"


def text_config_dict(raw: dict) -> dict:
    """The text model's fields of a config.json dict: its ``text_config`` (the multimodal ``qwen3_5_moe``), or
    the dict itself (``qwen3_5_moe_text`` and text-only re-saves). Every reader of the config goes through this
    rule: the loader, the engine, calibration, the quantizer."""
    return raw.get("text_config", raw) if raw.get("model_type") == "qwen3_5_moe" else raw


@dataclass(frozen=True)
class ModelArgs:
    """The text model's shapes, parsed once (``ModelArgs.from_text_config`` of ``text_config_dict``) and read
    by the loader, the engine, calibration, the quantizer and ``inspect``: heads, Gated DeltaNet dims, experts,
    rotary (``RopeConfig``, YaRN included), MTP layers."""

    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    shared_intermediate_size: int
    eps: float
    rope: RopeConfig
    max_position_embeddings: int
    mtp_num_hidden_layers: int = 0

    @property
    def conv_dim(self) -> int:
        """Channels of the Gated DeltaNet causal conv: q and k (key heads) and v (value heads)."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + (
            self.linear_num_value_heads * self.linear_value_head_dim
        )

    @classmethod
    def from_text_config(cls, text: dict) -> ModelArgs:
        for key in _COUNTS:  # "8" or 8.5 would pass int() here and break a library that reads the dict
            value = text.get(key)
            if key in text and not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"{key} must be a positive integer, got {str(value)[:40]!r}")
        if int(text["num_experts_per_tok"]) > int(text["num_experts"]):
            raise ValueError(
                f"num_experts_per_tok ({text['num_experts_per_tok']}) exceeds num_experts ({text['num_experts']})"
            )
        n = int(text["num_hidden_layers"])
        types = layer_types_of(text)
        return cls(
            hidden_size=int(text["hidden_size"]),
            num_layers=n,
            layer_types=tuple(types),
            vocab_size=int(text["vocab_size"]),
            num_heads=int(text["num_attention_heads"]),
            num_kv_heads=int(text["num_key_value_heads"]),
            head_dim=int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]),
            linear_num_key_heads=int(text["linear_num_key_heads"]),
            linear_num_value_heads=int(text["linear_num_value_heads"]),
            linear_key_head_dim=int(text["linear_key_head_dim"]),
            linear_value_head_dim=int(text["linear_value_head_dim"]),
            conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
            num_experts=int(text["num_experts"]),
            top_k=int(text["num_experts_per_tok"]),
            moe_intermediate_size=int(text["moe_intermediate_size"]),
            shared_intermediate_size=int(text["shared_expert_intermediate_size"]),
            eps=float(text.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_text_config(text),
            max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
            mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", 0) or 0),
        )


# text-config fields that must be positive JSON integers
_COUNTS = (
    "num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
)  # fmt: skip


@dataclass
class ModelConfig:
    model_type: str
    text: ModelArgs
    has_vision: bool
    raw: dict = field(repr=False)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        cfg_path = Path(path) / "config.json"
        if not cfg_path.exists():
            raise CheckpointError(not_a_checkpoint(path))
        try:
            raw = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_path}: invalid JSON ({e})") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"unsupported model_type {model_type!r}; fp4moe supports {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        try:
            args = ModelArgs.from_text_config(text_config_dict(raw))
        except KeyError as e:
            raise CheckpointError(f"config.json: text config lacks {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"config.json: malformed text config ({e})") from None
        return cls(model_type, args, has_vision="vision_config" in raw, raw=raw)


_LAYER_RE = re.compile(r"^(?P<prefix>.*?layers\.)(?P<idx>\d+)\.(?P<rest>.+)$")
_PER_EXPERT_RE = re.compile(
    r"^mlp\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.(?P<suffix>.+)$"
)


def text_prefix(reader: CheckpointReader) -> str:
    """``model.language_model.`` (the VLM checkpoint) or ``model.`` (text-only re-saves)."""
    for name in reader.names():
        if name.startswith("model.language_model.layers."):
            return "model.language_model."
    for name in reader.names():
        if name.startswith("model.layers."):
            return "model."
    raise CheckpointError(
        f"{reader.path}: no decoder layers found (expected model.language_model.layers.N.*)"
    )


def classify(name: str) -> Role:
    """The role of a checkpoint tensor, by name alone."""
    if name.startswith("mtp."):
        return Role.MTP
    if name.startswith(("model.visual.", "visual.")):
        return Role.VISION
    if name.startswith("lm_head."):
        return Role.LM_HEAD
    if name.endswith("embed_tokens.weight"):
        return Role.EMBED
    m = _LAYER_RE.match(name)
    if not m:
        return Role.NORM if name.endswith("norm.weight") else Role.OTHER
    rest = m["rest"]
    if rest.startswith("mlp.experts."):
        return Role.ROUTED_EXPERT
    if rest.startswith("mlp.gate."):
        return Role.ROUTER
    if rest.startswith("mlp.shared_expert_gate."):
        return Role.SHARED_EXPERT_GATE
    if rest.startswith("mlp.shared_expert."):
        return Role.SHARED_EXPERT
    if rest.startswith("self_attn."):
        return Role.NORM if "norm" in rest else Role.ATTENTION
    if rest.startswith("linear_attn."):
        return Role.DELTANET
    if "layernorm" in rest:
        return Role.NORM
    return Role.OTHER


def is_routed_expert(name: str) -> bool:
    """Whether a checkpoint tensor belongs to a routed expert (what ``formats.layouts`` needs to know)."""
    return classify(name) is Role.ROUTED_EXPERT


def layer_of(name: str) -> int | None:
    """Decoder layer index of a main-model tensor (None for MTP, vision and top-level tensors)."""
    if name.startswith("mtp.") or classify(name) is Role.VISION:
        return None
    m = _LAYER_RE.match(name)
    return int(m["idx"]) if m else None


def detect_expert_layout(reader: CheckpointReader, experts_prefix: str) -> ExpertLayout | None:
    """Layout of one MoE block's routed experts (``experts_prefix`` ends with ``mlp.experts.``)."""
    if f"{experts_prefix}gate_up_proj" in reader:
        return ExpertLayout.FUSED
    if f"{experts_prefix}0.gate_proj.weight" in reader:
        return ExpertLayout.PER_EXPERT
    return None


@dataclass
class ExpertBlock:
    """The routed experts of one MoE block as read from disk."""

    prefix: str  # e.g. "model.language_model.layers.3.mlp.experts."
    layout: ExpertLayout
    num_experts: int
    hidden_size: int
    intermediate_size: int

    def source_names(self) -> list[str]:
        if self.layout is ExpertLayout.FUSED:
            return [f"{self.prefix}gate_up_proj", f"{self.prefix}down_proj"]
        return [f"{self.prefix}{e}.{p}.weight" for e in range(self.num_experts) for p in PROJECTIONS]

    def read(
        self, reader: CheckpointReader, experts: range | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [e, 2I, H], down [e, H, I]) for the given experts, in the checkpoint's dtype."""
        experts = experts if experts is not None else range(self.num_experts)
        if self.layout is ExpertLayout.FUSED:
            gate_up = reader.get(f"{self.prefix}gate_up_proj")
            down = reader.get(f"{self.prefix}down_proj")
            _check_shape(
                f"{self.prefix}gate_up_proj",
                gate_up,
                (self.num_experts, 2 * self.intermediate_size, self.hidden_size),
            )
            _check_shape(
                f"{self.prefix}down_proj", down, (self.num_experts, self.hidden_size, self.intermediate_size)
            )
            return gate_up[experts.start : experts.stop], down[experts.start : experts.stop]
        gate_up, down = [], []
        for e in experts:
            g, u, d = (reader.get(f"{self.prefix}{e}.{p}.weight") for p in PROJECTIONS)
            _check_shape(f"{self.prefix}{e}.gate_proj.weight", g, (self.intermediate_size, self.hidden_size))
            _check_shape(f"{self.prefix}{e}.up_proj.weight", u, (self.intermediate_size, self.hidden_size))
            _check_shape(f"{self.prefix}{e}.down_proj.weight", d, (self.hidden_size, self.intermediate_size))
            gate_up.append(torch.cat([g, u], dim=0))
            down.append(d)
        return torch.stack(gate_up), torch.stack(down)


def _check_shape(name: str, t: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != expected:
        raise CheckpointError(f"{name}: shape {tuple(t.shape)}, expected {expected} from config.json")


def expert_block(reader: CheckpointReader, experts_prefix: str, cfg: ModelArgs) -> ExpertBlock:
    layout = detect_expert_layout(reader, experts_prefix)
    if layout is None:
        raise CheckpointError(
            f"{reader.path}: no routed experts under {experts_prefix}* (fused or per-expert)"
        )
    block = ExpertBlock(experts_prefix, layout, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
    missing = [n for n in block.source_names() if n not in reader]
    if missing:
        raise CheckpointError(
            f"{reader.path}: {len(missing)} expert tensors missing under {experts_prefix}, e.g. {missing[0]}"
        )
    return block


def layer_names(reader: CheckpointReader, prefix: str, idx: int) -> list[str]:
    """All tensor names of main decoder layer ``idx``."""
    head = f"{prefix}layers.{idx}."
    return [n for n in reader.names() if n.startswith(head)]


def strip_layer_prefix(name: str) -> str:
    """``model.language_model.layers.3.mlp.gate.weight`` -> ``mlp.gate.weight``."""
    m = _LAYER_RE.match(name)
    if not m:
        raise ValueError(f"{name} is not a decoder-layer tensor")
    return m["rest"]


def per_expert_name(experts_prefix: str, e: int, proj: str, suffix: str) -> str:
    return f"{experts_prefix}{e}.{proj}.{suffix}"


def parse_per_expert(rest: str) -> tuple[int, str, str] | None:
    """``mlp.experts.7.up_proj.weight_scale`` -> (7, "up_proj", "weight_scale")."""
    m = _PER_EXPERT_RE.match(rest)
    return (int(m["e"]), m["proj"], m["suffix"]) if m else None


# ---- the linears ``fp4moe quantize --quantize GROUP[:fp8]`` can quantize beyond the routed experts ----------
# (quantize.extra calibrates their inputs; vLLM fuses each inner list into one module, whose shards must
# share one precision, one global scale and one input scale)

GROUPS = {  # option -> fused groups of module names (relative to a decoder layer; lm_head: top level)
    "attention": [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"]],
    "deltanet": [["linear_attn.in_proj_qkv", "linear_attn.in_proj_z"], ["linear_attn.out_proj"]],
    "shared": [["mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"], ["mlp.shared_expert.down_proj"]],
    "lm_head": [["lm_head"]],
}


ALGOS = ("nvfp4", "fp8")


def split(option: str) -> tuple[str, str]:
    """``attention`` -> (attention, nvfp4); ``attention:fp8`` -> (attention, fp8)."""
    name, _, algo = option.partition(":")
    return name, algo or "nvfp4"


def parse_groups(value: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """``attention,deltanet:fp8`` (or a list) -> validated options; ``experts`` (always NVFP4) is implied."""
    if not value:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    options = sorted({i.strip() for i in items if i.strip() and i.strip() != "experts"})
    unknown = [o for o in options if split(o)[0] not in GROUPS]
    if unknown:
        choices = ", ".join(GROUPS)
        raise ValueError(f"--quantize: unknown group(s) {', '.join(unknown)}; choose from experts, {choices}")
    bad = [o for o in options if split(o)[1] not in ALGOS]
    if bad:
        raise ValueError(f"--quantize: unknown format in {', '.join(bad)}; use GROUP or GROUP:fp8")
    names = [split(o)[0] for o in options]
    if len(set(names)) != len(names):
        raise ValueError("--quantize: a group is listed with two formats")
    return tuple(options)


def uses_fp8(options: tuple[str, ...]) -> bool:
    return any(split(o)[1] == "fp8" for o in options)


def layer_groups(options: tuple[str, ...], module_names: set[str]) -> list[tuple[list[str], str]]:
    """(fused group, algo) of one decoder layer that exist in it (attention layers have no linear_attn)."""
    out = []
    for option in options:
        name, algo = split(option)
        if name == "lm_head":
            continue
        for group in GROUPS[name]:
            if all(m in module_names for m in group):
                out.append((group, algo))
    return out
