"""m2ops::fwd_pass_state: the state entering each chunk, the final state, and (for cu_seqlens) each packed
sequence's final state, from initial_states and with restarts at seq_idx changes; and its backward, as one op
(fwd_pass_state_bwd, the op's own autograd) and as its two stages (state_passing_bwd, the reverse recurrence
over the chunks; chunk_state_bwd, the per-token gradients from it), which the scan's backward calls."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.library import custom_op

from ..meta import fake
from ..meta.validate import check_chunk_state_bwd, check_state_passing_bwd
from . import dispatch
from ..reference import chunked as ref
from ..reference import chunked_backward as bwd

# The local-state gradients' dtypes the kernels read and write (meta.shapes.g_local_dtype for their inputs).
KERNEL_G_LOCAL_DTYPES = (torch.float32, torch.bfloat16)


@custom_op("m2ops::fwd_pass_state", mutates_args=())
def fwd_pass_state(x: Tensor, B: Tensor, dt_out: Tensor, dA_cumsum: Tensor, initial_states: Optional[Tensor],
                   seq_idx: Optional[Tensor], cu_seqlens: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    return ref.fwd_pass_state(x, B, dt_out, dA_cumsum, initial_states, seq_idx, cu_seqlens)


@custom_op("m2ops::fwd_pass_state_bwd", mutates_args=())
def fwd_pass_state_bwd(g_states: Tensor, g_final: Tensor, g_varlen: Tensor, x: Tensor, B: Tensor, dt_out: Tensor,
                       dA_cumsum: Tensor, initial_states: Optional[Tensor], seq_idx: Optional[Tensor],
                       cu_seqlens: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of x, B, dt_out, dA_cumsum and initial_states (empty when it is None): the entering states
    recomputed, then state_passing_bwd and chunk_state_bwd. The scan's backward calls those two itself, so that
    the states and their gradients are freed before the second (chunk_scan.backward_with)."""
    return bwd.fwd_pass_state_bwd(g_states, g_final, g_varlen, x, B, dt_out, dA_cumsum, initial_states, seq_idx,
                                  cu_seqlens)


@custom_op("m2ops::state_passing_bwd", mutates_args=())
def state_passing_bwd(g_states: Tensor, g_final: Tensor, states: Tensor, dA_cumsum: Tensor,
                      seq_idx: Optional[Tensor], g_local_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """fwd_pass_state's reverse recurrence from the entering states' gradients g_states and the final state's
    g_final: (g_local (batch, nchunks, nheads, headdim, dstate) in g_local_dtype, each chunk's local state's
    gradient; g_carry (batch, nheads, nchunks), its carry's; g_init (batch, nheads, headdim, dstate), the
    initial state's), given the forward's entering states."""
    check_state_passing_bwd(g_states, g_final, states, dA_cumsum, g_local_dtype)
    return bwd.state_passing_bwd(g_states, g_final, states, dA_cumsum, seq_idx, g_local_dtype)


@custom_op("m2ops::chunk_state_bwd", mutates_args=("g_x", "g_B", "g_dt_out", "g_dA_cumsum"))
def chunk_state_bwd(g_local: Tensor, g_carry: Tensor, x: Tensor, B: Tensor, dt_out: Tensor, dA_cumsum: Tensor,
                    seq_idx: Optional[Tensor], g_x: Tensor, g_B: Tensor, g_dt_out: Tensor,
                    g_dA_cumsum: Tensor) -> None:
    """From state_passing_bwd's g_local and g_carry: adds the gradients of x, B, dt_out and dA_cumsum into g_x,
    g_B, g_dt_out and g_dA_cumsum (another op's gradients of them: one buffer each for both, written where the
    kernels write theirs, in place of a separate sum)."""
    check_chunk_state_bwd(g_local, g_carry, x, B, dt_out, dA_cumsum, g_x, g_B, g_dt_out, g_dA_cumsum)
    bwd.chunk_state_bwd(g_local, g_carry, x, B, dt_out, dA_cumsum, seq_idx, g_x, g_B, g_dt_out, g_dA_cumsum)


fwd_pass_state.register_fake(fake.fwd_pass_state)
fwd_pass_state.register_kernel("cuda")(dispatch.cuda_impl(
    "fwd_pass_state", ref.fwd_pass_state,
    lambda x, B, dt_out, dA_cumsum, *_: (dt_out.shape[-1], (x, B, dt_out, dA_cumsum), True)))
fwd_pass_state_bwd.register_fake(fake.fwd_pass_state_bwd)
# The per-sequence states' backward (a non-empty g_varlen with cu_seqlens) has no kernel: the reference runs it.
fwd_pass_state_bwd.register_kernel("cuda")(dispatch.cuda_impl(
    "fwd_pass_state_bwd", bwd.fwd_pass_state_bwd,
    lambda g_states, g_final, g_varlen, x, B, dt_out, dA_cumsum, initial_states, seq_idx, cu_seqlens:
    (dt_out.shape[-1], (x, B, dt_out, dA_cumsum, g_states, g_final),
     cu_seqlens is None or g_varlen.numel() == 0)))
state_passing_bwd.register_fake(fake.state_passing_bwd)
_state_passing_bwd_cuda = dispatch.cuda_impl(
    "state_passing_bwd", bwd.state_passing_bwd,
    lambda g_states, g_final, states, dA_cumsum, seq_idx, g_local_dtype:
    (dA_cumsum.shape[-1], (g_states, g_final, states, dA_cumsum), g_local_dtype in KERNEL_G_LOCAL_DTYPES))


@state_passing_bwd.register_kernel("cuda")
def _(g_states, g_final, states, dA_cumsum, seq_idx, g_local_dtype):
    check_state_passing_bwd(g_states, g_final, states, dA_cumsum, g_local_dtype)
    return _state_passing_bwd_cuda(g_states, g_final, states, dA_cumsum, seq_idx, g_local_dtype)


chunk_state_bwd.register_fake(fake.chunk_state_bwd)
_chunk_state_bwd_cuda = dispatch.cuda_impl(
    "chunk_state_bwd", bwd.chunk_state_bwd,
    lambda g_local, g_carry, x, B, dt_out, dA_cumsum, seq_idx, *grads:
    (dt_out.shape[-1], (x, B, dt_out, dA_cumsum, g_carry, *grads), g_local.dtype in KERNEL_G_LOCAL_DTYPES))


@chunk_state_bwd.register_kernel("cuda")
def _(g_local, g_carry, x, B, dt_out, dA_cumsum, seq_idx, g_x, g_B, g_dt_out, g_dA_cumsum):
    check_chunk_state_bwd(g_local, g_carry, x, B, dt_out, dA_cumsum, g_x, g_B, g_dt_out, g_dA_cumsum)
    _chunk_state_bwd_cuda(g_local, g_carry, x, B, dt_out, dA_cumsum, seq_idx, g_x, g_B, g_dt_out, g_dA_cumsum)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, g_states, g_final, g_varlen):
    x, B, dt_out, dA_cumsum, initial_states, seq_idx, cu_seqlens = ctx.saved_tensors
    g_x, g_B, g_dt, g_dA, g_init = fwd_pass_state_bwd(g_states, g_final, g_varlen, x, B, dt_out, dA_cumsum,
                                                      initial_states, seq_idx, cu_seqlens)
    return g_x, g_B, g_dt, g_dA, g_init if initial_states is not None else None, None, None


fwd_pass_state.register_autograd(_backward, setup_context=_setup)
