"""Tiles of the Gated DeltaNet prefill conv (``kernels.causal_conv``, planar q/k/v out) on the full-size shape:
an 8,192-token chunk of in_proj's rows (8,192 conv channels at the fused projection's row stride), fresh
state; each candidate (token rows, channels, warps) checked equal to the default's output, timed as the median
of CUDA-event replays, with its share of the copy bandwidth (bytes read and written once).

    python3 benchmarks/tune/tune_conv.py --tokens 8192

Then the same for the sliding-window kernel (``causal_conv.WINDOW``: each input row read once), whose outputs
equal the taps kernel's but where the heads' L2 norm sums its squares in another order ("same output" may
then say False for a bf16 step on a few elements).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, provenance.py
from common import event_seconds  # noqa: E402
from provenance import write_result

from fp4moe.kernels import causal_conv

CANDIDATES = [(32, 128, 4), (64, 128, 4), (32, 256, 4), (64, 256, 8), (16, 256, 4), (128, 64, 4), (64, 64, 2)]
WINDOW_CANDIDATES = [(16, 1024, 4), (8, 1024, 4), (32, 1024, 4), (16, 512, 2), (16, 2048, 8), (8, 512, 2)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="rows of the chunk")
    ap.add_argument("--out", default="", help="write the timings to this JSON file")
    args = ap.parse_args()
    dev = torch.device("cuda")
    n, c, key = args.tokens, 8192, 2048  # conv channels: q, k (16 x 128 each), v (32 x 128)
    rows = torch.randn(n, c + 4096 + 64, device=dev, dtype=torch.bfloat16)  # + z, b, a: in_proj's row
    x = rows[:, :c]
    state = torch.zeros(c, 3, device=dev, dtype=torch.bfloat16)
    w = torch.randn(c, 1, 4, device=dev, dtype=torch.bfloat16) * 0.5
    parts, norm = (key, 2 * key), 128  # q and k L2-normalised per head, as the engine runs it
    causal_conv.WINDOW = False  # the taps kernel first, its default tile the reference
    ref, _ = causal_conv.causal_conv_silu(x, state, w, parts, norm)
    out = []

    def sweep(kind, tiles, setting):
        """Time each tile (``setting``: the module attribute holding the kernel's tile) against ``ref``."""
        default = getattr(causal_conv, setting)
        for tile in tiles:
            setattr(causal_conv, setting, tile)
            try:
                got, _ = causal_conv.causal_conv_silu(x, state, w, parts, norm)
            except ValueError as e:  # a channel block that splits a normalised head: not a candidate here
                print(f"{kind} tile {tile}: skipped ({e})", flush=True)
                continue
            same = all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
            sec = sorted(event_seconds(lambda: causal_conv.causal_conv_silu(x, state, w, parts, norm), 20))[
                10
            ]
            gbs = 2 * n * c * 2 / sec / 1e9
            out.append(dict(kernel=kind, tile=tile, us=sec * 1e6, gb_s=gbs, same=same))
            print(f"{kind} tile {tile}: {sec * 1e6:.1f} us, {gbs:.0f} GB/s, same output: {same}", flush=True)
        setattr(causal_conv, setting, default)

    sweep("taps", CANDIDATES, "TILE")
    causal_conv.WINDOW = True
    sweep("window", WINDOW_CANDIDATES, "WINDOW_TILE")
    causal_conv.WINDOW = False
    if args.out:
        write_result(args.out, dict(device=torch.cuda.get_device_name(), tokens=n, rows=out), indent=1)


if __name__ == "__main__":
    main()
