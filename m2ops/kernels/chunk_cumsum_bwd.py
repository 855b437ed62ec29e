"""chunk_cumsum_bwd kernel: gradients of dt, A and dt_bias through chunk_cumsum (backward of chunk_cumsum.py).

One program per (chunk, block of TILE_H_BWD heads, batch row). With R the reverse cumulative
sum of g_dA_cumsum within the chunk (R_l = sum_{i >= l} gcs_i) and d, u, v the forward's clamped,
softplus'd and biased dt (recomputed here):

    g_dt_raw = (g_dt_out + R A) [dt_min <= u <= dt_max] (sigmoid(v) if softplus and v <= 20, else 1)
    g_A      = sum over tokens of R d          g_dt_bias = sum over tokens of g_dt_raw

g_dt_raw is stored in dt's (b, t, h) layout; the two sums are stored per program, (b, chunk, h), and summed
over batch and chunks by the launcher (a few KB: cheaper than atomics and deterministic). Tail positions
past seqlen are constants in the forward: they contribute nothing.
"""

from __future__ import annotations

import cuda.tile as ct

from .chunk_cumsum import dt_stages
from .common import Big, ConstInt

_ZERO = ct.PaddingMode.ZERO


@ct.kernel
def chunk_cumsum_bwd_kernel(g_dt_out: Big, g_cs: Big, dt: Big, A, dt_bias, g_dt: Big, g_A_part: Big,
                            g_bias_part: Big,
                            seqlen: int, n_hblocks: int, has_bias: int, dt_softplus: int,
                            dt_min: float, dt_max: float,
                            L: ConstInt, BH: ConstInt):
    pid = ct.bid(0)
    b = ct.bid(1)
    c = pid // n_hblocks
    hb = pid % n_hblocks

    v, u, d, inside = dt_stages(dt, dt_bias, b, c, hb, seqlen, has_bias, dt_softplus, dt_min, dt_max, L, BH)

    gdo = ct.transpose(ct.load(g_dt_out, (b, hb, c, 0), shape=(1, BH, 1, L),
                               padding_mode=_ZERO).reshape((BH, L)))
    gcs = ct.transpose(ct.load(g_cs, (b, hb, c, 0), shape=(1, BH, 1, L),
                               padding_mode=_ZERO).reshape((BH, L)))
    a = ct.load(A, (hb,), shape=(BH,), padding_mode=_ZERO).astype(ct.float32)
    # Reverse cumulative sum: the total minus the sum of the terms before each position.
    rev = ct.sum(gcs, axis=0)[None, :] - ct.cumsum(gcs, axis=0) + gcs

    gv = gdo + rev * a[None, :]
    gv = ct.where((u >= dt_min) & (u <= dt_max), gv, 0.0)
    if dt_softplus != 0:
        gv = gv * ct.where(v > 20.0, 1.0, 1.0 / (1.0 + ct.exp(-v)))
    gv = ct.where(inside, gv, 0.0)

    ct.store(g_dt, (b, c, hb), gv.astype(g_dt.dtype).reshape((1, L, BH)))
    ct.store(g_A_part, (b, c, hb), ct.sum(rev * d, axis=0).reshape((1, 1, BH)))
    ct.store(g_bias_part, (b, c, hb), ct.sum(gv, axis=0).reshape((1, 1, BH)))
