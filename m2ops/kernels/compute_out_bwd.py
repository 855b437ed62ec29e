"""Kernels of the compute_out backward: the gradients of y1 = the output before the gate (the SSD part and
the skip term D x; the launcher handles z elementwise) given G = dL/dy1.

Blocks of BL tokens as in compute_out.py: row block m of chunk c (outputs l), column block j <= m (sources s);
CB_mj from chunk_cb.py, decay_mj = exp(cs_l - cs_s) on the causal same-sequence mask, W = CB decay dt_s, and
i_l = exp(cs_l) where token l belongs to the entering state's sequence. Gradients (chunked_backward.py):

    A_j    = sum_{m >= j} (CB decay)_mj^T G_m;  dx_j = A_j dt_s (+ D G_j; dD += G_j x_j);
           dt_s = rowsum(x_j A_j)_s                                     out_bwd_dx_kernel      (column block,
                                                                                               head, headdim tile)
    V_mj   = (G_m x_j^T) decay;  dCB_mj = sum over the group's heads of V dt_s;  with T = V CB:
           cs_l += rowsum(T dt),  cs_s -= colsum(T dt)                  out_bwd_dcbw_kernel    (row block,
                                                                                               column block, group,
                                                                                               head split)
           (each token's own term, which cancels between the two sums, left out of both)
    GS_m   = G_m S (per head);  dC_m = sum_j dCB_mj B_j + sum_r i_m GS_m;  cs_l += i_l rowsum(C_m GS_m);
           dB_j = sum_m dCB_mj^T C_m                                    out_bwd_dcdb_kernel    (row block, group,
                                                                                               dstate tile)
    dS_c   = sum_m (i_m G_m)^T C_m                                      out_bwd_dstates_kernel (chunk, head,
                                                                                               headdim, dstate tiles)

dt's gradient is sum over l of T too, and sum_l T_ls = sum_p x_sp (sum_l (CB decay)_ls G_lp): the product of x
with out_bwd_dx's accumulator before its factor dt_s. dA_cumsum's column sums are nevertheless formed in
out_bwd_dcbw, from the same float32 tile as its row sums: the two halves of every pair's term cancel to within a
few ulps there, where out_bwd_dx's accumulator, from the bfloat16-rounded CB decay, left about 2e-3 of each half
uncancelled, and g_A and g_dt_bias, sums over the row and column parts that are each ~100x the result, 5e-2 to
1e-1 off a float64 reference (emulated at b2 T2048 h16 g2 p64 n128 chunk 256: g_A 1.1e-1 -> 2.2e-3).

G_m x_j^T is formed once per (pair of blocks, head) and serves dA_cumsum and dCB; G_m S once per (block,
head) and serves dC and dA_cumsum. Below the diagonal block the decay factorises through a reference token p
between the blocks (the last of block j): exp(cs_l - cs_s) = exp(cs_l - cs_p) exp(cs_p - cs_s), both factors
<= 1 since cs falls, so those blocks need 2 BL exponentials instead of BL^2 (as in compute_out.py).

Sums that several programs contribute to are written to buffers with one slot per writer and summed by
out_bwd_sums_kernel (one program per chunk, head and batch row): dA_cumsum's row parts (b, h, L/BL, nchunks*L) — a
token of block q gets them from pair (q, k) in slot k <= q; its column parts likewise, a token of block k from pair
(q, k) in slot q >= k; dt per headdim tile; the inter-chunk part of dA_cumsum per dstate tile (dCB per head split is
summed by the launcher). The buffers are not initialised: out_bwd_sums reads only the slots written (those rules,
within the blocks of the chunk that hold tokens). With LOWP (bfloat16 inputs with G in bfloat16) the products with G
run in bfloat16: G x^T exactly as in tf32 (bfloat16 values are exact in tf32 too), while the decay-, state- or
i-weighted operands (r CB, CB decay, S, i G) are rounded to bfloat16 as the forward rounds its own; dCB's products
with B and C stay tf32 (dCB is float32). Without LOWP the products with G run in tf32.
"""

from __future__ import annotations

import cuda.tile as ct

from .common import Big, ConstBool, ConstInt, diag_decay
from .common import mma_operand as _op

_ZERO = ct.PaddingMode.ZERO


