"""chunk_state kernel: each chunk's own contribution to the state, from a zero start (first half of the
fwd_pass_state op; state_passing.py is the second).

One program per (chunk, head, (headdim tile, dstate tile), batch row) computes

    local_c = sum over tokens j of the chunk of  (w_j x_j)^T B_j,   w_j = exp(cs_last - cs_j) * dt_j

as mma's of (w * x)^T (TP, BL) by B (BL, TN), BL token rows at a time, and stores it (in float32, or
bfloat16 where specialise.local_dtype_names allows) into the chunk's slot of the states buffer, where state_passing
replaces it by the entering state.

Why: the old single kernel walked all chunks of one state tile in one program (B*H*P/TP*N/TN = 160
programs at the benchmark shape), so every chunk cost a dependent load -> mma -> store round trip and the
GPU sat at 6% occupancy. No chunk's local state depends on any other, so this part, which holds all the
matrix work and all reads of x and B, runs with one program per chunk tile (tens of thousands of
programs); only an elementwise multiply-add stays sequential.

HB heads per program (a constant; specialise.chunk_state_heads: 2 for bfloat16 at chunk 256 from dstate 65, else 1): the
program's rows are HB heads' headdim tiles side by side, (HB * TP, TN) = (w x)^T B with x loaded as
(BL, HB, TP), so that each B tile, which every head of a group shares, is read from L2 once per HB heads
rather than once per head (B was most of the kernel's L2 traffic at dstate 256-512: heads x dstate x 2 bytes
per token). The launcher only takes HB > 1 where HB divides the heads of a group.

With seq_idx (HAS_SEQ), tokens whose sequence differs from the chunk's last token add nothing (their
contribution belongs to a state that ends inside the chunk; varlen_states recomputes those).

chunk_state_cumsum_cb_kernel (the planned forward at up to four chunks, the config's fused_cumsum) is the same state
program with chunk_cb's programs (chunk_cb.cb_block) in front of it in its grid, each state program forming its
chunk's dt and cumulative sums itself as chunk_cumsum does: the short forward is three dependent launches instead
of five.
"""

from __future__ import annotations

import cuda.tile as ct

from .chunk_cb import cb_block
from .chunk_cumsum import dt_stages
from .common import (TILE_H, TILE_N, Big, ConstBool, ConstInt, dependent_launch_prologue, load_tile,
                     scale_by, token_weight, weighted_state_product)

_ZERO = ct.PaddingMode.ZERO


