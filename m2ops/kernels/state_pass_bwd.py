"""Kernels of the fwd_pass_state backward (the reverse of chunk_state.py + state_passing.py).

With S_c the state entering chunk c (recomputed by the forward kernels), carry_c and the token weights w_l as
in the forward, and gS_C = g_final:

1. state_passing_bwd_kernel, one program per (block of BLK state elements, head, batch row), walks the
   chunks backwards:  glocal_c = gS_{c+1};  gcarry_c = <gS_{c+1}, S_c> (this block's share);
   gS_c = g_states[c] + carry_c gS_{c+1};  at the end g_init = gS_0.
   Without GC (backward.separate_carry_grad) the walk leaves gcarry out and reads chunk
   c - 1's inputs while it works on chunk c, and state_carry_grad_kernel, one program per (chunk, head,
   batch row), forms gcarry_c = <glocal_c, S_c> afterwards, in parallel over the chunks.
2. chunk_state_bwd_x_kernel, one program per (chunk, head, headdim tile, batch row): for each block of BL
   tokens, M = B . glocal_c^T (over all dstate tiles), g_x = w M (added into the caller's g_x, another op's
   gradient of x) and this headdim tile's share of g_w = sum_p x M.
3. chunk_state_bwd_b_kernel, one program per (chunk, token block, group, dstate tile, batch row): g_B = sum
   over the group's heads and headdim tiles of (w x)^T-weighted glocal, i.e. (w x) . glocal_c per head (added
   into the caller's g_B, another op's gradient of B).
4. chunk_state_bwd_w_kernel, one program per (chunk, head, batch row), turns g_w (the headdim tiles' shares
   summed) and gcarry into the gradients of dt_out and dA_cumsum: g_dt = g_w decay and, with u = g_w w,
   g_cs_l = -u_l plus, at the chunk's last token, sum_l u_l + gcarry carry (reference:
   chunked_backward.token_weight_grads), in place of about a dozen small PyTorch operations and their launches;
   added into the caller's g_dt and g_cs (another op's), in place of two more.

The products with gradients run in tf32 (gradients are float32), or with LOWP (bfloat16 inputs) in bfloat16, glocal
and the weighted x rounded to bfloat16 as the forward rounds its operands. Under LOWP state_passing_bwd stores
glocal in bfloat16 (backward.g_local_dtype_name): the same rounding, done once where it is written instead of in
every program that reads it, at half the bytes; gcarry is formed from the float32 value before.
"""

from __future__ import annotations

import cuda.tile as ct

from .common import LOG2E, Big, ConstBool, ConstInt, exp2
from .common import mma_operand as _op
from .compute_out_bwd import written_slots_sum
from .state_passing import _chunk_inputs, _raw_carry, state_block

_ZERO = ct.PaddingMode.ZERO


