"""Kernels of the compute_out backward: the gradients of y1 = the output before the gate (the SSD part and
the skip term D x; the launcher handles z elementwise) given G = dL/dy1.

Blocks of BL tokens as in compute_out.py: row block m of chunk c (outputs l), column block j <= m (sources s);
CB_mj from chunk_cb.py, decay_mj = exp(cs_l - cs_s) on the causal same-sequence mask, W = CB decay dt_s, and
i_l = exp(cs_l) where token l belongs to the entering state's sequence. Gradients (chunked_backward.py):

    dx_j        = sum_{m >= j} W_mj^T G_m  (+ D G_j; dD += G_j x_j)  out_bwd_dx_kernel     (chunk block, head,
                                                                                           headdim tile)
    gW_mj       = G_m x_j^T;  dt_s += colsum(gW CB decay);  cs_l += rowsum(gW W);  cs_s -= colsum(gW W);
    cs_l       += i_l rowsum(G_m * (C_m S^T))                       out_bwd_dw_kernel     (row block, head)
    dCB_mj      = sum over the group's heads of gW_mj decay dt_s    out_bwd_dcb_kernel    (row block, column
                                                                                           block, group)
    dC_m        = sum_j dCB_mj B_j + sum_r i_m G_rm S_r;  dB_j = sum_m dCB_mj^T C_m
                                                                    out_bwd_dcdb_kernel   (row block, group,
                                                                                           dstate tile)
    dS_c        = sum_m (i_m G_m)^T C_m                             out_bwd_dstates_kernel (chunk, head,
                                                                                           headdim, dstate tiles)

Sums that several programs contribute to (dt and the column part of cs) are written per contributing row
block into zero-initialised (b, h, L/BL, nchunks*L) buffers and summed by the launcher; everything else has
one writer. Products with G run in tf32 (G is read in float32, or in bfloat16 for bfloat16 inputs, and
widened); those of inputs alone in the input dtype.
"""

from __future__ import annotations

import cuda.tile as ct

from .common import Big, ConstBool, ConstInt

_ZERO = ct.PaddingMode.ZERO
_NEG_INF = -float("inf")


