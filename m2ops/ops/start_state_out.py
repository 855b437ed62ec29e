"""m2ops::start_state_out: a packed row's output plus its sequences' own start states at the tokens of the chunk
where each sequence starts (per-sequence initial states with cu_seqlens; m2ops/sequence_states.py), and its
backward op m2ops::start_state_out_bwd.

The math: m2ops/reference/start_states.py (the CPU implementation, the fallback, and the backward everywhere: it
runs only where gradients are asked for, a training step through per-sequence starts); the CUDA implementation of
the forward: m2ops/kernels/start_states.py, where ops.dispatch.kernels_serve says so.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor
from torch.library import custom_op

from ..meta.validate import check_start_state_out
from ..reference import start_states as ref
from . import dispatch


@custom_op("m2ops::start_state_out", mutates_args=())
def start_state_out(y: Tensor, C: Tensor, z: Optional[Tensor], initial_states: Tensor, dA_cumsum: Tensor,
                    cu_seqlens: Tensor) -> Tensor:
    """y (1, seqlen, nheads, headdim) plus, for every packed sequence k >= 1 of cu_seqlens, its start state
    initial_states[k] carried to its tokens in its first chunk through C (1, seqlen, ngroups, dstate), the chunk's
    decays (dA_cumsum (1, nheads, nchunks, chunk_size)) and silu(z) where z is given. A fresh tensor like y.
    Shapes, dtypes and devices are checked (cu_seqlens' values are the caller's: mamba_chunk_scan_combined's
    checks)."""
    check_start_state_out(y, C, z, initial_states, dA_cumsum, cu_seqlens)
    return ref.start_state_out(y, C, z, initial_states, dA_cumsum, cu_seqlens)


@custom_op("m2ops::start_state_out_bwd", mutates_args=())
def start_state_out_bwd(g_out: Tensor, C: Tensor, z: Optional[Tensor], initial_states: Tensor, dA_cumsum: Tensor,
                        cu_seqlens: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of C, z (empty when None), initial_states and dA_cumsum (y's is g_out itself)."""
    return ref.start_state_out_bwd(g_out, C, z, initial_states, dA_cumsum, cu_seqlens)


@start_state_out.register_fake
def _(y, C, z, initial_states, dA_cumsum, cu_seqlens):
    check_start_state_out(y, C, z, initial_states, dA_cumsum, cu_seqlens)
    return y.new_empty(y.shape)


@start_state_out_bwd.register_fake
def _(g_out, C, z, initial_states, dA_cumsum, cu_seqlens):
    return (C.new_empty(C.shape), z.new_empty(z.shape) if z is not None else g_out.new_empty((0,)),
            initial_states.new_empty(initial_states.shape), dA_cumsum.new_empty(dA_cumsum.shape))


_start_state_out_cuda = dispatch.cuda_impl(
    "start_state_out", ref.start_state_out,
    lambda y, C, z, initial_states, dA_cumsum, cu_seqlens: (dA_cumsum.shape[-1], (y, C, z, initial_states, dA_cumsum),
                                                            True))


@start_state_out.register_kernel("cuda")
def _(y, C, z, initial_states, dA_cumsum, cu_seqlens):
    check_start_state_out(y, C, z, initial_states, dA_cumsum, cu_seqlens)
    return _start_state_out_cuda(y, C, z, initial_states, dA_cumsum, cu_seqlens)


def _setup(ctx, inputs, output):
    y, C, z, initial_states, dA_cumsum, cu_seqlens = inputs
    ctx.save_for_backward(C, z, initial_states, dA_cumsum, cu_seqlens)


def _backward(ctx, g_out):
    C, z, initial_states, dA_cumsum, cu_seqlens = ctx.saved_tensors
    g_C, g_z, g_init, g_cs = start_state_out_bwd(g_out, C, z, initial_states, dA_cumsum, cu_seqlens)
    return g_out, g_C, g_z if z is not None else None, g_init, g_cs, None


start_state_out.register_autograd(_backward, setup_context=_setup)
