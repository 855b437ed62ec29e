"""m2ops::chunk_cumsum: dt preprocessing (dt_bias, softplus, dt_limit clamp) and the within-chunk cumulative
sum of dt * A, in the (batch, nheads, nchunks, chunk_size) layout the later ops read."""

from __future__ import annotations

from typing import Optional

from torch import Tensor
from torch.library import custom_op

from ..meta import fake
from . import dispatch
from ..reference import chunked as ref
from ..reference import chunked_backward as bwd


@custom_op("m2ops::chunk_cumsum", mutates_args=())
def chunk_cumsum(dt: Tensor, A: Tensor, dt_bias: Optional[Tensor], chunk_size: int, dt_softplus: bool,
                 dt_min: float, dt_max: float) -> tuple[Tensor, Tensor]:
    return ref.chunk_cumsum(dt, A, dt_bias, chunk_size, dt_softplus, dt_min, dt_max)


@custom_op("m2ops::chunk_cumsum_bwd", mutates_args=())
def chunk_cumsum_bwd(g_dt_out: Tensor, g_dA_cumsum: Tensor, dt: Tensor, A: Tensor, dt_bias: Optional[Tensor],
                     chunk_size: int, dt_softplus: bool, dt_min: float,
                     dt_max: float) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of dt, A and dt_bias (empty when dt_bias is None)."""
    return bwd.chunk_cumsum_bwd(g_dt_out, g_dA_cumsum, dt, A, dt_bias, chunk_size, dt_softplus, dt_min, dt_max)


chunk_cumsum.register_fake(fake.chunk_cumsum)
# What decides kernels or reference (dispatch.kernels_serve): the chunk size and the tensors the kernels read as
# they are (A and dt_bias are converted to float32 whatever they are).
chunk_cumsum.register_kernel("cuda")(dispatch.cuda_impl(
    "chunk_cumsum", ref.chunk_cumsum, lambda dt, A, dt_bias, chunk_size, *_: (chunk_size, (dt,), True)))
chunk_cumsum_bwd.register_fake(fake.chunk_cumsum_bwd)
chunk_cumsum_bwd.register_kernel("cuda")(dispatch.cuda_impl(
    "chunk_cumsum_bwd", bwd.chunk_cumsum_bwd,
    lambda g_dt_out, g_dA_cumsum, dt, A, dt_bias, chunk_size, *_: (chunk_size, (dt, g_dt_out, A), True)))


def _setup(ctx, inputs, output):
    dt, A, dt_bias, *ctx.params = inputs
    ctx.save_for_backward(dt, A, dt_bias)


def _backward(ctx, g_dt_out, g_dA_cumsum):
    dt, A, dt_bias = ctx.saved_tensors
    g_dt, g_A, g_bias = chunk_cumsum_bwd(g_dt_out, g_dA_cumsum, dt, A, dt_bias, *ctx.params)
    return g_dt, g_A, g_bias if dt_bias is not None else None, None, None, None, None


chunk_cumsum.register_autograd(_backward, setup_context=_setup)
