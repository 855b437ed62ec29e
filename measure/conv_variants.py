"""The causal convolution's forward (or, with --backward, its backward) at the layer's size under other tiles and
occupancy hints:

    python measure/conv_variants.py [--backward] [--tiles 32x128,16x128] [--occupancy table,2]
                                    [--batch 8] [--seqlen 4096] [--channels 5376] [--json OUT]

x is the layer's: a (batch, channels, seqlen) transposed view of a slice of a wider (batch, seqlen, 10576) bf16
buffer (the input projection's output); width 4, bias, SiLU. Variants: the package's choice, then each of --tiles
(BTxBC: CONV_TILE_T x CONV_TILE_C, or CONV_BWD_TILE_T x CONV_BWD_TILE_C with --backward; harness.constants) under
each --occupancy hint ("table": the package's, "none": no hint; harness.hints). The backward is
m2ops::causal_conv1d_bwd called directly (g_x, g_weight, g_bias). Times: harness.median_ms (L2 flushed, median of
50); y compared with the package's choice (rel_err). Ends with the bandwidth bound.
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
    ap.add_argument("--backward", action="store_true", help="time causal_conv1d_bwd instead of the forward")
    ap.add_argument("--tiles", default="32x128,64x128,16x128,32x64,64x64,128x64,32x256",
                    help="BTxBC tilings, comma-separated (default: %(default)s)")
    ap.add_argument("--occupancy", default="table,2", help="occupancy hints, comma-separated (default: %(default)s)")
    harness.add_json(ap)
    args = ap.parse_args()
    b, L, C = args.batch, args.seqlen, args.channels
    buf = torch.randn(b, L, 10576, device="cuda", dtype=torch.bfloat16)
    x = buf[:, :, 5120:5120 + C].transpose(1, 2)
    w = torch.randn(C, 4, device="cuda", dtype=torch.bfloat16) * 0.3
    bias = torch.randn(C, device="cuda", dtype=torch.bfloat16)

    g_y = torch.randn(b, L, C, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    no_final = x.new_zeros((b, C, 0))

    def call():
        if args.backward:
            return torch.ops.m2ops.causal_conv1d_bwd(g_y, no_final, x, w, bias, None, None, True)[0]
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
    kernel = "causal_conv1d_bwd" if args.backward else "causal_conv1d"
    prefix = "CONV_BWD_TILE" if args.backward else "CONV_TILE"
    for tile in (t for t in args.tiles.split(",") if t):
        bt, bc = (int(v) for v in tile.split("x"))
        for occ in (o for o in args.occupancy.split(",") if o):
            with harness.constants(**{f"{prefix}_T": bt, f"{prefix}_C": bc}), \
                    harness.hints({} if occ == "table" else {kernel: {}} if occ == "none"
                                  else {kernel: {"occupancy": int(occ)}}):
                row(f"BT={bt} BC={bc} occupancy={occ}")
    moved = 3 if args.backward else 2  # (x, y) or (x, g_y, g_x)
    print(f"bandwidth bound at 3.35 TB/s: {moved * b * L * C * 2 / 3.35e12 * 1e3:.3f} ms")
    harness.write_json(args.json, rows)


if __name__ == "__main__":
    main()
