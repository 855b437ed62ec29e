"""causal_conv1d kernel: the causal depthwise convolution (+ SiLU) of the Mamba-2 layer, forward.

Launched by m2ops.kernels.conv.causal_conv1d, the CUDA implementation of m2ops::causal_conv1d; the math is
m2ops/reference/conv1d.py's. One program per (token tile of BT tokens, channel tile of BC channels, batch row)
reads x through its (batch, seqlen, channels) view, channels contiguous, and computes in float32:

    u[t] = bias + sum_k weight[k] x[t - (W-1) + k] [id(t - (W-1) + k) == id(t)],   y = silu(u) or u

Each tap's operand, the tile's tokens shifted back by 0 .. W-1, is gathered from x at those token rows
(ct.gather: 16-byte vector loads along the channels as the runtime builds it, the repeated rows served by the
caches); rows before token 0 read zeros, or in the first tile the history (initial_states as the launcher lays them
out); with seq_idx each row is zeroed where its token's id differs from the output token's (the history's id is 0;
without seq_idx every id is 0 and the masks are all true). At width 4, bfloat16, BT=16, BC=64, occupancy 8:
0.538 ms at 8 x 4096 x 5376 on an H200 against 0.944 ms for the former kernel, which loaded the tile and its halo
once and rebuilt the shifted tiles from extracted token rows (through 227 KB of shared memory) (2026-12-07,
measure/conv_variants.py; docs/history.md).

The last token tile's programs also write the final states (the last state_len inputs, history and masking as in
the reference), a row at a time: a few rows per (batch row, channel tile).

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


def ids_tile(seq_idx, b, i, has_seq, BT: int):
    """(BT,) int32 sequence ids of token tile i (zeros without seq_idx)."""
    ids = ct.zeros((BT,), dtype=ct.int32)
    if has_seq != 0:
        ids = ct.load(seq_idx, (b, i), shape=(1, BT), padding_mode=_ZERO).reshape((BT,))
    return ids


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


def tap_operand(x, hist, seq_idx, b, i, t, c, ids, s: int, has_seq, has_init, BT: int, BC: int):
    """(BT, BC) float32: the inputs s tokens before the tile's tokens t (zeros where that token's id differs from
    ids, the tile's own): rows of x gathered at t - s (zeros before token 0 and past the end), and for tile 0 the
    history's rows at the tokens before 0 (their id is 0)."""
    src = t - s
    v = ct.gather(x, (b, src[:, None], c[None, :])).astype(ct.float32)
    same = ct.full((BT,), True, dtype=ct.bool_)
    if s > 0:  # (the tile's own tokens, s = 0, share their ids)
        if has_seq != 0:
            same = ct.gather(seq_idx, (b, src)) == ids  # (0 before token 0: the history's id)
    if s > 0:
        if has_init != 0:
            if i == 0:
                v = v + ct.gather(hist, (b, (src + HALO)[:, None], c[None, :]), mask=(src < 0)[:, None])
    return ct.where(same[:, None], v, 0.0)


@ct.kernel
def causal_conv1d_kernel(x: Big, weight, bias, seq_idx, hist, y: Big, final,
                         seqlen: int, has_bias: int, has_seq: int, has_init: int, act: int, state_len: int,
                         W: ConstInt, BT: ConstInt, BC: ConstInt):
    i = ct.bid(0)
    cb = ct.bid(1)
    b = ct.bid(2)
    t = i * BT + ct.arange(BT, dtype=ct.int32)
    c = cb * BC + ct.arange(BC, dtype=ct.int32)
    ids = ids_tile(seq_idx, b, i, has_seq, BT)
    taps = tap_rows(weight, cb, W, BC)

    acc = ct.zeros((BT, BC), dtype=ct.float32) + bias_row(bias, cb, has_bias, BC)
    for s in ct.static_iter(range(W)):  # tap W-1-s reads the token s before
        acc = acc + tap_operand(x, hist, seq_idx, b, i, t, c, ids, s, has_seq, has_init, BT, BC) * taps[W - 1 - s]
    if act != 0:
        acc = silu(acc)
    ct.store(y, (b, i, cb), acc.astype(y.dtype).reshape((1, BT, BC)))

    if state_len > 0:
        if (i + 1) * BT >= seqlen:
            write_final_states(x, hist, seq_idx, final, b, cb, seqlen, state_len, has_init, has_seq, BC)
