"""The gated RMSNorm's forward kernel at the layer's size, under build hints and tilings, against the package's:

    python measure/norm_variants.py [--backward] [--rows 32768] [--hidden 5120] [--group 5120] [--json OUT]

bf16 x and z (z a slice of a wider buffer, as the layer's), weight in float32, norm after the gate
(norm_before_gate=False). Variants: the package's launch (m2ops.rms_norm_gated: for groups over 4096 channels
gated_norm_wide_kernel, which holds BR rows of the group as NC = cdiv(group, CS) column tiles in registers), that
kernel at other tilings and hints, and gated_norm_kernel holding the whole group in one power-of-two tile (one row
per program). Each variant's y is compared with the package's (rel_err); times are harness.median_ms (L2 flushed,
median of 50). Ends with the bandwidth bound (x, z read once, y written once).

--backward times the backward instead: the package's (for wide groups two kernels, each reading dy, x and z:
gated_norm_wide_rows_kernel for the row sums, gated_norm_wide_bwd_kernel per column tile) against a one-pass
kernel defined here (bwd_onepass: a program walks row blocks, holds its BR rows of x, z and dy as NC column
tiles, forms the row sums, writes dx and dz, and keeps the weight's partial sums of its rows in registers, one
partial row per program, summed after), at a few tilings and programs per SM; dx, dz and dw compared with the
package's. The bound: dy, x, z read once, dx, dz written once.
"""

from __future__ import annotations

import harness  # first of the local imports: it puts the repository on sys.path
import torch
from gpu_cases import rel_err

import cuda.tile as ct
from cuda.tile import kernel as tile_kernel  # (kept when an emulator stands in for ct)

import m2ops
from m2ops.kernels import norm, runtime
from m2ops.kernels.common import Big, ConstInt, cdiv
from m2ops.kernels.gated_norm import sigmoid
from m2ops.kernels.gated_norm_bwd import gate_first_grad, gated_rows
from m2ops.kernels.gated_norm_wide import column_tile
from m2ops.kernels.norm import NORM_HINTS
from m2ops.kernels.specialise import hinted

_ZERO = ct.PaddingMode.ZERO


def _normed(xf, r, zf, has_z, gate_first):
    n = xf * r
    if has_z != 0:
        if gate_first != 0:
            n = n * (zf * sigmoid(zf))
    return n


def bwd_onepass_kernel(dy: Big, x: Big, z: Big, weight, bias, rstd, dx: Big, dz: Big, dw_part, db_part,
                       n_row_blocks: int, n_programs: int, inv_group_size: float, has_z: int, has_bias: int,
                       gate_first: int, BR: ConstInt, CS: ConstInt, NC: ConstInt):
    """The wide group's backward in one pass over dy, x and z (arrays as gated_norm_wide_bwd_kernel's)."""
    p = ct.bid(0)
    g = ct.bid(1)
    ws = ()
    dws = ()
    dbs = ()
    for c in ct.static_iter(range(NC)):
        ws += (ct.load(weight, (g, c), shape=(1, CS), padding_mode=_ZERO).astype(ct.float32),)
        dws += (ct.zeros((CS,), dtype=ct.float32),)
        dbs += (ct.zeros((CS,), dtype=ct.float32),)
    for rb in range(p, n_row_blocks, n_programs):
        r = ct.load(rstd, (g, rb), shape=(1, BR), padding_mode=_ZERO).reshape((BR, 1))
        xs = ()
        zs = ()
        dos = ()
        new_dw = ()
        new_db = ()
        acc = ct.zeros((BR,), dtype=ct.float32)
        for c in ct.static_iter(range(NC)):
            xf = column_tile(x, rb, g, c, BR, CS)
            zf, n, do = gated_rows(xf, r, column_tile(dy, rb, g, c, BR, CS), z, ws[c], bias, dz, rb, g, c, has_z,
                                   has_bias, gate_first, BR, CS)
            new_dw += (dws[c] + ct.sum(do * n, axis=0),)
            new_db += (dbs[c] + ct.sum(do, axis=0),)
            acc = acc + ct.sum(do * ws[c] * n, axis=1)
            xs += (xf,)
            zs += (zf,)
            dos += (do,)
        dws = new_dw
        dbs = new_db
        m = (acc * inv_group_size).reshape((BR, 1))
        for c in ct.static_iter(range(NC)):
            dh = r * (dos[c] * ws[c] - _normed(xs[c], r, zs[c], has_z, gate_first) * m)
            dh = gate_first_grad(dh, xs[c], zs[c], dz, rb, g, c, has_z, gate_first, BR, CS)
            ct.store(dx, (rb, g, c), dh.astype(dx.dtype).reshape((BR, 1, CS)))
    for c in ct.static_iter(range(NC)):
        ct.store(dw_part, (p, g, c), dws[c].reshape((1, 1, CS)))
        if has_bias != 0:
            ct.store(db_part, (p, g, c), dbs[c].reshape((1, 1, CS)))


