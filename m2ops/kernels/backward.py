"""Launchers of the backward kernels, with the reference backward functions' signatures (chunked_backward.py):
outputs in their inputs' dtypes, contiguous, never aliasing an input; no host synchronisation.

Callers have decided that the kernels serve the inputs (ops.dispatch.kernels_serve; the fwd_pass_state_bwd op also
keeps a non-empty g_varlen with cu_seqlens, whose backward has no kernel yet, on the reference).

m2ops/kernels/__init__.py exports these as the CUDA implementations of the *_bwd ops; tests/tile_emulator.py
runs them on the CPU in CI (tests/test_emulated_backward.py) and tests/gpu/test_backward_kernels.py on a GPU.
"""

from __future__ import annotations

import functools

import torch

from ..meta.shapes import cb_shape, g_local_dtype, num_chunks
from ..reference import chunked_backward as ref_bwd
from . import config, runtime
from .common import STATE_BLOCKS, TILE_H_BWD, TILE_N, TILE_P, cdiv, sub_block
from .forward import compute_out, fwd_pass_state
from .runtime import as_dtype, common_dtype, d_per_channel, dtype_name, dummy
from .specialise import backward_walk_block, chunk_cb_constants, hinted_kernel, state_passing_checks


# The backward kernels launched through hinted_kernel (ct.kernel hints from launch's table, keyed by
# their token block): the matrix-heavy ones, whose register use the occupancy hint trades against spills.
HINTED = ("out_bwd_dx", "out_bwd_dcbw", "out_bwd_dcdb", "out_bwd_dstates", "chunk_state_bwd_x", "chunk_state_bwd_b")


def chunk_cumsum_bwd_constants(chunk_size: int) -> dict:
    return dict(L=chunk_size, BH=TILE_H_BWD)


# gcarry_c = <gS_{c+1}, S_c> in state_passing_bwd's walk (a block sum per chunk, which synchronises the program at
# every step) or apart from it, in state_carry_grad_kernel over all chunks at once. On an H200 (B=1, H=80, bf16,
# fwd+bwd ms, measure/backward_scan.py --variants "separate carry,carry in walk"), apart / in the walk:
# T=64K dstate 64 6.91 / 7.38 (walk block 512), dstate 128 8.43 / 8.40 (block 1024), dstate 256 11.38 / 11.08,
# dstate 512 18.29 / 17.61, T=16K dstate 512 4.81 / 4.64. config.current().separate_carry_grad (None: the rule
# below; M2OPS_BWD_SEPARATE_CARRY=1 / 0 forces one way) decides.
# The largest walk block (backward_walk_block) at which the sum is taken apart from the walk.
SEPARATE_CARRY_MAX_BLOCK = 512


def separate_carry_grad(block: int) -> bool:
    """Whether gcarry is formed apart from the walk, given the walk's block of state elements per program."""
    forced = config.current().separate_carry_grad
    if forced is not None:
        return forced
    return block <= SEPARATE_CARRY_MAX_BLOCK


def carry_block(state_elems: int) -> int:
    """state_carry_grad_kernel's step over one state: the largest of STATE_BLOCKS within it, so that a small
    state is read in one step (at T=64K, dstate 64: 0.31 ms in 4 steps of 1024, 0.28 in one of 4096)."""
    fits = [blk for blk in STATE_BLOCKS if blk <= state_elems]
    return max(fits) if fits else min(STATE_BLOCKS)


def state_passing_bwd_constants(block: int, has_seq: bool, carry_in_walk: bool = True, check: bool = True) -> dict:
    """check: bounds-checked loads in the walk without gcarry (state_passing_checks says when needed)."""
    return dict(BLK=block, HAS_SEQ=bool(has_seq), GC=bool(carry_in_walk), CHK=bool(check))


def chunk_state_bwd_w_constants(chunk_size: int, has_seq: bool) -> dict:
    return dict(L=chunk_size, HAS_SEQ=bool(has_seq))


