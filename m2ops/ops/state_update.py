"""m2ops::state_update: one token of the Mamba-2 recurrence (decoding), functional, with its backward.

The op returns (y, new_state) and writes nothing, so autograd can differentiate it (the layer's training-time
step) and torch.compile traces it as a plain node. Its public form is selective_state_update_functional.
m2ops.selective_state_update, mamba_ssm's in-place meaning (a state cache updated in place, rows picked by
index), is m2ops::state_update_inplace (ops/state_update_inplace.py): no state-sized copy per token, no gradients.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor
from torch.library import custom_op

from ..meta import fake
from . import dispatch
from ..reference import state_update as ref
from ..reference.backward import reference_vjp


@custom_op("m2ops::state_update", mutates_args=())
def state_update(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
                 z: Optional[Tensor], dt_bias: Optional[Tensor], dt_softplus: bool, dt_min: float,
                 dt_max: float) -> tuple[Tensor, Tensor]:
    return ref.state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max)


@custom_op("m2ops::state_update_bwd", mutates_args=())
def state_update_bwd(g_y: Tensor, g_state: Tensor, state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor,
                     C: Tensor, D: Optional[Tensor], z: Optional[Tensor], dt_bias: Optional[Tensor],
                     dt_softplus: bool, dt_min: float, dt_max: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                              Tensor, Tensor, Tensor, Tensor]:
    """Gradients of state, x, dt, A, B, C, D, z and dt_bias (the last three empty when absent)."""
    args = (state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max)
    return reference_vjp(ref.state_update, args, tuple(range(9)), (g_y, g_state))


state_update.register_fake(fake.state_update)
state_update.register_kernel("cuda")(dispatch.cuda_impl(
    "state_update", ref.state_update,
    lambda state, x, dt, A, B, C, D, z, *_: (None, (state, x, dt, B, C, z), True)))
state_update_bwd.register_fake(fake.state_update_bwd)


def _setup(ctx, inputs, output):
    *tensors, ctx.dt_softplus, ctx.dt_min, ctx.dt_max = inputs
    ctx.save_for_backward(*tensors)


def _backward(ctx, g_y, g_state):
    state, x, dt, A, B, C, D, z, dt_bias = ctx.saved_tensors
    g = state_update_bwd(g_y, g_state, state, x, dt, A, B, C, D, z, dt_bias, ctx.dt_softplus, ctx.dt_min,
                         ctx.dt_max)
    optional = tuple(gi if t is not None else None for gi, t in zip(g[6:], (D, z, dt_bias)))
    return (*g[:6], *optional, None, None, None)


state_update.register_autograd(_backward, setup_context=_setup)


def mamba_ssm_arguments(A, dt, dt_bias):
    """(A, dt, dt_bias) with mamba_ssm's broadcast forms taken back to one value per head (see _untie); tensors
    already in m2ops's forms, and non-tensors (left to the checks), pass unchanged."""
    if isinstance(A, Tensor):
        A = _untie("A", A, 1)
    if isinstance(dt, Tensor):
        dt = _untie("dt", dt, 2)
    if isinstance(dt_bias, Tensor):
        dt_bias = _untie("dt_bias", dt_bias, 1)
    return A, dt, dt_bias


def _untie(name, t, per_head_dims):
    """mamba_ssm's callers pass A as (nheads, headdim, dstate), dt as (batch, nheads, headdim) and dt_bias as
    (nheads, headdim), broadcast by expand/repeat from one value per head. Take that one value back; a tensor
    whose trailing dimensions really vary (Mamba-1's per-channel form) cannot be represented."""
    extra = t.dim() - per_head_dims
    if extra <= 0:
        return t
    if any(t.stride(d) != 0 for d in range(per_head_dims, t.dim())):
        from ..meta.validate import _WHERE_DECODE
        raise ValueError(f"{_WHERE_DECODE}: {name} must have one value per head (Mamba-2); got shape "
                         f"{tuple(t.shape)} whose trailing dimensions are not broadcast (stride 0)")
    return t[(slice(None),) * per_head_dims + (0,) * extra]


def selective_state_update_functional(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                                      dt_limit=(0.0, float("inf"))):
    """One decoding step of the Mamba-2 SSM, like mamba_ssm's selective_state_update but functional and
    differentiable (m2ops::state_update). m2ops.selective_state_update updates a cache in place instead.

    Args:
        state: (batch, nheads, headdim, dstate) state before the token (float32 usually); not modified.
        x: (batch, nheads, headdim) the token's input.
        dt: (batch, nheads) step sizes before dt_bias / softplus / dt_limit.
        A: (nheads,) decay rates.
        B, C: (batch, ngroups, dstate).
        D: optional (nheads,) or (nheads, headdim) skip connection.
        z: optional gate like x: y is multiplied by silu(z).
        dt_bias: optional (nheads,).
        dt_softplus, dt_limit: as in mamba_chunk_scan_combined (the same rules, so prefill + decode matches
            one scan over the whole sequence).
    mamba_ssm's broadcast forms (A (nheads, headdim, dstate), dt (batch, nheads, headdim), dt_bias (nheads,
    headdim), made with expand or repeat) are accepted as well.

    Returns:
        (y like x, new_state of state's dtype).
    """
    from ..meta.validate import check_state_update_inputs
    A, dt, dt_bias = mamba_ssm_arguments(A, dt, dt_bias)
    check_state_update_inputs(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit)
    return state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, float(dt_limit[0]), float(dt_limit[1]))
