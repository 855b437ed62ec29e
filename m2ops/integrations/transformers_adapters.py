"""m2ops behind the signatures of transformers' Mamba-2 helpers (transformers 5.x).

Every Mamba-2 family module in transformers (modeling_mamba2, modeling_bamba, ...) defines the same five functions
and its mixer calls them by module-level name; each function here has exactly the parameters of the one it stands
for (transformers_families.py checks that against the installed transformers), and reads the rest of the model's
keyword arguments (z, seq_idx, cu_seqlens) from **kwargs as transformers' own wrappers do, ignoring the others.
The gated-norm forwards replace the forward of the families' *RMSNormGated classes.
"""

from __future__ import annotations

import torch

from ..conv1d import causal_conv1d_fn, causal_conv1d_update
from ..gated_norm import rms_norm_gated
from ..ops.state_update_inplace import selective_state_update
from ..scan_combined import mamba_chunk_scan_combined

_SILU = (None, "silu", "swish")


def _activation(y, activation):
    """An activation m2ops's convolution does not apply itself, applied the way transformers' fallback does."""
    from transformers.activations import ACT2FN
    return ACT2FN[activation](y)


def chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None, dt_softplus=False,
               dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
    """mamba2_chunk_scan -> m2ops.mamba_chunk_scan_combined (prefill, and every forward without a cache).

    From kwargs: z (gate), seq_idx / cu_seqlens (packed sequences; with cu_seqlens an initial state per sequence,
    (num_sequences, nheads, headdim, dstate), is accepted too)."""
    return mamba_chunk_scan_combined(hidden_states, dt, A, B, C, int(chunk_size), D=D, z=kwargs.get("z"),
                                     dt_bias=dt_bias, initial_states=initial_states, seq_idx=kwargs.get("seq_idx"),
                                     cu_seqlens=kwargs.get("cu_seqlens"), dt_softplus=dt_softplus,
                                     dt_limit=(float(dt_limit[0]), float(dt_limit[1])),
                                     return_final_states=return_final_states)


def state_update(state, hidden_states, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, z=None, **kwargs):
    """mamba2_selective_state_update -> m2ops.selective_state_update: one decoding token, `state` (the cache's
    recurrent state) updated in place, y returned.

    No dt_limit, as in transformers' own decode step (its chunked path applies config.time_step_limit, its decode
    path does not: the same here, so that m2ops matches transformers token for token)."""
    return selective_state_update(state, hidden_states, dt, A, B, C, D=D, z=z, dt_bias=dt_bias,
                                  dt_softplus=dt_softplus)


def _packed_seq_idx(L, seq_idx, cu_seqlens):
    """seq_idx for a convolution input of L columns whose real tokens are the last ones (transformers prepends the
    cached inputs when it has a cache): the cached columns count as sequence 0, the rule m2ops applies to initial
    states, so sequence 0 continues the cache. Traceable (no host read of cu_seqlens)."""
    if seq_idx is None and cu_seqlens is not None:
        pos = torch.arange(L, device=cu_seqlens.device, dtype=cu_seqlens.dtype) - L + cu_seqlens[-1]
        seq_idx = torch.searchsorted(cu_seqlens[1:].contiguous(), pos.clamp_min(0), right=True)
        return seq_idx.to(torch.int32).unsqueeze(0)
    if seq_idx is not None and seq_idx.shape[-1] < L:
        seq_idx = torch.nn.functional.pad(seq_idx, (L - seq_idx.shape[-1], 0))
    return seq_idx


def conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
    """causal_conv1d_fn (hidden_states (batch, channels, seqlen)) -> m2ops.causal_conv1d_fn, which restarts at
    packed-sequence boundaries (seq_idx or cu_seqlens from kwargs)."""
    seq_idx = _packed_seq_idx(hidden_states.shape[-1], kwargs.get("seq_idx"), kwargs.get("cu_seqlens"))
    if activation in _SILU:
        return causal_conv1d_fn(hidden_states, weight, bias, seq_idx, activation=activation)
    return _activation(causal_conv1d_fn(hidden_states, weight, bias, seq_idx), activation)


def conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None):
    """causal_conv1d_update (one decoding token, hidden_states (batch, channels, 1)) -> m2ops.causal_conv1d_update:
    conv_state, the cache's (batch, channels, width) inputs, shifts by one in place."""
    if activation in _SILU:
        return causal_conv1d_update(hidden_states, conv_state, weight, bias, activation)
    return _activation(causal_conv1d_update(hidden_states, conv_state, weight, bias), activation)


def split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states=None,
                               dt_limit=(0.0, float("inf")), return_final_states=False, activation="silu",
                               rmsnorm_weight=None, rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None,
                               headdim=None, ngroups=1, norm_before_gate=True, **kwargs):
    """mamba2_split_conv1d_scan_combined (the fused training call) -> None, which every mixer reads as "no fused
    kernel": it goes on with its unfused path, i.e. the convolution, scan and norm above, all differentiable. That
    path keeps transformers' own semantics (padding mask after the convolution, FalconH1's norm order), which the
    fused call does not carry."""
    return None


def norm_forward_grouped(self, hidden_states, gate=None):
    """forward of MambaRMSNormGated and its copies (Bamba, GraniteMoeHybrid, NemotronH, Zamba2): gate applied
    before a per-group RMSNorm (group_size channels), then the weight -> m2ops.rms_norm_gated."""
    y = rms_norm_gated(hidden_states, self.weight, z=gate, eps=self.variance_epsilon, group_size=self.group_size,
                       norm_before_gate=False)
    # transformers multiplies by the weight after casting back to the input's dtype: keep its result dtype.
    return y.to(torch.promote_types(hidden_states.dtype, self.weight.dtype))


def norm_forward_falcon_h1(self, hidden_states, gate=None):
    """forward of FalconH1RMSNormGated: n_groups groups, the gate before or after the norm (norm_before_gate), the
    result in the input's dtype -> m2ops.rms_norm_gated."""
    return rms_norm_gated(hidden_states, self.weight, z=gate, eps=self.variance_epsilon,
                          group_size=hidden_states.shape[-1] // self.n_groups,
                          norm_before_gate=bool(self.norm_before_gate))


# Module attribute of a Mamba-2 family -> its m2ops adapter (transformers_families.py checks the signatures).
FUNCTIONS = {
    "mamba2_chunk_scan": chunk_scan,
    "mamba2_selective_state_update": state_update,
    "causal_conv1d_fn": conv1d_fn,
    "causal_conv1d_update": conv1d_update,
    "mamba2_split_conv1d_scan_combined": split_conv1d_scan_combined,
}

# The gated-norm classes by their constructor's parameters -> the forward that stands for theirs.
NORM_FORWARDS = {
    ("hidden_size", "group_size", "eps"): norm_forward_grouped,
    ("hidden_size", "eps", "n_groups", "norm_before_gate"): norm_forward_falcon_h1,
}
