"""gated_norm_wide kernel: the gated RMSNorm's forward for groups wider than one tile (m2ops::rms_norm_gated; the
math in m2ops/reference/gated_norm.py), as gated_norm.py computes it for narrower groups.

Launched by m2ops.kernels.norm.rms_norm_gated for groups over NORM_TILE_ELEMS channels (a Mamba-2 layer with one
group: 5120 channels at d_model 2560). gated_norm_kernel holds a whole group in one tile rounded up to a power of
two (8192 for 5120: 37% padding) and builds it as a pair of CTAs to stay in registers; measured on an H100 at 32768
rows x 5120 channels that takes 2.26 ms against 0.39 ms for mamba_ssm's norm. Here a program holds BR rows and walks
its group in CS-column tiles twice: the sums of squares first, then the output (the second reads come from L2: a
program's rows are BR x group_size x 2 inputs, 80 KB at 4 x 5120 bf16). Tiles past the group's end are zero-padded
and add nothing. Arrays as in gated_norm.py: (rows, ngroups, group_size) views, channels contiguous; rstd (ngroups,
rows) float32 for the backward.
"""

from __future__ import annotations

import cuda.tile as ct

from .common import Big, ConstInt
from .gated_norm import sigmoid

_ZERO = ct.PaddingMode.ZERO


@ct.kernel
def gated_norm_wide_kernel(x: Big, z: Big, weight, bias, y: Big, rstd,
                           inv_group_size: float, eps: float, has_z: int, has_bias: int, gate_first: int,
                           n_chunks: int, BR: ConstInt, CS: ConstInt):
    rb = ct.bid(0)
    g = ct.bid(1)
    ss = ct.zeros((BR,), dtype=ct.float32)
    for c in range(n_chunks):
        h = ct.load(x, (rb, g, c), shape=(BR, 1, CS), padding_mode=_ZERO).reshape((BR, CS)).astype(ct.float32)
        if has_z != 0:
            if gate_first != 0:
                zf = ct.load(z, (rb, g, c), shape=(BR, 1, CS), padding_mode=_ZERO).reshape((BR, CS)).astype(
                    ct.float32)
                h = h * (zf * sigmoid(zf))
        ss = ss + ct.sum(h * h, axis=1)
    r = ct.rsqrt(ss * inv_group_size + eps)
    for c in range(n_chunks):
        h = ct.load(x, (rb, g, c), shape=(BR, 1, CS), padding_mode=_ZERO).reshape((BR, CS)).astype(ct.float32)
        s = ct.full((BR, CS), 1.0, dtype=ct.float32)
        if has_z != 0:
            zf = ct.load(z, (rb, g, c), shape=(BR, 1, CS), padding_mode=_ZERO).reshape((BR, CS)).astype(ct.float32)
            s = zf * sigmoid(zf)
            if gate_first != 0:
                h = h * s
        o = h * r[:, None] * ct.load(weight, (g, c), shape=(1, CS), padding_mode=_ZERO).astype(ct.float32)
        if has_bias != 0:
            o = o + ct.load(bias, (g, c), shape=(1, CS), padding_mode=_ZERO).astype(ct.float32)
        if has_z != 0:
            if gate_first == 0:
                o = o * s
        ct.store(y, (rb, g, c), o.astype(y.dtype).reshape((BR, 1, CS)))
    ct.store(rstd, (g, rb), r.reshape((1, BR)))
