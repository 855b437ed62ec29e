"""The chained scan (the chunk_scan op's "chain" path): y and the final state in one pass over the inputs.

One program per (chunk, head, headdim tile, batch row). In order, it

1. forms its chunk's local state from a zero start, (w x)^T B over the chunk's tokens (w = exp(cs_last - cs) dt),
   in registers, from inputs that no other program waits for;
2. waits until the program of the previous chunk of its (batch row, head, headdim tile) has published the state
   entering this chunk, takes it, and publishes the state leaving it: S_out = exp(cs_last) S_in + local;
3. forms y for its chunk's rows from S_in and the chunk's own tokens (compute_out's products, with D and z).

The state is handed from chunk to chunk through one float32 slot per (batch row, head, headdim tile): the
caller's final_states array itself, which after the last chunk holds the final state. flags[b, h, pt] counts the
chunks folded into the slot: chunk c waits for c (an acquiring atomic), reads, writes S_out and sets c + 1
(a releasing exchange). A chunk reads the slot before it overwrites it, and its successor reads only after that
write, so one slot is enough.

Why: the two-op path writes every chunk's local state, reads it back in state_passing, writes every entering
state and reads it again in compute_out, and reads x twice (chunk_state and compute_out). Here x, B, C, dt and
cs are read once, nothing but y and the final state is written, and the only sequential work is step 2: one
elementwise multiply-add per chunk, which the other programs' matrix work hides as long as a chunk's
successor is resident while it runs.

Order of programs: a program's chunk comes from a ticket (an atomic counter), not from its block id, and tickets
run chunk-major (all heads of chunk c before chunk c + 1). A program that waits therefore waits for one that
took an earlier ticket, hence has started and runs to completion: no dependence on the order in which the
hardware schedules blocks, and no deadlock however few programs are resident. The launcher zeroes the ticket
and the flags before each launch.

seq_idx (HAS_SEQ) follows the rules of chunk_state, state_passing and compute_out at chunk granularity.

Scope: dstate <= 128 (NT, a power of two >= dstate, keeps the (TP, NT) float32 state and its
local twin in registers). Precision as in chunk_state / compute_out: token products in the input dtype with
float32 accumulation, the recurrence in float32, the inter-chunk product C . S^T in bfloat16 for bfloat16 inputs
(SBF) and tf32 otherwise.
"""

from __future__ import annotations

import cuda.tile as ct

from .common import (LOG2E, Big, ConstBool, ConstInt, dependent_launch_prologue, diag_decay, exp2, load_tile, scale_by, silu, token_weight,
                     weighted_state_product)

_ZERO = ct.PaddingMode.ZERO


