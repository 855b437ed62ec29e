"""causal_conv1d_bwd kernel: gradients of x, weight, bias and initial_states through the causal convolution
(backward of conv1d.py; the formulas are m2ops/reference/conv1d.py's causal_conv1d_bwd).

One program per (segment of token tiles, channel tile, batch row) walks its segment's tiles of BT tokens. Per tile
it loads x over the tile and HALO tokens on either side, and g_y over the tile and the HALO tokens after it, each
once, and computes in float32:

    du[t]   = g_y[t] silu'(u[t]) (u recomputed from the x rows, for the tile and the HALO tokens after it), or g_y
    g_x[t]  = sum_s weight[W-1-s] du[t+s] [id(t+s) == id(t)]
    g_w[k] += sum_t du[t] x[t-(W-1)+k] [same id]                   g_bias += sum_t du[t]

The shifted operands come from the token rows of the loaded windows, put back together by ct.cat (through
shared memory as the runtime builds it; with SiLU, 255 registers and 4.7 KB of spills at width 4, bfloat16).
Gathering them at shifted token rows instead, as the forward does (seven x and four g_y gathers a tile), measured
3.0 ms against this kernel's 0.92 at 8 x 4096 x 5376 on an H200 (docs/history.md).
Tokens past seqlen read g_y = 0, so they add nothing. The first tile also gives the history's gradient (the g_x
formula at tokens -HALO .. -1, whose id is 0), written channel-last, float32 (batch, HALO, channels), for the
launcher to take initial_states' W-1 rows from. g_w and g_bias are summed in registers over the segment and
written per program, float32 (programs, W, channels) and (programs, channels); the launcher sums them
(deterministic, no atomics). The final states' gradient goes to x and the history directly (a copy): the launcher
adds it.
"""

from __future__ import annotations

import cuda.tile as ct

from .common import LOG2E, Big, ConstBool, ConstInt, exp2
from .conv1d import HALO, bias_row, ids_of, ids_tile, rows_of, stack, tap_rows

_ZERO = ct.PaddingMode.ZERO


