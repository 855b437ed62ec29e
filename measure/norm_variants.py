"""The gated RMSNorm's forward kernel at the layer's size, under build hints and tilings, against the package's:

    python measure/norm_variants.py [--rows 32768] [--hidden 5120] [--group 5120] [--json OUT]

bf16 x and z (z a slice of a wider buffer, as the layer's), weight in float32, norm after the gate
(norm_before_gate=False). Variants: the package's launch (m2ops.rms_norm_gated: for groups over 4096 channels
gated_norm_wide_kernel, which holds BR rows of the group as NC = cdiv(group, CS) column tiles in registers), that
kernel at other tilings and hints, and gated_norm_kernel holding the whole group in one power-of-two tile (one row
per program). Each variant's y is compared with the package's (rel_err); times are harness.median_ms (L2 flushed,
median of 50). Ends with the bandwidth bound (x, z read once, y written once).
"""

from __future__ import annotations

import harness  # first of the local imports: it puts the repository on sys.path
import torch
from gpu_cases import rel_err

import m2ops
from m2ops.kernels import runtime
from m2ops.kernels.common import cdiv
from m2ops.kernels.norm import NORM_HINTS
from m2ops.kernels.specialise import hinted


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
            runtime.launch((cdiv(R, BR), ng, 1), k, (x3, z3, w2, dummy, y3, rstd, 1.0 / G, 1e-5, 1, 0, 1, BR, GS))
        row(f"gated_norm BR={BR} GS={GS} {hints}", launch, lambda: y)

    def wide_run(BR, CS, hints=None):
        k = hinted("gated_norm_wide", tuple(sorted((hints or dict(NORM_HINTS)).items())))

        def launch():
            runtime.launch((cdiv(R, BR), ng, 1), k,
                           (x3, z3, w2, dummy, y3, rstd, 1.0 / G, 1e-5, 1, 0, 1, BR, CS, cdiv(G, CS)))
        row(f"gated_norm_wide BR={BR} CS={CS} {hints or dict(NORM_HINTS)}", launch, lambda: y)

    runs = [lambda: wide_run(4, 512), lambda: wide_run(8, 512), lambda: wide_run(2, 512),
            lambda: wide_run(4, 256), lambda: wide_run(2, 1024), lambda: wide_run(4, 512, {"num_worker_warps": 4}),
            lambda: hinted_run({"num_ctas": 2})]
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
