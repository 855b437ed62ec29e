"""m2ops.mixer_fn: the Mamba-2 layer from in_proj's output to out_proj's output, trained by recomputing instead of
storing (m2ops.Mamba2's path with use_mem_eff_path=True; mamba_ssm's mamba_split_conv1d_scan_combined keeps the
same). It reads top-down: checks (those of causal_conv1d_fn, mamba_chunk_scan_combined and rms_norm_gated, so a
bad call fails with their messages), the chunk size the scan runs at (as the public scan decides it), one op:
m2ops::mixer (ops/mixer.py), whose registered backward recomputes the convolution, the dt tensors and the norm.
"""

from __future__ import annotations

import torch

from .meta import conv_validate
from .meta.mixer import check_sizes, split_xbc, split_zxbcdt
from .meta.norm_validate import check_rms_norm_gated_inputs
from .meta.validate import check_inputs, check_values, seq_idx_from_cu_seqlens, should_check_values
from .ops import dispatch
from .ops.mixer import mixer


def mixer_fn(zxbcdt, conv_weight, conv_bias, dt_bias, A, D, norm_weight, out_weight, out_bias, *, chunk_size,
             headdim, ngroups, dt_limit=(0.0, float("inf")), seq_idx=None, cu_seqlens=None,
             conv_initial_states=None, ssm_initial_states=None, norm_eps=1e-5, norm_group_size=None,
             norm_before_gate=False):
    """The Mamba-2 mixer after in_proj: causal convolution + SiLU of xBC, the scan (dt_bias, softplus, dt_limit, D;
    the gate z goes into the scan when norm_weight is None), the gated RMSNorm (when norm_weight is given), the
    gated MLP part silu(z0) * x0 in front (d_ssm < d_inner), out_proj. Equal to m2ops.Mamba2's composition of
    causal_conv1d_fn, mamba_chunk_scan_combined, rms_norm_gated and F.linear, but its autograd keeps only zxbcdt,
    the scan's output and the parameters for the backward, which recomputes the rest (m2ops/ops/mixer.py).

    Args:
        zxbcdt: (batch, seqlen, 2*d_mlp + d_ssm + conv_dim + nheads), in_proj's output: z0, x0, z, xBC, dt.
        conv_weight: (conv_dim, d_conv) or nn.Conv1d's (conv_dim, 1, d_conv); conv_bias: optional (conv_dim,).
        dt_bias: (nheads,); A: (nheads,) decay rates (-exp(A_log)); D: optional (nheads,) or (nheads, headdim).
        norm_weight: (d_ssm,) for the gated RMSNorm, or None (no norm; z gates the scan's output).
        out_weight: (d_model, d_inner), d_inner = d_mlp + d_ssm; out_bias: optional (d_model,).
        chunk_size, dt_limit, seq_idx, cu_seqlens: as in mamba_chunk_scan_combined; the convolution restarts at the
            same boundaries. On a GPU the scan runs at the chunk size the public scan would (dispatch.run_chunk_size).
        headdim, ngroups: the scan's head size and number of B/C groups (d_ssm = nheads * headdim, conv_dim =
            d_ssm + 2 * ngroups * d_state).
        conv_initial_states: optional (batch, conv_dim, d_conv - 1) convolution history (sequence 0's);
        ssm_initial_states: optional (batch, nheads, headdim, d_state) state before token 0.
        norm_eps, norm_group_size (None: d_ssm), norm_before_gate: the gated RMSNorm's options.

    Returns:
        (batch, seqlen, d_model). Differentiable in zxbcdt, every parameter and the initial states.
    """
    if isinstance(conv_weight, torch.Tensor) and conv_weight.dim() == 3 and conv_weight.shape[1] == 1:
        conv_weight = conv_weight[:, 0]
    s = check_sizes(zxbcdt, conv_weight, dt_bias, out_weight, headdim, ngroups)
    _, _, z, xBC, dt = split_zxbcdt(zxbcdt, s)
    scan_z = None if norm_weight is not None else z.unflatten(-1, (s.nheads, s.headdim))
    seq_idx = _checked_seq_idx(xBC, dt, A, D, scan_z, dt_bias, conv_weight, conv_bias, seq_idx, cu_seqlens,
                               conv_initial_states, ssm_initial_states, chunk_size, dt_limit, s)
    group_size = s.d_ssm if norm_group_size is None else norm_group_size
    if norm_weight is not None:  # (the scan's output has z's shape and dtype)
        group_size = check_rms_norm_gated_inputs(z, norm_weight, z, None, norm_eps, group_size, norm_before_gate)
    if torch.is_autocast_enabled(zxbcdt.device.type):
        # Under autocast F.linear would run out_proj in the autocast dtype: the op gets the weights cast so (the
        # casts recorded outside it, the parameters' gradients come back in their own dtype).
        dtype = torch.get_autocast_dtype(zxbcdt.device.type)
        out_weight = out_weight.to(dtype)
        out_bias = None if out_bias is None else out_bias.to(dtype)
    # The chunk size the public scan would run at: kernels_serve decides from the tensors the scan reads (the
    # convolution's output has xBC's dtype).
    serve = dispatch.kernels_serve(zxbcdt.device, chunk_size, (xBC, dt, scan_z))
    run_chunk = dispatch.run_chunk_size(chunk_size, zxbcdt.shape[1], serve)
    out, _ = mixer(zxbcdt, conv_weight, conv_bias, dt_bias, A, D, norm_weight, out_weight, out_bias, seq_idx,
                   conv_initial_states, ssm_initial_states, headdim, ngroups, run_chunk, float(dt_limit[0]),
                   float(dt_limit[1]), float(norm_eps), group_size, norm_before_gate)
    return out


def _checked_seq_idx(xBC, dt, A, D, scan_z, dt_bias, conv_weight, conv_bias, seq_idx, cu_seqlens, conv_init,
                     ssm_init, chunk_size, dt_limit, s):
    """The checks of causal_conv1d_fn and mamba_chunk_scan_combined in their order (the convolution's output has its
    input's shapes and dtypes), and the sequence ids both run with (from cu_seqlens when only it is given)."""
    conv_validate.check_conv_inputs(xBC.transpose(1, 2), conv_weight, conv_bias, seq_idx, conv_init, False,
                                    cu_seqlens, None)
    L = xBC.shape[1]
    if cu_seqlens is not None and should_check_values(cu_seqlens):
        conv_validate.check_cu_seqlens(cu_seqlens, L)
    x, B, C = split_xbc(xBC, s)
    check_inputs(x, dt, A, B, C, chunk_size, D, scan_z, dt_bias, ssm_init, seq_idx, cu_seqlens, True, dt_limit,
                 False, False)
    if should_check_values(seq_idx, cu_seqlens):
        check_values(seq_idx, cu_seqlens, L)
    if cu_seqlens is not None and seq_idx is None:
        seq_idx = seq_idx_from_cu_seqlens(cu_seqlens, L)
    return seq_idx


__all__ = ["mixer_fn"]
