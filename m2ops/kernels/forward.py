"""Launchers of the three forward ops of the design: chunk_cumsum, fwd_pass_state (chunk_state then
state_passing; varlen_states with cu_seqlens) and compute_out (chunk_cb then compute_out or compute_out_carry);
and start_state_out, the output term of packed sequences' own start states (start_states.py).
Each picks the specialisation (specialise.py), allocates the outputs, and launches on the current stream: no host
synchronisation and no branching on tensor values, so they run under CUDA-graph capture and inside torch.compile
graphs. What a launch decides from sizes, dtypes and options is a plan (cumsum_plan, state_plan, out_plan) kept per
such key; run_cumsum, run_states and run_out launch a plan, and planned.py's whole forward reuses them.

Callers have decided that the kernels serve the inputs (ops.dispatch.kernels_serve: a CUDA device the kernels
run on, their dtypes, one of their chunk sizes); elsewhere the ops run the reference.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..meta.shapes import cb_shape, cumsum_shape, final_states_shape, num_chunks, states_shape, varlen_states_shape
from . import config, runtime, start_states
from .common import TILE_N, TILE_P, cdiv
from .runtime import Step, as_dtype, common_dtype, d_arg, dense, dtype_name, dummy, planned, step
from .specialise import (bounds_checked, cb_dtype_name, chunk_cb_constants, chunk_cumsum_constants,
                         chunk_state_constants, chunk_state_heads, chunk_state_hints, chunk_state_tn,
                         compute_out_constants, forward_state_block, fused_cumsum_can_run, heads_per_program, hinted,
                         hinted_kernel, local_dtype_names, out_carry_applies, out_carry_constants, out_carry_hints,
                         state_passing_checks, state_passing_constants, varlen_states_constants)


@planned
def cumsum_plan(b, T, h, L, has_bias, dt_softplus, dt_min, dt_max, device) -> Step:
    k = chunk_cumsum_constants(L)
    n_hblocks = cdiv(h, k["BH"])
    return step((num_chunks(T, L) * n_hblocks, b, 1), hinted_kernel("chunk_cumsum", "float32", L),
                 (T, n_hblocks, int(has_bias), int(bool(dt_softplus)), float(dt_min), float(dt_max),
                  k["L"], k["BH"]), device)


def chunk_cumsum(dt, A, dt_bias, chunk_size: int, dt_softplus: bool, dt_min: float, dt_max: float):
    b, T, h = dt.shape
    A32 = as_dtype(A, torch.float32)
    bias = as_dtype(dt_bias, torch.float32) if dt_bias is not None else A32
    step = cumsum_plan(b, T, h, chunk_size, dt_bias is not None, bool(dt_softplus), float(dt_min), float(dt_max),
                        dt.device)
    return run_cumsum(step, cumsum_shape(b, T, h, chunk_size), dense(dt), A32, bias)


def run_cumsum(step: Step, shape: tuple, dt, A32, bias, scratch=None, go=Step.launch):
    """chunk_cumsum's outputs allocated (or scratch's pair of float32 buffers of shape taken) and its kernel
    launched by go, on arguments already in the kernel's form."""
    if scratch is None:
        scratch = (torch.empty(shape, dtype=torch.float32, device=dt.device),
                   torch.empty(shape, dtype=torch.float32, device=dt.device))
    dt_out, dA_cumsum = scratch
    go(step, (dt, A32, bias, dt_out, dA_cumsum))
    return dt_out, dA_cumsum


class StatePlan(NamedTuple):
    states_shape: tuple
    local_dtype: torch.dtype  # chunk_state's output (the local states)
    separate: bool            # the entering states in their own array of entering_dtype
    chunk_state: Step
    state_passing: Step
    # chunk_state's launch also runs chunk_cb's programs and does chunk_cumsum's work (the planned forward,
    # config.current().fused_cumsum): it takes C, cb, dt, A and dt_bias too
    fused_cumsum: bool = False


def cb_programs(out) -> tuple:
    """(programs per group, diagonal blocks only, row block) of the chunk_cb launch of OutPlan out: what
    state_plan needs to run those programs in chunk_state's launch."""
    n, L, BL, TN, diag = out.chunk_cb.tail
    return out.chunk_cb.grid[0], bool(diag), BL


