"""chunk_cumsum kernel: dt preprocessing and the within-chunk cumulative sum of dt * A.

One program per (chunk, block of TILE_H heads, batch row). It reads dt (b, t, h) as an (L, TILE_H) tile,
so heads are the contiguous axis of the read, and writes both outputs transposed into the (b, h, c, l)
layout, where positions are the contiguous axis that the later kernels read.
"""

from __future__ import annotations

import cuda.tile as ct

from .common import Big, ConstInt, dependent_launch_prologue

_ZERO = ct.PaddingMode.ZERO


def softplus(d):
    """log(1 + exp(d)), the identity above 20 (like torch's threshold). log1p is formed as
    log(u) * e / (u - 1) with u = 1 + e, which stays accurate where e is tiny and u rounds to 1."""
    e = ct.exp(ct.minimum(d, 20.0))
    u = 1.0 + e
    small = u == 1.0
    den = ct.where(small, 1.0, u - 1.0)
    lp = ct.where(small, e, ct.log(u) * (e / den))
    return ct.where(d > 20.0, d, lp)


def dt_stages(dt, dt_bias, b, c, hb, seqlen, has_bias, dt_softplus, dt_min, dt_max, L, BH):
    """The (L, BH) tile of chunk c, heads block hb, at each stage: v = dt (+ dt_bias), u = softplus(v) (or v),
    d = u clamped to [dt_min, dt_max] and zeroed past seqlen; and the mask of positions inside seqlen."""
    v = ct.load(dt, (b, c, hb), shape=(1, L, BH), padding_mode=_ZERO).reshape((L, BH)).astype(ct.float32)
    if has_bias != 0:
        bias = ct.load(dt_bias, (hb,), shape=(BH,), padding_mode=_ZERO).astype(ct.float32)
        v = v + bias[None, :]
    u = v
    if dt_softplus != 0:
        u = softplus(v)
    # Positions past seqlen get dt = 0 after the clamp, so they add nothing to any later sum.
    inside = (c * L + ct.arange(L, dtype=ct.int32) < seqlen)[:, None]
    d = ct.where(inside, ct.minimum(ct.maximum(u, dt_min), dt_max), 0.0)
    return v, u, d, inside


@ct.kernel
def chunk_cumsum_kernel(dt: Big, A, dt_bias, dt_out: Big, dA_cumsum: Big,
                        seqlen: int, n_hblocks: int, has_bias: int, dt_softplus: int,
                        dt_min: float, dt_max: float,
                        L: ConstInt, BH: ConstInt):
    dependent_launch_prologue()
    pid = ct.bid(0)
    b = ct.bid(1)
    c = pid // n_hblocks
    hb = pid % n_hblocks

    _, _, d, _ = dt_stages(dt, dt_bias, b, c, hb, seqlen, has_bias, dt_softplus, dt_min, dt_max, L, BH)

    a = ct.load(A, (hb,), shape=(BH,), padding_mode=_ZERO).astype(ct.float32)
    cs = ct.cumsum(d * a[None, :], axis=0)

    ct.store(dt_out, (b, hb, c, 0), ct.transpose(d).reshape((1, BH, 1, L)))
    ct.store(dA_cumsum, (b, hb, c, 0), ct.transpose(cs).reshape((1, BH, 1, L)))
