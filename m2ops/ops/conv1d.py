"""m2ops::causal_conv1d (the causal depthwise convolution of the Mamba-2 layer, + SiLU), its backward op
m2ops::causal_conv1d_bwd, and m2ops::causal_conv1d_update (one decoding token, updating the cache in place).

The math: m2ops/reference/conv1d.py (the CPU implementation and the fallback); shapes and fakes:
m2ops/meta/conv1d.py; the CUDA implementations: m2ops/kernels/conv.py where ops.dispatch.kernels_serve says so
and the kernels cover the call (widths 2-4; the update with a state of at most KERNEL_MAX_STATE_LEN entries in the
activations' dtype or float32), else the reference. The public functions are in m2ops/conv1d.py.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.library import custom_op

from ..meta import conv1d as meta
from ..reference import conv1d as ref
from . import dispatch


@custom_op("m2ops::causal_conv1d", mutates_args=())
def causal_conv1d(x: Tensor, weight: Tensor, bias: Optional[Tensor], seq_idx: Optional[Tensor],
                  initial_states: Optional[Tensor], silu: bool, final_state_len: int) -> tuple[Tensor, Tensor]:
    """(y (batch, channels, seqlen) channel-last like x's dtype, final states (batch, channels, final_state_len))."""
    return ref.causal_conv1d(x, weight, bias, seq_idx, initial_states, silu, final_state_len)


@custom_op("m2ops::causal_conv1d_bwd", mutates_args=())
def causal_conv1d_bwd(g_y: Tensor, g_final: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                      seq_idx: Optional[Tensor], initial_states: Optional[Tensor],
                      silu: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of x, weight, bias and initial_states (the last two empty when absent)."""
    return ref.causal_conv1d_bwd(g_y, g_final, x, weight, bias, seq_idx, initial_states, silu)


@custom_op("m2ops::causal_conv1d_update", mutates_args=("conv_state",))
def causal_conv1d_update(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Optional[Tensor], silu: bool,
                         conv_state_indices: Optional[Tensor]) -> Tensor:
    """y (batch, channels) like x; conv_state's named slots move one token on (in place)."""
    return ref.causal_conv1d_update(x, conv_state, weight, bias, silu, conv_state_indices)


def _width_covered(weight) -> bool:
    return weight.shape[1] in meta.KERNEL_WIDTHS


def _update_covered(x, conv_state, weight) -> bool:
    return (_width_covered(weight) and conv_state.shape[2] <= meta.KERNEL_MAX_STATE_LEN
            and conv_state.dtype in (x.dtype, torch.float32))


causal_conv1d.register_fake(meta.causal_conv1d)
causal_conv1d.register_kernel("cuda")(dispatch.cuda_impl(
    "causal_conv1d", ref.causal_conv1d,
    lambda x, weight, bias, seq_idx, initial_states, *_: (None, (x, weight, bias, initial_states),
                                                          _width_covered(weight))))
causal_conv1d_bwd.register_fake(meta.causal_conv1d_bwd)
causal_conv1d_bwd.register_kernel("cuda")(dispatch.cuda_impl(
    "causal_conv1d_bwd", ref.causal_conv1d_bwd,
    lambda g_y, g_final, x, weight, bias, seq_idx, initial_states, *_: (
        None, (g_y, g_final, x, weight, bias, initial_states), _width_covered(weight))))
causal_conv1d_update.register_fake(meta.causal_conv1d_update)
causal_conv1d_update.register_kernel("cuda")(dispatch.cuda_impl(
    "causal_conv1d_update", ref.causal_conv1d_update,
    lambda x, conv_state, weight, bias, *_: (None, (x, conv_state, weight, bias),
                                             _update_covered(x, conv_state, weight))))


def _setup(ctx, inputs, output):
    x, weight, bias, seq_idx, initial_states, ctx.silu, _ = inputs
    ctx.save_for_backward(x, weight, bias, seq_idx, initial_states)


def _backward(ctx, g_y, g_final):
    x, weight, bias, seq_idx, initial_states = ctx.saved_tensors
    g_x, g_w, g_b, g_i = causal_conv1d_bwd(g_y, g_final, x, weight, bias, seq_idx, initial_states, ctx.silu)
    return (g_x, g_w, g_b if bias is not None else None, None, g_i if initial_states is not None else None,
            None, None)


causal_conv1d.register_autograd(_backward, setup_context=_setup)