def bwd_onepass(dy, x, z, w, rstd, group_size, BR, CS, per_sm, hints, gate_first=True):
    """(dx, dw, dz) of the one-pass backward (no bias); x, z, dy (rows, hidden)."""
    rows, hidden = x.shape
    ng = hidden // group_size
    n_rb = cdiv(rows, BR)
    programs = norm.norm_bwd_programs(n_rb, ng, per_sm, x.device)
    dx, dz = torch.empty_like(x), torch.empty_like(x)
    dw_part = torch.empty((programs, ng, group_size), dtype=torch.float32, device=x.device)

    def g3(t):
        return t.view(rows, ng, group_size)
    k = tile_kernel(bwd_onepass_kernel, **hints)
    runtime.launch((programs, ng, 1), k,
                   (g3(dy), g3(x), g3(z), w.view(ng, group_size), dw_part[:1, 0], rstd, g3(dx), g3(dz), dw_part,
                    dw_part, n_rb, programs, 1.0 / group_size, 1, 0, int(gate_first), BR, CS, cdiv(group_size, CS)))
    return dx, dw_part.sum(0).view(-1), dz


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--group", type=int, default=5120)
    ap.add_argument("--backward", action="store_true", help="time the backward (see above)")
    harness.add_json(ap)
    args = ap.parse_args()
    if args.backward:
        return backward(args)
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


def backward(args):
    from m2ops.kernels.norm import rms_norm_gated_bwd
    R, H, G = args.rows, args.hidden, args.group
    buf = torch.randn(R, 2 * H, device="cuda", dtype=torch.bfloat16)
    x, z, dy = torch.randn(R, H, device="cuda", dtype=torch.bfloat16), buf[:, :H], torch.randn(
        R, H, device="cuda", dtype=torch.bfloat16)
    z = z.contiguous()  # (the variant reads (rows, hidden) arrays)
    w = torch.rand(H, device="cuda") + 0.5
    _, rstd = norm.rms_norm_gated(x, w, None, z, 1e-5, G, False)
    want_dx, want_dw, _, want_dz = rms_norm_gated_bwd(dy, x, w, None, z, rstd, 1e-5, G, False)
    rows = []

    def row(name, fn):
        got = fn()
        ms = harness.median_ms(fn, runs=50, warmup=5)
        err = max(rel_err(got[0], want_dx), rel_err(got[1], want_dw), rel_err(got[2], want_dz))
        rows.append({"variant": name, "ms": ms, "rel_err": err})
        print(f"{name:44s} {ms:8.3f} ms  err {err:.2e}", flush=True)

    row("package (rms_norm_gated_bwd)", lambda: (lambda o: (o[0], o[1], o[3]))(
        rms_norm_gated_bwd(dy, x, w, None, z, rstd, 1e-5, G, False)))
    for BR, CS, per_sm, hints in ((1, 512, 1, {"num_worker_warps": 8}), (1, 512, 2, {"num_worker_warps": 8}),
                                  (2, 512, 1, {"num_worker_warps": 8}), (1, 1024, 1, {"num_worker_warps": 8}),
                                  (1, 512, 2, {"num_worker_warps": 4}), (2, 256, 2, {"num_worker_warps": 8})):
        try:
            row(f"bwd_onepass BR={BR} CS={CS} per_sm={per_sm} {hints}",
                lambda BR=BR, CS=CS, per_sm=per_sm, hints=hints: bwd_onepass(dy, x, z, w, rstd, G, BR, CS, per_sm,
                                                                              hints))
        except Exception as e:  # noqa: BLE001 - a build that fails is a result too
            print(f"failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
    print(f"bandwidth bound at 3.35 TB/s: {5 * R * H * 2 / 3.35e12 * 1e3:.3f} ms")
    harness.write_json(args.json, rows)


if __name__ == "__main__":
    main()
