"""One token of the Mamba-2 recurrence (decoding), in plain PyTorch: the definition of m2ops::state_update.

    dt    = dt (+ dt_bias), softplus if dt_softplus (identity above 20), clamped to [dt_min, dt_max]
    state = exp(dt * A) * state + dt * outer(x, B)       per head; head k reads group k // (nheads / ngroups)
    y     = state @ C + D * x,  then * silu(z)

The dt rules are the chunk scan's (reference/chunked.py chunk_cumsum), so that a prefill by the scan followed
by token-by-token updates reproduces the scan over the whole sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..meta.shapes import compute_dtype


def state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus: bool, dt_min: float, dt_max: float):
    """state (b, h, p, n), x (b, h, p), dt (b, h), A (h,), B and C (b, g, n), D (h,) or (h, p), z like x,
    dt_bias (h,) -> (y like x, new state in state's dtype). Inputs are never written."""
    acc = torch.float64 if torch.float64 in (x.dtype, state.dtype) else compute_dtype(dt.dtype)
    h = x.shape[1]
    g = B.shape[1]
    d = dt.to(acc)
    if dt_bias is not None:
        d = d + dt_bias.to(acc)
    if dt_softplus:
        d = F.softplus(d, threshold=20.0)
    d = d.clamp(dt_min, dt_max)
    xf = x.to(acc)
    Bh = B.to(acc).repeat_interleave(h // g, dim=1)  # b h n
    Ch = C.to(acc).repeat_interleave(h // g, dim=1)
    decay = torch.exp(d * A.to(acc))  # b h
    new = decay[..., None, None] * state.to(acc) + (d[..., None] * xf)[..., None] * Bh[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", new, Ch)
    if D is not None:
        y = y + xf * (D.to(acc)[:, None] if D.dim() == 1 else D.to(acc))
    if z is not None:
        y = y * F.silu(z.to(acc))
    return y.to(x.dtype).contiguous(), new.to(state.dtype).contiguous()
