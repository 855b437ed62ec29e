"""gated_norm kernel: the gated RMSNorm's forward (m2ops::rms_norm_gated; the math in m2ops/reference/gated_norm.py).

Launched by m2ops.kernels.norm.rms_norm_gated. x, z and y are (rows, ngroups, group_size) views: any row stride,
channels contiguous (a slice of a fused projection is read in place). One program per (block of BR rows, group):
it loads its (BR, group_size) tiles of x and z once, zero-padded to (BR, GS) with GS the group size rounded up to
a power of two, so that padded rows and channels add nothing to the sums of squares, and writes y and each row's
1 / rms, rstd (ngroups, rows) in float32, which the backward reuses. Everything is computed in float32. Which
options are present (z, bias) and where the gate goes (gate_first: before the norm) are run-time flags: they only
pick elementwise branches, and do not multiply the specialisations.
"""

from __future__ import annotations

import cuda.tile as ct

from .common import LOG2E, Big, ConstInt, exp2

_ZERO = ct.PaddingMode.ZERO


def sigmoid(zf):
    """1 / (1 + exp(-zf)) of a float32 tile, with exp2 and the div.full division (as common.silu): 0 where
    exp(-zf) overflows."""
    return ct.truediv(1.0, 1.0 + exp2(zf * -LOG2E), rounding_mode=ct.RoundingMode.FULL)


@ct.kernel
def gated_norm_kernel(x: Big, z: Big, weight, bias, y: Big, rstd,
                      inv_group_size: float, eps: float, has_z: int, has_bias: int, gate_first: int,
                      BR: ConstInt, GS: ConstInt):
    rb = ct.bid(0)
    g = ct.bid(1)
    h = ct.load(x, (rb, g, 0), shape=(BR, 1, GS), padding_mode=_ZERO).reshape((BR, GS)).astype(ct.float32)
    s = ct.full((BR, GS), 1.0, dtype=ct.float32)
    if has_z != 0:
        zf = ct.load(z, (rb, g, 0), shape=(BR, 1, GS), padding_mode=_ZERO).reshape((BR, GS)).astype(ct.float32)
        s = zf * sigmoid(zf)
        if gate_first != 0:
            h = h * s
    r = ct.rsqrt(ct.sum(h * h, axis=1) * inv_group_size + eps)
    w = ct.load(weight, (g, 0), shape=(1, GS), padding_mode=_ZERO).astype(ct.float32)
    o = h * r[:, None] * w
    if has_bias != 0:
        o = o + ct.load(bias, (g, 0), shape=(1, GS), padding_mode=_ZERO).astype(ct.float32)
    if has_z != 0:
        if gate_first == 0:
            o = o * s
    ct.store(y, (rb, g, 0), o.astype(y.dtype).reshape((BR, 1, GS)))
    ct.store(rstd, (g, rb), r.reshape((1, BR)))
