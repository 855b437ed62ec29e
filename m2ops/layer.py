"""m2ops.Mamba2: a Mamba-2 mixer layer whose scan runs on the m2ops ops.

Parameters and their names, shapes and initialisation follow mamba_ssm 2.3.2's `Mamba2` module, so a state
dict saved from it loads unchanged:

    in_proj.weight   (2*d_inner + 2*ngroups*d_state + nheads, d_model)   output order z, x, B, C, dt
    conv1d.weight    (conv_dim, 1, d_conv), conv1d.bias (conv_dim,)      conv_dim = d_ssm + 2*ngroups*d_state
    dt_bias, A_log   (nheads,)
    D                (nheads,), or (d_ssm,) with D_has_hdim
    norm.weight      (d_ssm,)                                            gated RMSNorm, with rmsnorm=True
    out_proj.weight  (d_model, d_inner)

What differs from mamba_ssm, on purpose:
- The causal convolution (m2ops.causal_conv1d_fn, cuTile kernels on the GPU) restarts at sequence boundaries
  given by seq_idx or cu_seqlens: a tap never reads a token of another packed sequence.
- There is no inference_params: `forward(..., return_final_states=True)` returns the decoding caches after a
  prompt (per packed sequence with cu_seqlens), and `step` updates them in place, as mamba_ssm's step does.
- `step` applies dt_limit like `forward` does (mamba_ssm's step ignores it), so prefill + decode equals one
  forward over the whole sequence.
- cp_group (context parallelism): each rank of the group passes its contiguous slice of the sequence
  (m2ops/distributed/context_layer.py, docs/distributed.md).
- process_group (tensor parallelism, m2ops/distributed/tensor_parallel.py, docs/distributed.md): each rank holds
  mamba_ssm's shard of the heads and groups, but out_proj's bias is on every rank (mamba_ssm: rank 0 only), added
  once after the reduction; with sequence_parallel, 3-D u is split along the sequence (mamba_ssm gathers along
  dim 0, the batch). load_full_state_dict loads a rank's shard from the one-GPU state dict.

use_mem_eff_path (default True), as in mamba_ssm: a forward that autograd records (gradients enabled, something
requiring them) and returns no final states runs everything after in_proj as one op, m2ops.mixer_fn, whose autograd
keeps only in_proj's output and the scan's output (besides the parameters); its backward recomputes the
convolution, the dt tensors and the gated norm's output. Otherwise (use_mem_eff_path=False, inference,
return_final_states) the ops run one after another, each keeping what its own backward reads. The two agree (float64:
to 1e-10, tests/test_layer_mem_eff.py; on a GPU to rounding: the plain path's backward reuses the scan's bfloat16
entering states, this one recomputes them in float32).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import ops
from .meta.shapes import compute_dtype
from .meta.validate import FLOAT_DTYPES
from .conv1d import causal_conv1d_fn
from .gated_norm import rms_norm_gated
from .mixer_fn import mixer_fn
from .reference.state_update import decay_rates
from .scan_combined import mamba_chunk_scan_combined


def _fail(where, kind, name, expected, got):
    raise kind(f"m2ops.Mamba2.{where}: {name} must be {expected}; got {got}")


def _check_shape(where, name, t, expected, desc):
    if not isinstance(t, torch.Tensor):
        _fail(where, TypeError, name, "a torch.Tensor", type(t).__name__)
    if t.dtype not in FLOAT_DTYPES:
        _fail(where, TypeError, name, "a floating-point tensor", t.dtype)
    if tuple(t.shape) != tuple(expected):
        _fail(where, ValueError, name, f"of shape {desc} = {tuple(expected)}", tuple(t.shape))


def _check_tensor(where, name, t, ndim, desc):
    if not isinstance(t, torch.Tensor):
        _fail(where, TypeError, name, "a torch.Tensor", type(t).__name__)
    if t.dtype not in FLOAT_DTYPES:
        _fail(where, TypeError, name, "a floating-point tensor", t.dtype)
    if t.dim() != ndim:
        _fail(where, ValueError, name, f"{ndim}-dimensional {desc}", tuple(t.shape))


def _tensor_parallel():
    """m2ops.distributed.tensor_parallel, imported on first use (it imports torch.distributed)."""
    from .distributed import tensor_parallel
    return tensor_parallel


class RMSNormGated(nn.Module):
    """RMSNorm with a silu(z) gate, per group of `group_size` channels (mamba_ssm's layernorm_gated.RMSNorm
    semantics: gate before the norm unless norm_before_gate), through m2ops.rms_norm_gated (cuTile kernels on the
    GPU; computed in float32, or float64 for float64 inputs)."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.group_size = hidden_size if group_size is None else group_size
        self.norm_before_gate = norm_before_gate
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x, z=None):
        return rms_norm_gated(x, self.weight, z, None, self.eps, self.group_size, self.norm_before_gate)


