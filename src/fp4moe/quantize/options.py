"""What a ``quantize`` run takes (``QuantizeOptions``: calibration, scale method, format, extra groups, device,
shards) and what it reports (``QuantizeReport``), and the error it raises for a run that cannot be done."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import torch

from fp4moe.errors import UserError
from fp4moe.formats.checkpoint import parse_size
from fp4moe.formats.layouts import OutputFormat
from fp4moe.models import qwen3_5_moe as arch
from fp4moe.quantize.scales import ScaleMethod
from fp4moe.quantize.search import SearchTarget


class QuantizeError(UserError, RuntimeError):
    pass


@dataclass
class QuantizeOptions:
    format: OutputFormat = OutputFormat.MODELOPT
    num_samples: int = 128
    seq_len: int = 512
    calib_file: str | None = None
    calib_dataset: str | None = None
    calibrate_all_experts: bool = False
    scale_method: ScaleMethod = ScaleMethod.MSE  # beat RTN on eval KL (BENCHMARKS.md, issue 7)
    gptq: bool = False  # GPTQ error compensation for the routed experts (per-expert input Hessians)
    device: str = "auto"
    calib_dtype: str = "auto"
    batch_size: int = 8
    max_shard_size: str | int = "2GB"
    kv_cache_quant_algo: str | None = None
    overwrite: bool = False
    seed: int = 0
    read_ahead: bool = True  # the next decoder layer read on a worker thread while this one is quantized
    progress: bool = True
    quantize_extra: tuple[str, ...] = ()  # beyond the routed experts: attention, deltanet, shared, lm_head
    base_model: str | None = None  # the source's hub id, for the model card (the bytes do not depend on it)
    target: SearchTarget | None = None  # --budget / --target-bytes / --target-bpw: search formats per layer
    sensitivity: str | None = None  # a stored sensitivity table to search on instead of measuring one
    sensitivity_samples: int = 8  # held-out windows (of seq_len) the sensitivity KL is measured on

    def __post_init__(self):
        self.format = OutputFormat(self.format)
        self.quantize_extra = arch.parse_groups(self.quantize_extra)
        if arch.uses_fp8(self.quantize_extra) and self.format is not OutputFormat.MODELOPT:
            raise ValueError(
                "--quantize GROUP:fp8 is written as ModelOpt MIXED_PRECISION: use --format modelopt"
            )
        self.scale_method = ScaleMethod(self.scale_method)
        if self.target is not None and self.quantize_extra:
            raise ValueError(
                "--budget/--target-bytes/--target-bpw choose the formats themselves: drop --quantize"
            )
        if self.sensitivity is not None and self.target is None:
            raise ValueError(
                "--sensitivity is the table a search reuses: give --budget, --target-bytes or --target-bpw"
            )
        for name in ("num_samples", "seq_len", "batch_size", "sensitivity_samples"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.calib_dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(
                f"calib_dtype must be auto, bfloat16, float16 or float32, got {self.calib_dtype!r}"
            )
        if self.kv_cache_quant_algo not in (None, "FP8"):
            raise ValueError(f"kv_cache_quant_algo must be None or 'FP8', got {self.kv_cache_quant_algo!r}")
        self.max_shard_bytes = parse_size(self.max_shard_size)

    def resolve_device(self) -> torch.device:
        from fp4moe.kernels.gpu_arch import require_device

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        require_device(self.device)
        return torch.device(self.device)

    def resolve_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        """``auto``: run the layers in the checkpoint's own dtype (bf16 for the real model), as it is served."""
        if self.calib_dtype == "auto":
            return checkpoint_dtype if checkpoint_dtype.is_floating_point else torch.float32
        return getattr(torch, self.calib_dtype)


@dataclass
class QuantizeReport:
    src: str
    dst: str
    format: str
    num_layers: int
    num_experts: int
    expert_layouts: dict[str, str]
    calibration: str
    calibration_tokens: int
    device: str
    calib_dtype: str
    bytes_in: int
    bytes_out: int
    experts_quantized: int
    experts_calibrated: int
    fallback_experts: list[list[int]] = field(default_factory=list)  # [layer, expert]
    warnings: list[str] = field(default_factory=list)
    min_tokens_per_expert: int = 0
    seconds: float = 0.0
    stage_seconds: dict[str, float] = field(default_factory=dict)
    peak_rss_bytes: int = 0
    search: dict | None = None  # --budget & co: the target, predicted and measured KL, the formats chosen

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def summary(self) -> str:
        gb = 1e9
        lines = [
            f"quantized {self.src} -> {self.dst} ({self.format})",
            f"  layers {self.num_layers}, routed experts {self.experts_quantized} quantized "
            f"({self.num_experts} per layer; input layouts: {', '.join(f'{k}={v}' for k, v in self.expert_layouts.items())})",
            f"  calibration: {self.calibration}, {self.calibration_tokens} tokens on {self.device} ({self.calib_dtype})",
            f"  experts calibrated: {self.experts_calibrated}/{self.experts_quantized}; "
            f"fallbacks: {len(self.fallback_experts)}; fewest tokens for a calibrated expert: {self.min_tokens_per_expert}",
            f"  size: {self.bytes_in / gb:.3f} GB -> {self.bytes_out / gb:.3f} GB "
            f"({self.bytes_out / max(self.bytes_in, 1):.1%})",
            *[f"  warning: {w}" for w in self.warnings],
            *self._search_lines(),
            f"  time {self.seconds:.1f} s ({', '.join(f'{k} {v:.1f}' for k, v in self.stage_seconds.items())}), "
            f"peak RSS {self.peak_rss_bytes / gb:.2f} GB",
        ]
        return "\n".join(lines)

    def _search_lines(self) -> list[str]:
        if not self.search:
            return []
        s = self.search
        chosen: dict[str, int] = {}
        for row in s["formats"]:
            key = f"{row['part']} {row['format']}"
            chosen[key] = chosen.get(key, 0) + 1
        measured = "-" if s["measured_kl"] is None else f"{s['measured_kl']:.5g}"
        return [
            f"  search ({s['target']['kind']} {s['target']['value']:g}): predicted KL {s['predicted_kl']:.5g} "
            f"(sum of per-part KLs), measured KL {measured} on {s['held_out_tokens']} held-out calibration "
            f"tokens; {s['bits_per_weight']:.3f} bits per searched weight",
            "  formats chosen (layers): " + ", ".join(f"{k} x{v}" for k, v in sorted(chosen.items())),
        ]
