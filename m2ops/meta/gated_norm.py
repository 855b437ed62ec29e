"""Shapes of the gated RMSNorm ops (m2ops::rms_norm_gated and its backward) and their fake implementations, written
once for the reference, the kernels' launchers and torch.compile.

x (..., hidden) is rows of hidden = ngroups * group_size channels, rows = the product of x's leading dimensions.
y is a fresh contiguous tensor like x; rstd, the reciprocal rms of each (row, group), is (ngroups, rows) in the
compute dtype (float32, float64 for float64 x), so that a program's rows of one group are contiguous.
"""

from __future__ import annotations

import math

from .shapes import compute_dtype

# The largest group the cuTile kernels hold in one tile (larger groups run the reference).
KERNEL_NORM_MAX_GROUP = 8192


def norm_rstd_shape(x_shape, group_size):
    """rstd: (ngroups, rows). Works on SymInts."""
    return (x_shape[-1] // group_size, math.prod(x_shape[:-1]))


def rms_norm_gated(x, weight, bias, z, eps, group_size, norm_before_gate):
    """(y like x, rstd (ngroups, rows) in the compute dtype)."""
    return x.new_empty(x.shape), x.new_empty(norm_rstd_shape(x.shape, group_size), dtype=compute_dtype(x.dtype))


def rms_norm_gated_bwd(dy, x, weight, bias, z, rstd, eps, group_size, norm_before_gate):
    """(dx like x, dweight like weight, dbias like bias, dz like z); an empty tensor for an absent bias or z."""
    return (x.new_empty(x.shape), weight.new_empty(weight.shape),
            dy.new_empty((0,)) if bias is None else bias.new_empty(bias.shape),
            dy.new_empty((0,)) if z is None else z.new_empty(z.shape))