def _rows_in_chunk(seqlen, c, L, BL):
    """Row blocks of chunk c that hold tokens (the rest lie wholly past seqlen)."""
    return ct.minimum(L // BL, (seqlen - c * L + BL - 1) // BL)


def _decay(dA_cumsum, dt_out, seq_idx, b, h, c, m, j, L, BL, HAS_SEQ):
    """(decay_mj (BL, BL), dt_j (BL,)) of row block m and column block j of chunk c for head h."""
    nb = L // BL
    cs_i = ct.load(dA_cumsum, (b, h, c, m), shape=(1, 1, 1, BL)).reshape((BL,))
    cs_j = ct.load(dA_cumsum, (b, h, c, j), shape=(1, 1, 1, BL)).reshape((BL,))
    dt_j = ct.load(dt_out, (b, h, c, j), shape=(1, 1, 1, BL)).reshape((BL,))
    rows = m * BL + ct.arange(BL, dtype=ct.int32)
    cols = j * BL + ct.arange(BL, dtype=ct.int32)
    keep = rows[:, None] >= cols[None, :]
    if HAS_SEQ:
        seq_i = ct.load(seq_idx, (b, c * nb + m), shape=(1, BL), padding_mode=_ZERO).reshape((BL,))
        seq_j = ct.load(seq_idx, (b, c * nb + j), shape=(1, BL), padding_mode=_ZERO).reshape((BL,))
        keep = keep & (seq_i[:, None] == seq_j[None, :])
    return ct.exp(ct.where(keep, cs_i[:, None] - cs_j[None, :], _NEG_INF)), dt_j


def _inter(dA_cumsum, seq_idx, b, h, c, m, L, BL, HAS_SEQ):
    """i_l of row block m of chunk c: exp(cs_l), zero where token l is not of the entering state's sequence."""
    nb = L // BL
    i = ct.exp(ct.load(dA_cumsum, (b, h, c, m), shape=(1, 1, 1, BL)).reshape((BL,)))
    if HAS_SEQ:
        seq_i = ct.load(seq_idx, (b, c * nb + m), shape=(1, BL), padding_mode=_ZERO).reshape((BL,))
        seq_prev = ct.load(seq_idx, (b, ct.maximum(c * L - 1, 0)), shape=())
        seq_prev = ct.where(c == 0, 0, seq_prev)
        i = ct.where(seq_i == seq_prev, i, 0.0)
    return i


def _tf32(t):
    return t.astype(ct.float32).astype(ct.tfloat32)


def _g_rows(G, b, row, h, pt, BL, TP):
    """Block `row` (BL tokens) of G for head h and headdim tile pt, in float32 whatever G's dtype (the
    launcher passes G in bfloat16 for bfloat16 inputs: half the bytes of the kernels' largest read)."""
    return ct.load(G, (b, row, h, pt), shape=(1, BL, 1, TP), padding_mode=_ZERO).reshape((BL, TP)).astype(ct.float32)


@ct.kernel
def out_bwd_dx_kernel(G: Big, dt_out: Big, dA_cumsum: Big, cb: Big, seq_idx: Big, x: Big, D, g_x: Big,
                      g_D_part: Big,
                      seqlen: int, nheads: int, heads_per_group: int, n_ptiles: int, has_d: int,
                      L: int, BL: ConstInt, TP: ConstInt, HAS_SEQ: ConstBool):
    pid = ct.bid(0)
    b = ct.bid(1)
    pt = pid % n_ptiles
    rest = pid // n_ptiles
    h = rest % nheads
    rb = rest // nheads
    nb = L // BL
    c = rb // nb
    j = rb % nb
    g = h // heads_per_group

    acc = ct.zeros((BL, TP), dtype=ct.float32)
    for m in range(j, _rows_in_chunk(seqlen, c, L, BL)):
        decay, dt_j = _decay(dA_cumsum, dt_out, seq_idx, b, h, c, m, j, L, BL, HAS_SEQ)
        w = ct.load(cb, (b, c, g, m, j), shape=(1, 1, 1, BL, BL)).reshape((BL, BL)) * decay * dt_j[None, :]
        gm = _g_rows(G, b, c * nb + m, h, pt, BL, TP)
        acc = ct.mma(_tf32(ct.transpose(w)), _tf32(gm), acc)
    if has_d != 0:
        # The skip term here rather than in PyTorch: dx_j += D G_j, and this block's share of dD = sum G_j x_j.
        gj = _g_rows(G, b, rb, h, pt, BL, TP)
        dv = ct.load(D, (h, pt), shape=(1, TP), padding_mode=_ZERO).astype(ct.float32)
        acc = acc + gj * dv
        xj = ct.load(x, (b, rb, h, pt), shape=(1, BL, 1, TP), padding_mode=_ZERO).reshape((BL, TP))
        ct.store(g_D_part, (b, rb, h, pt), ct.sum(gj * xj.astype(ct.float32), axis=0).reshape((1, 1, 1, TP)))
    ct.store(g_x, (b, rb, h, pt), acc.astype(g_x.dtype).reshape((1, BL, 1, TP)))


@ct.kernel
def out_bwd_dw_kernel(G: Big, x: Big, dt_out: Big, dA_cumsum: Big, C: Big, cb: Big, states: Big, seq_idx: Big,
                      p_dt: Big, p_cs: Big, g_cs_row: Big,
                      seqlen: int, nheads: int, heads_per_group: int, n_ptiles: int, n_ntiles: int,
                      L: int, BL: ConstInt, TP: ConstInt, TN: ConstInt, HAS_SEQ: ConstBool):
    pid = ct.bid(0)
    b = ct.bid(1)
    h = pid % nheads
    rb = pid // nheads
    nb = L // BL
    c = rb // nb
    m = rb % nb
    g = h // heads_per_group

    row_sum = ct.zeros((BL,), dtype=ct.float32)
    for j in range(m + 1):
        jrow = c * nb + j
        decay, dt_j = _decay(dA_cumsum, dt_out, seq_idx, b, h, c, m, j, L, BL, HAS_SEQ)
        cbt = ct.load(cb, (b, c, g, m, j), shape=(1, 1, 1, BL, BL)).reshape((BL, BL))
        gw = ct.zeros((BL, BL), dtype=ct.float32)
        for pt in range(n_ptiles):
            gm = _g_rows(G, b, rb, h, pt, BL, TP)
            xj = ct.load(x, (b, jrow, h, pt), shape=(1, BL, 1, TP), padding_mode=_ZERO).reshape((BL, TP))
            gw = ct.mma(_tf32(gm), _tf32(ct.transpose(xj)), gw)
        t = gw * decay * cbt
        ct.store(p_dt, (b, h, m, jrow), ct.sum(t, axis=0).reshape((1, 1, 1, BL)))
        ww = t * dt_j[None, :]
        row_sum = row_sum + ct.sum(ww, axis=1)
        ct.store(p_cs, (b, h, m, jrow), (0.0 - ct.sum(ww, axis=0)).reshape((1, 1, 1, BL)))

    # Inter-chunk term: i_l <G_l, S C_l>.
    inter_sum = ct.zeros((BL,), dtype=ct.float32)
    for pt in range(n_ptiles):
        cs_ = ct.zeros((BL, TP), dtype=ct.float32)
        for nt in range(n_ntiles):
            ci = ct.load(C, (b, rb, g, nt), shape=(1, BL, 1, TN), padding_mode=_ZERO).reshape((BL, TN))
            st = ct.load(states, (b, c, h, pt, nt), shape=(1, 1, 1, TP, TN), padding_mode=_ZERO).reshape((TP, TN))
            cs_ = ct.mma(_tf32(ci), _tf32(ct.transpose(st)), cs_)
        gm = _g_rows(G, b, rb, h, pt, BL, TP)
        inter_sum = inter_sum + ct.sum(gm * cs_, axis=1)
    row_sum = row_sum + inter_sum * _inter(dA_cumsum, seq_idx, b, h, c, m, L, BL, HAS_SEQ)
    ct.store(g_cs_row, (b, h, rb), row_sum.reshape((1, 1, BL)))


@ct.kernel
def out_bwd_dcb_kernel(G: Big, x: Big, dt_out: Big, dA_cumsum: Big, seq_idx: Big, g_cb: Big,
                       seqlen: int, ngroups: int, heads_per_group: int, n_ptiles: int,
                       L: int, BL: ConstInt, TP: ConstInt, HAS_SEQ: ConstBool):
    # One program per (row block m, column block j, group), j > m idle: the heads of the group are summed
    # in the program, so the grid is what gives the parallelism (at 4K tokens and chunk 256, 64 row blocks).
    pid = ct.bid(0)
    b = ct.bid(1)
    nb = L // BL
    g = pid % ngroups
    rest = pid // ngroups
    j = rest % nb
    rb = rest // nb
    c = rb // nb
    m = rb % nb
    if j <= m:
        jrow = c * nb + j
        acc = ct.zeros((BL, BL), dtype=ct.float32)
        for r in range(heads_per_group):
            h = g * heads_per_group + r
            decay, dt_j = _decay(dA_cumsum, dt_out, seq_idx, b, h, c, m, j, L, BL, HAS_SEQ)
            gw = ct.zeros((BL, BL), dtype=ct.float32)
            for pt in range(n_ptiles):
                gm = _g_rows(G, b, rb, h, pt, BL, TP)
                xj = ct.load(x, (b, jrow, h, pt), shape=(1, BL, 1, TP), padding_mode=_ZERO).reshape((BL, TP))
                gw = ct.mma(_tf32(gm), _tf32(ct.transpose(xj)), gw)
            acc = acc + gw * decay * dt_j[None, :]
        ct.store(g_cb, (b, c, g, m, j), acc.reshape((1, 1, 1, BL, BL)))


@ct.kernel
def out_bwd_dcdb_kernel(G: Big, dA_cumsum: Big, C: Big, B: Big, states: Big, seq_idx: Big, g_cb: Big,
                        g_C: Big, g_B: Big,
                        seqlen: int, ngroups: int, heads_per_group: int, n_ptiles: int, n_ntiles: int,
                        L: int, BL: ConstInt, TP: ConstInt, TN: ConstInt, HAS_SEQ: ConstBool):
    pid = ct.bid(0)
    b = ct.bid(1)
    nt = pid % n_ntiles
    rest = pid // n_ntiles
    g = rest % ngroups
    rb = rest // ngroups
    nb = L // BL
    c = rb // nb
    q = rb % nb

    # dC of block q: its row of dCB against B, plus the inter-chunk term of every head of the group.
    acc = ct.zeros((BL, TN), dtype=ct.float32)
    for j in range(q + 1):
        gcb = ct.load(g_cb, (b, c, g, q, j), shape=(1, 1, 1, BL, BL)).reshape((BL, BL))
        bj = ct.load(B, (b, c * nb + j, g, nt), shape=(1, BL, 1, TN), padding_mode=_ZERO).reshape((BL, TN))
        acc = ct.mma(_tf32(gcb), _tf32(bj), acc)
    for r in range(heads_per_group):
        h = g * heads_per_group + r
        i = _inter(dA_cumsum, seq_idx, b, h, c, q, L, BL, HAS_SEQ)
        for pt in range(n_ptiles):
            gm = _g_rows(G, b, rb, h, pt, BL, TP)
            st = ct.load(states, (b, c, h, pt, nt), shape=(1, 1, 1, TP, TN), padding_mode=_ZERO).reshape((TP, TN))
            acc = ct.mma(_tf32(gm * i[:, None]), _tf32(st), acc)
    ct.store(g_C, (b, rb, g, nt), acc.astype(g_C.dtype).reshape((1, BL, 1, TN)))

    # dB of block q: its column of dCB against C.
    acc = ct.zeros((BL, TN), dtype=ct.float32)
    for m in range(q, _rows_in_chunk(seqlen, c, L, BL)):
        gcb = ct.load(g_cb, (b, c, g, m, q), shape=(1, 1, 1, BL, BL)).reshape((BL, BL))
        cm = ct.load(C, (b, c * nb + m, g, nt), shape=(1, BL, 1, TN), padding_mode=_ZERO).reshape((BL, TN))
        acc = ct.mma(_tf32(ct.transpose(gcb)), _tf32(cm), acc)
    ct.store(g_B, (b, rb, g, nt), acc.astype(g_B.dtype).reshape((1, BL, 1, TN)))


@ct.kernel
def out_bwd_dstates_kernel(G: Big, dA_cumsum: Big, C: Big, seq_idx: Big, g_states: Big,
                           seqlen: int, nheads: int, heads_per_group: int, n_ptiles: int, n_ntiles: int,
                           L: int, BL: ConstInt, TP: ConstInt, TN: ConstInt, HAS_SEQ: ConstBool):
    pid = ct.bid(0)
    b = ct.bid(1)
    nt = pid % n_ntiles
    rest = pid // n_ntiles
    pt = rest % n_ptiles
    rest = rest // n_ptiles
    h = rest % nheads
    c = rest // nheads
    g = h // heads_per_group
    nb = L // BL

    acc = ct.zeros((TP, TN), dtype=ct.float32)
    for m in range(_rows_in_chunk(seqlen, c, L, BL)):
        i = _inter(dA_cumsum, seq_idx, b, h, c, m, L, BL, HAS_SEQ)
        gm = _g_rows(G, b, c * nb + m, h, pt, BL, TP)
        cm = ct.load(C, (b, c * nb + m, g, nt), shape=(1, BL, 1, TN), padding_mode=_ZERO).reshape((BL, TN))
        acc = ct.mma(_tf32(ct.transpose(gm * i[:, None])), _tf32(cm), acc)
    ct.store(g_states, (b, c, h, pt, nt), acc.reshape((1, 1, 1, TP, TN)))
