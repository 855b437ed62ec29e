"""causal_conv1d_bwd kernel: gradients of x, weight, bias and initial_states through the causal convolution
(backward of conv1d.py; the formulas are m2ops/reference/conv1d.py's causal_conv1d_bwd). In float32, with W taps:

    du[t]   = g_y[t] silu'(u[t]) (u recomputed from x), or g_y[t] without SiLU
    g_x[t]  = sum_s weight[W-1-s] du[t+s] [id(t+s) == id(t)]
    g_w[k] += sum_t du[t] x[t-(W-1)+k] [same id]                   g_bias += sum_t du[t]

As in the forward, every shifted operand is a plain tile load of a shifted view: the launcher passes x, g_y and
seq_idx as views starting d tokens in (x_d[t'] = x[t' + d]); a program's token tile j covers tokens
HALO-1 + j*BT .., so x at t+e (e = -(HALO-1) .. HALO-1) is tile j of view HALO-1+e. du at t+s, s = 0 .. W-1, is
recomputed from its own u for each s (W evaluations of u and silu' per token instead of one): cuTile has no shift
of a computed tile other than through shared memory (conv1d.py). The first HALO-1 tokens, whose taps reach into
the history, and the history's gradient (tokens -HALO .. -1, id 0) are computed a row at a time by the program of
the first token tile. Tokens past seqlen read g_y = 0, so they add nothing.

One program per (segment of token tiles, channel tile, batch row) walks its segment's tiles; g_w and g_bias are
summed elementwise over the segment and reduced over tokens once, then written per program, float32 (programs, W,
channels) and (programs, channels); the launcher sums them (deterministic, no atomics). The history's gradient is
written channel-last, float32 (batch, HALO, channels), for the launcher to take initial_states' W-1 rows from. The
final states' gradient goes to x and the history directly (a copy): the launcher adds it.
"""

from __future__ import annotations

import cuda.tile as ct

from .common import LOG2E, Big, ConstBool, ConstInt, exp2
from .conv1d import HALO, bias_row, id_at, input_row, tap_rows_t

_ZERO = ct.PaddingMode.ZERO
# Views of x and seq_idx: offsets 0 .. 2*(HALO-1); of g_y: 0 and HALO-1 .. 2*(HALO-1).
VIEWS = 2 * HALO - 1


def silu_grad(u):
    """d silu(u)/du = sigmoid(u) (1 + u (1 - sigmoid(u))), sigmoid from exp2 (ex2.approx) and a div.full."""
    sig = ct.truediv(1.0, 1.0 + exp2(u * -LOG2E), rounding_mode=ct.RoundingMode.FULL)
    return sig * (1.0 + u * (1.0 - sig))


def view_tile(v, b, j, cb, avail, BT: int, BC: int):
    """(BT, BC) float32 tile j of view v, zeros where the view has avail < (j+1)*BT tokens (none: not loaded)."""
    t = ct.zeros((BT, BC), dtype=ct.float32)
    if j * BT < avail:
        t = ct.load(v, (b, j, cb), shape=(1, BT, BC), padding_mode=_ZERO).reshape((BT, BC)).astype(ct.float32)
    return t


def view_ids(v, b, j, avail, has_seq, BT: int):
    ids = ct.zeros((BT,), dtype=ct.int32)
    if has_seq != 0:
        if j * BT < avail:
            ids = ct.load(v, (b, j), shape=(1, BT), padding_mode=_ZERO).reshape((BT,))
    return ids


def du_row(x, g_y, hist, seq_idx, taps, br, b, t: int, cb, seqlen, has_init, has_seq, W: int, ACT: bool,
           BC: int):
    """(1, BC) float32 du at token t >= 0 (zeros at t >= seqlen)."""
    du = ct.zeros((1, BC), dtype=ct.float32)
    if t < seqlen:
        du = ct.load(g_y, (b, t, cb), shape=(1, 1, BC), padding_mode=_ZERO).reshape((1, BC)).astype(ct.float32)
        if ACT:
            me = id_at(seq_idx, b, t, has_seq)
            u = br
            for s in ct.static_iter(range(W)):
                row = input_row(x, hist, b, t - s, cb, seqlen, has_init, BC)
                if has_seq != 0:
                    if id_at(seq_idx, b, t - s, has_seq) != me:
                        row = ct.zeros((1, BC), dtype=ct.float32)
                u = u + row * taps[W - 1 - s]
            du = du * silu_grad(u)
    return du


