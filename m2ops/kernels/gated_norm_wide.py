"""gated_norm_wide kernel: the gated RMSNorm's forward for groups wider than one tile (m2ops::rms_norm_gated; the
math in m2ops/reference/gated_norm.py), as gated_norm.py computes it for narrower groups.

Launched by m2ops.kernels.norm.rms_norm_gated for groups over NORM_TILE_ELEMS channels (a Mamba-2 layer with one
group: 5120 channels at d_model 2560). A program holds BR rows of its group as NC column tiles of CS channels
(NC = cdiv(group_size, CS), a constant: one specialisation per tile count) in registers, read once: the sums of
squares as the tiles come in, then the output from the held tiles. The gate's z is read with x where it goes before
the norm, and only for the output where it goes after. At 32768 rows x 5120 channels, bfloat16, gate first
(BR=4, CS=512, 8 warps): 0.421 ms on an H200 as a kernel of this structure without the bias and gate-placement
flags, against 0.767 ms for the former kernel, which walked the group twice and read x and z again for the
output (measure/norm_variants.py, 2026-12-07; bandwidth bound 0.300). The last tile past the group's end is
zero-padded and adds nothing. Arrays as in gated_norm.py: (rows, ngroups, group_size) views, channels
contiguous; rstd (ngroups, rows) float32 for the backward.
"""

from __future__ import annotations

import cuda.tile as ct

from .common import Big, ConstInt
from .gated_norm import sigmoid

_ZERO = ct.PaddingMode.ZERO


def column_tile(arr, rb, g, c, BR: int, CS: int):
    """(BR, CS) float32: row block rb, column tile c of group g of a (rows, ngroups, group_size) array, zero-padded
    (shared with gated_norm_wide_bwd.py)."""
    return ct.load(arr, (rb, g, c), shape=(BR, 1, CS), padding_mode=_ZERO).reshape((BR, CS)).astype(ct.float32)


def _gate(zf):
    return zf * sigmoid(zf)


@ct.kernel
def gated_norm_wide_kernel(x: Big, z: Big, weight, bias, y: Big, rstd,
                           inv_group_size: float, eps: float, has_z: int, has_bias: int, gate_first: int,
                           BR: ConstInt, CS: ConstInt, NC: ConstInt):
    rb = ct.bid(0)
    g = ct.bid(1)
    hs = ()
    ss = ct.zeros((BR,), dtype=ct.float32)
    for c in ct.static_iter(range(NC)):
        h = column_tile(x, rb, g, c, BR, CS)
        if has_z != 0:
            if gate_first != 0:
                h = h * _gate(column_tile(z, rb, g, c, BR, CS))
        ss = ss + ct.sum(h * h, axis=1)
        hs += (h,)
    r = ct.rsqrt(ss * inv_group_size + eps)
    for c in ct.static_iter(range(NC)):
        o = hs[c] * r[:, None] * ct.load(weight, (g, c), shape=(1, CS), padding_mode=_ZERO).astype(ct.float32)
        if has_bias != 0:
            o = o + ct.load(bias, (g, c), shape=(1, CS), padding_mode=_ZERO).astype(ct.float32)
        if has_z != 0:
            if gate_first == 0:
                o = o * _gate(column_tile(z, rb, g, c, BR, CS))
        ct.store(y, (rb, g, c), o.astype(y.dtype).reshape((BR, 1, CS)))
    ct.store(rstd, (g, rb), r.reshape((1, BR)))
