"""m2ops::chunk_scan: fwd_pass_state and compute_out as one op, for callers that need y and the final state
but not the state entering every chunk (the public function without return_varlen_states).

On CUDA it runs the fused kernels of m2ops/kernels/segments.py, which never write per-chunk states; its math
is the reference composition of the two ops. Its backward recomputes the per-chunk states once with the
fwd_pass_state op and runs the two ops' backward ops on them (fwd_pass_state's in its two stages), so gradients
are exactly theirs.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.library import custom_op

from ..meta import fake
from ..meta.shapes import g_local_dtype
from . import dispatch
from ..reference import chunked as ref
from .compute_out import compute_out_bwd
from .fwd_pass_state import chunk_state_bwd, fwd_pass_state, state_passing_bwd


@custom_op("m2ops::chunk_scan", mutates_args=())
def chunk_scan(x: Tensor, dt_out: Tensor, dA_cumsum: Tensor, B: Tensor, C: Tensor,
               initial_states: Optional[Tensor], D: Optional[Tensor], z: Optional[Tensor],
               seq_idx: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    return ref.chunk_scan(x, dt_out, dA_cumsum, B, C, initial_states, D, z, seq_idx)


chunk_scan.register_fake(fake.chunk_scan)
chunk_scan.register_kernel("cuda")(dispatch.cuda_impl(
    "chunk_scan", ref.chunk_scan,
    lambda x, dt_out, dA_cumsum, B, C, initial_states, D, z, *_: (dt_out.shape[-1], (x, dt_out, dA_cumsum, B, C, z),
                                                                  True)))


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def backward_with(impl, saved, g_y, g_final, states=None):
    """The gradients of chunk_scan's inputs from its saved inputs, through impl's fwd_pass_state,
    compute_out_bwd, state_passing_bwd and chunk_state_bwd: this module's ops (the op's autograd) or the
    launchers themselves (m2ops/ops/eager.py), the same composition either way. states: the entering states the
    forward kept (launchers only: the forward's bfloat16 copy), else recomputed here in float32. g_y: y's
    gradient, or a list holding it alone, which is emptied once compute_out_bwd has read it (a caller that keeps
    no other reference frees it there, before the later stages allocate: the layer's backward)."""
    x, dt_out, dA_cumsum, B, C, initial_states, D, z, seq_idx = saved
    if isinstance(g_y, list):
        g_y = g_y.pop()
    if states is None:
        with torch.no_grad():
            states = impl.fwd_pass_state(x, B, dt_out, dA_cumsum, initial_states, seq_idx, None)[0]
        out_bwd_kwargs = {}
    else:
        out_bwd_kwargs = {"g_states_dtype": torch.float32}  # the recurrence's gradient stays float32
    g_x, g_dt, g_dA, g_C, g_B, g_states, g_D, g_z = impl.compute_out_bwd(g_y, x, dt_out, dA_cumsum, C, B, states,
                                                                         D, z, seq_idx, **out_bwd_kwargs)
    del g_y
    g_local, g_carry, g_init = impl.state_passing_bwd(g_states, g_final, states, dA_cumsum, seq_idx,
                                                      g_local_dtype(x.dtype, B.dtype, dA_cumsum.dtype))
    # The entering states and their gradients (two (b, c, h, p, n) float32 arrays where recomputed) are freed
    # before the per-token stage, where a training step's memory peaks; that stage adds its gradients of x, B,
    # dt_out and dA_cumsum into compute_out_bwd's (one buffer each, no separate sums).
    del states, g_states
    impl.chunk_state_bwd(g_local, g_carry, x, B, dt_out, dA_cumsum, seq_idx, g_x, g_B, g_dt, g_dA)
    del g_local, g_carry
    return (g_x, g_dt, g_dA, g_B, g_C,
            g_init.to(initial_states.dtype) if initial_states is not None else None,
            g_D if D is not None else None, g_z if z is not None else None, None)


class RegisteredOps:
    """The ops backward_with composes, as registered (each picks kernels or reference)."""
    fwd_pass_state = staticmethod(fwd_pass_state)
    compute_out_bwd = staticmethod(compute_out_bwd)
    state_passing_bwd = staticmethod(state_passing_bwd)
    chunk_state_bwd = staticmethod(chunk_state_bwd)


def _backward(ctx, g_y, g_final):
    return backward_with(RegisteredOps, ctx.saved_tensors, g_y, g_final)


chunk_scan.register_autograd(_backward, setup_context=_setup)