@ct.kernel
def state_passing_bwd_kernel(states: Big, g_states: Big, g_final: Big, dA_cumsum: Big, seq_idx: Big,
                             g_local: Big, g_carry_part: Big, g_init: Big,
                             seqlen: int, nchunks: int, n_blocks: int, L: int,
                             BLK: ConstInt, HAS_SEQ: ConstBool, GC: ConstBool, CHK: ConstBool):
    pid = ct.bid(0)
    b = ct.bid(1)
    blk = pid % n_blocks
    h = pid // n_blocks

    g = ct.load(g_final, (b, h, blk), shape=(1, 1, BLK), padding_mode=_ZERO).reshape((BLK,))
    if not GC:
        # Why: measured on the H200, this walk took 0.85 ms at T=64K, 80 heads, dstate 64 where the forward's
        # (the same traffic, reads issued a chunk ahead, no reduction) takes 0.16; issuing the reads ahead
        # with the per-chunk block sum still in the loop made it slower (0.95). Here the loop holds neither
        # the sum nor the states' reads: only chunk c - 1's carry and g_states block, read ahead. Both stay as
        # loaded until the step that uses them (cs_last is exponentiated there), and the loads are unchecked
        # where the block divides the state, as in the forward's walk (state_passing.py): 0.160 -> 0.147 ms at
        # T=64K N=64, 0.041 -> 0.038 at T=16K N=64 (docs/history.md, v25).
        c = nchunks - 1
        cs = _raw_carry(dA_cumsum, seq_idx, b, h, c, seqlen, L, HAS_SEQ)
        gst = state_block(g_states, b, c, h, blk, BLK, CHK)
        for i in range(nchunks):
            c = nchunks - 1 - i
            prv = ct.maximum(c - 1, 0)  # at c = 0 chunk 0 is read again, unused
            cs_p = _raw_carry(dA_cumsum, seq_idx, b, h, prv, seqlen, L, HAS_SEQ)
            gst_p = state_block(g_states, b, prv, h, blk, BLK, CHK)
            ct.store(g_local, (b, c, h, blk), g.astype(g_local.dtype).reshape((1, 1, 1, BLK)))
            g = gst + exp2(cs * LOG2E) * g
            cs, gst = cs_p, gst_p
        ct.store(g_init, (b, h, blk), g.reshape((1, 1, BLK)))
        return
    for i in range(nchunks):
        c = nchunks - 1 - i
        s_c, carry = _chunk_inputs(states, dA_cumsum, seq_idx, b, h, c, blk, seqlen, L, BLK, HAS_SEQ, 1)
        ct.store(g_local, (b, c, h, blk), g.astype(g_local.dtype).reshape((1, 1, 1, BLK)))
        # s_c float32, or bfloat16 where the forward's own copy is reused (backward.fwd_pass_state_bwd)
        ct.store(g_carry_part, (b, h, c, blk), ct.sum(g * s_c.astype(ct.float32)).reshape((1, 1, 1, 1)))
        gst = ct.load(g_states, (b, c, h, blk), shape=(1, 1, 1, BLK), padding_mode=_ZERO).reshape((BLK,))
        g = gst + carry * g
    ct.store(g_init, (b, h, blk), g.reshape((1, 1, BLK)))


@ct.kernel
def state_carry_grad_kernel(states: Big, g_local: Big, g_carry: Big, nheads: int, n_blocks: int,
                            BLK: ConstInt):
    """gcarry_c = <glocal_c, S_c> of one (chunk, head, batch row) (after state_passing_bwd_kernel without GC).
    One program takes a whole state, BLK elements at a time: one program per block instead (its first form)
    took 1.58 ms at T=64K, H=80, dstate 64 on an H200, where the bytes need 0.1."""
    pid = ct.bid(0)
    b = ct.bid(1)
    h = pid % nheads
    c = pid // nheads
    acc = ct.zeros((BLK,), dtype=ct.float32)
    for blk in range(n_blocks):
        s = ct.load(states, (b, c, h, blk), shape=(1, 1, 1, BLK), padding_mode=_ZERO).reshape((BLK,))
        gl = ct.load(g_local, (b, c, h, blk), shape=(1, 1, 1, BLK), padding_mode=_ZERO).reshape((BLK,))
        acc = acc + s.astype(ct.float32) * gl.astype(ct.float32)
    ct.store(g_carry, (b, h, c, 0), ct.sum(acc).reshape((1, 1, 1, 1)))


def _end_decays(dA_cumsum, seq_idx, b, h, c, sb, row, seqlen, L, BL, HAS_SEQ):
    """exp(cs_last - cs_l) of one block of BL tokens (block sb of chunk c, row of the token axis), zero off the
    chunk-end sequence."""
    cs_last = ct.load(dA_cumsum, (b, h, c, L - 1), shape=())
    cs = ct.load(dA_cumsum, (b, h, c, sb), shape=(1, 1, 1, BL)).reshape((BL,))
    decay = ct.exp(cs_last - cs)
    if HAS_SEQ:
        seq_last = ct.load(seq_idx, (b, ct.minimum(c * L + L - 1, seqlen - 1)), shape=())
        seq = ct.load(seq_idx, (b, row), shape=(1, BL), padding_mode=_ZERO).reshape((BL,))
        decay = ct.where(seq == seq_last, decay, 0.0)
    return decay