def chunk_state_bwd_constants(chunk_size: int, has_seq: bool, dtype: str = "float32") -> dict:
    """The chunk size itself is a run-time argument of these kernels (it only enters index arithmetic); only
    the token block BL it implies is a constant. LOWP: the products in bfloat16 for bfloat16 activations."""
    return dict(BL=sub_block(chunk_size), TP=TILE_P, TN=TILE_N, HAS_SEQ=bool(has_seq), LOWP=dtype == "bfloat16")


def chunk_cumsum_bwd(g_dt_out, g_dA_cumsum, dt, A, dt_bias, chunk_size, dt_softplus, dt_min, dt_max):
    b, T, h = dt.shape
    nchunks = num_chunks(T, chunk_size)
    dev = dt.device
    n_hblocks = cdiv(h, TILE_H_BWD)
    g_dt = torch.empty((b, T, h), dtype=dt.dtype, device=dev)
    g_A_part = torch.empty((b, nchunks, h), dtype=torch.float32, device=dev)
    g_bias_part = torch.empty((b, nchunks, h), dtype=torch.float32, device=dev)
    A32 = as_dtype(A, torch.float32)
    bias = as_dtype(dt_bias, torch.float32) if dt_bias is not None else A32
    k = chunk_cumsum_bwd_constants(chunk_size)
    runtime.launch((nchunks * n_hblocks, b, 1), hinted_kernel("chunk_cumsum_bwd", "float32", chunk_size),
            (as_dtype(g_dt_out, torch.float32), as_dtype(g_dA_cumsum, torch.float32), as_dtype(dt, dt.dtype), A32, bias,
             g_dt, g_A_part, g_bias_part,
             T, n_hblocks, int(dt_bias is not None), int(bool(dt_softplus)), float(dt_min), float(dt_max),
             k["L"], k["BH"]))
    g_A = g_A_part.sum((0, 1)).to(A.dtype)
    if dt_bias is None:
        return g_dt, g_A, g_dt_out.new_empty((0,))
    return g_dt, g_A, g_bias_part.sum((0, 1)).to(dt_bias.dtype)


def fwd_pass_state_bwd(g_states, g_final, g_varlen, x, B, dt_out, dA_cumsum, initial_states, seq_idx,
                       cu_seqlens):
    """The fwd_pass_state op's backward: the entering states again with the forward kernels, then the two
    stages below (no per-sequence states' gradient: callers keep that on the reference)."""
    states, _, _ = fwd_pass_state(x, B, dt_out, dA_cumsum, initial_states, seq_idx, None)
    g_local, g_carry, g_init = state_passing_bwd(g_states, g_final, states, dA_cumsum, seq_idx,
                                                 g_local_dtype(x.dtype, B.dtype, dA_cumsum.dtype))
    del states
    out = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (x, B, dt_out, dA_cumsum))
    _chunk_state_bwd(g_local, g_carry, x, B, dt_out, dA_cumsum, seq_idx, out, add_into=False)
    g_x, g_B, g_dt, g_cs = out
    if initial_states is None:
        return g_x, g_B, g_dt, g_cs, g_states.new_empty((0,))
    return g_x, g_B, g_dt, g_cs, g_init.to(initial_states.dtype)


