"""m2ops::fwd_pass_state: the state entering each chunk, the final state, and (for cu_seqlens) each packed
sequence's final state, from initial_states and with restarts at seq_idx changes."""

from __future__ import annotations

from typing import Optional

from torch import Tensor
from torch.library import custom_op

from ..meta import fake
from ..meta.validate import check_state_bwd_options
from . import dispatch
from ..reference import chunked as ref
from ..reference import chunked_backward as bwd


@custom_op("m2ops::fwd_pass_state", mutates_args=())
def fwd_pass_state(x: Tensor, B: Tensor, dt_out: Tensor, dA_cumsum: Tensor, initial_states: Optional[Tensor],
                   seq_idx: Optional[Tensor], cu_seqlens: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    return ref.fwd_pass_state(x, B, dt_out, dA_cumsum, initial_states, seq_idx, cu_seqlens)


@custom_op("m2ops::fwd_pass_state_bwd", mutates_args=())
def fwd_pass_state_bwd(g_states: Tensor, g_final: Tensor, g_varlen: Tensor, x: Tensor, B: Tensor, dt_out: Tensor,
                       dA_cumsum: Tensor, initial_states: Optional[Tensor], seq_idx: Optional[Tensor],
                       cu_seqlens: Optional[Tensor], states: Optional[Tensor] = None,
                       g_x_base: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of x, B, dt_out, dA_cumsum and initial_states (empty when it is None). states: the forward's
    entering states (fwd_pass_state's first output) where the caller has them, else recomputed. g_x_base: a
    gradient of x from elsewhere, added into the returned one (where the kernels write theirs, saving a pass)."""
    check_state_bwd_options(states, g_x_base, g_states, x)
    return bwd.fwd_pass_state_bwd(g_states, g_final, g_varlen, x, B, dt_out, dA_cumsum, initial_states, seq_idx,
                                  cu_seqlens, states, g_x_base)


fwd_pass_state.register_fake(fake.fwd_pass_state)
fwd_pass_state.register_kernel("cuda")(dispatch.cuda_impl(
    "fwd_pass_state", ref.fwd_pass_state,
    lambda x, B, dt_out, dA_cumsum, *_: (dt_out.shape[-1], (x, B, dt_out, dA_cumsum), True)))
fwd_pass_state_bwd.register_fake(fake.fwd_pass_state_bwd)
# The per-sequence states' backward (a non-empty g_varlen with cu_seqlens) has no kernel: the reference runs it.
_bwd_cuda = dispatch.cuda_impl(
    "fwd_pass_state_bwd", bwd.fwd_pass_state_bwd,
    lambda g_states, g_final, g_varlen, x, B, dt_out, dA_cumsum, initial_states, seq_idx, cu_seqlens, *_:
    (dt_out.shape[-1], (x, B, dt_out, dA_cumsum, g_states, g_final),
     cu_seqlens is None or g_varlen.numel() == 0))


@fwd_pass_state_bwd.register_kernel("cuda")
def _fwd_pass_state_bwd_cuda(g_states, g_final, g_varlen, x, B, dt_out, dA_cumsum, initial_states, seq_idx,
                             cu_seqlens, states=None, g_x_base=None):
    check_state_bwd_options(states, g_x_base, g_states, x)
    return _bwd_cuda(g_states, g_final, g_varlen, x, B, dt_out, dA_cumsum, initial_states, seq_idx, cu_seqlens,
                     states, g_x_base)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, g_states, g_final, g_varlen):
    x, B, dt_out, dA_cumsum, initial_states, seq_idx, cu_seqlens = ctx.saved_tensors
    g_x, g_B, g_dt, g_dA, g_init = fwd_pass_state_bwd(g_states, g_final, g_varlen, x, B, dt_out, dA_cumsum,
                                                      initial_states, seq_idx, cu_seqlens)
    return g_x, g_B, g_dt, g_dA, g_init if initial_states is not None else None, None, None


fwd_pass_state.register_autograd(_backward, setup_context=_setup)
