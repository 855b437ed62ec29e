"""The public function's eager CUDA path: chunk_cumsum and chunk_scan, forward and backward, as one
autograd.Function that calls the kernels' launchers directly.

Each custom-op call goes through the dispatcher, the op's autograd wrapper and a dynamo-disabling frame before
it reaches its launcher; for the five to seven op calls of a forward+backward that layering costs about as
much host time as the launches themselves (on the CPU with the launches stubbed, T=512: 1.64 ms through the
ops, 0.78 ms calling the launchers), and at T <= 16K the H200 waits on the host. The launchers, their order
and the backward's composition (chunk_scan.backward_with) are the ops' own, so results are the same bits but
for one difference (KEEP_STATES below): where the forward wrote bfloat16 entering states, the backward reuses
them instead of recomputing them in float32, which moves the gradients of dt, A and dt_bias by their rounding.

Without gradients the call goes further: kernels.planned.planned_forward keeps, per signature (sizes, dtypes, options,
device, the launch config: kernels.config.current()), everything chunk_cumsum and chunk_scan decide from their inputs, and a
repeated call only allocates and launches the same five kernels (same bits; the tuning cache's entry is checked
every call, so a new or changed entry takes effect as it does for the launchers). A call whose arguments match,
in everything the checks read, one that passed them and ran a plan goes to that plan first (call_key and
remembered_call, at the end of this module).

The ops stay what everything else sees: torch.compile (it traces the ops), dispatch and function modes,
functorch transforms, tensor subclasses, and devices where the kernels do not run (the ops' reference
fallback). Under the profiler each launcher runs inside a record_function of its op's name (m2ops::chunk_scan,
m2ops::compute_out_bwd, ...), so a trace names the same steps either way.
"""

from __future__ import annotations

import torch

from .. import envvars
from .chunk_scan import backward_with

_PLAIN = (torch.Tensor, torch.nn.Parameter)

# Where the forward's two-op path writes the states entering every chunk in bfloat16 (for compute_out's
# bfloat16 product), keep them for the backward instead of recomputing them there in float32 (chunk_state and
# state_passing again: 0.82 of 10.4 ms at 64K tokens, 80 heads, dstate 128 on an H200). The cost: that tensor,
# (batch, chunks, heads, headdim, dstate) in bfloat16, stays alive until the backward (2 * heads * headdim *
# dstate / chunk_size bytes per token: 5 KB at 80 x 64 x 128, chunk 256). M2OPS_RECOMPUTE_STATES=1 keeps the
# recompute (and the memory).
KEEP_STATES = not envvars.switch("M2OPS_RECOMPUTE_STATES", False)


def applies(serve: bool, x, tensors: tuple) -> bool:
    """Whether the direct path serves a call on x: the kernels serve it (serve: dispatch.kernels_serve's answer for
    the call) and nothing that must see the ops is active (context_allows, on every tensor: None entries are absent
    options)."""
    return serve and x.is_cuda and context_allows(tensors)


def context_allows(tensors) -> bool:
    """No compile, mode, transform, profiler or tensor subclass that must see the ops."""
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._len_torch_function_stack() or torch._C._are_functorch_transforms_active()):
        return False
    return all(t is None or type(t) in _PLAIN for t in tensors)


_LAUNCH = []


def _planned_module():
    """m2ops.kernels.planned, imported on first use (this module loads where cuTile is absent too)."""
    if not _LAUNCH:
        from ..kernels import planned
        _LAUNCH.append(planned)
    return _LAUNCH[0]


def _launcher(name: str):
    """m2ops.kernels.<name>, inside a record_function named like its op while a profiler runs."""
    def call(*args, **kwargs):
        from .. import kernels
        fn = getattr(kernels, name)
        if torch.autograd._profiler_enabled():
            with torch.autograd.profiler.record_function(f"m2ops::{name}"):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)
    call.__name__ = name
    return call


class _Launchers:
    chunk_cumsum = staticmethod(_launcher("chunk_cumsum"))
    chunk_scan = staticmethod(_launcher("chunk_scan"))
    fwd_pass_state = staticmethod(_launcher("fwd_pass_state"))
    compute_out_bwd = staticmethod(_launcher("compute_out_bwd"))
    state_passing_bwd = staticmethod(_launcher("state_passing_bwd"))
    chunk_state_bwd = staticmethod(_launcher("chunk_state_bwd"))
    chunk_cumsum_bwd = staticmethod(_launcher("chunk_cumsum_bwd"))


class _ScanCombined(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, chunk_size, dt_softplus, dt_min,
                dt_max):
        dt_out, dA_cumsum = _Launchers.chunk_cumsum(dt, A, dt_bias, chunk_size, dt_softplus, dt_min, dt_max)
        y, final_states, states = _Launchers.chunk_scan(x, dt_out, dA_cumsum, B, C, initial_states, D, z, seq_idx,
                                                        keep_states=True)
        if not (KEEP_STATES and any(ctx.needs_input_grad)):
            states = None  # written for compute_out anyway; only not kept
        ctx.save_for_backward(x, dt_out, dA_cumsum, B, C, initial_states, D, z, seq_idx, dt, A, dt_bias, states)
        ctx.params = (chunk_size, dt_softplus, dt_min, dt_max)
        return y, final_states

    @staticmethod
    def backward(ctx, g_y, g_final):
        *saved, dt, A, dt_bias, states = ctx.saved_tensors
        g_x, g_dt_out, g_dA_cumsum, g_B, g_C, g_init, g_D, g_z, _ = backward_with(_Launchers, saved, g_y, g_final,
                                                                                 states)
        g_dt, g_A, g_bias = _Launchers.chunk_cumsum_bwd(g_dt_out, g_dA_cumsum, dt, A, dt_bias, *ctx.params)
        return (g_x, g_dt, g_A, g_B, g_C, g_D, g_z, g_bias if dt_bias is not None else None, g_init,
                None, None, None, None, None)


