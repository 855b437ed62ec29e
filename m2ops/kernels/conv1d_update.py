"""causal_conv1d_update kernel: one decoding token of the causal convolution, updating the cache in place.

Launched by m2ops.kernels.conv.causal_conv1d_update, the CUDA implementation of m2ops::causal_conv1d_update (the
math: m2ops/reference/conv1d.py). One program per (channel tile of BC channels, batch row). The row's cache slot
is conv_state_indices[row] (the row itself without indices); a negative slot skips the row (y is 0, nothing is
written). With S = state_len and W = width, in float32:

    y         = bias + sum_{k < W-1} weight[k] state[S-(W-1)+k] + weight[W-1] x,   then silu if act
    state[j] <- state[j+1] (j < S-1),  state[S-1] <- x                               (in state's dtype)

The slot's state is read as a (BC, SP) tile (SP >= S, a power of two; gathers, so entries past S and channels past
the end read zero) twice, as is and one entry on, before the program writes it back; programs never share a slot
(the caller's indices name distinct slots). Width and state length are run-time values: only the state tile's
width SP and BC are constants.
"""

from __future__ import annotations

import cuda.tile as ct

from .common import ConstInt, silu

_ZERO = ct.PaddingMode.ZERO


@ct.kernel
def causal_conv1d_update_kernel(x, conv_state, weight, bias, indices, y,
                                state_len: int, width: int, has_bias: int, has_idx: int, act: int,
                                SP: ConstInt, BC: ConstInt):
    cb = ct.bid(0)
    b = ct.bid(1)
    slot = b
    if has_idx != 0:
        slot = ct.load(indices, (b,), shape=())
    out = ct.zeros((1, BC), dtype=ct.float32)
    if slot >= 0:
        ch = cb * BC + ct.arange(BC, dtype=ct.int32)
        col = ct.arange(SP, dtype=ct.int32)
        xr = ct.load(x, (b, cb), shape=(1, BC), padding_mode=_ZERO).astype(ct.float32)
        old = ct.gather(conv_state, (slot, ch[:, None], col[None, :]))
        nxt = ct.gather(conv_state, (slot, ch[:, None], (col + 1)[None, :]))
        # the tap of each state entry: entry S-(W-1)+k feeds tap k < W-1 (earlier entries none: out of bounds)
        tap = col - (state_len - (width - 1))
        wt = ct.gather(weight, (ch[:, None], tap[None, :]), mask=(tap < width - 1)[None, :])
        u = ct.sum(old.astype(ct.float32) * wt, axis=1).reshape((1, BC))
        u = u + xr * ct.gather(weight, (ch, width - 1)).reshape((1, BC))
        if has_bias != 0:
            u = u + ct.load(bias, (cb,), shape=(BC,), padding_mode=_ZERO).reshape((1, BC))
        if act != 0:
            u = silu(u)
        out = u
        new = ct.where((col == state_len - 1)[None, :], ct.transpose(xr).astype(conv_state.dtype), nxt)
        ct.store(conv_state, (slot, cb, 0), new.reshape((1, BC, SP)))
    ct.store(y, (b, cb), out.astype(y.dtype))
