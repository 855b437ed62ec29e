"""start_state_out kernel: per-sequence start states' term in a packed row's output (m2ops::start_state_out, launched
by m2ops.kernels.forward.start_state_out; the math in m2ops/reference/start_states.py).

One program per (sequence k >= 1, head, headdim tile of TP): sequence k starts at s_k in chunk c; its tokens in c,
t = s_k + j < min(e_k, (c + 1) L), get

    y_t += exp(cs_t - cs_{s_k - 1}) (C_t . h_k) silu(z_t)

in blocks of BL tokens: C's rows gathered at those tokens (BL x TN, dstate tiles summed), h_k's (TP x TN) tiles
loaded, their product on tensor cores (tf32: float32 operands), the decays from dA_cumsum's row of chunk c, then y's
rows gathered, added to and scattered back. The windows of different sequences are disjoint, so each element of y
has at most one writer (no atomics); y is the launcher's fresh copy. s_k and e_k are read from cu_seqlens on the
device: nothing on the host depends on their values.

L (the chunk size) is a run-time argument; BL, TP and TN are constants; z is a run-time flag.
"""

from __future__ import annotations

import cuda.tile as ct

from .common import LOG2E, TILE_N, TILE_P, Big, ConstInt, cdiv, exp2, silu, sub_block


@ct.kernel
def start_state_out_kernel(C: Big, z: Big, init: Big, dA_cumsum: Big, cu_seqlens, y: Big,
                           heads_per_group: int, headdim: int, n_ptiles: int, n_ntiles: int, has_z: int, L: int,
                           BL: ConstInt, TP: ConstInt, TN: ConstInt):
    k = ct.bid(0) + 1
    pid = ct.bid(1)
    pt = pid % n_ptiles
    h = pid // n_ptiles
    g = h // heads_per_group
    s = ct.load(cu_seqlens, (k,), shape=())
    e = ct.load(cu_seqlens, (k + 1,), shape=())
    c = s // L
    j0 = s - c * L
    stop = ct.minimum(e, c * L + L)
    cs0 = ct.load(dA_cumsum, (0, h, c, ct.maximum(j0 - 1, 0)), shape=())
    cs0 = ct.where(j0 > 0, cs0, 0.0)
    pidx = pt * TP + ct.arange(TP, dtype=ct.int32)
    for sb in range(cdiv(stop - s, BL)):
        j = sb * BL + ct.arange(BL, dtype=ct.int32)
        t = s + j
        inside = t < stop
        cs = ct.gather(dA_cumsum, (0, h, c, j0 + j), mask=inside)
        decay = ct.where(inside, exp2((cs - cs0) * LOG2E), 0.0)
        m = ct.zeros((BL, TP), dtype=ct.float32)
        for nt in range(n_ntiles):
            nidx = nt * TN + ct.arange(TN, dtype=ct.int32)
            ct_rows = ct.gather(C, (0, t[:, None], g, nidx[None, :]), mask=inside[:, None])
            hk = ct.load(init, (k, h, pt, nt), shape=(1, 1, TP, TN), padding_mode=ct.PaddingMode.ZERO)
            m = ct.mma(ct_rows.astype(ct.float32), ct.transpose(hk.reshape((TP, TN)).astype(ct.float32)), m)
        dy = m * decay[:, None]
        at = (0, t[:, None], h, pidx[None, :])
        keep = inside[:, None] & (pidx[None, :] < headdim)
        if has_z != 0:
            dy = dy * silu(ct.gather(z, at, mask=keep).astype(ct.float32))
        yt = ct.gather(y, at, mask=keep).astype(ct.float32)
        ct.scatter(y, at, (yt + dy).astype(y.dtype), mask=keep)


def start_state_out_constants(chunk_size: int) -> dict:
    return dict(BL=sub_block(chunk_size), TP=TILE_P, TN=TILE_N)
