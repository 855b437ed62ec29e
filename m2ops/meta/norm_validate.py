"""Input validation of m2ops.rms_norm_gated: every error names the argument and what was expected. Shapes, dtypes,
devices and plain values only (traceable by torch.compile)."""

from __future__ import annotations

import math

import torch

from .validate import FLOAT_DTYPES

WHERE = "m2ops.rms_norm_gated"


def _fail(kind, name, expected, got):
    raise kind(f"{WHERE}: {name} must be {expected}; got {got}")


def _tensor(name, t, x=None):
    if not isinstance(t, torch.Tensor):
        _fail(TypeError, name, "a torch.Tensor", type(t).__name__)
    if t.dtype not in FLOAT_DTYPES:
        _fail(TypeError, name, f"a tensor of floating dtype ({', '.join(str(d) for d in FLOAT_DTYPES)})", t.dtype)
    if x is not None and t.device != x.device:
        _fail(ValueError, name, f"on the same device as x ({x.device})", t.device)


def check_rms_norm_gated_inputs(x, weight, z, bias, eps, group_size, norm_before_gate) -> int:
    """Raise TypeError or ValueError for the first argument that does not fit; return the group size (hidden for
    None)."""
    _tensor("x", x)
    if x.dim() < 1 or x.shape[-1] < 1:
        _fail(ValueError, "x", "a tensor of shape (..., hidden) with hidden >= 1", tuple(x.shape))
    hidden = x.shape[-1]
    _tensor("weight", weight, x)
    if tuple(weight.shape) != (hidden,):
        _fail(ValueError, "weight", f"of shape (hidden,) = ({hidden},)", tuple(weight.shape))
    if z is not None:
        _tensor("z", z, x)
        if tuple(z.shape) != tuple(x.shape):
            _fail(ValueError, "z", f"of x's shape {tuple(x.shape)}", tuple(z.shape))
    if bias is not None:
        _tensor("bias", bias, x)
        if tuple(bias.shape) != (hidden,):
            _fail(ValueError, "bias", f"of shape (hidden,) = ({hidden},)", tuple(bias.shape))
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        _fail(TypeError, "eps", "a float", type(eps).__name__)
    if not (eps >= 0 and math.isfinite(eps)):
        _fail(ValueError, "eps", "a finite number >= 0", eps)
    if group_size is None:
        group_size = hidden
    elif isinstance(group_size, bool) or not isinstance(group_size, int):
        _fail(TypeError, "group_size", "an int or None", type(group_size).__name__)
    elif group_size < 1 or hidden % group_size != 0:
        _fail(ValueError, "group_size", f"a positive divisor of hidden = {hidden}", group_size)
    if not isinstance(norm_before_gate, bool):
        _fail(TypeError, "norm_before_gate", "a bool", type(norm_before_gate).__name__)
    return group_size
