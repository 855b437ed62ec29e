"""compute_out kernel: y from each chunk's entering state and the chunk's own tokens, with D and z fused.

One program per (block of BL rows of one chunk, head, headdim tile of TP, batch row), blocks of all heads
of a row block next to each other so that heads of one group share C and the C . B^T blocks in L2. For its
rows i it forms in registers:

    acc  = exp(cs_i) * C_i . S^T                          inter-chunk: (BL, N) x (N, TP), N in TN steps
    acc += sum over column blocks j <= i of
           (CB_ij  *  exp(cs_i - cs_j) * dt_j  masked to j <= i, same sequence)  x  x_j
    y    = (acc + D * x_i) * silu(z_i)

CB_ij = C_i . B_j^T comes from the float32 scratch chunk_cb.py writes once per (chunk, group): the same
values this kernel used to form itself for every head and headdim tile, so results are unchanged while the
intra-chunk loop is now load CB, x_j -> one mma per column block. Nothing but y is written. The
inter-chunk product runs in tf32 (states are float32; tf32 keeps their range where float16 would not); the
intra-chunk product runs in the input dtype (float32 mma for float32 inputs), accumulating in float32.
"""

from __future__ import annotations

import cuda.tile as ct

from .common import (LOG2E, Big, ConstBool, ConstInt, cdiv, dependent_launch_prologue, diag_decay, exp2, in_order,
                     load_tile, scale_by, silu)

_ZERO = ct.PaddingMode.ZERO


