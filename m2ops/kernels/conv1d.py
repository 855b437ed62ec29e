"""causal_conv1d kernel: the causal depthwise convolution (+ SiLU) of the Mamba-2 layer, forward.

Launched by m2ops.kernels.conv.causal_conv1d, the CUDA implementation of m2ops::causal_conv1d; the math is
m2ops/reference/conv1d.py's. In float32, with W taps:

    u[t] = bias + sum_s weight[W-1-s] x[t - s] [id(t - s) == id(t)],   y = silu(u) or u

x is read through its (batch, seqlen, channels) view, channels contiguous. Each tap's operand is a plain tile
load: the launcher passes x as HALO views, view s starting HALO-1-s tokens in (x_s[t'] = x[t' + HALO-1-s]), and
y and seq_idx likewise, so that tile j of every view lines up with output tokens HALO-1 + j*BT .. and view s holds
the token s before each. The four loads of a program overlap and hit L1 after the first. (Building the shifted
tiles from the token rows of one loaded window instead, with ct.extract and ct.cat, made tileiras move them
through ~220 KB of shared memory at run time, where the channel axis is known to be a multiple of 16 and loads are
16-byte vectors.) seq_idx compares the ids of the same shifted views.

The first HALO-1 output tokens, whose taps reach before token 0 (into the history the launcher lays out from
initial_states, or zeros), are computed a row at a time by the programs of the first token tile; the last token
tile's programs also write the final states (the last state_len inputs, history and masking as in the
reference), a row at a time.

W (taps, unrolled), BT and BC are constants; bias, seq_idx, initial_states, SiLU and the final states are
run-time flags (they select branches, not loops).
"""

from __future__ import annotations

import cuda.tile as ct

from .common import Big, ConstInt, silu

_ZERO = ct.PaddingMode.ZERO

# Tokens of history a tile carries before its first token: the taps of width up to 4 reach 3 back, and a tile
# of 4 rows keeps the shapes powers of two (the backward's halo after a tile is as long).
HALO = 4


# ---- token rows of a tile (shared with conv1d_bwd.py) ----

def rows_of(t, n, BC):
    """The n token rows of a (n, BC) tile, as a tuple of (1, BC) tiles (compile-time)."""
    rows = ()
    for j in ct.static_iter(range(n)):
        rows += (ct.extract(t, (j, 0), (1, BC)),)
    return rows


def ids_of(t, n):
    """The n entries of a (n,) tile, as a tuple of (1,) tiles (compile-time)."""
    out = ()
    for j in ct.static_iter(range(n)):
        out += (ct.extract(t, (j,), (1,)),)
    return out


