"""The gated RMSNorm's forward kernel at the layer's size, under build hints and tilings, against the package's:

    python measure/norm_variants.py [--rows 32768] [--hidden 5120] [--group 5120] [--json OUT]

bf16 x and z (z a slice of a wider buffer, as the layer's), weight in float32, norm after the gate
(norm_before_gate=False). Variants: the package's launch (m2ops.rms_norm_gated), gated_norm_kernel launched with
other hints (one CTA: the package builds a pair of CTAs for groups over 4096), and a column-chunked kernel (each
program holds BR rows and walks the group in CS-column tiles twice: sums of squares, then the output), so that no
tile is padded to a power of two. Each variant's y is compared with the package's (rel_err); times are
harness.median_ms (L2 flushed, median of 50). Ends with the bandwidth bound (x, z read once, y written once).
"""

from __future__ import annotations

import harness  # first of the local imports: it puts the repository on sys.path
import cuda.tile as ct
import torch
from gpu_cases import rel_err

import m2ops
from m2ops.kernels import runtime
from m2ops.kernels.common import Big, ConstInt, cdiv
from m2ops.kernels.gated_norm import sigmoid
from m2ops.kernels.specialise import hinted

_ZERO = ct.PaddingMode.ZERO


@ct.kernel
def chunked_norm_kernel(x: Big, z: Big, weight, y: Big, inv_group_size: float, eps: float,
                        BR: ConstInt, CS: ConstInt, NC: ConstInt):
    rb = ct.bid(0)
    g = ct.bid(1)
    ss = ct.zeros((BR,), dtype=ct.float32)
    for c in range(NC):
        zf = ct.load(z, (rb, g, c), shape=(BR, 1, CS), padding_mode=_ZERO).reshape((BR, CS)).astype(ct.float32)
        h = ct.load(x, (rb, g, c), shape=(BR, 1, CS), padding_mode=_ZERO).reshape((BR, CS)).astype(ct.float32)
        h = h * (zf * sigmoid(zf))
        ss = ss + ct.sum(h * h, axis=1)
    r = ct.rsqrt(ss * inv_group_size + eps)
    for c in range(NC):
        zf = ct.load(z, (rb, g, c), shape=(BR, 1, CS), padding_mode=_ZERO).reshape((BR, CS)).astype(ct.float32)
        h = ct.load(x, (rb, g, c), shape=(BR, 1, CS), padding_mode=_ZERO).reshape((BR, CS)).astype(ct.float32)
        w = ct.load(weight, (g, c), shape=(1, CS), padding_mode=_ZERO).astype(ct.float32)
        o = h * (zf * sigmoid(zf)) * r[:, None] * w
        ct.store(y, (rb, g, c), o.astype(y.dtype).reshape((BR, 1, CS)))


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--group", type=int, default=5120)
    harness.add_json(ap)
    args = ap.parse_args()
    R, H, G = args.rows, args.hidden, args.group
    ng = H // G
    buf = torch.randn(R, 2 * H, device="cuda", dtype=torch.bfloat16)
    x, z = torch.randn(R, H, device="cuda", dtype=torch.bfloat16), buf[:, :H]
    w = torch.rand(H, device="cuda") + 0.5
    ref = m2ops.rms_norm_gated(x, w, z, None, 1e-5, G, False)
    rows = []

    def row(name, fn, out):
        fn()
        ms = harness.median_ms(fn, runs=50, warmup=5)
        rows.append({"variant": name, "ms": ms, "rel_err": rel_err(out(), ref)})
        print(f"{name:44s} {ms:8.3f} ms  err {rows[-1]['rel_err']:.2e}", flush=True)

    row("package (m2ops.rms_norm_gated)", lambda: m2ops.rms_norm_gated(x, w, z, None, 1e-5, G, False),
        lambda: m2ops.rms_norm_gated(x, w, z, None, 1e-5, G, False))
    y = torch.empty_like(x)
    GS = 1 << (G - 1).bit_length()
    rstd = torch.empty(ng, R, device="cuda")
    x3, z3, y3, w2 = x.view(R, ng, G), z.view(R, ng, G), y.view(R, ng, G), w.view(ng, G)
    dummy = torch.empty(1, 1, device="cuda")

    def hinted_run(hints, BR=1):
        k = hinted("gated_norm", tuple(sorted(hints.items())))

        def launch():
            runtime.launch((cdiv(R, BR), ng, 1), k, (x3, z3, w2, dummy, y3, rstd, 1.0 / G, 1e-5, 1, 0, 0, BR, GS))
        row(f"gated_norm BR={BR} GS={GS} {hints}", launch, lambda: y)

    def chunked_run(BR, CS, hints=None):
        if G % CS:
            return
        k = chunked_norm_kernel.replace_hints(**hints) if hints else chunked_norm_kernel

        def launch():
            ct.launch(runtime.stream_handle(), (cdiv(R, BR), ng, 1), k,
                      (x3, z3, w2, y3, 1.0 / G, 1e-5, BR, CS, G // CS))
        row(f"chunked BR={BR} CS={CS} {hints or {}}", launch, lambda: y)

    # the likeliest first: a time-out still leaves the rows printed so far
    runs = [lambda: chunked_run(4, 1024), lambda: hinted_run({"num_worker_warps": 8}),
            lambda: chunked_run(2, 1024), lambda: chunked_run(1, 1024), lambda: chunked_run(8, 512),
            lambda: chunked_run(4, 512), lambda: chunked_run(1, 512), lambda: hinted_run({"num_worker_warps": 4}),
            lambda: hinted_run({}), lambda: hinted_run({"num_ctas": 2, "num_worker_warps": 8})]
    for run in runs:
        try:
            run()
        except Exception as e:  # noqa: BLE001 - a build that fails is a result too
            print(f"failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
    bound = 3 * R * H * 2 / 3.35e12 * 1e3
    print(f"bandwidth bound at 3.35 TB/s: {bound:.3f} ms")
    harness.write_json(args.json, rows)


if __name__ == "__main__":
    main()
