"""The sensitivity table as one figure (``sensitivity.png``): per candidate format a panel of decoder layer x
part, the colour the KL each part costs per MB it saves against bf16 (log scale; grey where the layer has
no such part)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fp4moe.quantize import parts as P


def kl_per_mb_saved(table, fmt: str) -> np.ndarray:
    """[layers, parts] KL per MB saved by ``fmt`` (NaN where not measured)."""
    layers = 1 + max(c.layer for c in table.parts)
    grid = np.full((layers, len(P.PARTS)), np.nan)
    for c in table.parts:
        saved = c.bytes[P.BF16] - c.bytes.get(fmt, c.bytes[P.BF16])
        if fmt in c.kl and saved > 0:
            grid[c.layer, P.PARTS.index(c.part)] = c.kl[fmt] / (saved / 1e6)
    return grid


def plot_table(table, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    formats = [f for f in P.FORMATS if f != P.BF16 and any(f in c.kl for c in table.parts)]
    grids = [kl_per_mb_saved(table, f) for f in formats]
    finite = np.concatenate([g[np.isfinite(g) & (g > 0)] for g in grids] or [np.array([1.0])])
    norm = LogNorm(vmin=float(finite.min()), vmax=float(max(finite.max(), finite.min() * 1.01)))
    layers = grids[0].shape[0]
    fig, axes = plt.subplots(1, len(formats), figsize=(2.8 * len(formats) + 2, 0.28 * layers + 2.4),
                             squeeze=False, sharey=True)  # fmt: skip
    for ax, fmt, grid in zip(axes[0], formats, grids, strict=True):
        ax.set_facecolor("#dddddd")
        image = ax.imshow(np.where(grid > 0, grid, np.nan), aspect="auto", norm=norm, cmap="viridis")
        ax.set_title(fmt)
        ax.set_xticks(range(len(P.PARTS)), P.PARTS, rotation=45, ha="right")
        ax.set_yticks(range(layers))
    axes[0][0].set_ylabel("decoder layer")
    fig.colorbar(image, ax=axes[0].tolist(), label="KL per MB saved vs bf16 (nats/token/MB)")
    fig.suptitle(f"only that part in that format, {table.held_out_tokens} held-out tokens", y=1.0)
    fig.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(fig)
