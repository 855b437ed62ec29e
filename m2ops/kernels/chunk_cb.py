"""chunk_cb kernel: C_i . B_j^T for every chunk and group, the lower-triangular blocks only.

One program per (block of BL rows of one chunk, column block of the chunk, group, batch row) computes the
(BL, BL) block cb[b, c, g, m, jb] = C_i . B_j^T when jb <= m (programs above the diagonal do nothing), as
mma's over dstate in TN steps, in the input dtype with float32 accumulation (the products compute_out
formed itself before), and stores it in float32. Blocks above the diagonal are neither written nor read.
One block per program rather than a row of blocks: the grid is small (cdiv(T, BL) * L/BL * G * B), so each
program should be short.

Why: C . B^T does not depend on the head, but compute_out formed it again for every head (and headdim
tile) that shares the group: H/G times the same 2*L*L*N/2 FLOPs per chunk, plus the dependent loads of C
and B in front of every intra-chunk mma. The scratch (b, c, g, L, L) float32 is small (L*L*4 bytes per
chunk and group: 4 MB at T=16K, L=64, G=1) and stays in L2 while compute_out's programs of one row block,
which run next to each other, read it.

The grid covers the row blocks that hold tokens (cdiv(seqlen, BL)), so no tile lies wholly outside C or B;
rows past seqlen are zero-padded and give zero rows.

DIAG: only the diagonal blocks (jb = m), one program per row block: all that compute_out_carry reads.

A program's work is cb_block, which chunk_state.chunk_state_cumsum_cb_kernel also runs (the config's fused_cumsum).
"""

from __future__ import annotations

import cuda.tile as ct

from .common import Big, ConstBool, ConstInt, dependent_launch_prologue

_ZERO = ct.PaddingMode.ZERO


def cb_block(C, B, cb, q, g, b, dstate, diag, L, BL, TN):
    """Program q of one group's C . B^T: the (BL, BL) block of row block q // (L/BL) and column block q % (L/BL)
    of its chunk (nothing above the diagonal), or with diag the diagonal block of row block q. Also run by
    chunk_state_cumsum_cb_kernel's first programs (chunk_state.py), with the same k-steps of TN, so the same
    bits."""
    blocks_per_chunk = L // BL
    jb = q % blocks_per_chunk    # column block inside the chunk
    rb = q // blocks_per_chunk   # row block over the whole sequence
    if diag:
        rb = q
    c = rb // blocks_per_chunk
    m = rb % blocks_per_chunk      # row block inside the chunk
    if diag:
        jb = m
    mma_dtype = C.dtype
    n_ntiles = (dstate + TN - 1) // TN

    if jb <= m:
        acc = ct.zeros((BL, BL), dtype=ct.float32)
        jrow = c * blocks_per_chunk + jb
        for k in range(n_ntiles):
            ci = ct.load(C, (b, rb, g, k), shape=(1, BL, 1, TN), padding_mode=_ZERO).reshape((BL, TN))
            bj = ct.load(B, (b, jrow, g, k), shape=(1, BL, 1, TN), padding_mode=_ZERO).reshape((BL, TN))
            acc = ct.mma(ci.astype(mma_dtype), ct.transpose(bj.astype(mma_dtype)), acc)
        ct.store(cb, (b, c, g, m, jb), acc.astype(cb.dtype).reshape((1, 1, 1, BL, BL)))


@ct.kernel
def chunk_cb_kernel(C: Big, B: Big, cb: Big,
                    dstate: int,
                    L: ConstInt, BL: ConstInt, TN: ConstInt, DIAG: ConstBool):
    dependent_launch_prologue()
    cb_block(C, B, cb, ct.bid(0), ct.bid(1), ct.bid(2), dstate, DIAG, L, BL, TN)
