"""m2ops::rms_norm_gated and m2ops::rms_norm_gated_bwd: the gated RMSNorm of the Mamba-2 layer (the math in
m2ops/reference/gated_norm.py).

The forward op returns y and rstd, the reciprocal rms of each (row, group) that its backward reuses: a functional
op with two outputs traces into torch.compile graphs as a plain node, and autograd saves rstd like any output
(it is not differentiable). Its registered autograd calls the backward op, which returns the gradients of x,
weight, bias and z (empty tensors for an absent bias or z). On CUDA both run the cuTile kernels where
ops.dispatch.kernels_serve says so and the group fits one tile (meta.gated_norm.KERNEL_NORM_MAX_GROUP), else the
reference.
m2ops.rms_norm_gated (m2ops/gated_norm.py) checks its arguments and calls the forward op.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor
from torch.library import custom_op

from ..meta import gated_norm as fake
from ..meta.gated_norm import KERNEL_NORM_MAX_GROUP
from ..reference import gated_norm as ref
from . import dispatch


@custom_op("m2ops::rms_norm_gated", mutates_args=())
def rms_norm_gated(x: Tensor, weight: Tensor, bias: Optional[Tensor], z: Optional[Tensor], eps: float,
                      group_size: int, norm_before_gate: bool) -> tuple[Tensor, Tensor]:
    return ref.rms_norm_gated(x, weight, bias, z, eps, group_size, norm_before_gate)


@custom_op("m2ops::rms_norm_gated_bwd", mutates_args=())
def rms_norm_gated_bwd(dy: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], z: Optional[Tensor],
                       rstd: Tensor, eps: float, group_size: int,
                       norm_before_gate: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of x, weight, bias and z (the last two empty when absent)."""
    return ref.rms_norm_gated_bwd(dy, x, weight, bias, z, rstd, eps, group_size, norm_before_gate)


def _decides(x, weight, bias, z, eps, group_size, *_):
    return None, (x, z), group_size <= KERNEL_NORM_MAX_GROUP


def _decides_bwd(dy, x, weight, bias, z, rstd, eps, group_size, *_):
    return None, (dy, x, z), group_size <= KERNEL_NORM_MAX_GROUP


rms_norm_gated.register_fake(fake.rms_norm_gated)
rms_norm_gated.register_kernel("cuda")(dispatch.cuda_impl("rms_norm_gated", ref.rms_norm_gated, _decides))
rms_norm_gated_bwd.register_fake(fake.rms_norm_gated_bwd)
rms_norm_gated_bwd.register_kernel("cuda")(dispatch.cuda_impl("rms_norm_gated_bwd", ref.rms_norm_gated_bwd,
                                                              _decides_bwd))


def _setup(ctx, inputs, output):
    x, weight, bias, z, ctx.eps, ctx.group_size, ctx.norm_before_gate = inputs
    ctx.save_for_backward(x, weight, bias, z, output[1])
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, dy, _g_rstd):
    x, weight, bias, z, rstd = ctx.saved_tensors
    dx, dweight, dbias, dz = rms_norm_gated_bwd(dy, x, weight, bias, z, rstd, ctx.eps, ctx.group_size,
                                                ctx.norm_before_gate)
    return (dx, dweight, dbias if bias is not None else None, dz if z is not None else None, None, None, None)


rms_norm_gated.register_autograd(_backward, setup_context=_setup)