def halo_before(x, hist, b, i, cb, has_init, BT: int, BC: int):
    """(HALO, BC) float32: the HALO tokens before token tile i. For tile 0, hist: the history as the launcher lays
    it out, float32 (batch, HALO, channels) with the W-1 entries of initial_states last (zeros before them), or
    zeros. (A (1, HALO, BC) load either way: both branches get one register layout, where building tile 0's halo
    from rows made tileiras convert it through shared memory.)"""
    h = ct.zeros((HALO, BC), dtype=ct.float32)
    if i > 0:
        h = ct.load(x, (b, i * (BT // HALO) - 1, cb), shape=(1, HALO, BC),
                    padding_mode=_ZERO).reshape((HALO, BC)).astype(ct.float32)
    else:
        if has_init != 0:
            h = ct.load(hist, (b, 0, cb), shape=(1, HALO, BC), padding_mode=_ZERO).reshape((HALO, BC))
    return h


def ids_before(seq_idx, b, i, has_seq, BT: int):
    """(HALO,) int32 ids of the HALO tokens before tile i: the history's are 0."""
    ids = ct.zeros((HALO,), dtype=ct.int32)
    if has_seq != 0:
        if i > 0:
            ids = ct.load(seq_idx, (b, i * (BT // HALO) - 1), shape=(1, HALO), padding_mode=_ZERO).reshape((HALO,))
    return ids


def shifted(rows, ids, start: int, ids_out, n: int):
    """The n rows from start, with the rows whose id differs from ids_out (the ids of the tokens they are combined
    with) zeroed: one tap's operand."""
    same = stack(ids[start:start + n]) == ids_out
    return ct.where(same[:, None], stack(rows[start:start + n]), 0.0)


def silu_grad(u):
    """d silu(u)/du = sigmoid(u) (1 + u (1 - sigmoid(u))), sigmoid from exp2 (ex2.approx) and a div.full."""
    sig = ct.truediv(1.0, 1.0 + exp2(u * -LOG2E), rounding_mode=ct.RoundingMode.FULL)
    return sig * (1.0 + u * (1.0 - sig))


def halo_after(a, b, i, cb, seqlen, BT: int, BC: int):
    """(HALO, BC) float32: the HALO tokens after token tile i of a (batch, seqlen, channels) array (zeros past
    seqlen; the load is skipped where none is inside)."""
    h = ct.zeros((HALO, BC), dtype=ct.float32)
    if (i + 1) * BT < seqlen:
        h = ct.load(a, (b, (i + 1) * (BT // HALO), cb), shape=(1, HALO, BC),
                    padding_mode=_ZERO).reshape((HALO, BC)).astype(ct.float32)
    return h


def ids_after(seq_idx, b, i, seqlen, has_seq, BT: int):
    ids = ct.zeros((HALO,), dtype=ct.int32)
    if has_seq != 0:
        if (i + 1) * BT < seqlen:
            ids = ct.load(seq_idx, (b, (i + 1) * (BT // HALO)), shape=(1, HALO), padding_mode=_ZERO).reshape((HALO,))
    return ids


def history_term(dur, idr, taps, t: int, k: int):
    """Tap k's term of a history row's gradient from token t: weight[k] du[t] [id(t) == 0]."""
    return ct.where((idr[HALO + t] == 0)[:, None], dur[t], 0.0) * taps[k]


def history_grad(dur, idr, taps, W: int):
    """(HALO, BC) float32: the gradient of the HALO tokens before token 0 (row j: token j - HALO), from dur (du at
    tokens 0, 1, ...) and idr (ids of tokens -HALO, ...): sum_s weight[W-1-s] du[j - HALO + s] [id == 0]. Rows
    before the history (j < HALO - (W-1)) have no terms and repeat the history's first row (the launcher drops
    them)."""
    rows = ()
    for j in ct.static_iter(range(HALO - (W - 1), HALO)):
        # token t = j - HALO + s reads history row j through tap W-1-s, for s >= HALO - j (t >= 0)
        acc = history_term(dur, idr, taps, 0, W - 1 - (HALO - j))
        for s in ct.static_iter(range(HALO - j + 1, W)):
            acc = acc + history_term(dur, idr, taps, j - HALO + s, W - 1 - s)
        rows += (acc,)
    lead = ()
    for _ in ct.static_iter(range(HALO - (W - 1))):
        lead += (rows[0],)
    return stack(lead + rows)


@ct.kernel
def causal_conv1d_bwd_kernel(x: Big, g_y: Big, weight, bias, seq_idx, hist,
                             g_x: Big, g_w_part, g_bias_part, g_hist,
                             seqlen: int, tiles_per_program: int, n_segments: int,
                             has_bias: int, has_seq: int, has_init: int,
                             W: ConstInt, BT: ConstInt, BC: ConstInt, ACT: ConstBool):
    g = ct.bid(0)
    cb = ct.bid(1)
    b = ct.bid(2)
    taps = tap_rows(weight, cb, W, BC)
    br = bias_row(bias, cb, has_bias, BC)

    gw = ct.zeros((HALO, BC), dtype=ct.float32)  # row k < W: tap k's partial sum
    gb = ct.zeros((1, BC), dtype=ct.float32)
    first = g * tiles_per_program
    stop = ct.minimum(first + tiles_per_program, ct.cdiv(seqlen, BT))
    for i in range(first, stop):
        xt = ct.load(x, (b, i, cb), shape=(1, BT, BC), padding_mode=_ZERO).reshape((BT, BC)).astype(ct.float32)
        # rows[j] and idr[j]: token i*BT - HALO + j, for j < HALO + BT + HALO
        rows = (rows_of(halo_before(x, hist, b, i, cb, has_init, BT, BC), HALO, BC) + rows_of(xt, BT, BC)
                + rows_of(halo_after(x, b, i, cb, seqlen, BT, BC), HALO, BC))
        ids = ids_tile(seq_idx, b, i, has_seq, BT)
        ids_next = ids_after(seq_idx, b, i, seqlen, has_seq, BT)
        idr = ids_of(ids_before(seq_idx, b, i, has_seq, BT), HALO) + ids_of(ids, BT) + ids_of(ids_next, HALO)

        du = ct.load(g_y, (b, i, cb), shape=(1, BT, BC), padding_mode=_ZERO).reshape((BT, BC)).astype(ct.float32)
        du_next = halo_after(g_y, b, i, cb, seqlen, BT, BC)
        if ACT:
            u = ct.zeros((BT, BC), dtype=ct.float32) + br
            u_next = ct.zeros((HALO, BC), dtype=ct.float32) + br
            for s in ct.static_iter(range(W)):
                u = u + shifted(rows, idr, HALO - s, ids, BT) * taps[W - 1 - s]
                u_next = u_next + shifted(rows, idr, HALO + BT - s, ids_next, HALO) * taps[W - 1 - s]
            du = du * silu_grad(u)
            du_next = du_next * silu_grad(u_next)
        dur = rows_of(du, BT, BC) + rows_of(du_next, HALO, BC)  # dur[j]: du at token i*BT + j

        gx = ct.zeros((BT, BC), dtype=ct.float32)
        for s in ct.static_iter(range(W)):
            gx = gx + shifted(dur, idr[HALO:], s, ids, BT) * taps[W - 1 - s]
        ct.store(g_x, (b, i, cb), gx.astype(g_x.dtype).reshape((1, BT, BC)))

        parts = ()
        for k in ct.static_iter(range(W)):
            parts += (ct.sum(shifted(rows, idr, HALO - (W - 1 - k), ids, BT) * du, axis=0).reshape((1, BC)),)
        for _ in ct.static_iter(range(HALO - W)):
            parts += (parts[0],)  # rows past W are not stored
        gw = gw + stack(parts)
        gb = gb + ct.sum(du, axis=0).reshape((1, BC))

        if has_init != 0:
            if i == 0:
                ct.store(g_hist, (b, 0, cb), history_grad(dur, idr, taps, W).reshape((1, HALO, BC)))

    ct.store(g_w_part, (b * n_segments + g, 0, cb), gw.reshape((1, HALO, BC)))
    if has_bias != 0:
        ct.store(g_bias_part, (b * n_segments + g, cb), gb)
