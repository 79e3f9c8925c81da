"""What ``inspect_checkpoint`` reports: the checkpoint's verdict, counts, sizes, problems and warnings
(``InspectReport``, with its table), and the collector that keeps a long list of one kind of problem short
(``Problems``)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

MAX_LISTED = 20  # problems of one kind listed before "... and N more"


@dataclass
class InspectReport:
    path: str
    format: str | None = None
    num_layers: int = 0
    num_experts: int = 0
    experts_quantized: int = 0
    experts_bf16: int = 0
    experts_fused_nvfp4: int = 0
    exclude_entries: int = 0
    mtp_tensors: int = 0
    vision_tensors: int = 0
    kv_cache: str = "-"  # "fp8, calibrated scales" where the config declares an fp8 KV cache
    bytes_on_disk: int = 0
    bytes_bf16_equivalent: int = 0
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "ok": self.ok}, indent=2)

    def table(self) -> str:
        gb = 1e9
        ratio = self.bytes_on_disk / self.bytes_bf16_equivalent if self.bytes_bf16_equivalent else 0.0
        rows = [
            ("checkpoint", self.path),
            ("format", self.format or "-"),
            ("layers x experts", f"{self.num_layers} x {self.num_experts}"),
            ("experts NVFP4 (per-expert)", str(self.experts_quantized)),
            ("experts NVFP4 fused (needs convert)", str(self.experts_fused_nvfp4)),
            ("experts left bf16", str(self.experts_bf16)),
            ("exclude-list entries", str(self.exclude_entries)),
            ("MTP tensors", str(self.mtp_tensors)),
            ("vision tensors", str(self.vision_tensors)),
            ("KV cache", self.kv_cache),
            (
                "size",
                f"{self.bytes_on_disk / gb:.3f} GB ({ratio:.1%} of {self.bytes_bf16_equivalent / gb:.3f} GB bf16)",
            ),
            ("result", "OK" if self.ok else f"{len(self.problems)} problem(s)"),
        ]
        width = max(len(k) for k, _ in rows)
        out = [f"{k:<{width}}  {v}" for k, v in rows]
        out += [f"PROBLEM: {p}" for p in self.problems]
        out += [f"warning: {w}" for w in self.warnings]
        return "\n".join(out)


class Problems:
    """Collects problems, listing at most MAX_LISTED of each kind."""

    def __init__(self, report: InspectReport):
        self.report = report
        self.counts: dict[str, int] = {}

    def add(self, kind: str, message: str) -> None:
        n = self.counts.get(kind, 0) + 1
        self.counts[kind] = n
        if n <= MAX_LISTED:
            self.report.problems.append(message)

    def finish(self) -> None:
        for kind, n in self.counts.items():
            if n > MAX_LISTED:
                self.report.problems.append(f"... and {n - MAX_LISTED} more problems of kind '{kind}'")
