"""mamba_chunk_scan_combined: the public function, call-compatible with mamba_ssm's function of that name."""

from __future__ import annotations

from . import ops, sequence_states
from .ops import dispatch, eager
from .meta.validate import check_inputs, check_values, seq_idx_from_cu_seqlens, should_check_values


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False):
    """The Mamba-2 SSD scan over a whole sequence, in chunks of chunk_size tokens.

    Args:
        x: (batch, seqlen, nheads, headdim) input.
        dt: (batch, seqlen, nheads) step sizes, before dt_bias / softplus / dt_limit.
        A: (nheads,) decay rates (negative for a stable state).
        B, C: (batch, seqlen, ngroups, dstate); ngroups divides nheads, head k reads group k // (nheads/ngroups).
        chunk_size: tokens per chunk (any positive int; seqlen need not be a multiple of it). On a GPU the
            kernels run a chunk_size of 64 or 128 on chunks of 256 from 4K tokens (faster there; the results
            differ only by rounding).
        D: optional skip connection, (nheads,) or (nheads, headdim).
        z: optional gate like x: the output is multiplied by silu(z).
        dt_bias: optional (nheads,) added to dt first.
        initial_states: optional (batch, nheads, headdim, dstate) state before token 0 (of sequence 0); with
            cu_seqlens also (num_sequences, nheads, headdim, dstate): sequence k starts from initial_states[k]
            (m2ops/sequence_states.py; with one sequence the two forms are the same).
        seq_idx: optional (batch, seqlen) int32/int64 sequence ids, non-decreasing; the state restarts at
            each change.
        cu_seqlens: optional (num_sequences + 1,) cumulative lengths of sequences packed along seqlen
            (batch 1). Without seq_idx, the ids are derived from it.
        dt_softplus: apply softplus to dt (+ dt_bias); the identity above 20.
        dt_limit: (dt_min, dt_max) clamp applied to dt last (the default turns negative dt into 0).
        return_final_states: also return the state after the last token, (batch, nheads, headdim, dstate).
        return_varlen_states: also return each packed sequence's final state, (num_sequences, nheads,
            headdim, dstate); needs cu_seqlens.

    Returns:
        y of x's shape and dtype; then final_states if asked, then varlen_states if asked. States are float32
        (float64 for float64 inputs).
    """
    key = eager.call_key(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus,
                         dt_limit, return_final_states, return_varlen_states)
    if key is not None:  # a call like one that passed every check below and ran a kept plan
        out = eager.remembered_call(key, x, dt, A, B, C, D, z, dt_bias, initial_states)
        if out is not None:
            return out if return_final_states else out[0]
    check_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus,
                 dt_limit, return_final_states, return_varlen_states)
    seqlen = x.shape[1]
    if should_check_values(seq_idx, cu_seqlens):
        check_values(seq_idx, cu_seqlens, seqlen)
    if cu_seqlens is not None and seq_idx is None:
        seq_idx = seq_idx_from_cu_seqlens(cu_seqlens, seqlen)
    dt_min, dt_max = float(dt_limit[0]), float(dt_limit[1])
    # The plan: kernels or reference (dispatch.kernels_serve, once), the chunk size every step runs at (a caller's
    # 64 or 128 on long sequences runs on chunks of 256: decided ahead of chunk_cumsum, so that nothing downstream
    # re-cuts its output), and the path: the launchers directly (eager.applies) or the torch.library ops.
    deciding = (x, dt, B, C, z)
    serve = dispatch.kernels_serve(x.device, chunk_size, deciding)
    run_chunk = dispatch.run_chunk_size(chunk_size, seqlen, serve)

    if sequence_states.is_per_sequence(initial_states, cu_seqlens):
        y, final_states, varlen_states = sequence_states.scan(x, dt, A, B, C, run_chunk, D, z, dt_bias,
                                                              initial_states, seq_idx, cu_seqlens, dt_softplus,
                                                              dt_min, dt_max)
        out = (y,) + ((final_states,) if return_final_states else ()) + ((varlen_states,) if return_varlen_states
                                                                          else ())
        return out[0] if len(out) == 1 else out

    if not return_varlen_states and eager.applies(serve, x, deciding + (A, D, dt_bias, initial_states, seq_idx)):
        if key is None:  # (no plan kept yet: this may be the first)
            key = eager.call_key(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                                 dt_softplus, dt_limit, return_final_states, return_varlen_states, first=True)
        y, final_states = eager.scan_combined(x, dt, A, B, C, run_chunk, D, z, dt_bias, initial_states, seq_idx,
                                              dt_softplus, dt_min, dt_max, key)
        return (y, final_states) if return_final_states else y

    dt_out, dA_cumsum = ops.chunk_cumsum(dt, A, dt_bias, run_chunk, dt_softplus, dt_min, dt_max)
    if return_varlen_states:
        # Per-sequence final states are read from the per-chunk states: the two-op path keeps them.
        states, final_states, varlen_states = ops.fwd_pass_state(x, B, dt_out, dA_cumsum, initial_states,
                                                                 seq_idx, cu_seqlens)
        y = ops.compute_out(x, dt_out, dA_cumsum, C, B, states, D, z, seq_idx)
    else:
        y, final_states = ops.chunk_scan(x, dt_out, dA_cumsum, B, C, initial_states, D, z, seq_idx)

    out = (y,)
    if return_final_states:
        out += (final_states,)
    if return_varlen_states:
        out += (varlen_states,)
    return out[0] if len(out) == 1 else out


__all__ = ["mamba_chunk_scan_combined"]
