"""m2ops::state_update_inplace and m2ops.selective_state_update: one decoding token, the state cache updated in
place (mamba_ssm's meaning of selective_state_update, with vLLM-style state_batch_indices and padding slots).

The op declares what it writes (mutates_args: state and out) and returns nothing, so torch.compile functionalises
it like any in-place op (fullgraph) and a CUDA graph replays its one launch; the public function allocates out
when the caller gives none and returns it. No autograd: decoding into a cache is inference; gradients through a
decode step come from m2ops::state_update (selective_state_update_functional).
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor
from torch.library import custom_op

from ..meta import fake
from ..meta.validate import check_state_batch_indices, check_state_update_inputs, should_check_values
from ..reference import state_update as ref
from . import dispatch
from .state_update import mamba_ssm_arguments


@custom_op("m2ops::state_update_inplace", mutates_args=("state", "out"))
def state_update_inplace(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
                         z: Optional[Tensor], dt_bias: Optional[Tensor], state_batch_indices: Optional[Tensor],
                         dt_softplus: bool, dt_min: float, dt_max: float, out: Tensor,
                         A_is_log: bool = False) -> None:
    """A_is_log: A holds a layer's A_log and the decay rates are -exp(A_log), formed by the kernel (no launches
    for them in a layer's decode step)."""
    ref.state_update_inplace(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices, dt_softplus, dt_min, dt_max,
                             out, A_is_log)


state_update_inplace.register_fake(fake.state_update_inplace)
state_update_inplace.register_kernel("cuda")(dispatch.cuda_impl(
    "state_update_inplace", ref.state_update_inplace,
    lambda state, x, dt, A, B, C, D, z, *_: (None, (state, x, dt, B, C, z), True)))


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           dt_limit=(0.0, float("inf")), state_batch_indices=None, out=None):
    """One decoding step of the Mamba-2 SSM into a state cache, as mamba_ssm's selective_state_update: `state` is
    updated in place and the output returned.

    Args:
        state: the cache, (cache_rows, nheads, headdim, dstate), updated in place (float32 usually; a cache in the
            activations' dtype works too). Without state_batch_indices cache_rows is batch and batch row b updates
            cache row b.
        x: (batch, nheads, headdim) the token's input.
        dt: (batch, nheads) step sizes before dt_bias / softplus / dt_limit.
        A: (nheads,) decay rates.
        B, C: (batch, ngroups, dstate).
        D: optional (nheads,) or (nheads, headdim) skip connection.
        z: optional gate like x: y is multiplied by silu(z).
        dt_bias: optional (nheads,).
        dt_softplus, dt_limit: as in mamba_chunk_scan_combined (the same rules, so prefill + decode matches
            one scan over the whole sequence).
        state_batch_indices: optional (batch,) int32 or int64: batch row b updates cache row
            state_batch_indices[b]. A negative index is a padding slot: that batch row is skipped (its cache row
            untouched, its output row left as it is in `out`, zero in a fresh output). Cache rows no index names are
            untouched. Indices must be below cache_rows and, where non-negative, distinct; checked when they are on
            the CPU, not on a GPU (that would synchronise every token); there the kernel skips an index >= cache_rows
            like a padding slot, and repeated rows give an undefined result.
        out: optional tensor of x's shape, dtype and device that receives y (and is returned).
    mamba_ssm's broadcast forms (A (nheads, headdim, dstate), dt (batch, nheads, headdim), dt_bias (nheads,
    headdim), made with expand or repeat) are accepted as well.

    Returns:
        y like x (out when given). Not differentiable: selective_state_update_functional is.
    A bad argument raises before anything is written.
    """
    A, dt, dt_bias = mamba_ssm_arguments(A, dt, dt_bias)
    check_state_update_inputs(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit,
                              state_batch_indices=state_batch_indices, out=out, in_place=True)
    if (state_batch_indices is not None and state_batch_indices.device.type == "cpu"
            and should_check_values(state_batch_indices)):
        check_state_batch_indices(state_batch_indices, state.shape[0])
    if out is None:
        out = x.new_zeros(x.shape) if state_batch_indices is not None else x.new_empty(x.shape)
    state_update_inplace(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices, dt_softplus,
                         float(dt_limit[0]), float(dt_limit[1]), out)
    return out


__all__ = ["state_update_inplace", "selective_state_update"]