def state_passing_bwd(g_states, g_final, states, dA_cumsum, seq_idx, g_local_dtype):
    """The reverse recurrence: (g_local in g_local_dtype, g_carry (b, h, c) and g_init (b, h, p, n) in float32).
    states: float32, or the forward's bfloat16 copy (m2ops/ops/eager.py), which the walk widens on load."""
    b, h, nchunks, L = dA_cumsum.shape
    p, n = g_final.shape[-2:]
    dev = g_final.device
    csk = as_dtype(dA_cumsum, torch.float32)
    has_seq = seq_idx is not None
    seq = as_dtype(seq_idx, torch.int32) if has_seq else dummy(csk, torch.int32, 2)
    T = seq_idx.shape[1] if has_seq else nchunks * L  # (read only with seq_idx)
    states = (states if states.dtype == torch.bfloat16 else as_dtype(states, torch.float32)).contiguous()
    pn = p * n
    blk = backward_walk_block(b, h, pn, dev)
    n_blocks = cdiv(pn, blk)
    g_local = torch.empty((b, nchunks, h, p, n), device=dev, dtype=g_local_dtype)
    separate = separate_carry_grad(blk)
    # gcarry's shares: one per walk block, or one per chunk from state_carry_grad_kernel
    g_carry_part = torch.empty((b, h, nchunks, 1 if separate else n_blocks), dtype=torch.float32, device=dev)
    g_init = torch.empty((b, h, p, n), dtype=torch.float32, device=dev)
    # (the walk with gcarry loads bounds-checked whatever the block)
    ks = state_passing_bwd_constants(blk, has_seq, carry_in_walk=not separate,
                                     check=not separate or state_passing_checks(blk, pn))
    runtime.launch((h * n_blocks, b, 1), hinted_kernel("state_passing_bwd", "float32", L),
            (states.view(b, nchunks, h, pn), as_dtype(g_states, torch.float32).reshape(b, nchunks, h, pn),
             as_dtype(g_final, torch.float32).reshape(b, h, pn), csk, seq,
             g_local.view(b, nchunks, h, pn), g_carry_part, g_init.view(b, h, pn),
             T, nchunks, n_blocks, L, ks["BLK"], ks["HAS_SEQ"], ks["GC"], ks["CHK"]))
    if not ks["GC"]:
        cblk = carry_block(pn)
        runtime.launch((nchunks * h, b, 1), hinted_kernel("state_carry_grad", "float32", L),
                (states.view(b, nchunks, h, pn), g_local.view(b, nchunks, h, pn), g_carry_part, h,
                 cdiv(pn, cblk), cblk))
    # (one share per chunk where state_carry_grad formed them: the sum would be a copy)
    g_carry = g_carry_part.view(b, h, nchunks) if g_carry_part.shape[-1] == 1 else g_carry_part.sum(-1)
    return g_local, g_carry, g_init


def chunk_state_bwd(g_local, g_carry, x, B, dt_out, dA_cumsum, seq_idx, g_x, g_B, g_dt, g_cs):
    """Adds the gradients of x, B, dt_out and dA_cumsum through the chunks' local states into g_x, g_B, g_dt and
    g_cs, in place (each kernel reads a tile of them before it writes that tile)."""
    _chunk_state_bwd(g_local, g_carry, x, B, dt_out, dA_cumsum, seq_idx, (g_x, g_B, g_dt, g_cs))


def _accumulator(acc, dtype, add_into):
    """acc itself where the kernels can read and write it in place (dtype, contiguous), else a copy of it in dtype
    (uninitialised where nothing is added into it)."""
    if acc.dtype == dtype and acc.is_contiguous():
        return acc
    if add_into:
        return acc.to(dtype, memory_format=torch.contiguous_format)
    return torch.empty(acc.shape, dtype=dtype, device=acc.device)


