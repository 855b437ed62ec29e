"""fwd_pass_state kernel: the state entering every chunk and the final state.

One program per (batch row, head, (headdim tile, dstate tile)) owns a (TP, TN) float32 tile of the state and
walks the chunks in order, carrying the tile in registers: it stores the tile as the chunk's entering state,
decays it by exp(cs_last), and adds the chunk's own tokens as mma's of (x^T) (TP, BL) by (w * B) (BL, TN),
BL rows at a time, w_j = exp(cs_last - cs_j) * dt_j. Chunk states are therefore never recomputed or re-read,
and the only sequential axis is the chunk axis.

With seq_idx (HAS_SEQ), tokens whose sequence differs from the chunk's last token add nothing, and the
entering state is dropped when the chunk's last token belongs to another sequence than the token before
the chunk (sequence 0 owns initial_states), exactly like the reference.
"""

from __future__ import annotations

import cuda.tile as ct

from .common import Big, ConstBool, ConstInt

_ZERO = ct.PaddingMode.ZERO


@ct.kernel
def fwd_pass_state_kernel(x: Big, B: Big, dt_out: Big, dA_cumsum: Big, initial_states: Big, seq_idx: Big,
                          states: Big, final_states: Big,
                          seqlen: int, nchunks: int, nheads: int, heads_per_group: int, n_ntiles: int,
                          n_ptiles: int, has_init: int,
                          L: ConstInt, BL: ConstInt, TP: ConstInt, TN: ConstInt, HAS_SEQ: ConstBool):
    pid = ct.bid(0)
    b = ct.bid(1)
    nt = pid % n_ntiles
    rest = pid // n_ntiles
    pt = rest % n_ptiles
    h = rest // n_ptiles
    g = h // heads_per_group
    mma_dtype = x.dtype

    s = ct.zeros((TP, TN), dtype=ct.float32)
    if has_init != 0:
        s = ct.load(initial_states, (b, h, pt, nt), shape=(1, 1, TP, TN),
                    padding_mode=_ZERO).reshape((TP, TN)).astype(ct.float32)

    for c in range(nchunks):
        ct.store(states, (b, c, h, pt, nt), s.reshape((1, 1, 1, TP, TN)))
        cs_last = ct.load(dA_cumsum, (b, h, c, L - 1), shape=())
        carry = ct.exp(cs_last)
        if HAS_SEQ:
            start = c * L
            seq_last = ct.load(seq_idx, (b, ct.minimum(start + L - 1, seqlen - 1)), shape=())
            seq_prev = ct.load(seq_idx, (b, ct.maximum(start - 1, 0)), shape=())
            seq_prev = ct.where(c == 0, 0, seq_prev)
            carry = ct.where(seq_last == seq_prev, carry, 0.0)
        s = s * carry

        # Sub-blocks wholly past seqlen are skipped: a tile entirely outside an array is undefined to load.
        n_sub = ct.minimum(L // BL, (seqlen - c * L + BL - 1) // BL)
        for sb in range(n_sub):
            cs = ct.load(dA_cumsum, (b, h, c, sb), shape=(1, 1, 1, BL)).reshape((BL,))
            dt = ct.load(dt_out, (b, h, c, sb), shape=(1, 1, 1, BL)).reshape((BL,))
            w = ct.exp(cs_last - cs) * dt
            if HAS_SEQ:
                seq = ct.load(seq_idx, (b, c * (L // BL) + sb), shape=(1, BL),
                              padding_mode=_ZERO).reshape((BL,))
                w = ct.where(seq == seq_last, w, 0.0)
            row = c * (L // BL) + sb
            xs = ct.load(x, (b, row, h, pt), shape=(1, BL, 1, TP), padding_mode=_ZERO).reshape((BL, TP))
            bs = ct.load(B, (b, row, g, nt), shape=(1, BL, 1, TN), padding_mode=_ZERO).reshape((BL, TN))
            bw = (bs.astype(ct.float32) * w[:, None]).astype(mma_dtype)
            s = ct.mma(ct.transpose(xs.astype(mma_dtype)), bw, s)

    ct.store(final_states, (b, h, pt, nt), s.reshape((1, 1, TP, TN)))
