"""One token of the Mamba-2 recurrence (decoding), in plain PyTorch: the definitions of m2ops::state_update
(functional) and m2ops::state_update_inplace (the same step on rows of a state cache, written back in place).

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
from .chunked import step_sizes


def state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus: bool, dt_min: float, dt_max: float):
    """state (b, h, p, n), x (b, h, p), dt (b, h), A (h,), B and C (b, g, n), D (h,) or (h, p), z like x,
    dt_bias (h,) -> (y like x, new state in state's dtype). Inputs are never written."""
    acc = torch.float64 if torch.float64 in (x.dtype, state.dtype) else compute_dtype(dt.dtype)
    h = x.shape[1]
    g = B.shape[1]
    d = step_sizes(dt, dt_bias, dt_softplus, dt_min, dt_max, acc)
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


def decay_rates(A_log):
    """A = -exp(A_log), in float32 at least: exp of a half-precision A_log can overflow (float64 stays float64)."""
    return -torch.exp(A_log.to(compute_dtype(A_log.dtype)))


def state_update_inplace(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices, dt_softplus: bool,
                         dt_min: float, dt_max: float, out, A_is_log: bool = False):
    """m2ops::state_update_inplace: state_update on cache rows, written back in place. Batch row b uses cache row b,
    or state_batch_indices[b]; a row outside [0, cache_rows) (negative: a padding slot) is skipped: its cache row
    and its row of out are left as they are. y goes into out. Returns nothing. A_is_log: A holds a layer's A_log,
    the decay rates being decay_rates(A_log).

    Without a host synchronisation (no boolean indexing: the fallback on a CUDA device stays capturable): the
    rows are gathered, updated by state_update and scattered back by one index_copy_, in which a skipped batch
    row writes the same values as the first used one (or, when none is used, cache row 0 its own values), so no
    cache row receives two different values unless the caller repeats a row."""
    if A_is_log:
        A = decay_rates(A)
    if state_batch_indices is None:
        y, new = state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max)
        state.copy_(new)
        out.copy_(y)
        return
    rows = state_batch_indices.long()
    used = (rows >= 0) & (rows < state.shape[0])
    y, new = state_update(state[rows.clamp(0, state.shape[0] - 1)], x, dt, A, B, C, D, z, dt_bias, dt_softplus,
                          dt_min, dt_max)
    any_used, first = used.any(), used.int().argmax()
    target = torch.where(used, rows, torch.where(any_used, rows[first], 0))
    src = torch.where(used[:, None, None, None], new, torch.where(any_used, new[first], state[0]))
    state.index_copy_(0, target, src)
    out.copy_(torch.where(used[:, None, None], y, out))