def stack(rows):
    """The rows (a power-of-two count of equal tiles) concatenated along axis 0, pairwise."""
    level = rows
    for _ in ct.static_iter(range(len(rows).bit_length() - 1)):
        nxt = ()
        for p in ct.static_iter(range(len(level) // 2)):
            nxt += (ct.cat((level[2 * p], level[2 * p + 1]), 0),)
        level = nxt
    return level[0]


def tap_rows(weight, cb, W: int, BC: int):
    """weight[:, k] of the channel tile for k < W, as (1, BC) float32 rows (weight is float32 (channels, W))."""
    wt = ct.transpose(ct.load(weight, (cb, 0), shape=(BC, HALO), padding_mode=_ZERO))
    return rows_of(wt, HALO, BC)[:W]


def bias_row(bias, cb, has_bias, BC: int):
    br = ct.zeros((1, BC), dtype=ct.float32)
    if has_bias != 0:
        br = ct.load(bias, (cb,), shape=(BC,), padding_mode=_ZERO).reshape((1, BC))
    return br


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


def ids_tile(seq_idx, b, i, has_seq, BT: int):
    """(BT,) int32 sequence ids of token tile i (zeros without seq_idx)."""
    ids = ct.zeros((BT,), dtype=ct.int32)
    if has_seq != 0:
        ids = ct.load(seq_idx, (b, i), shape=(1, BT), padding_mode=_ZERO).reshape((BT,))
    return ids


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


def last_id(seq_idx, b, seqlen, has_seq):
    last = ct.zeros((), dtype=ct.int32)
    if has_seq != 0:
        last = ct.load(seq_idx, (b, seqlen - 1), shape=())
    return last


def final_row(x, hist, seq_idx, b, t, cb, seqlen, has_init, has_seq, last, BC: int):
    """(1, BC) float32: the input at token t (the history's for -HALO <= t < 0, zeros before it and where the
    token's id is not last)."""
    row = ct.zeros((1, BC), dtype=ct.float32)
    if t >= 0:
        if t < seqlen:  # (rows past the end are clipped by the store; a load wholly outside is undefined)
            row = ct.load(x, (b, t, cb), shape=(1, 1, BC), padding_mode=_ZERO).reshape((1, BC)).astype(ct.float32)
            if has_seq != 0:
                if ct.load(seq_idx, (b, t), shape=()) != last:
                    row = ct.zeros((1, BC), dtype=ct.float32)
    else:
        if has_init != 0:
            if t >= -HALO:
                if last == 0:
                    row = ct.load(hist, (b, HALO + t, cb), shape=(1, 1, BC), padding_mode=_ZERO).reshape((1, BC))
    return row


def write_final_states(x, hist, seq_idx, final, b, cb, seqlen, state_len, has_init, has_seq, BC: int):
    """final ((batch, state_len, channels), channel-last) of batch row b, channel tile cb: the inputs at tokens
    seqlen - state_len .. seqlen - 1, in blocks of HALO rows (the last one clipped)."""
    last = last_id(seq_idx, b, seqlen, has_seq)
    for jb in range(ct.cdiv(state_len, HALO)):
        rows = ()
        for r in ct.static_iter(range(HALO)):
            t = seqlen - state_len + jb * HALO + r
            rows += (final_row(x, hist, seq_idx, b, t, cb, seqlen, has_init, has_seq, last, BC),)
        ct.store(final, (b, jb, cb), stack(rows).astype(final.dtype).reshape((1, HALO, BC)))


def input_row(x, hist, b, t, cb, seqlen, has_init, BC: int):
    """(1, BC) float32: the input at token t, -HALO <= t < seqlen (the history's before token 0, or zeros)."""
    row = ct.zeros((1, BC), dtype=ct.float32)
    if t >= 0:
        row = ct.load(x, (b, t, cb), shape=(1, 1, BC), padding_mode=_ZERO).reshape((1, BC)).astype(ct.float32)
    else:
        if has_init != 0:
            row = ct.load(hist, (b, HALO + t, cb), shape=(1, 1, BC), padding_mode=_ZERO).reshape((1, BC))
    return row


def id_at(seq_idx, b, t, has_seq):
    """The sequence id of token t (0 before token 0 and without seq_idx)."""
    out = ct.zeros((), dtype=ct.int32)
    if has_seq != 0:
        if t >= 0:
            out = ct.load(seq_idx, (b, t), shape=())
    return out


def write_head(x, hist, seq_idx, y, taps, br, b, cb, seqlen, has_init, has_seq, act, W: int, BC: int):
    """y at tokens 0 .. HALO-2 (those before seqlen), a row at a time: their taps reach the history."""
    for t in ct.static_iter(range(HALO - 1)):
        if t < seqlen:
            me = id_at(seq_idx, b, t, has_seq)
            acc = br
            for s in ct.static_iter(range(W)):
                row = input_row(x, hist, b, t - s, cb, seqlen, has_init, BC)
                if has_seq != 0:
                    if id_at(seq_idx, b, t - s, has_seq) != me:
                        row = ct.zeros((1, BC), dtype=ct.float32)
                acc = acc + row * taps[W - 1 - s]
            if act != 0:
                acc = silu(acc)
            ct.store(y, (b, t, cb), acc.astype(y.dtype).reshape((1, 1, BC)))


def tap_rows_t(weight_t, cb, W: int, BC: int):
    """weight[:, k] of the channel tile for k < W, as (1, BC) float32 rows of weight_t, float32 (W, channels)."""
    rows = ()
    for k in ct.static_iter(range(W)):
        rows += (ct.load(weight_t, (k, cb), shape=(1, BC), padding_mode=_ZERO),)
    return rows


@ct.kernel
def causal_conv1d_kernel(x0: Big, x1: Big, x2: Big, x3: Big, weight_t, bias,
                         s0, s1, s2, s3, hist, y: Big, y3: Big, final,
                         seqlen: int, has_bias: int, has_seq: int, has_init: int, act: int, state_len: int,
                         W: ConstInt, BT: ConstInt, BC: ConstInt):
    j = ct.bid(0)
    cb = ct.bid(1)
    b = ct.bid(2)
    xs = (x0, x1, x2, x3)  # xs[s]: x from token HALO-1-s; x3 is x itself
    ss = (s0, s1, s2, s3)  # seq_idx likewise
    taps = tap_rows_t(weight_t, cb, W, BC)
    br = bias_row(bias, cb, has_bias, BC)

    if j * BT < seqlen - (HALO - 1):
        ids = ct.zeros((BT,), dtype=ct.int32)
        if has_seq != 0:
            ids = ct.load(s0, (b, j), shape=(1, BT), padding_mode=_ZERO).reshape((BT,))
        acc = ct.zeros((BT, BC), dtype=ct.float32) + br
        for s in ct.static_iter(range(W)):  # tap W-1-s reads the token s before
            xt = ct.load(xs[s], (b, j, cb), shape=(1, BT, BC), padding_mode=_ZERO).reshape((BT, BC))
            xt = xt.astype(ct.float32)
            if has_seq != 0:
                if s > 0:
                    same = ct.load(ss[s], (b, j), shape=(1, BT), padding_mode=_ZERO).reshape((BT,)) == ids
                    xt = ct.where(same[:, None], xt, 0.0)
            acc = acc + xt * taps[W - 1 - s]
        if act != 0:
            acc = silu(acc)
        ct.store(y3, (b, j, cb), acc.astype(y3.dtype).reshape((1, BT, BC)))

    if j == 0:
        write_head(x3, hist, s3, y, taps, br, b, cb, seqlen, has_init, has_seq, act, W, BC)
    if state_len > 0:
        if j == ct.num_blocks(0) - 1:
            write_final_states(x3, hist, s3, final, b, cb, seqlen, state_len, has_init, has_seq, BC)
