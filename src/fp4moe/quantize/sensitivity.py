"""Per-layer sensitivity for the format search (``quantize --budget``): for every decoder layer, part and
candidate format, the mean KL(bf16 || model) over the full vocabulary on held-out calibration windows when
only that part takes that format (``measure``), with the bytes each format stores (``SensitivityTable``).

Streamed like the quantize pass: one decoder layer's weights in memory at a time. Each candidate's hidden
states start at its layer (the bf16 input with the part swapped in) and are carried through every later
bf16 layer as that layer is read, so the extra memory is one [B, S, H] activation per candidate (at full
size with the default 8 x 512 held-out tokens: 16 MB each in bf16, ~4 GB for 240 candidates), and the work
about L/2 layer forwards per candidate. ``KLTracker`` does the same for one whole assignment during the
quantize pass: the measured KL printed beside the predicted one.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from fp4moe.errors import UserError
from fp4moe.layers.divergence import token_kl
from fp4moe.layers.norm import rms_norm_zero_centred
from fp4moe.quantize import calibrate
from fp4moe.quantize import parts as P

TABLE_VERSION = 1
LOGIT_ROWS = 256  # token rows per lm_head chunk (full-size vocab: 256 x 248K fp32 = 254 MB)


class SensitivityError(UserError, ValueError):
    pass


@dataclass
class PartCost:
    """One (layer, part): its weights, the bytes it stores per format and the KL it costs per format."""

    layer: int
    part: str
    params: int
    bytes: dict[str, int]
    kl: dict[str, float]  # mean KL per held-out token with only this part in that format; bf16: 0

    def __post_init__(self):
        if self.part not in P.PARTS:
            raise ValueError(f"unknown part {self.part!r}")
        if any(f not in P.FORMATS for f in (*self.bytes, *self.kl)):
            raise ValueError(f"layer {self.layer} {self.part}: unknown format in {sorted(self.kl)}")


@dataclass
class SensitivityTable:
    """``sensitivity.json``: what was measured (``fingerprint``: the source and every setting the numbers
    depend on), on how many held-out tokens, and the per-part costs."""

    fingerprint: dict
    held_out_tokens: int
    fixed_bytes: int  # tensors outside the searched parts (embeddings, norms, routers, lm_head, ...)
    parts: list[PartCost]
    seconds: float = 0.0
    version: int = TABLE_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"

    @classmethod
    def load(cls, path: str | Path) -> SensitivityTable:
        path = Path(path)
        if path.is_dir():  # an output folder: its table
            path = path / "sensitivity.json"
        try:
            raw = json.loads(path.read_text())
            if raw.get("version") != TABLE_VERSION:
                raise SensitivityError(f"{path}: sensitivity table version {raw.get('version')}, "
                                       f"this fp4moe reads {TABLE_VERSION}: measure again")  # fmt: skip
            raw["parts"] = [PartCost(**p) for p in raw["parts"]]
            return cls(**raw)
        except FileNotFoundError:
            raise SensitivityError(f"--sensitivity {path}: no such file") from None
        except OSError as e:
            raise SensitivityError(f"--sensitivity {path}: cannot be read ({e.strerror or e})") from None
        except (json.JSONDecodeError, TypeError, KeyError, AttributeError) as e:
            raise SensitivityError(f"--sensitivity {path}: not a sensitivity table ({e})") from None

    def save(self, path: Path) -> None:
        """Written to a temporary file and renamed: an interrupted run never leaves half a table."""
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)

    def check(self, fingerprint: dict, path: str | Path) -> None:
        """SensitivityError where this table was measured on another source or with other settings."""
        diff = sorted(k for k in fingerprint.keys() | self.fingerprint.keys()
                      if fingerprint.get(k) != self.fingerprint.get(k))  # fmt: skip
        if diff:
            k = diff[0]
            raise SensitivityError(
                f"--sensitivity {path} was measured with {k}={self.fingerprint.get(k)!r}, this run has "
                f"{fingerprint.get(k)!r}: drop --sensitivity to measure again, or match the settings"
            )


def fingerprint(src: Path, reader, options, tokens: torch.Tensor, held: torch.Tensor) -> dict:
    """The source (config.json's digest, the tensor bytes, a digest of its small tensors: norms and routers,
    which a fine-tune of the same architecture changes), the calibration and held-out token windows
    themselves (so another text or tokenizer under the same file name is caught) and every option the KL
    numbers depend on."""
    config = hashlib.sha256((src / "config.json").read_bytes()).hexdigest()[:16]
    small = hashlib.sha256()
    for name in sorted(n for n in reader.names() if n.endswith(("norm.weight", "mlp.gate.weight")))[:64]:
        small.update(name.encode() + reader.get(name).float().numpy().tobytes())
    windows = hashlib.sha256(tokens.to(torch.int64).numpy().tobytes() + held.to(torch.int64).numpy().tobytes())
    return {
        "config_sha256": config,
        "tensor_bytes": reader.total_bytes(),
        "small_tensors_sha256": small.hexdigest()[:16],
        "tokens_sha256": windows.hexdigest()[:16],
        "calibrate_all_experts": options.calibrate_all_experts,
        "scale_method": options.scale_method.value,
        "gptq": options.gptq,
        "format": options.format.value,
        "calib_file": Path(options.calib_file).name if options.calib_file else None,
        "calib_dataset": options.calib_dataset,
        "num_samples": options.num_samples,
        "seq_len": options.seq_len,
        "seed": options.seed,
        "sensitivity_samples": options.sensitivity_samples,
        "calib_dtype": options.calib_dtype,
    }


class FinalLogits:
    """The model's last norm and lm_head: log-probabilities [T, V] of hidden states, a chunk of rows at a time."""

    def __init__(self, reader, prefix: str, text_config, device, dtype):
        self.norm = reader.get(f"{prefix}norm.weight").to(device=device, dtype=dtype)
        head = "lm_head.weight" if "lm_head.weight" in reader else f"{prefix}embed_tokens.weight"
        self.head = reader.get(head).to(device=device, dtype=dtype)
        self.eps = float(getattr(text_config, "rms_norm_eps", 1e-6))

    def kl_sum(self, ref: torch.Tensor, other: torch.Tensor) -> float:
        """Sum over tokens of KL(ref || other), both [B, S, H] before the final norm."""
        total = 0.0
        for a, b in zip(
            ref.flatten(0, 1).split(LOGIT_ROWS), other.flatten(0, 1).split(LOGIT_ROWS), strict=True
        ):
            total += float(token_kl(self.logprobs(a), self.logprobs(b)).sum())
        return total

    def logprobs(self, h: torch.Tensor) -> torch.Tensor:
        x = rms_norm_zero_centred(h, self.norm, self.eps)
        return torch.log_softmax((x @ self.head.T).float(), -1)


