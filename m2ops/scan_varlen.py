"""mamba_chunk_scan_combined_varlen: the packed 3-D scan serving engines call for a batch of prefill sequences,
with one start state per sequence, a preallocated output, final states scattered into a state cache by slot,
the states at block boundaries for prefix caching (block_states.py), and chunk metadata prepared once per batch
on the host (prepare_varlen) so that the call reads no tensor values.

It is a thin layer over the route of mamba_chunk_scan_combined: the inputs gain a batch dimension of 1, and the
same ops run (chunk_cumsum, fwd_pass_state, compute_out; with start states, sequence_states.scan).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import block_states, ops, sequence_states
from .meta.validate import check_inputs, seq_idx_from_cu_seqlens, should_check_values
from .meta.varlen_validate import (WHERE, check_cu_seqlens_values, check_state_slots, check_varlen_inputs)
from .ops import dispatch


class VarlenMeta(NamedTuple):
    """What a batch's cu_seqlens decide, computed once on the host (prepare_varlen) and shared by every layer's
    call: with it a call reads no tensor values (no host synchronisation; CUDA-graph capturable)."""
    cu_seqlens: torch.Tensor  # (num_sequences + 1,) int32, on the device
    seq_idx: torch.Tensor     # (1, total_tokens) int32 sequence number of every token, on the device
    num_sequences: int
    total_tokens: int
    chunk_size: int           # the caller's chunk size
    index: Optional[sequence_states.SequenceIndex]  # for the chunk size calls run at on the device
    blocks: Optional[block_states.BlockIndex] = None  # with block_size: the prefix-caching boundaries


def prepare_varlen(cu_seqlens, chunk_size: int, device=None, *, block_size=None, context_lens=None) -> VarlenMeta:
    """Check cu_seqlens (a CPU tensor or a list of ints, read here) and derive what the calls of this batch need,
    on device (default: cu_seqlens' device). Call once per batch, outside CUDA-graph capture.

    block_size (prefix caching): also place the boundaries at which return_block_states=True returns states: every
    multiple of block_size tokens of each sequence's prompt, counting context_lens[k] tokens (default 0) before
    piece k (a continued prompt's earlier pieces). The result's .blocks.sequence and .blocks.position say, for each
    returned state, which sequence and how many prompt tokens it follows."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"m2ops.prepare_varlen: chunk_size must be a positive int; got {chunk_size!r}")
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0):
        raise ValueError(f"m2ops.prepare_varlen: block_size must be None or a positive int; got {block_size!r}")
    if context_lens is not None and block_size is None:
        raise ValueError("m2ops.prepare_varlen: context_lens needs block_size (it places the block boundaries)")
    if not isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = torch.as_tensor(cu_seqlens, dtype=torch.int32)
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"m2ops.prepare_varlen: cu_seqlens must be an integer tensor; got {cu_seqlens.dtype}")
    device = torch.device(device) if device is not None else cu_seqlens.device
    cu = cu_seqlens.cpu().to(torch.int32)
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError("m2ops.prepare_varlen: cu_seqlens must be 1-dimensional (num_sequences + 1,) with at least "
                         f"2 entries; got {tuple(cu.shape)}")
    T = int(cu[-1])
    check_cu_seqlens_values(cu, T)
    seq_idx = seq_idx_from_cu_seqlens(cu, T)
    run_chunk = dispatch.kernel_chunk_size(chunk_size, T, device)
    index = sequence_states.sequence_index(cu, seq_idx, T, run_chunk)
    index = sequence_states.SequenceIndex(run_chunk, *(t.to(device) for t in index[1:]))
    blocks = None
    if block_size is not None:
        blocks = block_states.block_index(cu.long(), _context_lens(context_lens, cu.shape[0] - 1), block_size, device)
    return VarlenMeta(cu.to(device), seq_idx.to(device), cu.shape[0] - 1, T, chunk_size, index, blocks)


def _context_lens(context_lens, nseq: int) -> torch.Tensor:
    """context_lens (None, a list or a tensor of nseq non-negative ints) -> a CPU int64 tensor (read here)."""
    if context_lens is None:
        return torch.zeros(nseq, dtype=torch.int64)
    c = torch.as_tensor(context_lens)
    if c.is_floating_point() or c.is_complex() or c.dtype == torch.bool:
        raise TypeError(f"m2ops.prepare_varlen: context_lens must hold integers; got {c.dtype}")
    if tuple(c.shape) != (nseq,):
        raise ValueError(f"m2ops.prepare_varlen: context_lens must be of shape (num_sequences,) = ({nseq},); got "
                         f"{tuple(c.shape)}")
    c = c.cpu().long()
    if nseq and int(c.min()) < 0:
        raise ValueError(f"m2ops.prepare_varlen: context_lens must be >= 0; got {c.tolist()}")
    return c