@planned
def state_plan(b, T, h, p, g, n, L, dname, has_seq, has_init, state_block, separate, entering_dtype,
                device, cb=None, dt_args=None) -> StatePlan:
    """cb, dt_args: cb_programs(out) and chunk_cumsum's (has_bias, dt_softplus, dt_min, dt_max), to run chunk_cb's
    programs and chunk_cumsum's work in chunk_state's launch where that is built (fused_cumsum_can_run) and the
    row blocks agree; or None."""
    nchunks = num_chunks(T, L)
    local_bf16 = separate and entering_dtype == torch.bfloat16 and "bfloat16" in local_dtype_names(dname, L)
    n_ptiles = cdiv(p, TILE_P)
    # 1. Each chunk's local state (from zero) into its slot of states: parallel over chunks.
    hb = heads_per_program(chunk_state_heads(dname, L, n), h // g)
    k = bounds_checked(chunk_state_constants(L, has_seq, heads=hb, tn=chunk_state_tn(n)), T, p, n)
    n_state_tiles = cdiv(n, k["TN"])
    n_programs = nchunks * (h // k["HB"]) * n_ptiles * n_state_tiles
    hints = tuple(sorted(chunk_state_hints(dname, L, k["HB"]).items()))
    consts = (k["L"], k["BL"], k["TP"], k["TN"], k["HAS_SEQ"], k["CHK"], k["HB"])
    fused_cumsum = (cb is not None and dt_args is not None and cb[2] == k["BL"] and not has_seq
                    and fused_cumsum_can_run(L, k["HB"]))
    if fused_cumsum:
        per_group, diag, _ = cb
        has_bias, softplus, dt_min, dt_max = dt_args
        chunk_state = step((per_group * g + n_programs, b, 1), hinted("chunk_state_cumsum_cb", hints),
                            (T, h, h // g, n_state_tiles, n_ptiles, per_group, n, int(diag), int(has_bias),
                             int(softplus), float(dt_min), float(dt_max), k["L"], k["BL"], k["TP"], k["TN"],
                             k["CHK"], k["HB"]), device)
    else:
        chunk_state = step((n_programs, b, 1), hinted("chunk_state", hints),
                            (T, h, h // g, n_state_tiles, n_ptiles, *consts), device)
    # 2. The recurrence over chunks, in place (local -> entering state), on flat blocks of each head's state.
    blk = state_block or forward_state_block()
    n_blocks = cdiv(p * n, blk)
    ks = state_passing_constants(blk, has_seq, separate, state_passing_checks(blk, p * n))
    state_passing = step((h * n_blocks, b, 1), hinted_kernel("state_passing", "float32", L),
                          (T, nchunks, n_blocks, int(has_init), L, ks["BLK"], ks["HAS_SEQ"], ks["LAT"], ks["SEP"],
                           ks["CHK"]),
                          device)
    return StatePlan(states_shape(b, nchunks, h, p, n), torch.bfloat16 if local_bf16 else torch.float32,
                      separate, chunk_state, state_passing, fused_cumsum)


def fwd_pass_state(x, B, dt_out, dA_cumsum, initial_states, seq_idx, cu_seqlens, state_block=None,
                   entering_dtype=None, varlen_out=True):
    """state_block: the state_passing block size (default: forward_state_block()). entering_dtype
    (bfloat16; without cu_seqlens): the entering states are returned in that dtype, written by state_passing
    to their own buffer (for compute_out alone: chunk_scan's two-op path). varlen_out=False
    (without cu_seqlens): None in place of the empty varlen states the op returns."""
    L = dt_out.shape[-1]
    b, T, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    dev = x.device
    mma_dtype = common_dtype(x, B)
    xk, Bk = as_dtype(x, mma_dtype), as_dtype(B, mma_dtype)
    dtk, csk = as_dtype(dt_out, torch.float32), as_dtype(dA_cumsum, torch.float32)
    separate = entering_dtype is not None and cu_seqlens is None
    plan = state_plan(b, T, h, p, g, n, L, dtype_name(mma_dtype), seq_idx is not None,
                       initial_states is not None, state_block, separate, entering_dtype if separate else None,
                       dev)
    seq = as_dtype(seq_idx, torch.int32) if seq_idx is not None else dummy(x, torch.int32, 2)
    init = as_dtype(initial_states, torch.float32) if initial_states is not None else None
    states, final_states = run_states(plan, entering_dtype if separate else None, xk, Bk, dtk, csk, seq, init)
    # (with separate entering states, states is them; then there are no cu_seqlens, and varlen_states, which reads
    # float32 states, does not run)

    if cu_seqlens is None and not varlen_out:
        return states, final_states, None
    varlen = torch.empty(varlen_states_shape(cu_seqlens, h, p, n), dtype=torch.float32, device=dev)
    if cu_seqlens is not None:
        nseq = cu_seqlens.shape[0] - 1
        n_ptiles, n_ntiles = cdiv(p, TILE_P), cdiv(n, TILE_N)
        kv = varlen_states_constants(L)
        runtime.launch((nseq, h, n_ptiles * n_ntiles), hinted_kernel("varlen_states", dtype_name(mma_dtype), L),
                (xk, Bk, dtk, csk, states, as_dtype(cu_seqlens, torch.int32), varlen,
                 h // g, n_ntiles, kv["L"], kv["BL"], kv["TP"], kv["TN"]))
    return states, final_states, varlen


def run_states(plan: StatePlan, entering_dtype, xk, Bk, dtk, csk, seq, init, scratch=None, go=Step.launch,
                cb_arrays=None, dt_arrays=None):
    """fwd_pass_state's buffers allocated and its two kernels launched by go, on arguments already in the kernels'
    form (init: float32 initial states or None). scratch: the (local, entering) state buffers, given (entering
    None unless plan.separate). Returns the states entering every chunk (in their own entering_dtype array when
    plan.separate, else in place of the local states) and the final states. cb_arrays: (C, cb) and dt_arrays:
    (dt, A, dt_bias or A) as chunk_cumsum takes them, for a plan whose chunk_state launch also forms C . B^T and
    writes dtk and csk (plan.fused_cumsum)."""
    b, nchunks, h, p, n = plan.states_shape
    pn, dev = p * n, xk.device
    if scratch is None:
        scratch = (torch.empty(plan.states_shape, dtype=plan.local_dtype, device=dev),
                   torch.empty(plan.states_shape, dtype=entering_dtype, device=dev) if plan.separate else None)
    states, entering = scratch
    final_states = torch.empty(final_states_shape(b, h, p, n), dtype=torch.float32, device=dev)
    if plan.fused_cumsum:
        go(plan.chunk_state, (xk, Bk, *dt_arrays, dtk, csk, states, *cb_arrays))
    else:
        go(plan.chunk_state, (xk, Bk, dtk, csk, seq, states))
    init = init.reshape(b, h, pn) if init is not None else dummy(xk, torch.float32, 3)
    go(plan.state_passing, (states.view(b, nchunks, h, pn), csk, seq, init, final_states.view(b, h, pn),
                            entering.view(b, nchunks, h, pn) if plan.separate else dummy(xk, torch.float32, 4)))
    return (entering if plan.separate else states), final_states


class OutPlan(NamedTuple):
    cb_shape: tuple
    cb_dtype: torch.dtype
    states_bf16: bool  # compute_out reads bfloat16 entering states as they are (else float32)
    chunk_cb: Step
    compute_out: Step
    carry: bool        # compute_out is compute_out_carry's kernel (it also reads B)


@planned
def out_plan(b, T, h, p, g, n, L, dname, has_seq, states_dtype, has_d, has_z, device) -> OutPlan:
    k = bounds_checked(compute_out_constants(L, has_seq, dtype=dname), T, p, n)
    BL = k["BL"]
    n_rblocks = cdiv(T, BL)
    carry = out_carry_applies(n, L, T)
    if carry:
        k = bounds_checked(out_carry_constants(L, n, has_seq, dname), T, p, n)
        n_ptiles = cdiv(p, k["TP"])
        hints = tuple(sorted(out_carry_hints(dname, k["TN"]).items()))
        compute_out = step((cdiv(T, L) * h * n_ptiles, b, 1), hinted("compute_out_carry", hints),
                            (T, h, h // g, n_ptiles, has_d, int(has_z), int(config.current().out_reverse),
                             k["L"], k["BL"], k["TP"], k["TN"], k["HAS_SEQ"], k["CHK"], k["SBF"]), device)
    else:
        n_ptiles = cdiv(p, k["TP"])
        compute_out = step((n_rblocks * h * n_ptiles, b, 1), hinted_kernel("compute_out", dname, L),
                            (T, h, h // g, n, n_ptiles, has_d, int(has_z), int(config.current().out_reverse),
                             k["L"], k["BL"], k["TP"], k["TN"], k["HAS_SEQ"], k["CHK"], k["SBF"]), device)
    # C_i . B_j^T once per (chunk, group), lower-triangular blocks of compute_out's row block (the diagonal ones
    # for compute_out_carry); the output kernel reads it for every head.
    kc = chunk_cb_constants(L, BL, diag=carry)
    chunk_cb = step((n_rblocks * (1 if carry else L // BL), g, b), hinted_kernel("chunk_cb", dname, L),
                     (n, kc["L"], kc["BL"], kc["TN"], kc["DIAG"]), device)
    return OutPlan(cb_shape(b, T, g, L), getattr(torch, cb_dtype_name(dname)),
                    k["SBF"] and states_dtype == torch.bfloat16, chunk_cb, compute_out, carry)


def compute_out(x, dt_out, dA_cumsum, C, B, states, D, z, seq_idx):
    L = dt_out.shape[-1]
    b, T, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    dev = x.device
    mma_dtype = common_dtype(x, B, C, z)
    xk, Bk, Ck = as_dtype(x, mma_dtype), as_dtype(B, mma_dtype), as_dtype(C, mma_dtype)
    zk = as_dtype(z, mma_dtype) if z is not None else xk
    Dk, has_d = d_arg(D, x)
    seq = as_dtype(seq_idx, torch.int32) if seq_idx is not None else dummy(x, torch.int32, 2)
    plan = out_plan(b, T, h, p, g, n, L, dtype_name(mma_dtype), seq_idx is not None, states.dtype, has_d,
                     z is not None, dev)
    y = run_out(plan, xk, as_dtype(dt_out, torch.float32), as_dtype(dA_cumsum, torch.float32), Ck, Bk,
                 states if plan.states_bf16 else as_dtype(states, torch.float32), Dk, zk, seq)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def run_out(plan: OutPlan, xk, dtk, csk, Ck, Bk, states, Dk, zk, seq, cb=None, go=Step.launch, cb_done=False):
    """compute_out's buffers allocated (C . B^T's unless given as cb) and its two kernels launched by go, on
    arguments already in the kernels' form (cb_done: cb given and already formed, by a fused chunk_state launch:
    the output kernel alone). y comes out in xk's dtype."""
    if cb is None:
        cb = torch.empty(plan.cb_shape, dtype=plan.cb_dtype, device=xk.device)
    if not cb_done:
        go(plan.chunk_cb, (Ck, Bk, cb))
    y = torch.empty(xk.shape, dtype=xk.dtype, device=xk.device)
    go(plan.compute_out, (xk, dtk, csk, Ck, cb, states, Dk, zk, seq, y, Bk) if plan.carry
       else (xk, dtk, csk, Ck, cb, states, Dk, zk, seq, y))
    return y


def start_state_out(y, C, z, initial_states, dA_cumsum, cu_seqlens):
    """m2ops::start_state_out on the GPU: a copy of y with the term added (in y's dtype). C and z are read in their
    promoted dtype with y's (converted when they differ), the states in float32 or that dtype, dA_cumsum in float32,
    cu_seqlens as int32. One launch besides the copy; no host synchronisation."""
    _, T, h, p = y.shape
    g, n = C.shape[2], C.shape[3]
    act = common_dtype(y, C, z)
    out = y.to(act, memory_format=torch.contiguous_format, copy=True)
    nseq = initial_states.shape[0]
    if nseq > 1 and T > 0:
        L = dA_cumsum.shape[-1]
        k = start_states.start_state_out_constants(L)
        Ck = as_dtype(C, act)
        zk = as_dtype(z, act) if z is not None else dummy(y, act, 4)
        sk = dense(initial_states) if initial_states.dtype in (act, torch.float32) else as_dtype(
            initial_states, torch.float32)
        n_ptiles, n_ntiles = cdiv(p, k["TP"]), cdiv(n, k["TN"])
        runtime.launch((nseq - 1, h * n_ptiles, 1), hinted_kernel("start_state_out", dtype_name(act), 0),
                       (Ck, zk, sk, as_dtype(dA_cumsum, torch.float32), as_dtype(cu_seqlens, torch.int32), out,
                        h // g, p, n_ptiles, n_ntiles, int(z is not None), L, k["BL"], k["TP"], k["TN"]))
    return out if out.dtype == y.dtype else out.to(y.dtype)
