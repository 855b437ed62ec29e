"""Fake (meta) implementations: output shapes and dtypes only, from the rules in shapes.py. torch.compile and
opcheck trace the ops through these."""

from __future__ import annotations

from .validate import check_chunk_state_bwd, check_state_passing_bwd
from .shapes import (compute_dtype, cumsum_shape, decode_state_shape, final_states_shape, states_shape,
                     varlen_states_shape)


def chunk_cumsum(dt, A, dt_bias, chunk_size, dt_softplus, dt_min, dt_max):
    shape = cumsum_shape(dt.shape[0], dt.shape[1], dt.shape[2], chunk_size)
    acc = compute_dtype(dt.dtype)
    return dt.new_empty(shape, dtype=acc), dt.new_empty(shape, dtype=acc)


def fwd_pass_state(x, B, dt_out, dA_cumsum, initial_states, seq_idx, cu_seqlens):
    b, _, h, p = x.shape
    n = B.shape[-1]
    acc = dt_out.dtype
    return (x.new_empty(states_shape(b, dt_out.shape[2], h, p, n), dtype=acc),
            x.new_empty(final_states_shape(b, h, p, n), dtype=acc),
            x.new_empty(varlen_states_shape(cu_seqlens, h, p, n), dtype=acc))


def compute_out(x, dt_out, dA_cumsum, C, B, states, D, z, seq_idx):
    return x.new_empty(x.shape)


def chunk_scan(x, dt_out, dA_cumsum, B, C, initial_states, D, z, seq_idx):
    b, _, h, p = x.shape
    return x.new_empty(x.shape), x.new_empty(final_states_shape(b, h, p, B.shape[-1]), dtype=dt_out.dtype)


def _like(t, ref):
    """Gradient of an optional input: its shape, or an empty tensor like ref (the first cotangent, as
    reference_vjp makes it) when the input is absent."""
    return ref.new_empty((0,)) if t is None else t.new_empty(t.shape)


def chunk_cumsum_bwd(g_dt_out, g_dA_cumsum, dt, A, dt_bias, chunk_size, dt_softplus, dt_min, dt_max):
    return dt.new_empty(dt.shape), A.new_empty(A.shape), _like(dt_bias, g_dt_out)


def fwd_pass_state_bwd(g_states, g_final, g_varlen, x, B, dt_out, dA_cumsum, initial_states, seq_idx,
                       cu_seqlens):
    return (x.new_empty(x.shape), B.new_empty(B.shape), dt_out.new_empty(dt_out.shape),
            dA_cumsum.new_empty(dA_cumsum.shape), _like(initial_states, g_states))


def state_passing_bwd(g_states, g_final, states, dA_cumsum, seq_idx, g_local_dtype):
    check_state_passing_bwd(g_states, g_final, states, dA_cumsum, g_local_dtype)
    b, c, h, p, n = g_states.shape
    acc = dA_cumsum.dtype
    return (g_states.new_empty((b, c, h, p, n), dtype=g_local_dtype), g_states.new_empty((b, h, c), dtype=acc),
            g_states.new_empty((b, h, p, n), dtype=acc))


def chunk_state_bwd(g_local, g_carry, x, B, dt_out, dA_cumsum, seq_idx, g_x, g_B, g_dt_out, g_dA_cumsum):
    check_chunk_state_bwd(g_local, g_carry, x, B, dt_out, dA_cumsum, g_x, g_B, g_dt_out, g_dA_cumsum)


def compute_out_bwd(g_y, x, dt_out, dA_cumsum, C, B, states, D, z, seq_idx):
    return (x.new_empty(x.shape), dt_out.new_empty(dt_out.shape), dA_cumsum.new_empty(dA_cumsum.shape),
            C.new_empty(C.shape), B.new_empty(B.shape), states.new_empty(states.shape), _like(D, g_y),
            _like(z, g_y))


def state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max):
    """(y like x, the new state in state's dtype and layout)."""
    b, h, p = x.shape
    return x.new_empty(x.shape), state.new_empty(decode_state_shape(b, h, p, B.shape[-1]))


def state_update_inplace(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices, dt_softplus, dt_min, dt_max,
                         out, A_is_log=False):
    """Nothing: the op writes state and out, which it declares as mutated."""
    return None


def state_update_bwd(g_y, g_state, state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max):
    return (state.new_empty(state.shape), x.new_empty(x.shape), dt.new_empty(dt.shape), A.new_empty(A.shape),
            B.new_empty(B.shape), C.new_empty(C.shape), _like(D, g_y), _like(z, g_y), _like(dt_bias, g_y))
