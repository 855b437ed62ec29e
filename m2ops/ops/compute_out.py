"""m2ops::compute_out: the output from each chunk's entering state and its own tokens, with D and z gating."""

from __future__ import annotations

from typing import Optional

from torch import Tensor
from torch.library import custom_op

from ..meta import fake
from . import dispatch
from ..reference import chunked as ref
from ..reference import chunked_backward as bwd


@custom_op("m2ops::compute_out", mutates_args=())
def compute_out(x: Tensor, dt_out: Tensor, dA_cumsum: Tensor, C: Tensor, B: Tensor, states: Tensor,
                D: Optional[Tensor], z: Optional[Tensor], seq_idx: Optional[Tensor]) -> Tensor:
    return ref.compute_out(x, dt_out, dA_cumsum, C, B, states, D, z, seq_idx)


@custom_op("m2ops::compute_out_bwd", mutates_args=())
def compute_out_bwd(g_y: Tensor, x: Tensor, dt_out: Tensor, dA_cumsum: Tensor, C: Tensor, B: Tensor,
                    states: Tensor, D: Optional[Tensor], z: Optional[Tensor],
                    seq_idx: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                        Tensor]:
    """Gradients of x, dt_out, dA_cumsum, C, B, states, D and z (the last two empty when absent)."""
    return bwd.compute_out_bwd(g_y, x, dt_out, dA_cumsum, C, B, states, D, z, seq_idx)


compute_out.register_fake(fake.compute_out)
compute_out.register_kernel("cuda")(dispatch.cuda_impl(
    "compute_out", ref.compute_out,
    lambda x, dt_out, dA_cumsum, C, B, states, D, z, *_: (dt_out.shape[-1], (x, dt_out, dA_cumsum, C, B, states, z),
                                                          True)))
compute_out_bwd.register_fake(fake.compute_out_bwd)
compute_out_bwd.register_kernel("cuda")(dispatch.cuda_impl(
    "compute_out_bwd", bwd.compute_out_bwd,
    lambda g_y, x, dt_out, dA_cumsum, C, B, states, D, z, *_: (dt_out.shape[-1],
                                                               (g_y, x, dt_out, dA_cumsum, C, B, states, z), True)))


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, g_y):
    x, dt_out, dA_cumsum, C, B, states, D, z, seq_idx = ctx.saved_tensors
    g = compute_out_bwd(g_y, x, dt_out, dA_cumsum, C, B, states, D, z, seq_idx)
    g_D = g[6] if D is not None else None
    g_z = g[7] if z is not None else None
    return (*g[:6], g_D, g_z, None)


compute_out.register_autograd(_backward, setup_context=_setup)
