"""varlen_states kernel: the final state of every sequence packed along seqlen by cu_seqlens (batch 1).

One program per (sequence, head, (headdim tile, dstate tile)). A sequence's final state is the state
entering the chunk that holds its last token, decayed to that token (kept only when that entering state
belongs to the sequence: it began before the chunk, or it is sequence 0 at token 0, which owns
initial_states), plus the sequence's own tokens inside that chunk (the token blocks that hold them). Reads the
states written by fwd_pass_state_kernel, so it runs after it on the same stream; no host loop over sequences.
"""

from __future__ import annotations

import cuda.tile as ct

from .common import LOG2E, Big, ConstInt, dependent_launch_prologue, exp2, weighted_state_product

_ZERO = ct.PaddingMode.ZERO


@ct.kernel
def varlen_states_kernel(x: Big, B: Big, dt_out: Big, dA_cumsum: Big, states: Big, cu_seqlens,
                         varlen_states: Big,
                         heads_per_group: int, n_ntiles: int,
                         L: ConstInt, BL: ConstInt, TP: ConstInt, TN: ConstInt):
    dependent_launch_prologue()
    seq = ct.bid(0)
    h = ct.bid(1)
    tile = ct.bid(2)
    nt = tile % n_ntiles
    pt = tile // n_ntiles
    g = h // heads_per_group

    start = ct.load(cu_seqlens, (seq,), shape=())
    last = ct.load(cu_seqlens, (seq + 1,), shape=()) - 1
    c = last // L
    pos_last = last - c * L
    cs_end = ct.load(dA_cumsum, (0, h, c, pos_last), shape=())
    s = ct.zeros((TP, TN), dtype=ct.float32)
    if (start < c * L) | (start == 0):  # the entering state is the sequence's (read only then)
        s = ct.load(states, (0, c, h, pt, nt), shape=(1, 1, 1, TP, TN)).reshape((TP, TN)).astype(ct.float32) * exp2(
            cs_end * LOG2E)

    # Only the sub-blocks from the sequence's first token in the chunk to its last: those before hold other
    # sequences' tokens (weight 0), those after may lie wholly past seqlen.
    for sb in range(ct.maximum(start - c * L, 0) // BL, pos_last // BL + 1):
        cs = ct.load(dA_cumsum, (0, h, c, sb), shape=(1, 1, 1, BL)).reshape((BL,))
        dt = ct.load(dt_out, (0, h, c, sb), shape=(1, 1, 1, BL)).reshape((BL,))
        t = c * L + sb * BL + ct.arange(BL, dtype=ct.int32)
        inside = (t >= start) & (t <= last)
        w = exp2(ct.where(inside, (cs_end - cs) * LOG2E, -float("inf"))) * dt
        row = c * (L // BL) + sb
        xs = ct.load(x, (0, row, h, pt), shape=(1, BL, 1, TP), padding_mode=_ZERO).reshape((BL, TP))
        bs = ct.load(B, (0, row, g, nt), shape=(1, BL, 1, TN), padding_mode=_ZERO).reshape((BL, TN))
        s = weighted_state_product(xs, bs, w, s)

    ct.store(varlen_states, (seq, h, pt, nt), s.reshape((1, 1, TP, TN)))
