"""The fused scan (the chunk_scan op): y and the final state without per-chunk states in memory.

Every (batch row, head) sequence is cut into `nseg` segments of whole token blocks of BL tokens. Three launches:

1. segment_state_kernel, one program per (headdim tile, head, segment, batch row): walks its segment's
   blocks from a zero state and stores the segment's end state (float32, (b, nseg, h, P, N)) and the log of
   the segment's total decay (float32, (b, h, nseg, 1); -inf where a seq_idx change cuts the carry).
2. state_passing_kernel (state_passing.py), run over segments instead of chunks: turns the end states into
   the states entering each segment, in place, and gives the final state.
3. segment_out_kernel, one program per (headdim tile, head, segment, batch row): starts from the state
   entering its segment, held in registers, and for each block of BL tokens forms

       y_i  = exp(cs_i - cs_0) C_i . S^T  +  sum_{j <= i} (C_i . B_j) exp(cs_i - cs_j) dt_j x_j
       S   <- exp(cs_last - cs_0) S  +  sum_j exp(cs_last - cs_j) dt_j x_j^T B_j

   with D and z fused into y; it writes only y.

Why: the three-kernel split writes the state entering every chunk (B*T/L*H*P*N float32) and reads it
back, which at chunk 64 is more traffic than the inputs, and needs a chunk size of 256 to make that traffic
small, at the price of L^2 intra-chunk work. Here the state lives in registers between blocks, so blocks can
be small (BL <= 64 tokens: the intra-block work is BL*P per token) while the states in memory are a few
per head. Parallelism comes from the segments: the launcher picks nseg so that about
SEGMENT_PROGRAMS_PER_SM programs run per SM. x and B are read twice (steps 1 and 3), C once.

Blocks are read from the chunked intermediates of chunk_cumsum, dt and dA_cumsum viewed flat as (b, h,
nchunks * L): a block never straddles a chunk (BL divides L), cs_0 is the cumulative sum just before the
block (0 at a chunk start) and cs_last the block's last one. Tail positions past seqlen have dt = 0 and an
unchanged cumulative sum, so they add nothing; blocks wholly past seqlen are not visited.

seq_idx (HAS_SEQ): the state entering a block belongs to the sequence of the token before the block
(sequence 0 for the first block, which owns initial_states): rows of another sequence do not see it, and the
carry is cut when the block's last token is of another sequence; tokens add to the state only when they
share the block's last token's sequence, and to y only within their sequence. The same rules as the
reference's, at block instead of chunk granularity; the math does not depend on the granularity.

Precision as in chunk_state / compute_out: token products in the input dtype with float32 accumulation,
the state product C . S^T in tf32.
"""

from __future__ import annotations

import cuda.tile as ct

from .common import (LOG2E, Big, ConstBool, ConstInt, dependent_launch_prologue, diag_decay, exp2, silu,
                     token_weight, weighted_state_product)

_ZERO = ct.PaddingMode.ZERO


def _program(nheads, heads_per_group, n_ptiles, blocks_per_seg, n_blocks):
    """(batch row, headdim tile, head, group, segment, first block, end block) of this program."""
    pid = ct.bid(0)
    b = ct.bid(1)
    pt = pid % n_ptiles
    rest = pid // n_ptiles
    h = rest % nheads
    seg = rest // nheads
    r0 = seg * blocks_per_seg
    return b, pt, h, h // heads_per_group, seg, r0, ct.minimum(r0 + blocks_per_seg, n_blocks)


def _block(cs, dt, seq_idx, b, h, r, seqlen, blocks_per_chunk, BL, HAS_SEQ):
    """Block r of head h: its cumulative sums csb and cs_0 (just before the block; 0 at a chunk start), dt,
    the token weights w = exp(cs_last - cs) dt (zero off the sequence of the block's last token), the log of
    the carry of the entering state across the block (-inf where a sequence starts inside it), and, with
    seq_idx, the tokens' sequence ids and that of the token before the block (0, 0 without)."""
    cs_last = ct.load(cs, (b, h, r * BL + BL - 1), shape=())
    cs_0 = ct.load(cs, (b, h, ct.maximum(r * BL - 1, 0)), shape=())
    cs_0 = ct.where(r % blocks_per_chunk == 0, 0.0, cs_0)
    csb = ct.load(cs, (b, h, r), shape=(1, 1, BL)).reshape((BL,))
    dtb = ct.load(dt, (b, h, r), shape=(1, 1, BL)).reshape((BL,))
    w = token_weight(cs_last, csb, dtb)
    step = cs_last - cs_0
    seqb = 0
    seq_before = 0
    if HAS_SEQ:
        seq_last = ct.load(seq_idx, (b, ct.minimum(r * BL + BL - 1, seqlen - 1)), shape=())
        seq_before = ct.load(seq_idx, (b, ct.maximum(r * BL - 1, 0)), shape=())
        seq_before = ct.where(r == 0, 0, seq_before)
        seqb = ct.load(seq_idx, (b, r), shape=(1, BL), padding_mode=_ZERO).reshape((BL,))
        w = ct.where(seqb == seq_last, w, 0.0)
        step = ct.where(seq_last == seq_before, step, -float("inf"))
    return csb, cs_0, dtb, w, step, seqb, seq_before