def masked_row(row, seq_idx, b, t: int, t_other: int, has_seq):
    """row, or zeros where tokens t and t_other belong to different sequences (ids before token 0 are 0)."""
    if has_seq != 0:
        if id_at(seq_idx, b, t, has_seq) != id_at(seq_idx, b, t_other, has_seq):
            row = ct.zeros(row.shape, dtype=ct.float32)
    return row


def head(x, g_y, hist, seq_idx, g_x, g_hist, taps, br, b, cb, seqlen, has_init, has_seq, W: int, ACT: bool,
         BC: int):
    """g_x at tokens 0 .. HALO-2 and the history's gradient, a row at a time, and those tokens' (g_w, g_bias)
    terms as (1, BC) rows."""
    dus = ()
    for t in ct.static_iter(range(2 * (HALO - 1))):  # du at tokens 0 .. 2*(HALO-1) - 1
        dus += (du_row(x, g_y, hist, seq_idx, taps, br, b, t, cb, seqlen, has_init, has_seq, W, ACT, BC),)
    for t in ct.static_iter(range(HALO - 1)):
        if t < seqlen:
            gx = ct.zeros((1, BC), dtype=ct.float32)
            for s in ct.static_iter(range(W)):
                gx = gx + masked_row(dus[t + s], seq_idx, b, t + s, t, has_seq) * taps[W - 1 - s]
            ct.store(g_x, (b, t, cb), gx.astype(g_x.dtype).reshape((1, 1, BC)))
    if has_init != 0:
        for r in ct.static_iter(range(HALO)):  # history row r: token r - HALO (id 0)
            gh = ct.zeros((1, BC), dtype=ct.float32)
            for s in ct.static_iter(range(W)):
                if r - HALO + s >= 0:
                    gh = gh + masked_row(dus[r - HALO + s], seq_idx, b, r - HALO + s, -1, has_seq) * taps[W - 1 - s]
            ct.store(g_hist, (b, r, cb), gh.reshape((1, 1, BC)))
    gws = ()
    for k in ct.static_iter(range(W)):
        gw = ct.zeros((1, BC), dtype=ct.float32)
        for t in ct.static_iter(range(HALO - 1)):
            row = input_row(x, hist, b, t - (W - 1) + k, cb, seqlen, has_init, BC)
            gw = gw + masked_row(dus[t], seq_idx, b, t - (W - 1) + k, t, has_seq) * row
        gws += (gw,)
    gb = ct.zeros((1, BC), dtype=ct.float32)
    for t in ct.static_iter(range(HALO - 1)):
        gb = gb + dus[t]
    return gws, gb


def w_term(xv, sv, ids, du0, b, j, cb, seqlen, has_seq, k: int, W: int, BT: int, BC: int):
    """Tap k's g_w term of token tile j, du[t] x[t-(W-1)+k] [same id] (zeros for k >= W: not loaded)."""
    out = ct.zeros((BT, BC), dtype=ct.float32)
    if k < W:
        d = HALO - 1 - (W - 1) + k
        xt = view_tile(xv[d], b, j, cb, seqlen - d, BT, BC)
        if has_seq != 0:
            if k != W - 1:
                same = view_ids(sv[d], b, j, seqlen - d, has_seq, BT) == ids
                xt = ct.where(same[:, None], xt, 0.0)
        out = xt * du0
    return out


