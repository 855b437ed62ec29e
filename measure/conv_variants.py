"""The causal convolution's forward at the layer's size under other tiles and occupancy hints:

    python measure/conv_variants.py [--batch 8] [--seqlen 4096] [--channels 5376] [--json OUT]

x is the layer's: a (batch, channels, seqlen) transposed view of a slice of a wider (batch, seqlen, 10576) bf16
buffer (the input projection's output); width 4, bias, SiLU. Variants: the package's choice, then
CONV_TILE_T x CONV_TILE_C (harness.constants) and the occupancy hint (harness.hints). Times: harness.median_ms
(L2 flushed, median of 50); y compared with the package's choice (rel_err). Ends with the bandwidth bound.
"""

from __future__ import annotations

import harness  # first of the local imports: it puts the repository on sys.path
import torch
from gpu_cases import rel_err

import m2ops


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--channels", type=int, default=5376)
    harness.add_json(ap)
    args = ap.parse_args()
    b, L, C = args.batch, args.seqlen, args.channels
    buf = torch.randn(b, L, 10576, device="cuda", dtype=torch.bfloat16)
    x = buf[:, :, 5120:5120 + C].transpose(1, 2)
    w = torch.randn(C, 4, device="cuda", dtype=torch.bfloat16) * 0.3
    bias = torch.randn(C, device="cuda", dtype=torch.bfloat16)

    def call():
        return m2ops.causal_conv1d_fn(x, w, bias, activation="silu")

    ref = call()
    rows = []

    def row(name):
        try:
            call()
            ms = harness.median_ms(call, runs=50, warmup=5)
        except Exception as e:  # noqa: BLE001 - a build that fails is a result too
            print(f"{name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            return
        rows.append({"variant": name, "ms": ms, "rel_err": rel_err(call(), ref)})
        print(f"{name:40s} {ms:8.3f} ms  err {rows[-1]['rel_err']:.2e}", flush=True)

    row("package")
    for bt, bc in ((32, 128), (64, 128), (16, 128), (32, 64), (64, 64), (128, 64), (32, 256)):
        for occ in (None, 2):
            with harness.constants(CONV_TILE_T=bt, CONV_TILE_C=bc), \
                    harness.hints({} if occ is None else {"causal_conv1d": {"occupancy": occ}}):
                row(f"BT={bt} BC={bc} occupancy={occ or 'table'}")
    print(f"bandwidth bound at 3.35 TB/s: {2 * b * L * C * 2 / 3.35e12 * 1e3:.3f} ms")
    harness.write_json(args.json, rows)


if __name__ == "__main__":
    main()
