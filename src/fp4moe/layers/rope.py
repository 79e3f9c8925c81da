"""Partial rotary embedding with interleaved mRoPE (T/H/W position sections) and YaRN context extension.

Only the first ``rotary_dim = head_dim * partial_rotary_factor`` dims rotate (rotate-half style within them).
Frequency i takes its position from the H axis if i % 3 == 1 and i < 3 * sections[1], from W if
i % 3 == 2 and i < 3 * sections[2], else from T. For text all three positions are equal (plain 1-D rope).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeConfig:
    head_dim: int
    theta: float = 1e7
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, int, int] = (11, 11, 10)
    rope_type: str = "default"  # or "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    truncate: bool = True

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_text_config(cls, text: dict) -> RopeConfig:
        params = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ("default", "yarn"):
            raise ValueError(f"unsupported rope_type {rope_type!r}; fp4moe supports default and yarn")
        head_dim = int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])
        kw = dict(
            head_dim=head_dim,
            theta=float(params.get("rope_theta", text.get("rope_theta", 10000.0))),
            partial_rotary_factor=float(
                params.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
            ),
            mrope_section=tuple(params.get("mrope_section", (11, 11, 10))),
            rope_type=rope_type,
        )
        if rope_type == "yarn":
            factor = float(params["factor"])
            original = params.get("original_max_position_embeddings") or text.get("max_position_embeddings")
            kw |= dict(
                factor=factor,
                original_max_position_embeddings=int(original),
                beta_fast=float(params.get("beta_fast") or 32.0),
                beta_slow=float(params.get("beta_slow") or 1.0),
                attention_factor=params.get("attention_factor"),
                truncate=bool(params.get("truncate", True)),
            )
        cfg = cls(**kw)
        if sum(cfg.mrope_section) != cfg.rotary_dim // 2:
            raise ValueError(
                f"mrope_section {cfg.mrope_section} must sum to rotary_dim/2 = {cfg.rotary_dim // 2}"
            )
        return cfg


def inv_freq_and_scale(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim/2] and the cos/sin scale (1 except for YaRN)."""
    dim = cfg.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.float) / dim
    base_inv = 1.0 / (cfg.theta**exponents)
    if cfg.rope_type == "default":
        return base_inv, 1.0

    # YaRN: interpolate low frequencies by `factor`, keep high ones, ramp between the correction dims
    def correction_dim(rotations: float) -> float:
        return (
            dim
            * math.log(cfg.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(cfg.theta))
        )

    low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the original frequency), 0: interpolate
    inv = (base_inv / cfg.factor) * (1 - keep) + base_inv * keep
    scale = cfg.attention_factor
    if scale is None:
        scale = 0.1 * math.log(cfg.factor) + 1.0 if cfg.factor > 1 else 1.0
    return inv, float(scale)


class Rotary:
    """cos/sin for 3-axis positions, and their application to q/k."""

    def __init__(self, cfg: RopeConfig, device: torch.device | str = "cpu"):
        self.cfg = cfg
        inv, self.scale = inv_freq_and_scale(cfg)
        self.inv_freq = inv.to(device)
        n = cfg.rotary_dim // 2
        axis = torch.zeros(n, dtype=torch.long)  # 0 = T, 1 = H, 2 = W, per frequency
        i = torch.arange(n)
        axis[(i % 3 == 1) & (i < 3 * cfg.mrope_section[1])] = 1
        axis[(i % 3 == 2) & (i < 3 * cfg.mrope_section[2])] = 2
        self.axis = axis.to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, T] (or [T] for text) -> cos, sin [T, rotary_dim]."""
        if positions.ndim == 1:
            positions = positions.unsqueeze(0).expand(3, -1)
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [3, T, n]
        freqs = freqs.gather(0, self.axis.view(1, 1, -1).expand(1, freqs.shape[1], -1)).squeeze(0)  # [T, n]
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim]; rotates the first rotary_dim dims (rotate-half within them)."""
        d = cos.shape[-1]
        rot, rest = x[..., :d], x[..., d:]
        half = d // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return torch.cat([rot * cos + rotated * sin, rest], dim=-1)
