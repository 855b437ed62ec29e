"""The gated RMSNorm of the Mamba-2 layer in plain PyTorch: the definition of m2ops::rms_norm_gated, and the explicit
formulas of its backward, m2ops::rms_norm_gated_bwd (checked against autograd in tests/test_gated_norm.py).

x (..., hidden) is read as rows of hidden = ngroups * group_size channels; the norm runs over each group of a row.
With s = silu(z) (z like x, optional), per row and group:

    h    = x * s                     z given and not norm_before_gate (the gate goes into the norm), else x
    rstd = 1 / sqrt(mean(h^2) + eps)
    n    = h * rstd
    o    = n * weight (+ bias)
    y    = o * s                     z given and norm_before_gate, else o

(mamba_ssm's gated RMSNorm: the bias is added before a gate after the norm.) Computed in float32, float64 for
float64 x; y in x's dtype. rstd is returned as (ngroups, rows) in the compute dtype, rows = x.numel() / hidden:
the backward reuses it instead of reducing over the group again.

Backward, given dy; r = rstd, s' = dsilu/dz = sig(z) (1 + z (1 - sig(z))), sums over a row's group:

    do      = dy * s, dz = dy * o * s'          gate after the norm; else do = dy
    dweight = sum over rows of do * n,  dbias = sum over rows of do
    dn      = do * weight
    dh      = r * (dn - n * mean(dn * n))       (d rstd / dh_j = -rstd^3 h_j / group_size)
    dx      = dh * s, dz = dh * x * s'          gate before the norm; else dx = dh
"""

from __future__ import annotations

import torch

from ..meta.shapes import compute_dtype


def _rows(t, group_size):
    """t (..., hidden) as (rows, ngroups, group_size)."""
    return t.reshape(-1, t.shape[-1] // group_size, group_size)


def _gate(z, acc):
    """silu(z) and its derivative, in acc."""
    zf = z.to(acc)
    sig = torch.sigmoid(zf)
    return zf * sig, sig * (1 + zf * (1 - sig))


def rms_norm_gated(x, weight, bias, z, eps: float, group_size: int, norm_before_gate: bool):
    """x (..., hidden), weight and bias (hidden,), z like x -> (y like x, rstd (ngroups, rows))."""
    acc = compute_dtype(x.dtype)
    h = _rows(x, group_size).to(acc)
    s = None if z is None else _rows(z, group_size).to(acc)
    if s is not None:
        s = s * torch.sigmoid(s)
        if not norm_before_gate:
            h = h * s
    rstd = torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)
    o = h * rstd * weight.to(acc).view(-1, group_size)
    if bias is not None:
        o = o + bias.to(acc).view(-1, group_size)
    if s is not None and norm_before_gate:
        o = o * s
    return o.reshape(x.shape).to(x.dtype).contiguous(), rstd[..., 0].t().contiguous()


def rms_norm_gated_bwd(dy, x, weight, bias, z, rstd, eps: float, group_size: int, norm_before_gate: bool):
    """Gradients (dx like x, dweight like weight, dbias like bias, dz like z), contiguous; an empty tensor for an
    absent bias or z. rstd is the forward's (eps is not needed then; it is part of the signature so that the
    backward reads the forward's arguments)."""
    acc = compute_dtype(x.dtype)
    xf = _rows(x, group_size).to(acc)
    g = _rows(dy, group_size).to(acc)
    r = rstd.t().to(acc).unsqueeze(-1)  # (rows, ngroups, 1)
    w = weight.to(acc).view(-1, group_size)
    s = ds = None
    if z is not None:
        s, ds = _gate(_rows(z, group_size), acc)
    h = xf * s if s is not None and not norm_before_gate else xf
    n = h * r
    dz = None
    if s is not None and norm_before_gate:
        o = n * w if bias is None else n * w + bias.to(acc).view(-1, group_size)
        dz = g * o * ds
        g = g * s
    dweight = (g * n).sum(0).reshape(weight.shape)
    dbias = g.sum(0).reshape(bias.shape) if bias is not None else None
    dn = g * w
    dh = r * (dn - n * (dn * n).mean(-1, keepdim=True))
    dx = dh
    if s is not None and not norm_before_gate:
        dz = dh * xf * ds
        dx = dh * s
    return (dx.reshape(x.shape).to(x.dtype).contiguous(), dweight.to(weight.dtype),
            dy.new_empty((0,)) if bias is None else dbias.to(bias.dtype),
            dy.new_empty((0,)) if z is None else dz.reshape(z.shape).to(z.dtype).contiguous())