def mamba_chunk_scan_combined_varlen(x, dt, A, B, C, chunk_size, cu_seqlens, *, initial_states=None, D=None, z=None,
                                     dt_bias=None, dt_softplus=False, dt_limit=(0.0, float("inf")), out=None,
                                     state_dtype=None, state_cache=None, state_slots=None, has_initial_state=None,
                                     meta=None, return_block_states=False):
    """The Mamba-2 scan over packed sequences (a serving engine's prefill batch), one state per sequence.

    Args:
        x: (total_tokens, nheads, headdim); dt: (total_tokens, nheads); B, C: (total_tokens, ngroups, dstate);
            A, D, z, dt_bias, dt_softplus, dt_limit, chunk_size: as in mamba_chunk_scan_combined (z like x).
        cu_seqlens: (num_sequences + 1,) int32/int64 cumulative lengths, from 0 to total_tokens. May be None when
            meta is given.
        initial_states: optional (num_sequences, nheads, headdim, dstate): sequence k starts from
            initial_states[k] (else from zero).
        out: optional (total_tokens, nheads, headdim) tensor of x's dtype that receives y (and is returned).
        state_dtype: dtype of the returned states (default float32; float64 inputs: float64).
        state_cache, state_slots: optional together: a cache (cache_rows, nheads, headdim, dstate) and
            (num_sequences,) int slots; sequence k's final state is written into state_cache[state_slots[k]] (in
            the cache's dtype), other rows untouched. Slots must be distinct and in [0, cache_rows): checked where
            values are checked (below), else unchecked.
        has_initial_state: optional (num_sequences,) bool: sequence k starts from its start state where True and
            from zero where False. The start states are initial_states when given, else state_cache[state_slots]
            (a continued prompt of chunked prefill reads the state its previous piece wrote).
        meta: optional VarlenMeta from prepare_varlen(cu_seqlens, chunk_size, device) for this batch. With it the
            call reads no tensor values (cu_seqlens was checked there; state_slots on a GPU are not checked): no
            host synchronisation, so a CUDA graph can capture it. Without it, in eager mode, cu_seqlens (and
            state_slots) are read and checked on every call (M2OPS_CHECK_VALUES=0 skips that).
        return_block_states: also return the states at the block boundaries meta was prepared with
            (prepare_varlen(..., block_size=..., context_lens=...)), for prefix caching.

    Returns:
        (y, varlen_states): y (total_tokens, nheads, headdim) in x's dtype (out when given), and each sequence's
        final state (num_sequences, nheads, headdim, dstate) in state_dtype; with return_block_states also
        block_states (num_blocks, nheads, headdim, dstate) in state_dtype, state i after meta.blocks.position[i]
        tokens of sequence meta.blocks.sequence[i]. Differentiable in every float input including
        initial_states. A bad argument raises TypeError/ValueError naming it before anything is written.
    """
    if meta is not None and not isinstance(meta, VarlenMeta):
        raise TypeError(f"{WHERE}: meta must be a VarlenMeta (m2ops.prepare_varlen); got {type(meta).__name__}")
    if return_block_states and (meta is None or meta.blocks is None):
        raise ValueError(f"{WHERE}: return_block_states needs meta from m2ops.prepare_varlen(cu_seqlens, chunk_size, "
                         "device, block_size=...) (the boundaries are placed on the host, once per batch)")
    nseq = check_varlen_inputs(x, dt, B, C, z, cu_seqlens, initial_states, out, state_dtype, state_cache,
                               state_slots, has_initial_state, meta)
    if cu_seqlens is None:
        cu_seqlens = meta.cu_seqlens
    T = x.shape[0]
    x4, dt4, B4, C4 = x.unsqueeze(0), dt.unsqueeze(0), B.unsqueeze(0), C.unsqueeze(0)
    z4 = z.unsqueeze(0) if z is not None else None
    check_inputs(x4, dt4, A, B4, C4, chunk_size, D, z4, dt_bias, None, None, cu_seqlens, dt_softplus, dt_limit,
                 False, True)
    if meta is None and should_check_values(cu_seqlens, state_slots):
        check_cu_seqlens_values(cu_seqlens, T)
        if state_slots is not None:
            check_state_slots(state_slots, state_cache.shape[0])
    elif state_slots is not None and state_slots.device.type == "cpu" and should_check_values(state_slots):
        check_state_slots(state_slots, state_cache.shape[0])

    starts = initial_states
    if has_initial_state is not None:
        if starts is None:
            starts = state_cache.index_select(0, state_slots.long())
        starts = torch.where(has_initial_state[:, None, None, None], starts, starts.new_zeros(()))
    seq_idx = meta.seq_idx if meta is not None else seq_idx_from_cu_seqlens(cu_seqlens, T)
    dt_min, dt_max = float(dt_limit[0]), float(dt_limit[1])
    serve = dispatch.kernels_serve(x.device, chunk_size, (x, dt, B, C, z))
    run_chunk = dispatch.run_chunk_size(chunk_size, T, serve)

    if starts is not None and nseq > 1:
        y, _, varlen = sequence_states.scan(x4, dt4, A, B4, C4, run_chunk, D, z4, dt_bias, starts, seq_idx,
                                            cu_seqlens, dt_softplus, dt_min, dt_max,
                                            meta.index if meta is not None else None)
    else:  # no start states, or one sequence: the batch form of mamba_chunk_scan_combined's varlen route
        dt_out, dA_cumsum = ops.chunk_cumsum(dt4, A, dt_bias, run_chunk, dt_softplus, dt_min, dt_max)
        states, _, varlen = ops.fwd_pass_state(x4, B4, dt_out, dA_cumsum, starts, seq_idx, cu_seqlens)
        y = ops.compute_out(x4, dt_out, dA_cumsum, C4, B4, states, D, z4, seq_idx)

    y = y[0]
    if out is not None:
        out.copy_(y)
        y = out
    if state_dtype is not None and varlen.dtype != state_dtype:
        varlen = varlen.to(state_dtype)
    if state_cache is not None:
        state_cache.index_copy_(0, state_slots.long(), varlen.to(state_cache.dtype))
    if not return_block_states:
        return y, varlen
    blocks = block_states.block_states(x, dt, A, B, dt_bias, dt_softplus, dt_min, dt_max, starts, nseq, meta.blocks)
    return y, varlen, blocks.to(state_dtype or varlen.dtype)


__all__ = ["VarlenMeta", "prepare_varlen", "mamba_chunk_scan_combined_varlen"]