def program_tile(pid, nheads, heads_per_group, n_ntiles, n_ptiles, HB):
    """(dstate tile, headdim tile, block of HB heads, chunk, group) of state program pid (the grid's order:
    dstate tile fastest, then headdim tile, block of heads, chunk)."""
    nt = pid % n_ntiles
    rest = pid // n_ntiles
    pt = rest % n_ptiles
    rest = rest // n_ptiles
    hb = rest % (nheads // HB)     # block of HB heads (the launcher makes HB divide nheads)
    c = rest // (nheads // HB)
    return nt, pt, hb, c, (hb * HB) // heads_per_group


def add_sub_block(s, x, B, w, b, row, g, hb, pt, nt, BL, TP, TN, CHK, HB):
    """s + (w x)^T B over the BL tokens of row block row, w (HB, BL) the tokens' weights."""
    bs = load_tile(B, (b, row, g, nt), (1, BL, 1, TN), CHK).reshape((BL, TN))
    if HB == 1:
        xs = load_tile(x, (b, row, hb, pt), (1, BL, 1, TP), CHK).reshape((BL, TP))
        s = weighted_state_product(xs, bs, w.reshape((BL,)), s)
    else:
        xs = load_tile(x, (b, row, hb, pt), (1, BL, HB, TP), CHK).reshape((BL, HB, TP))
        xw = scale_by(xs, ct.transpose(w)[:, :, None])
        s = ct.mma(ct.transpose(xw.reshape((BL, HB * TP))), bs.astype(xs.dtype), s)
    return s


def state_program(x, B, dt_out, dA_cumsum, seq_idx, states, pid, b, seqlen, nheads, heads_per_group, n_ntiles,
                  n_ptiles, L, BL, TP, TN, HAS_SEQ, CHK, HB):
    """Program pid of the local states of batch row b."""
    nt, pt, hb, c, g = program_tile(pid, nheads, heads_per_group, n_ntiles, n_ptiles, HB)

    # cs at the chunk's last token, taken from the last sub-block's tile rather than loaded alone (a
    # per-thread global load, where the tile's is a TMA copy; neutral on the H200, docs/history.md v19).
    cs_end = ct.load(dA_cumsum, (b, hb, c, L // BL - 1), shape=(1, HB, 1, BL), check_bounds=False)
    cs_last = ct.extract(cs_end, index=(0, 0, 0, BL - 1), shape=(1, HB, 1, 1)).reshape((HB, 1))
    if HAS_SEQ:
        seq_last = ct.load(seq_idx, (b, ct.minimum(c * L + L - 1, seqlen - 1)), shape=())

    s = ct.zeros((HB * TP, TN), dtype=ct.float32)
    # Sub-blocks wholly past seqlen are skipped: a tile entirely outside an array is undefined to load.
    n_sub = ct.minimum(L // BL, (seqlen - c * L + BL - 1) // BL)
    for sb in range(n_sub):
        cs = ct.load(dA_cumsum, (b, hb, c, sb), shape=(1, HB, 1, BL), check_bounds=False).reshape((HB, BL))
        dt = ct.load(dt_out, (b, hb, c, sb), shape=(1, HB, 1, BL), check_bounds=False).reshape((HB, BL))
        w = token_weight(cs_last, cs, dt)
        row = c * (L // BL) + sb
        if HAS_SEQ:
            seq = load_tile(seq_idx, (b, row), (1, BL), CHK).reshape((1, BL))
            w = ct.where(seq == seq_last, w, 0.0)
        s = add_sub_block(s, x, B, w, b, row, g, hb, pt, nt, BL, TP, TN, CHK, HB)

    ct.store(states, (b, c, hb, pt, nt), s.astype(states.dtype).reshape((1, 1, HB, TP, TN)))


@ct.kernel
def chunk_state_kernel(x: Big, B: Big, dt_out: Big, dA_cumsum: Big, seq_idx: Big, states: Big,
                       seqlen: int, nheads: int, heads_per_group: int, n_ntiles: int, n_ptiles: int,
                       L: ConstInt, BL: ConstInt, TP: ConstInt, TN: ConstInt, HAS_SEQ: ConstBool,
                       CHK: ConstBool, HB: ConstInt):
    dependent_launch_prologue()
    state_program(x, B, dt_out, dA_cumsum, seq_idx, states, ct.bid(0), ct.bid(1), seqlen, nheads, heads_per_group,
                  n_ntiles, n_ptiles, L, BL, TP, TN, HAS_SEQ, CHK, HB)


def heads_of(t, h0, HB):
    """Columns h0 % TILE_H .. + HB of an (L, TILE_H) tile of one block of heads, as an (HB, L) tile. A one-hot
    sum, exact (each output adds one element to zeros), where an index into the tile's columns would not be a
    compile-time constant."""
    pick = ct.arange(TILE_H, dtype=ct.int32)[:, None] == (h0 % TILE_H) + ct.arange(HB, dtype=ct.int32)[None, :]
    return ct.transpose(ct.sum(ct.where(pick[None, :, :], t[:, :, None], 0.0), axis=1))


def state_program_from_dt(x, B, dt, A, dt_bias, dt_out, dA_cumsum, states, pid, b, seqlen, nheads, heads_per_group,
                          n_ntiles, n_ptiles, has_bias, dt_softplus, dt_min, dt_max, L, BL, TP, TN, CHK, HB):
    """state_program without seq_idx, forming the chunk's dt and cumulative sums itself from dt (b, t, h) as
    chunk_cumsum does, over the same (L, TILE_H) tile (so the same bits), and storing them for the kernels after
    it from the programs of the first headdim and dstate tile."""
    nt, pt, hb, c, g = program_tile(pid, nheads, heads_per_group, n_ntiles, n_ptiles, HB)
    h0 = hb * HB
    blk = h0 // TILE_H            # the launcher makes HB divide TILE_H, so the HB heads share one block

    _, _, d, _ = dt_stages(dt, dt_bias, b, c, blk, seqlen, has_bias, dt_softplus, dt_min, dt_max, L, TILE_H)
    a = ct.load(A, (blk,), shape=(TILE_H,), padding_mode=_ZERO).astype(ct.float32)
    cs = heads_of(ct.cumsum(d * a[None, :], axis=0), h0, HB)      # (HB, L)
    dh = heads_of(d, h0, HB)
    if pt == 0:
        if nt == 0:
            ct.store(dt_out, (b, hb, c, 0), dh.reshape((1, HB, 1, L)))
            ct.store(dA_cumsum, (b, hb, c, 0), cs.reshape((1, HB, 1, L)))
    cs_last = ct.extract(cs, index=(0, L - 1), shape=(HB, 1))
    # every token's weight at once; each step takes its sub-block's by a one-hot sum (exact, as above)
    w_all = token_weight(cs_last, cs, dh).reshape((HB, L // BL, BL))
    subs = ct.arange(L // BL, dtype=ct.int32)

    s = ct.zeros((HB * TP, TN), dtype=ct.float32)
    n_sub = ct.minimum(L // BL, (seqlen - c * L + BL - 1) // BL)
    for sb in range(n_sub):
        w = ct.sum(ct.where((subs == sb)[None, :, None], w_all, 0.0), axis=1)      # (HB, BL)
        s = add_sub_block(s, x, B, w, b, c * (L // BL) + sb, g, hb, pt, nt, BL, TP, TN, CHK, HB)

    ct.store(states, (b, c, hb, pt, nt), s.astype(states.dtype).reshape((1, 1, HB, TP, TN)))


@ct.kernel
def chunk_state_cumsum_cb_kernel(x: Big, B: Big, dt: Big, A, dt_bias, dt_out: Big, dA_cumsum: Big, states: Big,
                                 C: Big, cb: Big,
                                 seqlen: int, nheads: int, heads_per_group: int, n_ntiles: int, n_ptiles: int,
                                 cb_per_group: int, dstate: int, cb_diag: int, has_bias: int, dt_softplus: int,
                                 dt_min: float, dt_max: float,
                                 L: ConstInt, BL: ConstInt, TP: ConstInt, TN: ConstInt, CHK: ConstBool,
                                 HB: ConstInt):
    """chunk_state's programs after chunk_cb's (cb_per_group programs per group of each batch row, first in the
    grid), each state program doing chunk_cumsum's work for its chunk itself (the config's fused_cumsum, the planned
    forward without seq_idx): the forward is three dependent launches (this one, state_passing, the output kernel)
    instead of five. C . B^T needs neither the cumulative sums nor the states, so chunk_cb's work rides here."""
    dependent_launch_prologue()
    pid = ct.bid(0)
    b = ct.bid(1)
    n_cb = cb_per_group * (nheads // heads_per_group)
    if pid < n_cb:
        cb_block(C, B, cb, pid % cb_per_group, pid // cb_per_group, b, dstate, cb_diag != 0, L, BL, TILE_N)
    else:
        state_program_from_dt(x, B, dt, A, dt_bias, dt_out, dA_cumsum, states, pid - n_cb, b, seqlen, nheads,
                              heads_per_group, n_ntiles, n_ptiles, has_bias, dt_softplus, dt_min, dt_max,
                              L, BL, TP, TN, CHK, HB)