def _token_weights(dA_cumsum, dt_out, seq_idx, b, h, c, sb, row, seqlen, L, BL, HAS_SEQ):
    """w_l = exp(cs_last - cs_l) dt_l of one block of BL tokens, zero off the chunk-end sequence."""
    dt = ct.load(dt_out, (b, h, c, sb), shape=(1, 1, 1, BL)).reshape((BL,))
    return _end_decays(dA_cumsum, seq_idx, b, h, c, sb, row, seqlen, L, BL, HAS_SEQ) * dt


@ct.kernel
def chunk_state_bwd_x_kernel(x: Big, B: Big, dt_out: Big, dA_cumsum: Big, seq_idx: Big, g_local: Big,
                             g_x: Big, g_w_part: Big,
                             seqlen: int, nheads: int, heads_per_group: int, n_ptiles: int, n_ntiles: int,
                             add_into: int, L: int,
                             BL: ConstInt, TP: ConstInt, TN: ConstInt, HAS_SEQ: ConstBool, LOWP: ConstBool):
    pid = ct.bid(0)
    b = ct.bid(1)
    pt = pid % n_ptiles
    rest = pid // n_ptiles
    h = rest % nheads
    c = rest // nheads
    g = h // heads_per_group

    n_sub = ct.minimum(L // BL, (seqlen - c * L + BL - 1) // BL)
    for sb in range(n_sub):
        row = c * (L // BL) + sb
        w = _token_weights(dA_cumsum, dt_out, seq_idx, b, h, c, sb, row, seqlen, L, BL, HAS_SEQ)
        # x and the gradient of x already in g_x (another op's, added into here rather than in a separate pass:
        # this program alone reads and then writes the tile) are loaded before the products so that their
        # latency overlaps them: loaded after, the added read cost 0.4 ms at 64K/128 for 0.16 ms of traffic
        # (docs/history.md v9). Both stay in their storage dtype until used: widened early, they spilled
        # registers at occupancy 4 (ncu, v11).
        xs = ct.load(x, (b, row, h, pt), shape=(1, BL, 1, TP), padding_mode=_ZERO).reshape((BL, TP))
        if add_into != 0:
            base = ct.load(g_x, (b, row, h, pt), shape=(1, BL, 1, TP), padding_mode=_ZERO).reshape((BL, TP))
        else:
            base = ct.zeros((BL, TP), dtype=g_x.dtype)
        m = ct.zeros((BL, TP), dtype=ct.float32)
        for nt in range(n_ntiles):
            bs = ct.load(B, (b, row, g, nt), shape=(1, BL, 1, TN), padding_mode=_ZERO).reshape((BL, TN))
            gl = ct.load(g_local, (b, c, h, pt, nt), shape=(1, 1, 1, TP, TN),
                         padding_mode=_ZERO).reshape((TP, TN))
            m = ct.mma(_op(bs, LOWP), _op(ct.transpose(gl), LOWP), m)
        gx = m * w[:, None] + base.astype(ct.float32)
        ct.store(g_x, (b, row, h, pt), gx.astype(g_x.dtype).reshape((1, BL, 1, TP)))
        gw = ct.sum(xs.astype(ct.float32) * m, axis=1)
        ct.store(g_w_part, (b, h, pt, row), gw.reshape((1, 1, 1, BL)))


@ct.kernel
def chunk_state_bwd_b_kernel(x: Big, dt_out: Big, dA_cumsum: Big, seq_idx: Big, g_local: Big, g_B: Big,
                             seqlen: int, ngroups: int, heads_per_group: int, n_ptiles: int, n_ntiles: int,
                             add_into: int, L: int,
                             BL: ConstInt, TP: ConstInt, TN: ConstInt, HAS_SEQ: ConstBool, LOWP: ConstBool):
    # One program per (chunk, token block, group, dstate tile): the heads of the group are summed in the
    # program, so the token blocks in the grid are what gives the parallelism at short sequences.
    pid = ct.bid(0)
    b = ct.bid(1)
    nt = pid % n_ntiles
    rest = pid // n_ntiles
    g = rest % ngroups
    rest = rest // ngroups
    sb = rest % (L // BL)
    c = rest // (L // BL)
    if c * L + sb * BL < seqlen:
        row = c * (L // BL) + sb
        acc = ct.zeros((BL, TN), dtype=ct.float32)
        for r in range(heads_per_group):
            h = g * heads_per_group + r
            w = _token_weights(dA_cumsum, dt_out, seq_idx, b, h, c, sb, row, seqlen, L, BL, HAS_SEQ)
            for pt in range(n_ptiles):
                xs = ct.load(x, (b, row, h, pt), shape=(1, BL, 1, TP), padding_mode=_ZERO).reshape((BL, TP))
                xw = xs.astype(ct.float32) * w[:, None]
                gl = ct.load(g_local, (b, c, h, pt, nt), shape=(1, 1, 1, TP, TN),
                             padding_mode=_ZERO).reshape((TP, TN))
                acc = ct.mma(_op(xw, LOWP), _op(gl, LOWP), acc)
        if add_into != 0:  # another op's gradient of B: this program alone reads and then writes the tile
            acc = acc + ct.load(g_B, (b, row, g, nt), shape=(1, BL, 1, TN),
                                padding_mode=_ZERO).reshape((BL, TN)).astype(ct.float32)
        ct.store(g_B, (b, row, g, nt), acc.astype(g_B.dtype).reshape((1, BL, 1, TN)))


@ct.kernel
def chunk_state_bwd_w_kernel(g_w_part: Big, dA_cumsum: Big, dt_out: Big, g_carry: Big, seq_idx: Big,
                             g_dt: Big, g_cs: Big,
                             seqlen: int, nheads: int, n_ptiles: int, add_into: int,
                             L: ConstInt, HAS_SEQ: ConstBool):
    pid = ct.bid(0)
    b = ct.bid(1)
    h = pid % nheads
    c = pid // nheads
    gw = written_slots_sum(g_w_part, b, h, c, n_ptiles, seqlen, L)  # (chunk_state_bwd_x's per-headdim-tile shares)
    tok = ct.arange(L, dtype=ct.int32)
    decay = _end_decays(dA_cumsum, seq_idx, b, h, c, 0, c, seqlen, L, L, HAS_SEQ)  # the whole chunk as one block
    dt = ct.load(dt_out, (b, h, c, 0), shape=(1, 1, 1, L)).reshape((L,))
    carry = exp2(_raw_carry(dA_cumsum, seq_idx, b, h, c, seqlen, L, HAS_SEQ) * LOG2E)
    gdt = gw * decay
    u = gdt * dt
    last = ct.sum(u) + ct.load(g_carry, (b, h, c), shape=()) * carry
    gcs = ct.where(tok == L - 1, last - u, -u)
    if add_into != 0:  # another op's gradients of dt_out and dA_cumsum, added in float32 before any rounding
        gdt = gdt + ct.load(g_dt, (b, h, c, 0), shape=(1, 1, 1, L)).reshape((L,))
        gcs = gcs + ct.load(g_cs, (b, h, c, 0), shape=(1, 1, 1, L)).reshape((L,))
    ct.store(g_dt, (b, h, c, 0), gdt.astype(g_dt.dtype).reshape((1, 1, 1, L)))
    ct.store(g_cs, (b, h, c, 0), gcs.astype(g_cs.dtype).reshape((1, 1, 1, L)))