@ct.kernel
def causal_conv1d_bwd_kernel(x0: Big, x1: Big, x2: Big, x3: Big, x4: Big, x5: Big, x6: Big,
                             g0: Big, g3: Big, g4: Big, g5: Big, g6: Big,
                             s0, s1, s2, s3, s4, s5, s6,
                             weight_t, bias, hist, g_x: Big, g_x3: Big, g_w_part, g_bias_part, g_hist,
                             seqlen: int, tiles_per_program: int, n_segments: int,
                             has_bias: int, has_seq: int, has_init: int,
                             W: ConstInt, BT: ConstInt, BC: ConstInt, ACT: ConstBool):
    g = ct.bid(0)
    cb = ct.bid(1)
    b = ct.bid(2)
    xv = (x0, x1, x2, x3, x4, x5, x6)  # xv[d]: x from token d; x0 is x itself
    gv = (g0, g0, g0, g3, g4, g5, g6)  # gv[d] for d >= HALO-1: g_y from token d; g0 is g_y itself
    sv = (s0, s1, s2, s3, s4, s5, s6)  # seq_idx likewise
    H1 = HALO - 1
    taps = tap_rows_t(weight_t, cb, W, BC)
    br = bias_row(bias, cb, has_bias, BC)

    # g_w's partial sums, elementwise over the segment (tap k in gw<k>; taps past W stay zero and are not stored)
    gw0 = ct.zeros((BT, BC), dtype=ct.float32)
    gw1 = gw0
    gw2 = gw0
    gw3 = gw0
    gb_acc = ct.zeros((BT, BC), dtype=ct.float32)
    first = g * tiles_per_program
    stop = ct.minimum(first + tiles_per_program, ct.cdiv(seqlen - H1, BT))
    for j in range(first, stop):
        # tokens t = H1 + j*BT + r; view d holds token t - H1 + d
        ids = view_ids(sv[H1], b, j, seqlen - H1, has_seq, BT)
        gx = ct.zeros((BT, BC), dtype=ct.float32)
        du0 = gx
        for s in ct.static_iter(range(W)):  # du at t + s
            du = view_tile(gv[H1 + s], b, j, cb, seqlen - H1 - s, BT, BC)
            ids_s = view_ids(sv[H1 + s], b, j, seqlen - H1 - s, has_seq, BT)
            if ACT:
                u = ct.zeros((BT, BC), dtype=ct.float32) + br
                for e in ct.static_iter(range(W)):  # x at t + s - e
                    d = H1 + s - e
                    xt = view_tile(xv[d], b, j, cb, seqlen - d, BT, BC)
                    if has_seq != 0:
                        if e != s:
                            same = view_ids(sv[d], b, j, seqlen - d, has_seq, BT) == ids_s
                            xt = ct.where(same[:, None], xt, 0.0)
                    u = u + xt * taps[W - 1 - e]
                du = du * silu_grad(u)
            if s == 0:
                du0 = du
                gx = gx + du * taps[W - 1]
            else:
                if has_seq != 0:
                    du = ct.where((ids_s == ids)[:, None], du, 0.0)
                gx = gx + du * taps[W - 1 - s]
        ct.store(g_x3, (b, j, cb), gx.astype(g_x3.dtype).reshape((1, BT, BC)))

        gw0 = gw0 + w_term(xv, sv, ids, du0, b, j, cb, seqlen, has_seq, 0, W, BT, BC)
        gw1 = gw1 + w_term(xv, sv, ids, du0, b, j, cb, seqlen, has_seq, 1, W, BT, BC)
        gw2 = gw2 + w_term(xv, sv, ids, du0, b, j, cb, seqlen, has_seq, 2, W, BT, BC)
        gw3 = gw3 + w_term(xv, sv, ids, du0, b, j, cb, seqlen, has_seq, 3, W, BT, BC)
        gb_acc = gb_acc + du0

    gws = ()
    for k in ct.static_iter(range(W)):
        gws += (ct.sum((gw0, gw1, gw2, gw3)[k], axis=0).reshape((1, BC)),)
    gb = ct.sum(gb_acc, axis=0).reshape((1, BC))
    if g == 0:
        hw, hb = head(x0, g0, hist, s0, g_x, g_hist, taps, br, b, cb, seqlen, has_init, has_seq, W, ACT, BC)
        parts = ()
        for k in ct.static_iter(range(W)):
            parts += (gws[k] + hw[k],)
        gws = parts
        gb = gb + hb
    for k in ct.static_iter(range(W)):
        ct.store(g_w_part, (b * n_segments + g, k, cb), gws[k].reshape((1, 1, BC)))
    if has_bias != 0:
        ct.store(g_bias_part, (b * n_segments + g, cb), gb)
