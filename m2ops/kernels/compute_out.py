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

from .common import Big, ConstBool, ConstInt

_ZERO = ct.PaddingMode.ZERO


@ct.kernel
def compute_out_kernel(x: Big, dt_out: Big, dA_cumsum: Big, C: Big, cb: Big, states: Big, D, z: Big,
                       seq_idx: Big, y: Big,
                       seqlen: int, nheads: int, heads_per_group: int, dstate: int, n_ptiles: int,
                       has_d: int, has_z: int,
                       L: ConstInt, BL: ConstInt, TP: ConstInt, TN: ConstInt, HAS_SEQ: ConstBool):
    pid = ct.bid(0)
    b = ct.bid(1)
    pt = pid % n_ptiles
    rest = pid // n_ptiles
    h = rest % nheads
    rb = rest // nheads            # row block over the whole sequence
    blocks_per_chunk = L // BL
    c = rb // blocks_per_chunk
    m = rb % blocks_per_chunk      # row block inside the chunk
    g = h // heads_per_group
    mma_dtype = x.dtype
    n_ntiles = (dstate + TN - 1) // TN

    cs_i = ct.load(dA_cumsum, (b, h, c, m), shape=(1, 1, 1, BL)).reshape((BL,))
    rows = m * BL + ct.arange(BL, dtype=ct.int32)   # positions inside the chunk

    # Inter-chunk term from the state entering the chunk.
    acc = ct.zeros((BL, TP), dtype=ct.float32)
    for k in range(n_ntiles):
        ci = ct.load(C, (b, rb, g, k), shape=(1, BL, 1, TN), padding_mode=_ZERO).reshape((BL, TN))
        st = ct.load(states, (b, c, h, pt, k), shape=(1, 1, 1, TP, TN),
                     padding_mode=_ZERO).reshape((TP, TN))
        acc = ct.mma(ci.astype(ct.float32).astype(ct.tfloat32),
                     ct.transpose(st.astype(ct.float32)).astype(ct.tfloat32), acc)
    scale = ct.exp(cs_i)
    if HAS_SEQ:
        seq_i = ct.load(seq_idx, (b, rb), shape=(1, BL), padding_mode=_ZERO).reshape((BL,))
        seq_prev = ct.load(seq_idx, (b, ct.maximum(c * L - 1, 0)), shape=())
        seq_prev = ct.where(c == 0, 0, seq_prev)
        scale = ct.where(seq_i == seq_prev, scale, 0.0)
    acc = acc * scale[:, None]

    # Intra-chunk term: column blocks up to and including the diagonal one.
    for jb in range(m + 1):
        jrow = c * blocks_per_chunk + jb
        cbt = ct.load(cb, (b, c, g, m, jb), shape=(1, 1, 1, BL, BL)).reshape((BL, BL))
        cs_j = ct.load(dA_cumsum, (b, h, c, jb), shape=(1, 1, 1, BL)).reshape((BL,))
        dt_j = ct.load(dt_out, (b, h, c, jb), shape=(1, 1, 1, BL)).reshape((BL,))
        cols = jb * BL + ct.arange(BL, dtype=ct.int32)
        keep = rows[:, None] >= cols[None, :]
        if HAS_SEQ:
            seq_j = ct.load(seq_idx, (b, jrow), shape=(1, BL), padding_mode=_ZERO).reshape((BL,))
            keep = keep & (seq_i[:, None] == seq_j[None, :])
        # Masked before exp: above the diagonal cs_i - cs_j > 0 and could overflow.
        decay = ct.exp(ct.where(keep, cs_i[:, None] - cs_j[None, :], -float("inf")))
        wgt = cbt * decay * dt_j[None, :]
        xj = ct.load(x, (b, jrow, h, pt), shape=(1, BL, 1, TP), padding_mode=_ZERO).reshape((BL, TP))
        acc = ct.mma(wgt.astype(mma_dtype), xj.astype(mma_dtype), acc)

    if has_d != 0:
        xi = ct.load(x, (b, rb, h, pt), shape=(1, BL, 1, TP), padding_mode=_ZERO).reshape((BL, TP))
        dv = ct.load(D, (h, pt), shape=(1, TP), padding_mode=_ZERO)
        acc = acc + xi.astype(ct.float32) * dv.astype(ct.float32)
    if has_z != 0:
        zi = ct.load(z, (b, rb, h, pt), shape=(1, BL, 1, TP), padding_mode=_ZERO).reshape((BL, TP))
        zf = zi.astype(ct.float32)
        acc = acc * (zf / (1.0 + ct.exp(-zf)))
    ct.store(y, (b, rb, h, pt), acc.astype(y.dtype).reshape((1, BL, 1, TP)))