def _rows_in_chunk(seqlen, c, L, BL):
    """Row blocks of chunk c that hold tokens (the rest lie wholly past seqlen)."""
    return ct.minimum(L // BL, (seqlen - c * L + BL - 1) // BL)


def written_slots_sum(part, b, h, c, n_slots, seqlen, L):
    """The sum of one (batch row, head, chunk)'s L positions over its writers' slots part[b, h, i, c*L:(c+1)*L],
    i < n_slots, zero past the last token (no writer writes there: the slots are left uninitialised)."""
    acc = ct.zeros((L,), dtype=ct.float32)
    for i in range(n_slots):
        acc = acc + ct.load(part, (b, h, i, c), shape=(1, 1, 1, L)).reshape((L,))
    return ct.where(c * L + ct.arange(L, dtype=ct.int32) < seqlen, acc, 0.0)


def _vec(a, b, h, c, blk, BL):
    """Block blk (BL positions) of a chunked (b, h, c, L) float32 array."""
    return ct.load(a, (b, h, c, blk), shape=(1, 1, 1, BL)).reshape((BL,))


def _seq_block(seq_idx, b, row, BL):
    return ct.load(seq_idx, (b, row), shape=(1, BL), padding_mode=_ZERO).reshape((BL,))


def _inter(dA_cumsum, seq_idx, b, h, c, m, L, BL, HAS_SEQ):
    """i_l of row block m of chunk c: exp(cs_l), zero where token l is not of the entering state's sequence."""
    nb = L // BL
    i = ct.exp(_vec(dA_cumsum, b, h, c, m, BL))
    if HAS_SEQ:
        seq_i = _seq_block(seq_idx, b, c * nb + m, BL)
        seq_prev = ct.load(seq_idx, (b, ct.maximum(c * L - 1, 0)), shape=())
        seq_prev = ct.where(c == 0, 0, seq_prev)
        i = ct.where(seq_i == seq_prev, i, 0.0)
    return i


def _g_rows(G, b, row, h, pt, BL, TP, LOWP):
    """Block `row` (BL tokens) of G for head h and headdim tile pt: as stored under LOWP (bfloat16), else in
    float32 (G is float32 then, or bfloat16 widened)."""
    t = ct.load(G, (b, row, h, pt), shape=(1, BL, 1, TP), padding_mode=_ZERO).reshape((BL, TP))
    return t if LOWP else t.astype(ct.float32)


@ct.kernel
def out_bwd_dx_kernel(G: Big, dt_out: Big, dA_cumsum: Big, cb: Big, seq_idx: Big, x: Big, D, g_x: Big,
                      g_D_part: Big, g_dt_part: Big,
                      seqlen: int, nheads: int, heads_per_group: int, n_ptiles: int, has_d: int,
                      L: int, BL: ConstInt, TP: ConstInt, HAS_SEQ: ConstBool, LOWP: ConstBool):
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

    cs_j = _vec(dA_cumsum, b, h, c, j, BL)
    dt_j = _vec(dt_out, b, h, c, j, BL)
    if HAS_SEQ:
        seq_j = _seq_block(seq_idx, b, rb, BL)
    # Row blocks below the diagonal: W_mj^T G_m = diag(exp(cs_p - cs_s) dt_s) (diag(exp(cs_l - cs_p)) CB_mj)^T G_m
    # with p the last token of block j; the column scale is applied once after the loop. The row scale goes on
    # CB (already in registers for the mask and the transpose), not on G, whose tile then reaches the mma as
    # loaded (the change that made chunk_state 1.6x faster).
    cs_p = ct.load(dA_cumsum, (b, h, c, j * BL + BL - 1), shape=())
    acc = ct.zeros((BL, TP), dtype=ct.float32)
    for m in range(j + 1, _rows_in_chunk(seqlen, c, L, BL)):
        cbt = ct.load(cb, (b, c, g, m, j), shape=(1, 1, 1, BL, BL)).reshape((BL, BL))
        if HAS_SEQ:
            seq_m = _seq_block(seq_idx, b, c * nb + m, BL)
            cbt = ct.where(seq_m[:, None] == seq_j[None, :], cbt, 0.0)
        r = ct.exp(_vec(dA_cumsum, b, h, c, m, BL) - cs_p)
        gm = _g_rows(G, b, c * nb + m, h, pt, BL, TP, LOWP)
        acc = ct.mma(_op(ct.transpose(cbt * r[:, None]), LOWP), _op(gm, LOWP), acc)
    acc = acc * ct.exp(cs_p - cs_j)[:, None]
    # The diagonal block, decay per element, below its diagonal first, then each token's own term.
    rows = ct.arange(BL, dtype=ct.int32)
    below = rows[:, None] > rows[None, :]
    if HAS_SEQ:
        below = below & (seq_j[:, None] == seq_j[None, :])
    gj = _g_rows(G, b, rb, h, pt, BL, TP, LOWP)
    xj = ct.load(x, (b, rb, h, pt), shape=(1, BL, 1, TP), padding_mode=_ZERO).reshape((BL, TP))
    cbt = ct.load(cb, (b, c, g, j, j), shape=(1, 1, 1, BL, BL)).reshape((BL, BL))
    cb_ss = ct.sum(ct.where(rows[:, None] == rows[None, :], cbt, 0.0), axis=1)  # each token's own C.B
    acc = ct.mma(_op(ct.transpose(cbt * diag_decay(cs_j, below)), LOWP), _op(gj, LOWP), acc)
    # acc = sum_m (CB decay)_mj^T G_m without the diagonal, the gradient of x_j before the factor dt_s; its
    # product with x_j is dt's gradient.
    g_dt_below = ct.sum(xj.astype(ct.float32) * acc, axis=1)
    # Each token's own term (decay 1): CB_ss G_s.
    g_own = ct.sum(xj.astype(ct.float32) * gj.astype(ct.float32), axis=1)
    ct.store(g_dt_part, (b, h, pt, rb), (g_dt_below + cb_ss * g_own).reshape((1, 1, 1, BL)))
    acc = (acc + cb_ss[:, None] * gj.astype(ct.float32)) * dt_j[:, None]
    if has_d != 0:
        # The skip term here rather than in PyTorch: dx_j += D G_j, and this block's share of dD = sum G_j x_j.
        dv = ct.load(D, (h, pt), shape=(1, TP), padding_mode=_ZERO).astype(ct.float32)
        acc = acc + gj.astype(ct.float32) * dv
        ct.store(g_D_part, (b, rb, h, pt),
                 ct.sum(gj.astype(ct.float32) * xj.astype(ct.float32), axis=0).reshape((1, 1, 1, TP)))
    ct.store(g_x, (b, rb, h, pt), acc.astype(g_x.dtype).reshape((1, BL, 1, TP)))


def _gx_first(G, x, b, h, rb, jrow, BL, TP, LOWP):
    """Head h's tiles of G (row block rb) and x (column block jrow) in headdim tile 0."""
    gm = _g_rows(G, b, rb, h, 0, BL, TP, LOWP)
    xj = ct.load(x, (b, jrow, h, 0), shape=(1, BL, 1, TP), padding_mode=_ZERO).reshape((BL, TP))
    return gm, xj


def _gx_rest(gm, xj, G, x, b, h, rb, jrow, n_ptiles, BL, TP, LOWP):
    """G_m x_j^T (BL, BL) for head h, headdim tile 0's tiles given (gm, xj, _gx_first's), the others loaded."""
    gw = ct.mma(_op(gm, LOWP), _op(ct.transpose(xj), LOWP), ct.zeros((BL, BL), dtype=ct.float32))
    for pt in range(1, n_ptiles):
        gm = _g_rows(G, b, rb, h, pt, BL, TP, LOWP)
        xj = ct.load(x, (b, jrow, h, pt), shape=(1, BL, 1, TP), padding_mode=_ZERO).reshape((BL, TP))
        gw = ct.mma(_op(gm, LOWP), _op(ct.transpose(xj), LOWP), gw)
    return gw


def _gx(G, x, b, h, rb, jrow, n_ptiles, BL, TP, LOWP):
    """G_m x_j^T (BL, BL) for head h: row block rb of G against column block jrow of x."""
    gm, xj = _gx_first(G, x, b, h, rb, jrow, BL, TP, LOWP)
    return _gx_rest(gm, xj, G, x, b, h, rb, jrow, n_ptiles, BL, TP, LOWP)


def _store_sums(p_cs, p_cs_col, t, b, h, row_slot, rb, col_slot, jrow, BL: int):
    """T dt's row sums (+, to row block rb's tokens) and column sums (-, to column block jrow's) of a pair."""
    ct.store(p_cs, (b, h, row_slot, rb), ct.sum(t, axis=1).reshape((1, 1, 1, BL)))
    ct.store(p_cs_col, (b, h, col_slot, jrow), (0.0 - ct.sum(t, axis=0)).reshape((1, 1, 1, BL)))


@ct.kernel
def out_bwd_dcbw_kernel(G: Big, x: Big, dt_out: Big, dA_cumsum: Big, cb: Big, seq_idx: Big,
                        g_cb_part: Big, p_cs: Big, p_cs_col: Big,
                        seqlen: int, ngroups: int, heads_per_group: int, n_ptiles: int, n_split: int,
                        L: int, BL: ConstInt, TP: ConstInt, HAS_SEQ: ConstBool, LOWP: ConstBool):
    # One program per (row block m, column block j, group, head split), j > m idle. A split's heads are
    # summed into its own dCB slot; the splits only exist to fill the GPU at short sequences.
    pid = ct.bid(0)
    b = ct.bid(1)
    nb = L // BL
    sp = pid % n_split
    rest = pid // n_split
    g = rest % ngroups
    rest = rest // ngroups
    j = rest % nb
    rb = rest // nb
    c = rb // nb
    m = rb % nb
    if j <= m:
        jrow = c * nb + j
        cbt = ct.load(cb, (b, c, g, m, j), shape=(1, 1, 1, BL, BL)).reshape((BL, BL))
        rows = ct.arange(BL, dtype=ct.int32)
        keep = (rows[:, None] + m * BL) >= (rows[None, :] + j * BL)
        below = (rows[:, None] + m * BL) > (rows[None, :] + j * BL)
        if HAS_SEQ:
            keep = keep & (_seq_block(seq_idx, b, rb, BL)[:, None] == _seq_block(seq_idx, b, jrow, BL)[None, :])
        per = (heads_per_group + n_split - 1) // n_split
        h0 = g * heads_per_group + sp * per
        h1 = g * heads_per_group + ct.minimum((sp + 1) * per, heads_per_group)
        acc = ct.zeros((BL, BL), dtype=ct.float32)
        if m == j:
            for h in range(h0, h1):
                cs_m = _vec(dA_cumsum, b, h, c, m, BL)
                dt_j = _vec(dt_out, b, h, c, j, BL)
                gx = _gx(G, x, b, h, rb, jrow, n_ptiles, BL, TP, LOWP)
                v = gx * diag_decay(cs_m, keep)
                vd = v * dt_j[None, :]
                # Without each token's own term (it cancels between the two sums).
                _store_sums(p_cs, p_cs_col, ct.where(below, vd * cbt, 0.0), b, h, m, rb, m, rb, BL)
                acc = acc + vd
        else:
            # decay = r q^T (r_l = exp(cs_l - cs_p), q_s = exp(cs_p - cs_s)): with U = (G_m x_j^T) diag(r),
            # rowsum(T dt) = (U CB) (q dt) and the dCB term V dt = U diag(q dt).
            p = j * BL + BL - 1
            for h in range(h0, h1):
                cs_p = ct.load(dA_cumsum, (b, h, c, p), shape=())
                r = ct.exp(_vec(dA_cumsum, b, h, c, m, BL) - cs_p)
                qd = ct.exp(cs_p - _vec(dA_cumsum, b, h, c, j, BL)) * _vec(dt_out, b, h, c, j, BL)
                gx = _gx(G, x, b, h, rb, jrow, n_ptiles, BL, TP, LOWP)
                u = gx * r[:, None]
                if HAS_SEQ:
                    u = ct.where(keep, u, 0.0)
                ud = u * qd[None, :]
                _store_sums(p_cs, p_cs_col, ud * cbt, b, h, j, rb, m, jrow, BL)
                acc = acc + ud
        ct.store(g_cb_part, (b, sp, c, g, m, j), acc.reshape((1, 1, 1, 1, BL, BL)))


@ct.kernel
def out_bwd_dcdb_kernel(G: Big, dA_cumsum: Big, C: Big, B: Big, states: Big, seq_idx: Big, g_cb: Big,
                        g_C: Big, g_B: Big, g_cs_inter: Big,
                        seqlen: int, ngroups: int, heads_per_group: int, n_ptiles: int, n_ntiles: int,
                        L: int, BL: ConstInt, TP: ConstInt, TN: ConstInt, HAS_SEQ: ConstBool, LOWP: ConstBool):
    pid = ct.bid(0)
    b = ct.bid(1)
    nt = pid % n_ntiles
    rest = pid // n_ntiles
    g = rest % ngroups
    rb = rest // ngroups
    nb = L // BL
    c = rb // nb
    q = rb % nb

    # dC of block q: its row of dCB against B, plus the inter-chunk term G_q S of every head of the group,
    # whose product with C_q is also that head's inter-chunk part of dA_cumsum (this dstate tile's share).
    acc = ct.zeros((BL, TN), dtype=ct.float32)
    for j in range(q + 1):
        gcb = ct.load(g_cb, (b, c, g, q, j), shape=(1, 1, 1, BL, BL)).reshape((BL, BL))
        bj = ct.load(B, (b, c * nb + j, g, nt), shape=(1, BL, 1, TN), padding_mode=_ZERO).reshape((BL, TN))
        acc = ct.mma(_op(gcb, False), _op(bj, False), acc)
    cq = ct.load(C, (b, rb, g, nt), shape=(1, BL, 1, TN), padding_mode=_ZERO).reshape((BL, TN)).astype(ct.float32)
    for r in range(heads_per_group):
        h = g * heads_per_group + r
        i = _inter(dA_cumsum, seq_idx, b, h, c, q, L, BL, HAS_SEQ)
        gs = ct.zeros((BL, TN), dtype=ct.float32)
        for pt in range(n_ptiles):
            gm = _g_rows(G, b, rb, h, pt, BL, TP, LOWP)
            st = ct.load(states, (b, c, h, pt, nt), shape=(1, 1, 1, TP, TN), padding_mode=_ZERO).reshape((TP, TN))
            gs = ct.mma(_op(gm, LOWP), _op(st, LOWP), gs)
        gs = gs * i[:, None]
        acc = acc + gs
        ct.store(g_cs_inter, (b, h, nt, rb), ct.sum(gs * cq, axis=1).reshape((1, 1, 1, BL)))
    ct.store(g_C, (b, rb, g, nt), acc.astype(g_C.dtype).reshape((1, BL, 1, TN)))

    # dB of block q: its column of dCB against C.
    acc = ct.zeros((BL, TN), dtype=ct.float32)
    for m in range(q, _rows_in_chunk(seqlen, c, L, BL)):
        gcb = ct.load(g_cb, (b, c, g, m, q), shape=(1, 1, 1, BL, BL)).reshape((BL, BL))
        cm = ct.load(C, (b, c * nb + m, g, nt), shape=(1, BL, 1, TN), padding_mode=_ZERO).reshape((BL, TN))
        acc = ct.mma(_op(ct.transpose(gcb), False), _op(cm, False), acc)
    ct.store(g_B, (b, rb, g, nt), acc.astype(g_B.dtype).reshape((1, BL, 1, TN)))


@ct.kernel
def out_bwd_dstates_kernel(G: Big, dA_cumsum: Big, C: Big, seq_idx: Big, g_states: Big,
                           seqlen: int, nheads: int, heads_per_group: int, n_ptiles: int, n_ntiles: int,
                           L: int, BL: ConstInt, TP: ConstInt, TN: ConstInt, HAS_SEQ: ConstBool, LOWP: ConstBool):
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
        gm = _g_rows(G, b, c * nb + m, h, pt, BL, TP, LOWP).astype(ct.float32) * i[:, None]
        cm = ct.load(C, (b, c * nb + m, g, nt), shape=(1, BL, 1, TN), padding_mode=_ZERO).reshape((BL, TN))
        acc = ct.mma(_op(ct.transpose(gm), LOWP), _op(cm, LOWP), acc)
    ct.store(g_states, (b, c, h, pt, nt), acc.reshape((1, 1, 1, TP, TN)))


@ct.kernel
def out_bwd_sums_kernel(g_dt_part: Big, p_cs: Big, g_cs_inter: Big, g_dt: Big, g_cs: Big,
                        seqlen: int, nheads: int, n_ptiles: int, n_ntiles: int,
                        L: ConstInt, BL: ConstInt):
    """dt's and dA_cumsum's gradients of one (chunk, head, batch row) from the other kernels' per-writer slots."""
    pid = ct.bid(0)
    b = ct.bid(1)
    h = pid % nheads
    c = pid // nheads
    tok = ct.arange(L, dtype=ct.int32)
    q = tok // BL  # each token's block
    rows = _rows_in_chunk(seqlen, c, L, BL)
    gdt = written_slots_sum(g_dt_part, b, h, c, n_ptiles, seqlen, L)
    gcs = ct.zeros((L,), dtype=ct.float32)
    for s in range(L // BL):
        row = ct.load(p_cs, (0, b, h, s, c), shape=(1, 1, 1, 1, L)).reshape((L,))
        col = ct.load(p_cs, (1, b, h, s, c), shape=(1, 1, 1, 1, L)).reshape((L,))
        gcs = gcs + ct.where((q >= s) & (q < rows), row, 0.0) + ct.where((q <= s) & (s < rows), col, 0.0)
    for nt in range(n_ntiles):
        gcs = gcs + ct.load(g_cs_inter, (b, h, nt, c), shape=(1, 1, 1, L), padding_mode=_ZERO).reshape((L,))
    ct.store(g_dt, (b, h, c, 0), gdt.reshape((1, 1, 1, L)))
    ct.store(g_cs, (b, h, c, 0), gcs.reshape((1, 1, 1, L)))
