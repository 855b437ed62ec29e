"""The mixer backward's assembly of its two gradient buffers from their pieces (m2ops/ops/mixer.py, mixer_bwd):
the convolution output's gradient from the scan's g_x, g_B, g_C, and zxbcdt's from g_z, the convolution's input
gradient (channel-last storage, read through its transpose) and g_dt, timed as shipped against torch.cat:

    python measure/grad_assembly.py [--shape 8x4096] [--d-model 2560] [--json OUT]

bf16, d_state 128, headdim 64, one group, expand 2, no MLP part (m2ops.bench.layer's layer). "slices" writes each
piece into a slice of an empty buffer with copy_ (as shipped); "cat" is one torch.cat per buffer. Each variant's
buffers are compared with the shipped ones bit for bit.
"""

from __future__ import annotations

import harness  # first of the local imports: it puts the repository on sys.path
import torch


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--shape", default="8x4096")
    ap.add_argument("--d-model", type=int, default=2560)
    harness.add_json(ap)
    args = ap.parse_args()
    b, t = (int(v) for v in args.shape.lower().split("x"))
    h, p, n = 2 * args.d_model // 64, 64, 128
    d_ssm, conv_dim = h * p, h * p + 2 * n
    bf = dict(dtype=torch.bfloat16, device="cuda")
    g_x, g_B, g_C = torch.randn(b, t, h, p, **bf), torch.randn(b, t, 1, n, **bf), torch.randn(b, t, 1, n, **bf)
    g_z, g_dt = torch.randn(b, t, d_ssm, **bf), torch.randn(b, t, h, **bf)
    g_xbc = torch.randn(b, t, conv_dim, **bf).transpose(1, 2)  # (b, conv_dim, t), channel-last storage

    def slices():
        g_conv = torch.empty(b, t, conv_dim, **bf)
        for dst, src in zip(torch.split(g_conv, [d_ssm, n, n], -1), (g_x, g_B, g_C)):
            dst.copy_(src.flatten(-2))
        g_zx = torch.empty(b, t, d_ssm + conv_dim + h, **bf)
        for dst, src in zip(torch.split(g_zx, [d_ssm, conv_dim, h], -1), (g_z, g_xbc.transpose(1, 2), g_dt)):
            dst.copy_(src)
        return g_conv, g_zx

    def cat():
        g_conv = torch.cat([g_x.flatten(-2), g_B.flatten(-2), g_C.flatten(-2)], -1)
        return g_conv, torch.cat([g_z, g_xbc.transpose(1, 2), g_dt], -1)

    want = slices()
    rows = []
    for name, fn in (("slices", slices), ("cat", cat)):
        got = fn()
        same = all(torch.equal(a, w) for a, w in zip(got, want))
        rows.append(dict(variant=name, ms=harness.median_ms(fn, runs=50), equal=same))
    harness.print_table(rows)
    harness.write_json(args.json, rows, shape=args.shape, d_model=args.d_model)


if __name__ == "__main__":
    main()
