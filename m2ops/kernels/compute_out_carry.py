"""compute_out_carry kernel: y of a whole chunk in one program, the state carried from row block to row block.

compute_out.py gives each row block m of a chunk its own program, which adds the chunk's earlier tokens by
walking the C . B^T blocks (m, j < m): m products and 2m tiles read, 0 to 3 of each at chunk 256. Here one
program per (chunk, head, headdim tile, batch row) takes the row blocks in order and carries the state S
(TP, N) referenced to the start of the current block, in float32 registers:

    y_i  = exp(cs_i - cs_ref) * C_i . S^T  +  diagonal block (CB_ii * decay * dt) x_i,   D and z as compute_out
    S   <- exp(cs_end - cs_ref) * S  +  (w x)^T B,   w_j = exp(cs_end - cs_j) * dt_j,   cs_ref <- cs_end

S starts as the state entering the chunk (state_passing's, referenced to the chunk's start, cs = 0). Per row
block that is three products (state, diagonal, update) and five tiles (C, B, x, the diagonal C . B^T block,
y) whatever m is, so chunk_cb writes only the diagonal blocks. (Forming C_i . B_i^T here from the C and B tiles
already loaded, one more product per block and no chunk_cb launch, was slower on the H200 from 4K tokens:
docs/history.md v34.) Every factor exp(.) is of a non-positive
difference (cs falls), as in the other kernels. The state tile holds all of dstate (TN >= dstate), so this
kernel is for small dstate; the state product is bfloat16 under SBF (S rounded each block, as the entering
states are) and tf32 otherwise.

With seq_idx (HAS_SEQ) the carried state belongs to the sequence of the token before the current block:
rows of another sequence take none of it, tokens of a sequence that ends inside the block are left out of
the update, and the state is dropped where the block's last token starts or continues another sequence.
"""

from __future__ import annotations

import cuda.tile as ct

from .common import (LOG2E, Big, ConstBool, ConstInt, cdiv, dependent_launch_prologue, diag_decay, exp2, in_order,
                     load_tile, scale_by, silu, token_weight, weighted_state_product)


@ct.kernel
def compute_out_carry_kernel(x: Big, dt_out: Big, dA_cumsum: Big, C: Big, cb: Big, states: Big, D, z: Big,
                             seq_idx: Big, y: Big, B: Big,
                             seqlen: int, nheads: int, heads_per_group: int, n_ptiles: int,
                             has_d: int, has_z: int, reverse: int,
                             L: ConstInt, BL: ConstInt, TP: ConstInt, TN: ConstInt, HAS_SEQ: ConstBool,
                             CHK: ConstBool, SBF: ConstBool):
    dependent_launch_prologue()
    pid = ct.bid(0)
    b = ct.bid(1)
    pt = pid % n_ptiles
    rest = pid // n_ptiles
    h = rest % nheads
    c = rest // nheads
    # reverse = 1 takes the chunks last first: chunk_state reads x first to last, so the chunks it read last may
    # still be in L2 when the output kernel starts
    c = in_order(c, cdiv(seqlen, L), reverse)
    g = h // heads_per_group
    mma_dtype = x.dtype
    blocks_per_chunk = L // BL
    n_sub = ct.minimum(blocks_per_chunk, (seqlen - c * L + BL - 1) // BL)

    s = load_tile(states, (b, c, h, pt, 0), (1, 1, 1, TP, TN), CHK).reshape((TP, TN)).astype(ct.float32)
    csl_ref = ct.zeros((1,), dtype=ct.float32)     # log2-scaled cs the carried state is referenced to
    # The loop-carried values (s, csl_ref, seq_ref) are assigned on every path: a loop-carried tile assigned
    # under a compile-time branch gave wrong results on the GPU once (docs/history.md v21, PREFETCH).
    seq_ref = ct.zeros((1,), dtype=ct.int32)       # the sequence the carried state belongs to (HAS_SEQ)
    if HAS_SEQ:
        seq_ref = ct.load(seq_idx, (b, ct.maximum(c * L - 1, 0)), shape=()).reshape((1,))
        seq_ref = ct.where(c == 0, 0, seq_ref)
    rows = ct.arange(BL, dtype=ct.int32)
    causal = rows[:, None] >= rows[None, :]

    for m in range(n_sub):
        rb = c * blocks_per_chunk + m
        cs_i = ct.load(dA_cumsum, (b, h, c, m), shape=(1, 1, 1, BL), check_bounds=False).reshape((BL,))
        dt_i = ct.load(dt_out, (b, h, c, m), shape=(1, 1, 1, BL), check_bounds=False).reshape((BL,))
        cbd = ct.load(cb, (b, c, g, m, m), shape=(1, 1, 1, BL, BL), check_bounds=False).reshape((BL, BL))
        xi = load_tile(x, (b, rb, h, pt), (1, BL, 1, TP), CHK).reshape((BL, TP))
        ci = load_tile(C, (b, rb, g, 0), (1, BL, 1, TN), CHK).reshape((BL, TN))
        bi = load_tile(B, (b, rb, g, 0), (1, BL, 1, TN), CHK).reshape((BL, TN))
        csl_i = cs_i * LOG2E

        acc = ct.zeros((BL, TP), dtype=ct.float32)
        if SBF:
            acc = ct.mma(ci, ct.transpose(s.astype(mma_dtype)), acc)
        else:
            acc = ct.mma(ci.astype(ct.float32).astype(ct.tfloat32),
                         ct.transpose(s).astype(ct.tfloat32), acc)
        row_scale = exp2(csl_i - csl_ref)
        keep = causal
        seq_i = ct.zeros((BL,), dtype=ct.int32)
        if HAS_SEQ:
            seq_i = load_tile(seq_idx, (b, rb), (1, BL), CHK).reshape((BL,))
            row_scale = ct.where(seq_i == seq_ref, row_scale, 0.0)
            keep = keep & (seq_i[:, None] == seq_i[None, :])
        acc = acc * row_scale[:, None]
        wgt = scale_by(cbd, diag_decay(cs_i, keep) * dt_i[None, :])
        acc = ct.mma(wgt.astype(mma_dtype), xi.astype(mma_dtype), acc)

        if has_d == 1:
            acc = acc + xi.astype(ct.float32) * ct.load(D, (h, 0), shape=()).astype(ct.float32)
        if has_d == 2:
            acc = acc + xi.astype(ct.float32) * load_tile(D, (h, pt), (1, TP), CHK).astype(ct.float32)
        if has_z != 0:
            zi = load_tile(z, (b, rb, h, pt), (1, BL, 1, TP), CHK).reshape((BL, TP))
            acc = acc * silu(zi.astype(ct.float32))
        ct.store(y, (b, rb, h, pt), acc.astype(y.dtype).reshape((1, BL, 1, TP)))

        # The state at the end of this block, for the next one.
        cs_end = ct.extract(cs_i, index=(BL - 1,), shape=(1,))
        csl_end = cs_end * LOG2E
        w = token_weight(cs_end, cs_i, dt_i)
        carry = exp2(csl_end - csl_ref)
        seq_end = ct.extract(seq_i, index=(BL - 1,), shape=(1,))
        if HAS_SEQ:
            w = ct.where(seq_i == seq_end, w, 0.0)
            carry = ct.where(seq_end == seq_ref, carry, 0.0)
        s = weighted_state_product(xi, bi, w, s * carry.reshape((1, 1)))
        csl_ref = csl_end
        seq_ref = seq_end
