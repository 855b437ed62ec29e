"""The gated RMSNorm's backward for groups wider than one tile (m2ops::rms_norm_gated_bwd; the formulas in
m2ops/reference/gated_norm.py), as gated_norm_bwd.py computes it for narrower groups. Two kernels:

- gated_norm_wide_rows_kernel, one program per (block of BR rows, group): walks the group in CS-column tiles and
  writes each row's mean of dn * n over the group (the one reduction across the whole group), msum (ngroups, rows)
  float32;
- gated_norm_wide_bwd_kernel, program (p, g, c) for column tile c of group g: walks the row blocks p, p + P, ...
  (P = n_programs), writes dx and dz of its tile from rstd and msum, and keeps its tile's sums of do * n and do
  over its rows in registers, stored once to row p of dw_part / db_part (n_programs, ngroups, group_size); the
  launcher sums those rows (deterministic, no atomics).

dy, x and z are read twice (once per kernel) instead of once, for tiles that fit in registers: gated_norm_bwd holds
a whole group per tile (8192 for 5120 channels) and is built as a CTA pair, which took 3.0 ms at 32768 rows x 5120
channels on an H100 against mamba_ssm's 1.0 ms. Arrays as in gated_norm_bwd.py; tiles past the group's end are
zero-padded (weight 0 there, so they add nothing).
"""

from __future__ import annotations

import cuda.tile as ct

from .common import Big, ConstInt
from .gated_norm import sigmoid
from .gated_norm_bwd import gated_rows, gate_first_grad
from .gated_norm_wide import column_tile

_ZERO = ct.PaddingMode.ZERO


@ct.kernel
def gated_norm_wide_rows_kernel(dy: Big, x: Big, z: Big, weight, rstd, msum,
                                inv_group_size: float, has_z: int, gate_first: int, n_chunks: int,
                                BR: ConstInt, CS: ConstInt):
    rb = ct.bid(0)
    g = ct.bid(1)
    r = ct.load(rstd, (g, rb), shape=(1, BR), padding_mode=_ZERO).reshape((BR, 1))
    acc = ct.zeros((BR,), dtype=ct.float32)
    for c in range(n_chunks):
        w = ct.load(weight, (g, c), shape=(1, CS), padding_mode=_ZERO).astype(ct.float32)
        n = column_tile(x, rb, g, c, BR, CS) * r
        do = column_tile(dy, rb, g, c, BR, CS)
        if has_z != 0:
            zf = column_tile(z, rb, g, c, BR, CS)
            s = zf * sigmoid(zf)
            if gate_first != 0:
                n = n * s
            else:  # the gradient reaching the norm's output is dy * s
                do = do * s
        acc = acc + ct.sum(do * w * n, axis=1)
    ct.store(msum, (g, rb), (acc * inv_group_size).reshape((1, BR)))


@ct.kernel
def gated_norm_wide_bwd_kernel(dy: Big, x: Big, z: Big, weight, bias, rstd, msum, dx: Big, dz: Big, dw_part,
                               db_part, n_row_blocks: int, n_programs: int, has_z: int, has_bias: int,
                               gate_first: int, BR: ConstInt, CS: ConstInt):
    p = ct.bid(0)
    g = ct.bid(1)
    c = ct.bid(2)
    w = ct.load(weight, (g, c), shape=(1, CS), padding_mode=_ZERO).astype(ct.float32)
    dw = ct.zeros((CS,), dtype=ct.float32)
    db = ct.zeros((CS,), dtype=ct.float32)
    for rb in range(p, n_row_blocks, n_programs):
        r = ct.load(rstd, (g, rb), shape=(1, BR), padding_mode=_ZERO).reshape((BR, 1))
        m = ct.load(msum, (g, rb), shape=(1, BR), padding_mode=_ZERO).reshape((BR, 1))
        xf = column_tile(x, rb, g, c, BR, CS)
        do = column_tile(dy, rb, g, c, BR, CS)
        zf, n, do = gated_rows(xf, r, do, z, w, bias, dz, rb, g, c, has_z, has_bias, gate_first, BR, CS)
        dw = dw + ct.sum(do * n, axis=0)
        db = db + ct.sum(do, axis=0)
        dh = r * (do * w - n * m)
        dh = gate_first_grad(dh, xf, zf, dz, rb, g, c, has_z, gate_first, BR, CS)
        ct.store(dx, (rb, g, c), dh.astype(dx.dtype).reshape((BR, 1, CS)))
    ct.store(dw_part, (p, g, c), dw.reshape((1, 1, CS)))
    if has_bias != 0:
        ct.store(db_part, (p, g, c), db.reshape((1, 1, CS)))
