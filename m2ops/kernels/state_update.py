"""state_update kernel: one token of the Mamba-2 recurrence (decoding), functional.

Launched by m2ops.kernels.decode.state_update, the CUDA implementation of m2ops::state_update (validated by
tests/gpu/test_state_update_kernel.py on an H200 before it was enabled).

One program per (headdim tile of TP rows, head, batch row). With d the head's processed step size:

    d      = dt (+ dt_bias), softplus if dt_softplus (identity above 20), clamped to [dt_min, dt_max]
    new    = exp(d * A) * state + (d * x) outer B            B, C of the head's group (h // heads_per_group)
    y      = (new . C + D * x) * silu(z)

dstate is covered by TN-wide tiles (TN is dstate rounded up to a power of two, at most 256: one tile, or a
loop for larger dstate); each tile of the new state is stored to the fresh output new_state (in its dtype)
and its float32 values feed y, so y sees the unrounded state, as in the reference. Nothing is written in
place. Everything is computed in float32; flags that only pick a branch (dt_bias, softplus, D, z) are
run-time arguments. has_d: 0 no D, 1 one value per head (D given as (nheads, 1)), 2 (nheads, headdim).
The step size and the output's D and z terms are device helpers (step_decay, gated_output) that the in-place
kernel (state_update_inplace.py) shares.
"""

from __future__ import annotations

import cuda.tile as ct

from .chunk_cumsum import softplus
from .common import Big, ConstInt, silu

_ZERO = ct.PaddingMode.ZERO


@ct.kernel
def state_update_kernel(state: Big, x: Big, dt, A, B: Big, C: Big, D, z: Big, dt_bias,
                        new_state: Big, y: Big,
                        nheads: int, heads_per_group: int, dstate: int, n_ptiles: int,
                        has_d: int, has_z: int, has_bias: int, dt_softplus: int,
                        dt_min: float, dt_max: float,
                        TP: ConstInt, TN: ConstInt):
    pid = ct.bid(0)
    b = ct.bid(1)
    pt = pid % n_ptiles
    h = pid // n_ptiles
    g = h // heads_per_group

    d, decay = step_decay(dt, A, dt_bias, b, h, has_bias, dt_softplus, dt_min, dt_max)

    xp = ct.load(x, (b, h, pt), shape=(1, 1, TP), padding_mode=_ZERO).reshape((TP,)).astype(ct.float32)
    dx = d * xp

    acc = ct.zeros((TP,), dtype=ct.float32)
    n_ntiles = (dstate + TN - 1) // TN
    for k in range(n_ntiles):
        s = ct.load(state, (b, h, pt, k), shape=(1, 1, TP, TN), padding_mode=_ZERO).reshape((TP, TN))
        bk = ct.load(B, (b, g, k), shape=(1, 1, TN), padding_mode=_ZERO).reshape((TN,)).astype(ct.float32)
        ck = ct.load(C, (b, g, k), shape=(1, 1, TN), padding_mode=_ZERO).reshape((TN,)).astype(ct.float32)
        s = decay * s.astype(ct.float32) + dx[:, None] * bk[None, :]
        ct.store(new_state, (b, h, pt, k), s.astype(new_state.dtype).reshape((1, 1, TP, TN)))
        # Padded columns of B and C are zero, so they add nothing to y.
        acc = acc + ct.sum(s * ck[None, :], axis=1)

    acc = gated_output(acc, xp, D, z, b, h, pt, has_d, has_z, TP)
    ct.store(y, (b, h, pt), acc.astype(y.dtype).reshape((1, 1, TP)))


def step_decay(dt, A, dt_bias, b, h, has_bias, dt_softplus, dt_min, dt_max, a_is_log=0):
    """(d, exp(d * A)) of batch row b, head h: d = dt (+ dt_bias), softplus if dt_softplus, clamped to
    [dt_min, dt_max]; float32. a_is_log: A holds A_log, and A = -exp(A_log) is formed here."""
    d = ct.load(dt, (b, h), shape=()).astype(ct.float32)
    if has_bias != 0:
        d = d + ct.load(dt_bias, (h,), shape=()).astype(ct.float32)
    if dt_softplus != 0:
        d = softplus(d)
    d = ct.minimum(ct.maximum(d, dt_min), dt_max)
    a = ct.load(A, (h,), shape=()).astype(ct.float32)
    if a_is_log != 0:
        a = 0.0 - ct.exp(a)
    return d, ct.exp(d * a)


def gated_output(acc, xp, D, z, b, h, pt, has_d, has_z, TP):
    """acc (the TP rows of new . C) plus D * x, times silu(z) where z is given (float32)."""
    if has_d == 1:
        acc = acc + xp * ct.load(D, (h, 0), shape=()).astype(ct.float32)
    if has_d == 2:
        dv = ct.load(D, (h, pt), shape=(1, TP), padding_mode=_ZERO).reshape((TP,)).astype(ct.float32)
        acc = acc + xp * dv
    if has_z != 0:
        zf = ct.load(z, (b, h, pt), shape=(1, 1, TP), padding_mode=_ZERO).reshape((TP,)).astype(ct.float32)
        acc = acc * silu(zf)
    return acc