@ct.kernel
def chained_scan_kernel(x: Big, dt_out: Big, dA_cumsum: Big, B: Big, C: Big, cb: Big, D, z: Big, seq_idx: Big,
                        initial_states: Big, final_states: Big, flags, ticket, y: Big,
                        seqlen: int, batch: int, nheads: int, heads_per_group: int, n_ptiles: int,
                        has_init: int, has_d: int, has_z: int,
                        L: ConstInt, BL: ConstInt, TP: ConstInt, NT: ConstInt, HAS_SEQ: ConstBool, CHK: ConstBool,
                        SBF: ConstBool):
    dependent_launch_prologue()  # (also orders the ticket and flags after the launcher's zeroing of them)
    t = ct.atomic_add(ticket, 0, 1, memory_order=ct.MemoryOrder.RELAXED)
    per_chunk = batch * nheads * n_ptiles
    c = t // per_chunk
    r = t % per_chunk
    pt = r % n_ptiles
    r = r // n_ptiles
    h = r % nheads
    b = r // nheads
    g = h // heads_per_group
    mma_dtype = x.dtype
    blocks_per_chunk = L // BL
    n_sub = ct.minimum(blocks_per_chunk, (seqlen - c * L + BL - 1) // BL)  # sub-blocks that hold tokens
    cs_last = ct.load(dA_cumsum, (b, h, c, L - 1), shape=())
    cs_carry = cs_last  # log of the entering state's decay across the chunk
    if HAS_SEQ:
        # As chunk_state, state_passing and compute_out: the entering state belongs to the sequence of the token
        # before the chunk (sequence 0 owns initial_states) and survives the chunk only if its last token is of
        # that sequence; only tokens of the last token's sequence add to the leaving state.
        seq_last = ct.load(seq_idx, (b, ct.minimum(c * L + L - 1, seqlen - 1)), shape=())
        seq_prev = ct.load(seq_idx, (b, ct.maximum(c * L - 1, 0)), shape=())
        seq_prev = ct.where(c == 0, 0, seq_prev)
        cs_carry = ct.where(seq_last == seq_prev, cs_last, -float("inf"))

    # 1. The chunk's local state.
    local = ct.zeros((TP, NT), dtype=ct.float32)
    for sb in range(n_sub):
        row = c * blocks_per_chunk + sb
        cs = ct.load(dA_cumsum, (b, h, c, sb), shape=(1, 1, 1, BL), check_bounds=False).reshape((BL,))
        dt = ct.load(dt_out, (b, h, c, sb), shape=(1, 1, 1, BL), check_bounds=False).reshape((BL,))
        xs = load_tile(x, (b, row, h, pt), (1, BL, 1, TP), CHK).reshape((BL, TP))
        bs = load_tile(B, (b, row, g, 0), (1, BL, 1, NT), CHK).reshape((BL, NT))
        w = token_weight(cs_last, cs, dt)
        if HAS_SEQ:
            w = ct.where(load_tile(seq_idx, (b, row), (1, BL), CHK).reshape((BL,)) == seq_last, w, 0.0)
        local = weighted_state_product(xs, bs, w, local)

    # 2. The state entering the chunk, and the one leaving it for the next chunk's program.
    if c == 0:
        s_in = ct.zeros((TP, NT), dtype=ct.float32)
        if has_init != 0:
            s_in = ct.load(initial_states, (b, h, pt, 0), shape=(1, 1, TP, NT),
                           padding_mode=_ZERO).reshape((TP, NT))
    else:
        # Polled with an atomic (adding 0), not a load: a scalar atomic runs on one thread and its result is
        # broadcast, so every thread leaves the loop on the same iteration. A polling load runs on every thread;
        # threads that saw the new value at different iterations then met different barriers (a hang on the H200).
        while ct.atomic_add(flags, (b, h, pt), 0, memory_order=ct.MemoryOrder.ACQUIRE) < c:
            pass
        # Not through TMA: the copy engine's reads are not ordered by the acquire above.
        s_in = ct.load(final_states, (b, h, pt, 0), shape=(1, 1, TP, NT), padding_mode=_ZERO,
                       allow_tma=False).reshape((TP, NT))
    s_out = s_in * exp2(cs_carry * LOG2E) + local  # (exp2(-inf) = 0: a sequence starts inside the chunk)
    ct.store(final_states, (b, h, pt, 0), s_out.reshape((1, 1, TP, NT)), allow_tma=False)
    ct.atomic_xchg(flags, (b, h, pt), c + 1, memory_order=ct.MemoryOrder.RELEASE)

    # 3. y for the chunk's rows, as compute_out forms it (see compute_out.py for the decay factorisation).
    if SBF:
        s_op = ct.transpose(s_in.astype(mma_dtype))
    else:
        s_op = ct.transpose(s_in).astype(ct.tfloat32)
    dv = ct.zeros((1, TP), dtype=ct.float32)
    if has_d == 1:
        dv = dv + ct.load(D, (h, 0), shape=()).astype(ct.float32)
    if has_d == 2:
        dv = load_tile(D, (h, pt), (1, TP), CHK).astype(ct.float32)
    rows = ct.arange(BL, dtype=ct.int32)
    causal = rows[:, None] >= rows[None, :]
    for m in range(n_sub):
        rb = c * blocks_per_chunk + m
        cs_i = ct.load(dA_cumsum, (b, h, c, m), shape=(1, 1, 1, BL), check_bounds=False).reshape((BL,))
        dt_i = ct.load(dt_out, (b, h, c, m), shape=(1, 1, 1, BL), check_bounds=False).reshape((BL,))
        csl_s = ct.extract(cs_i, index=(0,), shape=(1,)).reshape(()) * LOG2E
        keep = causal
        if HAS_SEQ:
            seq_i = load_tile(seq_idx, (b, rb), (1, BL), CHK).reshape((BL,))
            keep = keep & (seq_i[:, None] == seq_i[None, :])
        ci = load_tile(C, (b, rb, g, 0), (1, BL, 1, NT), CHK).reshape((BL, NT))
        xi = load_tile(x, (b, rb, h, pt), (1, BL, 1, TP), CHK).reshape((BL, TP))
        if SBF:
            acc = ct.mma(ci, s_op, ct.zeros((BL, TP), dtype=ct.float32))
        else:
            acc = ct.mma(ci.astype(ct.float32).astype(ct.tfloat32), s_op, ct.zeros((BL, TP), dtype=ct.float32))
        if HAS_SEQ:
            acc = acc * ct.where(seq_i == seq_prev, exp2(csl_s), 0.0)[:, None]
        else:
            acc = acc * exp2(csl_s)
        for jb in range(m):
            cbt = ct.load(cb, (b, c, g, m, jb), shape=(1, 1, 1, BL, BL), check_bounds=False).reshape((BL, BL))
            cs_j = ct.load(dA_cumsum, (b, h, c, jb), shape=(1, 1, 1, BL), check_bounds=False).reshape((BL,))
            dt_j = ct.load(dt_out, (b, h, c, jb), shape=(1, 1, 1, BL), check_bounds=False).reshape((BL,))
            wgt = scale_by(cbt, (exp2(csl_s - cs_j * LOG2E) * dt_j)[None, :])
            if HAS_SEQ:
                seq_j = load_tile(seq_idx, (b, c * blocks_per_chunk + jb), (1, BL), CHK).reshape((BL,))
                wgt = ct.where(seq_i[:, None] == seq_j[None, :], wgt, 0.0)
            xj = load_tile(x, (b, c * blocks_per_chunk + jb, h, pt), (1, BL, 1, TP), CHK).reshape((BL, TP))
            acc = ct.mma(wgt.astype(mma_dtype), xj.astype(mma_dtype), acc)
        acc = acc * exp2(cs_i * LOG2E - csl_s)[:, None]
        cbd = ct.load(cb, (b, c, g, m, m), shape=(1, 1, 1, BL, BL), check_bounds=False).reshape((BL, BL))
        wgt = scale_by(cbd, diag_decay(cs_i, keep) * dt_i[None, :])
        acc = ct.mma(wgt.astype(mma_dtype), xi.astype(mma_dtype), acc)
        if has_d != 0:
            acc = acc + xi.astype(ct.float32) * dv
        if has_z != 0:
            zi = load_tile(z, (b, rb, h, pt), (1, BL, 1, TP), CHK).reshape((BL, TP))
            acc = acc * silu(zi.astype(ct.float32))
        ct.store(y, (b, rb, h, pt), acc.astype(y.dtype).reshape((1, BL, 1, TP)))
