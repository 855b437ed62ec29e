"""The causal convolution's forward (or, with --backward, its backward) at the layer's size under other tiles and
occupancy hints:

    python measure/conv_variants.py [--backward] [--tiles 32x128,16x128] [--occupancy table,2]
                                    [--batch 8] [--seqlen 4096] [--channels 5376] [--json OUT]

x is the layer's: a (batch, channels, seqlen) transposed view of a slice of a wider (batch, seqlen, 10576) bf16
buffer (the input projection's output); width 4, bias, SiLU. Variants: the package's choice, then each of --tiles (BTxBC: CONV_TILE_T x CONV_TILE_C, or
CONV_BWD_TILE_T x CONV_BWD_TILE_C with --backward; harness.constants) under each --occupancy hint ("table": the
package's, "none": no hint; harness.hints). The backward is m2ops::causal_conv1d_bwd called directly (g_x, g_weight, g_bias).
Forward only, --gather-tiles: a kernel defined here (gather: each tap's operand a ct.gather of the token rows
shifted by its offset, channels contiguous; rows before the sequence's start come back as zeros; no seq_idx or
initial states) under each --occupancy, y written channel-last. Times: harness.median_ms
(L2 flushed, median of 50); y compared with the package's choice (rel_err). Ends with the bandwidth bound.
"""

from __future__ import annotations

import harness  # first of the local imports: it puts the repository on sys.path
import torch
from gpu_cases import rel_err

import cuda.tile as ct

import m2ops
from m2ops.kernels import runtime
from m2ops.kernels.common import Big, ConstInt, cdiv, silu

_ZERO = ct.PaddingMode.ZERO


def _gather_kernel(x: Big, w, bias, y: Big, W: ConstInt, BT: ConstInt, BC: ConstInt):
    """y[t] = silu(bias + sum_k w[k] x[t - (W-1) + k]) of a (BT, BC) tile; x, y (batch, seqlen, channels)."""
    i = ct.bid(0)
    cb = ct.bid(1)
    b = ct.bid(2)
    wt = ct.transpose(ct.load(w, (cb, 0), shape=(BC, 4), padding_mode=_ZERO))
    t = i * BT + ct.arange(BT, dtype=ct.int32)
    c = cb * BC + ct.arange(BC, dtype=ct.int32)
    acc = ct.load(bias, (cb,), shape=(BC,), padding_mode=_ZERO).reshape((1, BC)) + ct.zeros((BT, BC), ct.float32)
    for k in ct.static_iter(range(W)):
        v = ct.gather(x, (b, (t - (W - 1 - k))[:, None], c[None, :]))
        acc = acc + v.astype(ct.float32) * ct.extract(wt, (k, 0), (1, BC))
    ct.store(y, (b, i, cb), silu(acc).astype(y.dtype).reshape((1, BT, BC)))


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--channels", type=int, default=5376)
    ap.add_argument("--backward", action="store_true", help="time causal_conv1d_bwd instead of the forward")
    ap.add_argument("--tiles", default="32x128,64x128,16x128,32x64,64x64,128x64,32x256",
                    help="BTxBC tilings, comma-separated (default: %(default)s)")
    ap.add_argument("--occupancy", default="table,2", help="occupancy hints, comma-separated (default: %(default)s)")
    ap.add_argument("--gather-tiles", default="", help="BTxBC tilings of the gather kernel (forward; default none)")
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

    def row(name, fn=call):
        try:
            fn()
            ms = harness.median_ms(fn, runs=50, warmup=5)
        except Exception as e:  # noqa: BLE001 - a build that fails is a result too
            print(f"{name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            return
        rows.append({"variant": name, "ms": ms, "rel_err": rel_err(fn(), ref)})
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
    if args.gather_tiles and not args.backward:
        xl, w32, b32 = x.transpose(1, 2), w.float().contiguous(), bias.float()
        yl = torch.empty(b, L, C, device="cuda", dtype=torch.bfloat16)
        for tile in args.gather_tiles.split(","):
            bt, bc = (int(v) for v in tile.split("x"))
            for occ in (o for o in args.occupancy.split(",") if o):
                kernel = ct.kernel(_gather_kernel, **({} if occ == "table" else {"occupancy": int(occ)}))

                def gathered(kernel=kernel, bt=bt, bc=bc):
                    runtime.launch((cdiv(L, bt), cdiv(C, bc), b), kernel, (xl, w32, b32, yl, 4, bt, bc))
                    return yl.transpose(1, 2)
                row(f"gather BT={bt} BC={bc} occupancy={'none' if occ == 'table' else occ}", gathered)
    moved = 3 if args.backward else 2  # (x, y) or (x, g_y, g_x)
    print(f"bandwidth bound at 3.35 TB/s: {moved * b * L * C * 2 / 3.35e12 * 1e3:.3f} ms")
    harness.write_json(args.json, rows)


if __name__ == "__main__":
    main()
