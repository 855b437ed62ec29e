"""gated_norm_bwd kernel: the gated RMSNorm's backward (m2ops::rms_norm_gated_bwd; the formulas in
m2ops/reference/gated_norm.py).

Launched by m2ops.kernels.norm.rms_norm_gated_bwd. Arrays as in the forward (gated_norm.py): dy, x, z, dx, dz are
(rows, ngroups, group_size) views, tiles of (BR, GS) zero-padded. Program (p, g) walks the row blocks p, p + P,
p + 2P, ... of group g (P = n_programs): each block reads dy, x, z and the forward's rstd once and writes dx and dz,
with the normalised values recomputed from rstd (no reduction but the one of dn * n). The program's sums of
do * n and do over its rows stay in registers and are stored once, to row p of dw_part and db_part
(n_programs, ngroups, group_size) float32; the launcher sums those rows (deterministic, no atomics). Padded rows
read dy = 0 and padded channels weight 0, so they add nothing to either sum.
"""

from __future__ import annotations

import cuda.tile as ct

from .common import Big, ConstInt
from .gated_norm import sigmoid

_ZERO = ct.PaddingMode.ZERO


def gated_rows(xf, r, do, z, w, bias, dz, rb, g, c, has_z, has_bias, gate_first, BR: int, W: int):
    """Before the row reduction, for tile (rb, g, c) of W channels: z's tile (zeros without z), n, the normalised
    rows (times silu(z) with the gate first), and the gradient reaching the norm's output (dy, times silu(z) with
    the gate last, when dz is stored here)."""
    zf = ct.zeros((BR, W), dtype=ct.float32)
    n = xf * r
    if has_z != 0:
        zf = ct.load(z, (rb, g, c), shape=(BR, 1, W), padding_mode=_ZERO).reshape((BR, W)).astype(ct.float32)
        sig = sigmoid(zf)
        if gate_first != 0:
            n = n * (zf * sig)
        else:  # y = o * s: dz from o; the gradient reaching o is dy * s
            o = n * w
            if has_bias != 0:
                o = o + ct.load(bias, (g, c), shape=(1, W), padding_mode=_ZERO).astype(ct.float32)
            ct.store(dz, (rb, g, c), (do * o * sig * (1.0 + zf * (1.0 - sig))).astype(dz.dtype)
                     .reshape((BR, 1, W)))
            do = do * (zf * sig)
    return zf, n, do


def gate_first_grad(dh, xf, zf, dz, rb, g, c, has_z, gate_first, BR: int, W: int):
    """After the row reduction, with the gate first (h = x * s): dz stored, and the gradient reaching x returned
    (dh as it is otherwise)."""
    if has_z != 0:
        if gate_first != 0:
            sig = sigmoid(zf)
            ct.store(dz, (rb, g, c), (dh * xf * sig * (1.0 + zf * (1.0 - sig))).astype(dz.dtype)
                     .reshape((BR, 1, W)))
            dh = dh * (zf * sig)
    return dh


@ct.kernel
def gated_norm_bwd_kernel(dy: Big, x: Big, z: Big, weight, bias, rstd, dx: Big, dz: Big, dw_part, db_part,
                          n_row_blocks: int, n_programs: int, inv_group_size: float,
                          has_z: int, has_bias: int, gate_first: int,
                          BR: ConstInt, GS: ConstInt):
    p = ct.bid(0)
    g = ct.bid(1)
    w = ct.load(weight, (g, 0), shape=(1, GS), padding_mode=_ZERO).astype(ct.float32)
    dw = ct.zeros((GS,), dtype=ct.float32)
    db = ct.zeros((GS,), dtype=ct.float32)
    for rb in range(p, n_row_blocks, n_programs):
        xf = ct.load(x, (rb, g, 0), shape=(BR, 1, GS), padding_mode=_ZERO).reshape((BR, GS)).astype(ct.float32)
        do = ct.load(dy, (rb, g, 0), shape=(BR, 1, GS), padding_mode=_ZERO).reshape((BR, GS)).astype(ct.float32)
        r = ct.load(rstd, (g, rb), shape=(1, BR), padding_mode=_ZERO).reshape((BR, 1))
        # Only x and z are kept through the row reduction; silu(z), its derivative and n are recomputed from them
        # where needed (registers, not memory, are what this kernel runs short of).
        zf, n, do = gated_rows(xf, r, do, z, w, bias, dz, rb, g, 0, has_z, has_bias, gate_first, BR, GS)
        dw = dw + ct.sum(do * n, axis=0)
        db = db + ct.sum(do, axis=0)
        dn = do * w
        dh = r * (dn - n * (ct.sum(dn * n, axis=1) * inv_group_size)[:, None])
        dh = gate_first_grad(dh, xf, zf, dz, rb, g, 0, has_z, gate_first, BR, GS)
        ct.store(dx, (rb, g, 0), dh.astype(dx.dtype).reshape((BR, 1, GS)))
    ct.store(dw_part, (p, g, 0), dw.reshape((1, 1, GS)))
    if has_bias != 0:
        ct.store(db_part, (p, g, 0), db.reshape((1, 1, GS)))
