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

# Taps of width up to HALO reach HALO-1 tokens back: the views are offset by up to HALO-1 tokens (the backward's by
# twice that), and the history the launcher lays out from initial_states has HALO rows (a power-of-two tile).
HALO = 4


def bias_row(bias, cb, has_bias, BC: int):
    br = ct.zeros((1, BC), dtype=ct.float32)
    if has_bias != 0:
        br = ct.load(bias, (cb,), shape=(BC,), padding_mode=_ZERO).reshape((1, BC))
    return br


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
    seqlen - state_len .. seqlen - 1, a row at a time."""
    last = last_id(seq_idx, b, seqlen, has_seq)
    for r in range(state_len):
        row = final_row(x, hist, seq_idx, b, seqlen - state_len + r, cb, seqlen, has_init, has_seq, last, BC)
        ct.store(final, (b, r, cb), row.astype(final.dtype).reshape((1, 1, BC)))


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