def _chunk_state_bwd(g_local, g_carry, x, B, dt_out, dA_cumsum, seq_idx, out, add_into=True):
    """chunk_state_bwd into out = (g_x, g_B, g_dt, g_cs); add_into=False: their contents are not read, only
    overwritten."""
    L = dt_out.shape[-1]
    b, T, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    nchunks = dt_out.shape[2]
    dev = x.device
    mma_dtype = common_dtype(x, B)
    xk, Bk = as_dtype(x, mma_dtype), as_dtype(B, mma_dtype)
    dtk, csk = as_dtype(dt_out, torch.float32), as_dtype(dA_cumsum, torch.float32)
    has_seq = seq_idx is not None
    seq = as_dtype(seq_idx, torch.int32) if has_seq else dummy(x, torch.int32, 2)
    # The gradients are read and written in the dtypes the kernels compute in (specs.py's signatures): through
    # a copy where the caller's are not in them, or not contiguous.
    dtypes = (mma_dtype, mma_dtype, torch.float32, torch.float32)
    work = [_accumulator(t, d, add_into) for t, d in zip(out, dtypes)]
    g_xk, g_Bk, g_dtk, g_csk = work

    # Per token: g_x and g_w (per headdim tile), then g_B per group.
    k = chunk_state_bwd_constants(L, has_seq, dtype_name(mma_dtype))
    n_ptiles, n_ntiles = cdiv(p, TILE_P), cdiv(n, TILE_N)
    # (rows past the last token are left unwritten: chunk_state_bwd_w reads none of them)
    g_w_part = torch.empty((b, h, n_ptiles, nchunks * L), dtype=torch.float32, device=dev)
    hinted = functools.partial(hinted_kernel, dtype=dtype_name(mma_dtype), chunk_size=k["BL"])
    runtime.launch((nchunks * h * n_ptiles, b, 1), hinted("chunk_state_bwd_x"),
            (xk, Bk, dtk, csk, seq, g_local, g_xk, g_w_part,
             T, h, h // g, n_ptiles, n_ntiles, int(add_into),
             L, k["BL"], k["TP"], k["TN"], k["HAS_SEQ"], k["LOWP"]))
    runtime.launch((nchunks * (L // k["BL"]) * g * n_ntiles, b, 1), hinted("chunk_state_bwd_b"),
            (xk, dtk, csk, seq, g_local, g_Bk,
             T, g, h // g, n_ptiles, n_ntiles, int(add_into), L, k["BL"], k["TP"], k["TN"], k["HAS_SEQ"], k["LOWP"]))

    # g_w and g_carry -> g_dt and g_dA_cumsum, (b, h, c, L): one launch for the reference's elementwise formulas.
    runtime.launch((nchunks * h, b, 1), hinted_kernel("chunk_state_bwd_w", "float32", L),
                   (g_w_part, csk, dtk, as_dtype(g_carry, torch.float32), seq, g_dtk, g_csk, T, h, n_ptiles,
                    int(add_into), *chunk_state_bwd_w_constants(L, has_seq).values()))
    for dst, src in zip(out, work):
        if dst is not src:
            dst.copy_(src)


# compute_out_bwd's G (dL/dy before the gate) passed to its kernels in bfloat16 for bfloat16 inputs: G is the
# caller's dy itself without z (no rounding, no copy), dy times the gate's derivative rounded once with z; the
# kernels widen it to float32 on load, so only the bytes they read change (G is the largest array five of
# the six kernels read).
G_IN_BF16 = True


def g_dtype_name(dtype: str) -> str:
    """dtype of compute_out_bwd's G for activations of dtype."""
    return "bfloat16" if (G_IN_BF16 and dtype == "bfloat16") else "float32"


def g_local_dtype_name(dtype: str) -> str:
    """dtype of glocal for activations of dtype (meta.shapes.g_local_dtype)."""
    act = getattr(torch, dtype)
    return dtype_name(g_local_dtype(act, act, torch.float32))


def out_bwd_sums_constants(chunk_size: int) -> dict:
    return dict(L=chunk_size, BL=sub_block(chunk_size))


def compute_out_bwd_constants(chunk_size: int, has_seq: bool, dtype: str = "float32") -> dict:
    """As chunk_state_bwd_constants: the chunk size is a run-time argument. LOWP: the products with G in
    bfloat16, where the activations and G are bfloat16 (compute_out_bwd.py)."""
    return dict(BL=sub_block(chunk_size), TP=TILE_P, TN=TILE_N, HAS_SEQ=bool(has_seq),
                LOWP=g_dtype_name(dtype) == "bfloat16")


# Programs per SM out_bwd_dcbw aims for: its (row block, column block, group) pairs are split over the group's
# heads until there are this many (at 4K tokens, chunk 256 and one group only 160 pairs hold work).
DCBW_PROGRAMS_PER_SM = 4


def dcbw_split(pairs: int, heads_per_group: int, device) -> int:
    """How many programs share the heads of one (pair, group) in out_bwd_dcbw (each with cdiv(heads, n))."""
    want = max(1, min(heads_per_group, cdiv(DCBW_PROGRAMS_PER_SM * runtime.sm_count(device), max(pairs, 1))))
    return cdiv(heads_per_group, cdiv(heads_per_group, want))


def compute_out_bwd(g_y, x, dt_out, dA_cumsum, C, B, states, D, z, seq_idx, g_states_dtype=None):
    """The compute_out op's backward. states: float32, or bfloat16 with bfloat16 activations (the forward's own
    copy, m2ops/ops/eager.py), read as is: out_bwd_dcdb rounds them to bfloat16 for its product then anyway.
    g_states_dtype: the dtype of the states' gradient (default: the states' own)."""
    L = dt_out.shape[-1]
    b, T, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    nchunks = dt_out.shape[2]
    dev = x.device
    mma_dtype = common_dtype(x, B, C, z)
    xk, Bk, Ck = as_dtype(x, mma_dtype), as_dtype(B, mma_dtype), as_dtype(C, mma_dtype)
    dtk, csk = as_dtype(dt_out, torch.float32), as_dtype(dA_cumsum, torch.float32)
    seq = as_dtype(seq_idx, torch.int32) if seq_idx is not None else dummy(x, torch.int32, 2)
    k = compute_out_bwd_constants(L, seq_idx is not None, dtype_name(mma_dtype))
    sk = states if (states.dtype == torch.bfloat16 and k["LOWP"]) else as_dtype(states, torch.float32)
    BL, nb = k["BL"], L // k["BL"]
    n_rblocks = cdiv(T, BL)
    n_ptiles, n_ntiles = cdiv(p, TILE_P), cdiv(n, TILE_N)
    consts4 = (L, k["BL"], k["TP"], k["TN"], k["HAS_SEQ"], k["LOWP"])
    consts3 = (L, k["BL"], k["TP"], k["HAS_SEQ"], k["LOWP"])
    hinted = functools.partial(hinted_kernel, dtype=dtype_name(mma_dtype), chunk_size=BL)

    # D and z, elementwise: G = dL/dy1 (y1 = the output before the gate, recomputed by compute_out).
    gy = g_y
    g_D = g_z = None
    if z is not None:
        y1 = compute_out(x, dt_out, dA_cumsum, C, B, states, D, None, seq_idx).float()
        g_z, gy = ref_bwd.gate_grads(g_y.float(), y1, z.float())
        g_z = g_z.to(z.dtype)
    G = gy.to(getattr(torch, g_dtype_name(dtype_name(mma_dtype)))).contiguous()

    # C . B^T per (chunk, group), as in the forward.
    cb = torch.empty(cb_shape(b, T, g, L), dtype=torch.float32, device=dev)
    kc = chunk_cb_constants(L)
    runtime.launch((n_rblocks * nb, g, b), hinted_kernel("chunk_cb", dtype_name(mma_dtype), L),
                   (Ck, Bk, cb, n, kc["L"], kc["BL"], kc["TN"], kc["DIAG"]))

    # g_x, and per headdim tile dt's gradient (zero past the last block the grid covers).
    g_x = torch.empty((b, T, h, p), dtype=mma_dtype, device=dev)
    g_D_part = (torch.empty((b, n_rblocks, h, p), dtype=torch.float32, device=dev) if D is not None
                else dummy(x, torch.float32, 4))
    g_dt_part = torch.empty((b, h, n_ptiles, nchunks * L), dtype=torch.float32, device=dev)
    runtime.launch((n_rblocks * h * n_ptiles, b, 1), hinted("out_bwd_dx"),
                   (G, dtk, csk, cb, seq, xk, d_per_channel(D, h, p, x), g_x, g_D_part, g_dt_part,
                    T, h, h // g, n_ptiles, int(D is not None), *consts3))

    # dCB and the row and column parts of the intra-chunk dA_cumsum from one G x^T per (pair of blocks, head)
    # (slots no pair writes are left as they are: out_bwd_sums reads none).
    p_cs = torch.empty((2, b, h, nb, nchunks * L), dtype=torch.float32, device=dev)
    n_split = dcbw_split(b * cdiv(n_rblocks * (nb + 1), 2) * g, h // g, dev)
    g_cb_part = torch.empty((b, n_split, nchunks, g, L, L), dtype=torch.float32, device=dev)
    runtime.launch((n_rblocks * nb * g * n_split, b, 1), hinted("out_bwd_dcbw"),
                   (G, xk, dtk, csk, cb, seq, g_cb_part, p_cs[0], p_cs[1], T, g, h // g, n_ptiles, n_split, *consts3))
    g_cb = g_cb_part[:, 0] if n_split == 1 else g_cb_part.sum(1)
    # Scratch is released as soon as its last reader is queued, so that the allocator reuses it for the arrays
    # below (the layer's training step peaks in this function: measure/memory_replay.py).
    del cb, g_cb_part

    g_C = torch.empty((b, T, g, n), dtype=mma_dtype, device=dev)
    g_B = torch.empty((b, T, g, n), dtype=mma_dtype, device=dev)
    g_cs_inter = torch.empty((b, h, n_ntiles, n_rblocks * BL), dtype=torch.float32, device=dev)
    runtime.launch((n_rblocks * g * n_ntiles, b, 1), hinted("out_bwd_dcdb"),
                   (G, csk, Ck, Bk, sk, seq, g_cb, g_C, g_B, g_cs_inter, T, g, h // g, n_ptiles, n_ntiles, *consts4))
    del g_cb
    # dt's and dA_cumsum's shares summed, one launch
    g_dt = torch.empty((b, h, nchunks, L), dtype=torch.float32, device=dev)
    g_cs = torch.empty((b, h, nchunks, L), dtype=torch.float32, device=dev)
    runtime.launch((nchunks * h, b, 1), hinted_kernel("out_bwd_sums", "float32", L),
                   (g_dt_part, p_cs, g_cs_inter, g_dt, g_cs, T, h, n_ptiles, n_ntiles,
                    *out_bwd_sums_constants(L).values()))
    del g_dt_part, p_cs, g_cs_inter

    g_S = torch.empty((b, nchunks, h, p, n), dtype=torch.float32, device=dev)
    runtime.launch((nchunks * h * n_ptiles * n_ntiles, b, 1), hinted("out_bwd_dstates"),
                   (G, csk, Ck, seq, g_S, T, h, h // g, n_ptiles, n_ntiles, *consts4))

    if D is not None:
        per_head = D.dim() == 1
        if z is not None and G.dtype != torch.float32:
            # G is the gated gradient rounded to 16 bits for the products; D's gradient, a sum over every token
            # whose random-signed terms cancel, keeps that rounding (about 1e-3 relative): form it from the
            # float32 G instead (one more pass over x).
            g_D = torch.einsum("bthp,bthp->h" if per_head else "bthp,bthp->hp", gy, x.to(gy.dtype))
        else:
            g_D = g_D_part.sum((0, 1, 3) if per_head else (0, 1))  # (h) or (h, p)
        g_D = g_D.to(D.dtype)
    g_dt, g_cs = as_dtype(g_dt, dt_out.dtype), as_dtype(g_cs, dA_cumsum.dtype)
    # Absent gradients are two distinct empty tensors: a custom op's outputs must not alias each other.
    g_S = g_S.to(g_states_dtype or states.dtype)
    return (as_dtype(g_x, x.dtype), g_dt, g_cs, as_dtype(g_C, C.dtype), as_dtype(g_B, B.dtype), g_S,
            g_D if g_D is not None else g_y.new_empty((0,)), g_z if g_z is not None else g_y.new_empty((0,)))
