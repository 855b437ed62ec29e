"""The public function's eager CUDA path: chunk_cumsum and chunk_scan, forward and backward, as one
autograd.Function that calls the kernels' launchers directly.

Each custom-op call goes through the dispatcher, the op's autograd wrapper and a dynamo-disabling frame before
it reaches its launcher; for the five to seven op calls of a forward+backward that layering costs about as
much host time as the launches themselves (on the CPU with the launches stubbed, T=512: 1.64 ms through the
ops, 0.78 ms calling the launchers), and at T <= 16K the H200 waits on the host. The launchers, their order
and the backward's composition (chunk_scan.backward_with) are the ops' own, so results are the same bits.

The ops stay what everything else sees: torch.compile (it traces the ops), dispatch and function modes,
functorch transforms, tensor subclasses, the profiler (its trace names the m2ops:: ops), and devices where
the kernels do not run (the ops' reference fallback).
"""

from __future__ import annotations

import torch

from . import dispatch
from .chunk_scan import backward_with

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def applies(*tensors) -> bool:
    """Whether the direct path may serve a call on these tensors (None entries are absent options)."""
    return tensors[0].is_cuda and context_allows(tensors) and dispatch.use_kernels(tensors[0].device)


def context_allows(tensors) -> bool:
    """No compile, mode, transform, profiler or tensor subclass that must see the ops."""
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._len_torch_function_stack() or torch._C._are_functorch_transforms_active()
            or torch.autograd._profiler_enabled()):
        return False
    return all(t is None or type(t) in _PLAIN for t in tensors)


class _ScanCombined(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, chunk_size, dt_softplus, dt_min,
                dt_max):
        from .. import kernels
        dt_out, dA_cumsum = kernels.chunk_cumsum(dt, A, dt_bias, chunk_size, dt_softplus, dt_min, dt_max)
        y, final_states = kernels.chunk_scan(x, dt_out, dA_cumsum, B, C, initial_states, D, z, seq_idx)
        ctx.save_for_backward(x, dt_out, dA_cumsum, B, C, initial_states, D, z, seq_idx, dt, A, dt_bias)
        ctx.params = (chunk_size, dt_softplus, dt_min, dt_max)
        return y, final_states

    @staticmethod
    def backward(ctx, g_y, g_final):
        from .. import kernels
        *saved, dt, A, dt_bias = ctx.saved_tensors
        g_x, g_dt_out, g_dA_cumsum, g_B, g_C, g_init, g_D, g_z, _ = backward_with(kernels, saved, g_y, g_final)
        g_dt, g_A, g_bias = kernels.chunk_cumsum_bwd(g_dt_out, g_dA_cumsum, dt, A, dt_bias, *ctx.params)
        return (g_x, g_dt, g_A, g_B, g_C, g_D, g_z, g_bias if dt_bias is not None else None, g_init,
                None, None, None, None, None)


def scan_combined(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus, dt_min, dt_max):
    """y and the final states, as ops.chunk_cumsum followed by ops.chunk_scan would give them."""
    return _ScanCombined.apply(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, chunk_size,
                               bool(dt_softplus), dt_min, dt_max)