@ct.kernel
def compute_out_kernel(x: Big, dt_out: Big, dA_cumsum: Big, C: Big, cb: Big, states: Big, D, z: Big,
                       seq_idx: Big, y: Big,
                       seqlen: int, nheads: int, heads_per_group: int, dstate: int, n_ptiles: int,
                       has_d: int, has_z: int, reverse: int,
                       L: ConstInt, BL: ConstInt, TP: ConstInt, TN: ConstInt, HAS_SEQ: ConstBool,
                       CHK: ConstBool, SBF: ConstBool):
    dependent_launch_prologue()
    pid = ct.bid(0)
    b = ct.bid(1)
    pt = pid % n_ptiles
    rest = pid // n_ptiles
    h = rest % nheads
    rb = rest // nheads            # row block over the whole sequence
    # reverse = 1 takes the row blocks last first (the chunks chunk_state read last may still be in L2)
    rb = in_order(rb, cdiv(seqlen, BL), reverse)
    blocks_per_chunk = L // BL
    c = rb // blocks_per_chunk
    m = rb % blocks_per_chunk      # row block inside the chunk
    g = h // heads_per_group
    mma_dtype = x.dtype
    n_ntiles = (dstate + TN - 1) // TN

    # The chunked intermediates (dA_cumsum, dt_out, cb) are padded to whole chunks: never out of bounds.
    cs_i = ct.load(dA_cumsum, (b, h, c, m), shape=(1, 1, 1, BL), check_bounds=False).reshape((BL,))
    dt_i = ct.load(dt_out, (b, h, c, m), shape=(1, 1, 1, BL), check_bounds=False).reshape((BL,))
    # Reference point s = the row block's first token: for i >= s > j, exp(cs_i - cs_j) = exp(cs_i - cs_s) *
    # exp(cs_s - cs_j), both factors <= 1 (cs falls). Below the diagonal block the decay is then a row scale
    # times a column scale, so those blocks need no (BL x BL) exp or mask; only the diagonal block does. cs_s
    # is taken from cs_i rather than loaded on its own (a per-thread global load; every other load is a TMA
    # copy). That was neutral on the H200 (docs/history.md v19) but needs no first-block special case.
    cs_s = ct.extract(cs_i, index=(0,), shape=(1,)).reshape(())
    csl_s = cs_s * LOG2E           # the exponentials below are exp2 of log2(e)-scaled sums (common.exp2)
    if HAS_SEQ:
        seq_i = load_tile(seq_idx, (b, rb), (1, BL), CHK).reshape((BL,))
        seq_prev = ct.load(seq_idx, (b, ct.maximum(c * L - 1, 0)), shape=())
        seq_prev = ct.where(c == 0, 0, seq_prev)

    # The diagonal block's tiles are requested first, ahead of the state product and the column loop: 2-3% less
    # compute_out time on the H200 than requesting them where they are used (docs/history.md, v21).
    cbd = ct.load(cb, (b, c, g, m, m), shape=(1, 1, 1, BL, BL), check_bounds=False).reshape((BL, BL))
    xi = load_tile(x, (b, rb, h, pt), (1, BL, 1, TP), CHK).reshape((BL, TP))

    # Inter-chunk term from the state entering the chunk, scaled by exp(cs_s) now and exp(cs_i - cs_s) below.
    acc = ct.zeros((BL, TP), dtype=ct.float32)
    for k in range(n_ntiles):
        ci = load_tile(C, (b, rb, g, k), (1, BL, 1, TN), CHK).reshape((BL, TN))
        st = load_tile(states, (b, c, h, pt, k), (1, 1, 1, TP, TN), CHK).reshape((TP, TN))
        if SBF:
            acc = ct.mma(ci, ct.transpose(st.astype(mma_dtype)), acc)
        else:
            acc = ct.mma(ci.astype(ct.float32).astype(ct.tfloat32),
                         ct.transpose(st.astype(ct.float32)).astype(ct.tfloat32), acc)
    if HAS_SEQ:
        acc = acc * ct.where(seq_i == seq_prev, exp2(csl_s), 0.0)[:, None]
    else:
        acc = acc * exp2(csl_s)

    # Column blocks below the diagonal one: weights CB_ij * exp(cs_s - cs_j) * dt_j.
    for jb in range(m):
        jrow = c * blocks_per_chunk + jb
        cbt = ct.load(cb, (b, c, g, m, jb), shape=(1, 1, 1, BL, BL),
                      check_bounds=False).reshape((BL, BL))
        cs_j = ct.load(dA_cumsum, (b, h, c, jb), shape=(1, 1, 1, BL), check_bounds=False).reshape((BL,))
        dt_j = ct.load(dt_out, (b, h, c, jb), shape=(1, 1, 1, BL), check_bounds=False).reshape((BL,))
        wgt = scale_by(cbt, (exp2(csl_s - cs_j * LOG2E) * dt_j)[None, :])
        if HAS_SEQ:
            seq_j = load_tile(seq_idx, (b, jrow), (1, BL), CHK).reshape((BL,))
            wgt = ct.where(seq_i[:, None] == seq_j[None, :], wgt, 0.0)
        xj = load_tile(x, (b, jrow, h, pt), (1, BL, 1, TP), CHK).reshape((BL, TP))
        acc = ct.mma(wgt.astype(mma_dtype), xj.astype(mma_dtype), acc)
    acc = acc * exp2(cs_i * LOG2E - csl_s)[:, None]

    # The diagonal block: causal mask (and same sequence), decay formed per element.
    rows = ct.arange(BL, dtype=ct.int32)
    keep = rows[:, None] >= rows[None, :]
    if HAS_SEQ:
        keep = keep & (seq_i[:, None] == seq_i[None, :])
    decay = diag_decay(cs_i, keep)
    wgt = scale_by(cbd, decay * dt_i[None, :])
    acc = ct.mma(wgt.astype(mma_dtype), xi.astype(mma_dtype), acc)

    # D: has_d 1 is one value per head, D given as (nheads, 1) (no per-channel copy for the host to make);
    # 2 is (nheads, headdim).
    if has_d == 1:
        acc = acc + xi.astype(ct.float32) * ct.load(D, (h, 0), shape=()).astype(ct.float32)
    if has_d == 2:
        dv = load_tile(D, (h, pt), (1, TP), CHK)
        acc = acc + xi.astype(ct.float32) * dv.astype(ct.float32)
    if has_z != 0:
        zi = load_tile(z, (b, rb, h, pt), (1, BL, 1, TP), CHK).reshape((BL, TP))
        zf = zi.astype(ct.float32)
        acc = acc * silu(zf)
    ct.store(y, (b, rb, h, pt), acc.astype(y.dtype).reshape((1, BL, 1, TP)))