class Mamba2(nn.Module):
    """The Mamba-2 mixer (mamba_ssm.modules.mamba2.Mamba2's parameters and arguments) on m2ops.

    forward(u) maps (batch, seqlen, d_model) to the same shape; with return_final_states=True it also returns
    the decoding caches (conv_state, ssm_state), which `step` then advances one token at a time.
    """

    def __init__(self, d_model, d_state=128, d_conv=4, conv_init=None, expand=2, headdim=64, d_ssm=None,
                 ngroups=1, A_init_range=(1, 16), D_has_hdim=False, rmsnorm=True, norm_before_gate=False,
                 dt_min=0.001, dt_max=0.1, dt_init_floor=1e-4, dt_limit=(0.0, float("inf")), bias=False,
                 conv_bias=True, chunk_size=256, use_mem_eff_path=True, layer_idx=None, process_group=None,
                 sequence_parallel=True, cp_group=None, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.d_model, self.d_state, self.d_conv, self.expand = d_model, d_state, d_conv, expand
        self.conv_init = conv_init
        self.d_inner = expand * d_model
        self.headdim = headdim
        self.d_ssm = self.d_inner if d_ssm is None else d_ssm
        if self.d_ssm % headdim != 0:
            raise ValueError(f"m2ops.Mamba2: headdim={headdim} must divide d_ssm={self.d_ssm}")
        self.nheads = self.d_ssm // headdim
        if ngroups < 1 or self.nheads % ngroups != 0:
            raise ValueError(f"m2ops.Mamba2: ngroups={ngroups} must divide nheads={self.nheads}")
        self.ngroups = ngroups
        # With process_group, the sizes above become this rank's shard's (m2ops/distributed/tensor_parallel.py).
        self.tp_group, self.tp_rank, self.tp_world, self.sequence_parallel = None, 0, 1, sequence_parallel
        if process_group is not None:
            _tensor_parallel().setup(self, process_group, cp_group)
        self.D_has_hdim, self.rmsnorm, self.norm_before_gate = D_has_hdim, rmsnorm, norm_before_gate
        self.dt_limit = (float(dt_limit[0]), float(dt_limit[1]))
        self.activation = "silu"
        self.chunk_size = chunk_size
        self.use_mem_eff_path = use_mem_eff_path  # training through m2ops.mixer_fn (see forward)
        self.layer_idx = layer_idx
        # The ranks sharing one sequence (None: the layer sees whole sequences); read at each forward.
        self.cp_group = cp_group

        d_in_proj = 2 * self.d_inner + 2 * self.ngroups * d_state + self.nheads
        self.in_proj = nn.Linear(d_model, d_in_proj, bias=bias, **factory)
        self.conv_dim = self.d_ssm + 2 * self.ngroups * d_state
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel_size=d_conv, groups=self.conv_dim,
                                padding=d_conv - 1, bias=conv_bias, **factory)
        if conv_init is not None:
            nn.init.uniform_(self.conv1d.weight, -conv_init, conv_init)
        self.act = nn.SiLU()

        # dt_bias = softplus^-1(dt) for dt log-uniform in [dt_min, dt_max], floored: the initial step sizes.
        dt = torch.exp(torch.rand(self.nheads, **factory) * (math.log(dt_max) - math.log(dt_min))
                       + math.log(dt_min)).clamp(min=dt_init_floor)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        if not (A_init_range[0] > 0 and A_init_range[1] >= A_init_range[0]):
            raise ValueError(f"m2ops.Mamba2: A_init_range must be (lo, hi) with 0 < lo <= hi; got {A_init_range}")
        A = torch.empty(self.nheads, dtype=torch.float32, device=device).uniform_(*A_init_range)
        self.A_log = nn.Parameter(torch.log(A).to(dtype=dtype))
        # D stays float32 whatever `dtype` is, as in mamba_ssm.
        self.D = nn.Parameter(torch.ones(self.d_ssm if D_has_hdim else self.nheads, device=device))
        for p in (self.dt_bias, self.A_log, self.D):
            p._no_weight_decay = True
        if rmsnorm:
            self.norm = RMSNormGated(self.d_ssm, eps=1e-5, norm_before_gate=norm_before_gate,
                                     group_size=self.d_ssm // self.ngroups, **factory)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias, **factory)

    # -----------------------------------------------------------------------------------------------------
    # pieces shared by forward and step
    # -----------------------------------------------------------------------------------------------------

    def _split(self, zxbcdt):
        d_mlp = self.d_inner - self.d_ssm
        return torch.split(zxbcdt, [d_mlp, d_mlp, self.d_ssm, self.conv_dim, self.nheads], dim=-1)

    def _A(self):
        return decay_rates(self.A_log)

    def _D(self):
        return self.D.view(self.nheads, self.headdim) if self.D_has_hdim else self.D

    def _finish(self, y, z, z0, x0):
        """Gated norm (the gate z goes into the norm, not the scan, with rmsnorm), MLP part, out_proj (with
        tensor parallelism, this rank's partial sum: the bias comes after the reduction, tensor_parallel.leave)."""
        if self.rmsnorm:
            y = self.norm(y, z)
        if z0.shape[-1] > 0:
            y = torch.cat([F.silu(z0) * x0, y], dim=-1)
        return self.out_proj(y) if self.tp_group is None else F.linear(y, self.out_proj.weight)

    def _output(self, out, seqlen):
        """out_proj's output as forward returns it: flattened with seqlen; reduced over process_group."""
        out = out.flatten(0, 1) if seqlen is not None else out
        return out if self.tp_group is None else _tensor_parallel().leave(self, out, seqlen)

    def _mem_eff(self, zxbcdt, cache, return_final_states):
        """Whether forward takes the memory-efficient path: use_mem_eff_path, a backward to come (gradients
        recorded, something requiring them) and no final states to return."""
        if not (self.use_mem_eff_path and torch.is_grad_enabled()) or return_final_states:
            return False
        tensors = (zxbcdt, *(cache or ()), *self.parameters())
        return any(t.requires_grad for t in tensors)

    def _mixer_mem_eff(self, zxbcdt, seq_idx, cu_seqlens, conv_cache, ssm_cache):
        """Everything after in_proj as one op (m2ops.mixer_fn) whose autograd keeps zxbcdt and the scan's output
        only; its backward recomputes the convolution, the dt tensors and the norm's output."""
        norm = self.norm if self.rmsnorm else None
        return mixer_fn(
            zxbcdt, self.conv1d.weight, self.conv1d.bias, self.dt_bias, self._A(), self._D(),
            None if norm is None else norm.weight, self.out_proj.weight,
            self.out_proj.bias if self.tp_group is None else None,  # (with process_group: after the reduction)
            chunk_size=self.chunk_size, headdim=self.headdim, ngroups=self.ngroups, dt_limit=self.dt_limit,
            seq_idx=seq_idx, cu_seqlens=cu_seqlens,
            conv_initial_states=None if conv_cache is None else conv_cache[:, :, 1:], ssm_initial_states=ssm_cache,
            norm_eps=1e-5 if norm is None else norm.eps, norm_group_size=None if norm is None else norm.group_size,
            norm_before_gate=self.norm_before_gate)

    # -----------------------------------------------------------------------------------------------------

    def forward(self, u, seqlen=None, seq_idx=None, cu_seqlens=None, cache=None, return_final_states=False):
        """u (batch, seqlen, d_model) -> (batch, seqlen, d_model); with `seqlen`, u is (batch * seqlen, d_model)
        and so is the output.

        seq_idx (batch, seqlen) / cu_seqlens (num_sequences + 1,) pack several sequences along seqlen: the
        convolution and the scan restart at each boundary. cache: optional (conv_state, ssm_state) to continue
        from (a previous prompt's caches). return_final_states: also return (conv_state, ssm_state) after the
        last token, per packed sequence with cu_seqlens: (num_sequences, conv_dim, d_conv) and
        (num_sequences, nheads, headdim, d_state).

        With cp_group, u is this rank's contiguous slice of the sequence (rank order, at least d_conv tokens),
        seq_idx this rank's slice of the whole sequence's ids, cache the state before the whole sequence and the
        returned caches those after its last token, the same on every rank; cu_seqlens is not taken
        (docs/distributed.md).
        """
        if self.cp_group is not None:
            from .distributed.context_layer import forward as forward_across_ranks
            return forward_across_ranks(self, u, seqlen, seq_idx, cu_seqlens, cache, return_final_states)
        return self._forward_whole(u, seqlen, seq_idx, cu_seqlens, cache, return_final_states)

    def _check_u(self, u, seqlen):
        _check_tensor("forward", "u", u, 3 if seqlen is None else 2,
                      "(batch, seqlen, d_model)" if seqlen is None else "(batch * seqlen, d_model)")
        if u.shape[-1] != self.d_model:
            _fail("forward", ValueError, "u", f"of last dimension d_model={self.d_model}", tuple(u.shape))

    def _check_ids_and_cache(self, batch, L, seq_idx, cache):
        """seq_idx (batch, L) and cache (conv_state, ssm_state) for u of batch x L tokens."""
        if seq_idx is not None:  # checked before the convolution reads it; the scan checks it again
            if not isinstance(seq_idx, torch.Tensor) or seq_idx.is_floating_point():
                _fail("forward", TypeError, "seq_idx", "an integer tensor",
                      getattr(seq_idx, "dtype", type(seq_idx).__name__))
            if tuple(seq_idx.shape) != (batch, L):
                _fail("forward", ValueError, "seq_idx", f"an integer tensor of shape (batch, seqlen) = ({batch}, {L})",
                      tuple(seq_idx.shape))
        if cache is not None:
            conv_cache, ssm_cache = cache
            _check_shape("forward", "cache[0] (conv_state)", conv_cache, (batch, self.conv_dim, self.d_conv),
                         "(batch, conv_dim, d_conv)")
            _check_shape("forward", "cache[1] (ssm_state)", ssm_cache,
                         (batch, self.nheads, self.headdim, self.d_state), "(batch, nheads, headdim, d_state)")

    def _forward_whole(self, u, seqlen, seq_idx, cu_seqlens, cache, return_final_states):
        """forward on whole sequences (no cp_group, or a group of one rank)."""
        self._check_u(u, seqlen)
        if self.tp_group is not None:  # replicated, or with sequence_parallel gathered from every rank's share
            u = _tensor_parallel().enter(self, u, seqlen)
        if seqlen is not None:
            u = u.reshape(-1, seqlen, self.d_model)
        batch, L, _ = u.shape
        self._check_ids_and_cache(batch, L, seq_idx, cache)
        conv_cache, ssm_cache = cache if cache is not None else (None, None)

        zxbcdt = self.in_proj(u)
        if self._mem_eff(zxbcdt, cache, return_final_states):
            return self._output(self._mixer_mem_eff(zxbcdt, seq_idx, cu_seqlens, conv_cache, ssm_cache), seqlen)
        z0, x0, z, xBC, dt = self._split(zxbcdt)
        want_varlen = return_final_states and cu_seqlens is not None
        # The convolution (+ SiLU) restarts where seq_idx / cu_seqlens start a sequence; its final states (the
        # last d_conv inputs, per packed sequence with cu_seqlens) are the decoding cache. Its output comes back
        # channel-last, so the split below is of contiguous rows.
        conv = causal_conv1d_fn(xBC.transpose(1, 2), self.conv1d.weight, self.conv1d.bias, seq_idx=seq_idx,
                                initial_states=None if conv_cache is None else conv_cache[:, :, 1:],
                                return_final_states=return_final_states, activation="silu", cu_seqlens=cu_seqlens,
                                state_len=self.d_conv)
        xBC, conv_state = conv if return_final_states else (conv, None)
        x, B, C = torch.split(xBC.transpose(1, 2), [self.d_ssm, self.ngroups * self.d_state,
                                                    self.ngroups * self.d_state], dim=-1)
        A = self._A()
        res = mamba_chunk_scan_combined(
            x.unflatten(-1, (self.nheads, self.headdim)), dt, A,
            B.unflatten(-1, (self.ngroups, self.d_state)), C.unflatten(-1, (self.ngroups, self.d_state)),
            chunk_size=self.chunk_size, D=self._D(),
            z=None if self.rmsnorm else z.unflatten(-1, (self.nheads, self.headdim)),
            dt_bias=self.dt_bias, initial_states=ssm_cache, seq_idx=seq_idx, cu_seqlens=cu_seqlens,
            dt_softplus=True, dt_limit=self.dt_limit, return_final_states=return_final_states and not want_varlen,
            return_varlen_states=want_varlen)
        y = res[0] if return_final_states else res
        out = self._output(self._finish(y.flatten(-2), z, z0, x0), seqlen)
        if not return_final_states:
            return out
        return out, conv_state.to(self.conv1d.weight.dtype), res[1]

    def step(self, hidden_states, conv_state, ssm_state):
        """One token: hidden_states (batch, 1, d_model), caches from allocate_inference_cache or a prompt's
        forward(..., return_final_states=True) -> (out (batch, 1, d_model), conv_state, ssm_state). The caches are
        updated in place, as mamba_ssm's step does, and returned (the same tensors): a decoding loop copies
        nothing cache-sized per token and captures into one CUDA graph. No gradients flow through step."""
        _check_tensor("step", "hidden_states", hidden_states, 3, "(batch, 1, d_model)")
        _check_shape("step", "hidden_states", hidden_states, (hidden_states.shape[0], 1, self.d_model),
                     "(batch, 1, d_model)")
        b = hidden_states.shape[0]
        _check_shape("step", "conv_state", conv_state, (b, self.conv_dim, self.d_conv), "(batch, conv_dim, d_conv)")
        _check_shape("step", "ssm_state", ssm_state, (b, self.nheads, self.headdim, self.d_state),
                     "(batch, nheads, headdim, d_state)")
        z0, x0, z, xBC, dt = self._split(self.in_proj(hidden_states[:, 0]))
        xBC = ops.causal_conv1d_update(xBC, conv_state, self.conv1d.weight[:, 0], self.conv1d.bias, True, None)
        x, B, C = torch.split(xBC, [self.d_ssm, self.ngroups * self.d_state, self.ngroups * self.d_state], dim=-1)
        x = x.unflatten(-1, (self.nheads, self.headdim))
        y = torch.empty_like(x)
        # A_log as is: the decay rates -exp(A_log) are formed in the kernel
        ops.state_update_inplace(
            ssm_state, x, dt, self.A_log, B.unflatten(-1, (self.ngroups, self.d_state)),
            C.unflatten(-1, (self.ngroups, self.d_state)), self._D(),
            None if self.rmsnorm else z.unflatten(-1, (self.nheads, self.headdim)), self.dt_bias, None, True,
            self.dt_limit[0], self.dt_limit[1], y, A_is_log=True)
        out = self._finish(y.flatten(-2), z, z0, x0)
        if self.tp_group is not None:  # no sequence split at decode: a sum over the group
            out = _tensor_parallel().leave(self, out, None, decode=True)
        return out.unsqueeze(1), conv_state, ssm_state

    def allocate_inference_cache(self, batch_size, max_seqlen=None, dtype=None, **kwargs):
        """Zero caches for `step`: conv_state (batch, conv_dim, d_conv) in the conv weight's dtype (or dtype),
        ssm_state (batch, nheads, headdim, d_state) in float32 (float64 for a float64 dtype): the scan's state
        dtype, so a prompt's final state and the decoding state agree. max_seqlen is unused (the caches do
        not grow)."""
        device = self.out_proj.weight.device
        conv_dtype = self.conv1d.weight.dtype if dtype is None else dtype
        conv_state = torch.zeros(batch_size, self.conv_dim, self.d_conv, device=device, dtype=conv_dtype)
        ssm_state = torch.zeros(batch_size, self.nheads, self.headdim, self.d_state, device=device,
                                dtype=compute_dtype(conv_dtype))
        return conv_state, ssm_state

    def load_full_state_dict(self, state_dict):
        """Load an unsharded state dict (the one-rank layer's or mamba_ssm's) into this rank's shard; strict."""
        return self.load_state_dict(_tensor_parallel().shard_state_dict(self, state_dict))

    def full_state_dict(self):
        """The unsharded state dict, gathered from the shards (with process_group every rank must call it)."""
        return _tensor_parallel().full_state_dict(self)


__all__ = ["Mamba2", "RMSNormGated"]
