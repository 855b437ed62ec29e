"""The causal convolution's forward at the layer's size under other tiles and occupancy hints:

    python measure/conv_variants.py [--batch 8] [--seqlen 4096] [--channels 5376] [--json OUT]

x is the layer's: a (batch, channels, seqlen) transposed view of a slice of a wider (batch, seqlen, 10576) bf16
buffer (the input projection's output); width 4, bias, SiLU. Variants: the package's choice, then
CONV_TILE_T x CONV_TILE_C (harness.constants) and the occupancy hint (harness.hints). Times: harness.median_ms
(L2 flushed, median of 50); y compared with the package's choice (rel_err). Ends with the bandwidth bound.
With --backward, the backward op (m2ops.ops.causal_conv1d_bwd: g_x, g_weight, g_bias) likewise under
CONV_BWD_TILE_T x CONV_BWD_TILE_C.
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
    ap.add_argument("--backward", action="store_true", help="time the backward op instead")
    ap.add_argument("--tiles", default=None,
                    help="BTxBC,... tilings to try beside the package's (default: a built-in list; '' for none)")
    ap.add_argument("--occupancy", default="table,2", help="occupancy hints to try per tiling (table: the package's)")
    harness.add_json(ap)
    args = ap.parse_args()
    b, L, C = args.batch, args.seqlen, args.channels
    buf = torch.randn(b, L, 10576, device="cuda", dtype=torch.bfloat16)
    x = buf[:, :, 5120:5120 + C].transpose(1, 2)
    w = torch.randn(C, 4, device="cuda", dtype=torch.bfloat16) * 0.3
    bias = torch.randn(C, device="cuda", dtype=torch.bfloat16)

    g_y = torch.randn(b, L, C, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # channel-last, as the layer's
    g_final = x.new_zeros((b, C, 0))

    def call():
        if args.backward:
            return m2ops.ops.causal_conv1d_bwd(g_y, g_final, x, w, bias, None, None, True)[0]
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
    name, t_name, c_name = (("causal_conv1d_bwd", "CONV_BWD_TILE_T", "CONV_BWD_TILE_C") if args.backward else
                            ("causal_conv1d", "CONV_TILE_T", "CONV_TILE_C"))
    tiles = (((16, 128), (8, 1024), (16, 1024), (8, 512)) if args.backward else
             ((32, 128), (64, 128), (16, 128), (32, 64), (64, 64), (128, 64), (32, 256)))
    if args.tiles is not None:
        tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",") if t]
    occs = [None if o == "table" else int(o) for o in args.occupancy.split(",")]
    for bt, bc in tiles:
        for occ in occs:
            with harness.constants(**{t_name: bt, c_name: bc}), \
                    harness.hints({} if occ is None else {name: {"occupancy": occ}}):
                row(f"BT={bt} BC={bc} occupancy={occ or 'table'}")
    arrays = 3 if args.backward else 2  # x, g_y read and g_x written; x read and y written
    print(f"bandwidth bound at 3.35 TB/s: {arrays * b * L * C * 2 / 3.35e12 * 1e3:.3f} ms")
    harness.write_json(args.json, rows)


if __name__ == "__main__":
    main()