def layer_shapes(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Size]:
    return {n: t.shape for n, t in tensors.items()}


@dataclass
class _Candidate:
    layer: int
    part: str
    fmt: str
    hidden: torch.Tensor


@dataclass
class Measurement:
    """The streaming sensitivity pass, fed one decoder layer at a time by the pipeline (``step``), summed up
    by ``finish``."""

    held_out: torch.Tensor  # [B, S, H] bf16 hidden states of the held-out windows at the current layer
    rotary: object
    options: object
    device: torch.device
    dtype: torch.dtype
    itemsize: int
    pending: list[_Candidate] = field(default_factory=list)
    costs: list[PartCost] = field(default_factory=list)
    bar: object = None

    def step(self, i: int, layer, tensors: dict[str, torch.Tensor], stats) -> None:
        """Layer ``i`` (transformers' module ``layer`` holding ``tensors``, names relative to the layer;
        ``stats``: its calibration statistics, with Hessians under ``--gptq``): carry every started candidate
        through it, then start its own parts' candidates."""
        opts, bs = self.options, self.options.batch_size
        for c in self.pending:
            c.hidden = calibrate.run_layer(layer, c.hidden, self.rotary, bs)
        shapes = layer_shapes(tensors)
        fp8_ok = opts.format.value == "modelopt"
        for part in P.layer_parts(tensors):
            formats = P.candidates(part, opts.gptq, fp8_ok)
            self.costs.append(PartCost(
                i, part, P.part_params(shapes, part),
                {f: P.part_bytes(shapes, part, f, self.itemsize) for f in (P.BF16, *formats)}, {P.BF16: 0.0},
            ))  # fmt: skip
            for fmt in formats:
                weights = P.part_weights(
                    tensors, part, fmt, opts.scale_method, self.device, self.dtype, stats
                )
                with P.Swapped(layer, weights):
                    out = calibrate.run_layer(layer, self.held_out, self.rotary, bs)
                self.pending.append(_Candidate(i, part, fmt, out))
                if self.bar is not None:
                    self.bar.update(1)
        self.held_out = calibrate.run_layer(layer, self.held_out, self.rotary, bs)

    def finish(self, final: FinalLogits) -> list[PartCost]:
        tokens = self.held_out.shape[0] * self.held_out.shape[1]
        by_key = {(c.layer, c.part): c for c in self.costs}
        for c in self.pending:
            by_key[(c.layer, c.part)].kl[c.fmt] = final.kl_sum(self.held_out, c.hidden) / tokens
        self.pending.clear()
        return self.costs


class KLTracker:
    """The measured KL of one whole assignment, in the quantize pass: the held-out windows through the bf16
    layers and through the layers as written (each layer's chosen formats swapped in), compared at the end."""

    def __init__(self, held_out: torch.Tensor, rotary, options, device, dtype):
        self.ref, self.quant = held_out, held_out.clone()
        self.rotary, self.options, self.device, self.dtype = rotary, options, device, dtype

    def step(self, layer, tensors: dict[str, torch.Tensor], formats: dict[str, str], stats) -> None:
        bs = self.options.batch_size
        weights = {}
        for part, fmt in formats.items():
            if fmt != P.BF16:
                weights.update(P.part_weights(tensors, part, fmt, self.options.scale_method, self.device,
                                              self.dtype, stats))  # fmt: skip
        with P.Swapped(layer, weights):
            self.quant = calibrate.run_layer(layer, self.quant, self.rotary, bs)
        self.ref = calibrate.run_layer(layer, self.ref, self.rotary, bs)

    def finish(self, final: FinalLogits) -> float:
        return final.kl_sum(self.ref, self.quant) / (self.ref.shape[0] * self.ref.shape[1])
