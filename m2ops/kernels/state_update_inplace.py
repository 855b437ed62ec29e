"""state_update_inplace kernel: one token of the Mamba-2 recurrence (decoding), the state cache updated in place.

Launched by m2ops.kernels.decode.state_update_inplace, the CUDA implementation of m2ops::state_update_inplace.

The math is state_update_kernel's (state_update.py, whose device helpers it shares); what differs is where the
state lives. Batch row b reads and writes cache row r = rows[b] (r = b when has_rows is 0): each tile of the state
is loaded, updated and stored back to the same place, so a decode step moves the state once in and once out, with
no state-sized copy. A row outside [0, cache_rows) (a negative index is a padding slot) is skipped: neither the
cache nor y is written for it.

`state` is one parameter, read and written, rather than an input and an output passed the same tensor: the
compiler may assume that distinct parameters do not alias (state_passing.py does the same). Programs write
disjoint tiles as long as the rows of the batch are distinct (the caller's promise, checked where the indices are
on the CPU). With a_is_log, A holds a layer's A_log and the decay rate -exp(A_log) is formed here (a layer's
decode step then launches no kernels for it). Everything is computed in float32; the new state is rounded to
state's dtype when stored.
"""

from __future__ import annotations

import cuda.tile as ct

from .common import Big, ConstInt
from .state_update import gated_output, step_decay

_ZERO = ct.PaddingMode.ZERO


@ct.kernel
def state_update_inplace_kernel(state: Big, x: Big, dt, A, B: Big, C: Big, D, z: Big, dt_bias, rows, y: Big,
                                nheads: int, heads_per_group: int, dstate: int, n_ptiles: int, cache_rows: int,
                                has_d: int, has_z: int, has_bias: int, dt_softplus: int, has_rows: int,
                                a_is_log: int, dt_min: float, dt_max: float,
                                TP: ConstInt, TN: ConstInt):
    pid = ct.bid(0)
    b = ct.bid(1)
    pt = pid % n_ptiles
    h = pid // n_ptiles
    g = h // heads_per_group

    r = b
    if has_rows != 0:
        r = ct.load(rows, (b,), shape=())
    if (r >= 0) & (r < cache_rows):
        d, decay = step_decay(dt, A, dt_bias, b, h, has_bias, dt_softplus, dt_min, dt_max, a_is_log)
        xp = ct.load(x, (b, h, pt), shape=(1, 1, TP), padding_mode=_ZERO).reshape((TP,)).astype(ct.float32)
        dx = d * xp

        acc = ct.zeros((TP,), dtype=ct.float32)
        n_ntiles = (dstate + TN - 1) // TN
        for k in range(n_ntiles):
            s = ct.load(state, (r, h, pt, k), shape=(1, 1, TP, TN), padding_mode=_ZERO).reshape((TP, TN))
            bk = ct.load(B, (b, g, k), shape=(1, 1, TN), padding_mode=_ZERO).reshape((TN,)).astype(ct.float32)
            ck = ct.load(C, (b, g, k), shape=(1, 1, TN), padding_mode=_ZERO).reshape((TN,)).astype(ct.float32)
            s = decay * s.astype(ct.float32) + dx[:, None] * bk[None, :]
            ct.store(state, (r, h, pt, k), s.astype(state.dtype).reshape((1, 1, TP, TN)))
            # Padded columns of B and C are zero, so they add nothing to y.
            acc = acc + ct.sum(s * ck[None, :], axis=1)

        acc = gated_output(acc, xp, D, z, b, h, pt, has_d, has_z, TP)
        ct.store(y, (b, h, pt), acc.astype(y.dtype).reshape((1, 1, TP)))