def scan_combined(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus, dt_min, dt_max,
                  key=None):
    """y and the final states, as ops.chunk_cumsum followed by ops.chunk_scan would give them. key: the public
    call's call_key, under which a plan that serves this call is kept (remembered_call)."""
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                            for t in (x, dt, A, B, C, D, z, dt_bias, initial_states))):
        # Nothing to differentiate: the launchers without the autograd Function (its context and saved tensors
        # cost the host about 10 us a call; inference and benchmarks take this path), and where this signature
        # has a planned.ForwardPlan, not even the launchers' own checks and decisions.
        if seq_idx is None:
            out = _planned_module().planned_forward(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states,
                                                   dt_softplus, dt_min, dt_max, key)
            if out is not None:
                return out
        dt_out, dA_cumsum = _Launchers.chunk_cumsum(dt, A, dt_bias, chunk_size, bool(dt_softplus), dt_min, dt_max)
        return _Launchers.chunk_scan(x, dt_out, dA_cumsum, B, C, initial_states, D, z, seq_idx)
    return _ScanCombined.apply(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, chunk_size,
                               bool(dt_softplus), dt_min, dt_max)


# ---- a repeated call without gradients, straight to its plan ----
# The public call's checks (check_inputs), this module's dispatch (applies, the gradient test) and
# planned_forward's own signature cost the H200's host about 35 of a planned forward's 117 us at 4K tokens
# (measure/plan_cost.py --ladder), against 40 us for the five launches. A call whose key matches one that passed
# all of them and ran a plan (planned.CALL_PLANS) goes to that plan directly. The key holds everything those steps
# read from the arguments: each tensor's exact type, size, dtype, layout, device and contiguity, and the plain arguments
# with their types, and the launch config, so an argument check cannot come out differently; what they read from
# elsewhere (compile, modes, transforms, the profiler, gradient mode and requires_grad, the tuning cache) is looked
# at on every call.

def call_key(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus, dt_limit,
             return_final_states, return_varlen_states, first=False):
    """The public call's key for planned.CALL_PLANS, or None: no plan is kept yet (unless first: the call is about
    to take the direct path, having passed the checks), or the call is of a kind that is never kept (seq_idx,
    cu_seqlens, varlen states, dt_limit not a tuple, a tensor of another type than torch.Tensor or
    nn.Parameter, plain arguments not of the exact builtin types). Never raises, whatever the arguments."""
    if torch.compiler.is_compiling():  # (first: dynamo then never reads the rest)
        return None
    if first:
        _planned_module()
    elif not _LAUNCH or not _LAUNCH[0].CALL_PLANS:
        return None
    if (seq_idx is not None or cu_seqlens is not None or return_varlen_states is not False
            or type(dt_limit) is not tuple or len(dt_limit) != 2):
        return None
    metas = []
    try:  # (a sparse or otherwise unusual tensor may raise here; check_inputs then says what is wrong)
        for t in (x, dt, A, B, C, D, z, dt_bias, initial_states):
            if t is None:
                metas.append(None)
            elif type(t) in _PLAIN:
                metas.append((type(t), t.shape, t.dtype, t.layout, t.device, t.is_contiguous()))
            else:
                return None
    except Exception:  # noqa: BLE001
        return None
    lo, hi = dt_limit
    # Plain values of exact builtin types only: anything else (a bool chunk size, a list, an unhashable object) is
    # left to check_inputs, whose error it must raise.
    if (type(chunk_size) is not int or type(dt_softplus) is not bool or type(return_final_states) is not bool
            or type(lo) not in (int, float) or type(hi) not in (int, float)):
        return None
    return (*metas, chunk_size, dt_softplus, type(lo), lo, type(hi), hi, return_final_states,
            _LAUNCH[0].config.current())


def remembered_call(key, x, dt, A, B, C, D, z, dt_bias, initial_states):
    """(y, final states) from the plan kept under key, or None where the call must take the whole path: no plan
    under key, or something besides the arguments that the path looks at is not as it was (a compile, mode,
    transform or profiler; a tensor requiring its gradient with gradients on; the tuning cache's entry changed)."""
    planned = _LAUNCH[0]
    fp = planned.CALL_PLANS.get(key)
    if fp is None:
        return None
    if torch.autograd._profiler_enabled() or not context_allows(()):
        return None
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (x, dt, A, B, C, D, z, dt_bias, initial_states)):
        return None
    if not planned.forward_plan_current(fp):
        return None
    return planned.run_forward(fp, x, dt, A, B, C, D, z, dt_bias, initial_states)