@ct.kernel
def segment_state_kernel(x: Big, B: Big, dt: Big, cs: Big, seq_idx: Big, seg_states: Big, seg_logcarry: Big,
                         seqlen: int, nheads: int, heads_per_group: int, n_ptiles: int, blocks_per_seg: int,
                         n_blocks: int, blocks_per_chunk: int,
                         BL: ConstInt, TP: ConstInt, NT: ConstInt, HAS_SEQ: ConstBool):
    dependent_launch_prologue()
    b, pt, h, g, seg, r0, r1 = _program(nheads, heads_per_group, n_ptiles, blocks_per_seg, n_blocks)

    s = ct.zeros((TP, NT), dtype=ct.float32)
    logc = ct.zeros((), dtype=ct.float32)
    for r in range(r0, r1):
        _, _, _, w, step, _, _ = _block(cs, dt, seq_idx, b, h, r, seqlen, blocks_per_chunk, BL, HAS_SEQ)
        xs = ct.load(x, (b, r, h, pt), shape=(1, BL, 1, TP), padding_mode=_ZERO).reshape((BL, TP))
        bs = ct.load(B, (b, r, g, 0), shape=(1, BL, 1, NT), padding_mode=_ZERO).reshape((BL, NT))
        s = weighted_state_product(xs, bs, w, s * exp2(step * LOG2E))
        logc = logc + step

    ct.store(seg_states, (b, seg, h, pt, 0), s.reshape((1, 1, 1, TP, NT)))
    if pt == 0:
        ct.store(seg_logcarry, (b, h, seg, 0), logc)


@ct.kernel
def segment_out_kernel(x: Big, dt: Big, cs: Big, C: Big, B: Big, seq_idx: Big, seg_states: Big, D, z: Big,
                       y: Big,
                       seqlen: int, nheads: int, heads_per_group: int, n_ptiles: int, blocks_per_seg: int,
                       n_blocks: int, blocks_per_chunk: int, has_d: int, has_z: int,
                       BL: ConstInt, TP: ConstInt, NT: ConstInt, HAS_SEQ: ConstBool):
    dependent_launch_prologue()
    b, pt, h, g, seg, r0, r1 = _program(nheads, heads_per_group, n_ptiles, blocks_per_seg, n_blocks)
    mma_dtype = x.dtype

    s = ct.load(seg_states, (b, seg, h, pt, 0), shape=(1, 1, 1, TP, NT),
                padding_mode=_ZERO).reshape((TP, NT))
    pos = ct.arange(BL, dtype=ct.int32)
    causal = pos[:, None] >= pos[None, :]
    # D as in compute_out: has_d 1 is (nheads, 1), one value per head; 2 is (nheads, headdim).
    dv = ct.zeros((1, TP), dtype=ct.float32)
    if has_d == 1:
        dv = dv + ct.load(D, (h, 0), shape=()).astype(ct.float32)
    if has_d == 2:
        dv = ct.load(D, (h, pt), shape=(1, TP), padding_mode=_ZERO).astype(ct.float32)
    for r in range(r0, r1):
        csb, cs_0, dtb, w, step, seqb, seq_before = _block(cs, dt, seq_idx, b, h, r, seqlen, blocks_per_chunk,
                                                           BL, HAS_SEQ)
        xs = ct.load(x, (b, r, h, pt), shape=(1, BL, 1, TP), padding_mode=_ZERO).reshape((BL, TP))
        cm = ct.load(C, (b, r, g, 0), shape=(1, BL, 1, NT), padding_mode=_ZERO).reshape((BL, NT))
        bm = ct.load(B, (b, r, g, 0), shape=(1, BL, 1, NT), padding_mode=_ZERO).reshape((BL, NT))

        keep = causal
        inter = exp2((csb - cs_0) * LOG2E)
        if HAS_SEQ:
            keep = keep & (seqb[:, None] == seqb[None, :])
            inter = ct.where(seqb == seq_before, inter, 0.0)
        # Inter-block term from the state entering the block, then the intra-block term.
        acc = ct.mma(cm.astype(ct.float32).astype(ct.tfloat32), ct.transpose(s).astype(ct.tfloat32),
                     ct.zeros((BL, TP), dtype=ct.float32))
        acc = acc * inter[:, None]
        cb = ct.mma(cm, ct.transpose(bm), ct.zeros((BL, BL), dtype=ct.float32))
        decay = diag_decay(csb, keep)
        acc = ct.mma((cb * decay * dtb[None, :]).astype(mma_dtype), xs, acc)
        if has_d != 0:
            acc = acc + xs.astype(ct.float32) * dv
        if has_z != 0:
            zs = ct.load(z, (b, r, h, pt), shape=(1, BL, 1, TP), padding_mode=_ZERO).reshape((BL, TP))
            zf = zs.astype(ct.float32)
            acc = acc * silu(zf)
        ct.store(y, (b, r, h, pt), acc.astype(y.dtype).reshape((1, BL, 1, TP)))

        s = weighted_state_product(xs, bm, w, s * exp2(step * LOG2E))
