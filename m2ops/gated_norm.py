"""m2ops.rms_norm_gated: the gated RMSNorm of the Mamba-2 layer (checks, then the m2ops::rms_norm_gated op)."""

from __future__ import annotations

from .meta.norm_validate import check_rms_norm_gated_inputs
from .ops import gated_norm as _op


def rms_norm_gated(x, weight, z=None, bias=None, eps=1e-5, group_size=None, norm_before_gate=True):
    """Gated RMSNorm (mamba_ssm's gated RMSNorm, as the Mamba-2 layer applies it after the scan).

    Args:
        x: (..., hidden); any layout (a view whose leading dimensions flatten to one row stride, channels
            contiguous, is read in place by the kernels).
        weight: (hidden,).
        z: optional gate like x (a strided view, e.g. a slice of a fused projection, is read in place).
        bias: optional (hidden,), added after the weight (before a gate after the norm).
        eps: added to the mean square.
        group_size: channels per norm group (dividing hidden); None: one group of hidden.
        norm_before_gate: True: y = (norm(x) * weight + bias) * silu(z); False: y = norm(x * silu(z)) * weight
            + bias. Without z both are norm(x) * weight + bias.

    Computed in float32 (float64 for float64 x); returns y like x (x's dtype, contiguous). Differentiable in x,
    weight, z and bias.
    """
    group_size = check_rms_norm_gated_inputs(x, weight, z, bias, eps, group_size, norm_before_gate)
    return _op.rms_norm_gated(x, weight, bias, z, float(eps), group_size, norm_before_gate)[0]
