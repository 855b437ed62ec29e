"""m2ops::mixer and m2ops::mixer_bwd: the Mamba-2 layer from in_proj's output to out_proj's output, recomputing
in the backward what the composition of the layer's ops would keep (m2ops.Mamba2's training path with
use_mem_eff_path=True; the public function is m2ops/mixer_fn.py).

The layer's plain composition (convolution, scan, gated norm, out_proj, each op with its own autograd) keeps alive
until the backward, per token: the convolution's output, the scan's saved tensors, y, the norm's output (saved by
out_proj) and its rstd. m2ops::mixer returns (out, y) and its autograd saves only zxbcdt (in_proj's output: every
input of the mixer), y (the scan's output before the norm; not differentiable) and the parameters. Its backward
op recomputes:

    the convolution's output (m2ops::causal_conv1d)    for the scan's backward (x, B, C)
    dt_out and dA_cumsum (m2ops::chunk_cumsum)          (batch, nheads, chunks, chunk) float32 twice: 8 * nheads
                                                        bytes a token if kept, against one cheap pass over dt
    the norm's output and rstd (m2ops::rms_norm_gated)  for out_proj's weight gradient; its rstd then serves
                                                        the norm's backward, so the forward's is not kept
    the MLP part silu(z0) * x0 (d_ssm < d_inner)        elementwise
    the scan's entering states (float32)                as the m2ops::chunk_scan op's own backward does

then runs, in reverse order: out_proj's backward (matrix products), the norm's (m2ops::rms_norm_gated_bwd), the
scan's (chunk_scan.backward_with on the registered ops, then m2ops::chunk_cumsum_bwd), the convolution's
(m2ops::causal_conv1d_bwd). Every step is a registered op, so the CPU reference and the GPU kernels both serve.
The gradient of zxbcdt is one buffer, allocated once the pieces are ready and written by slices.

Why two ops and not an autograd.Function: torch.compile traces a Function's forward and backward into one joint
graph, where AOTAutograd merges the backward's recomputations with the forward's identical calls (CSE) and moves
backward work that reads only forward values into the forward, saving its result: the compiled Function kept the
convolution's output, the norm's output, the dt tensors and even the gradient buffer. An op is opaque there, so
the compiled graph saves exactly what setup_context saves.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.library import custom_op

from ..meta import mixer as meta
from ..meta.mixer import sizes, split_xbc, split_zxbcdt
from .chunk_cumsum import chunk_cumsum, chunk_cumsum_bwd
from .chunk_scan import RegisteredOps, backward_with, chunk_scan
from .conv1d import causal_conv1d, causal_conv1d_bwd
from .gated_norm import rms_norm_gated, rms_norm_gated_bwd


def _conv(xBC, conv_weight, conv_bias, seq_idx, conv_init):
    """Convolution + SiLU of xBC (b, L, conv_dim) -> (b, L, conv_dim), contiguous (the op's channel-last output
    read back through its transpose)."""
    y, _ = causal_conv1d(xBC.transpose(1, 2), conv_weight, conv_bias, seq_idx, conv_init, True, 0)
    return y.transpose(1, 2)


def _scan_gate(z, s, norm_weight):
    """The gate the scan applies: z where there is no norm (the norm takes it otherwise)."""
    return None if norm_weight is not None else z.unflatten(-1, (s.nheads, s.headdim))


@custom_op("m2ops::mixer", mutates_args=())
def mixer(zxbcdt: Tensor, conv_weight: Tensor, conv_bias: Optional[Tensor], dt_bias: Tensor, A: Tensor,
          D: Optional[Tensor], norm_weight: Optional[Tensor], out_weight: Tensor, out_bias: Optional[Tensor],
          seq_idx: Optional[Tensor], conv_initial_states: Optional[Tensor], ssm_initial_states: Optional[Tensor],
          headdim: int, ngroups: int, chunk_size: int, dt_min: float, dt_max: float, eps: float, group_size: int,
          norm_before_gate: bool) -> tuple[Tensor, Tensor]:
    """(out (b, L, d_model), y (b, L, d_ssm): the scan's output, which the backward reads). conv_weight is
    (conv_dim, d_conv); chunk_size is the one the scan runs at; norm_weight None: no norm (z gates the scan)."""
    s = sizes(conv_weight, dt_bias, out_weight, headdim, ngroups)
    z0, x0, z, xBC, dt = split_zxbcdt(zxbcdt, s)
    x, B, C = split_xbc(_conv(xBC, conv_weight, conv_bias, seq_idx, conv_initial_states), s)
    dt_out, dA_cumsum = chunk_cumsum(dt, A, dt_bias, chunk_size, True, dt_min, dt_max)
    y, _ = chunk_scan(x, dt_out, dA_cumsum, B, C, ssm_initial_states, D, _scan_gate(z, s, norm_weight), seq_idx)
    del x, B, C, dt_out, dA_cumsum  # (the convolution's output is freed here)
    y = y.flatten(-2)
    yn = y if norm_weight is None else rms_norm_gated(y, norm_weight, None, z, eps, group_size, norm_before_gate)[0]
    if s.d_mlp:
        yn = torch.cat([F.silu(z0) * x0, yn], dim=-1)
    # out_proj in out_weight's dtype (the caller casts the weights for autocast, as F.linear would be cast)
    return F.linear(yn.to(out_weight.dtype), out_weight, out_bias), y


@custom_op("m2ops::mixer_bwd", mutates_args=())
def mixer_bwd(g_out: Tensor, zxbcdt: Tensor, y: Tensor, conv_weight: Tensor, conv_bias: Optional[Tensor],
              dt_bias: Tensor, A: Tensor, D: Optional[Tensor], norm_weight: Optional[Tensor], out_weight: Tensor,
              out_bias: Optional[Tensor], seq_idx: Optional[Tensor], conv_initial_states: Optional[Tensor],
              ssm_initial_states: Optional[Tensor], headdim: int, ngroups: int, chunk_size: int, dt_min: float,
              dt_max: float, eps: float, group_size: int,
              norm_before_gate: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                               Tensor, Tensor]:
    """Gradients of zxbcdt, conv_weight, conv_bias, dt_bias, A, D, norm_weight, out_weight, out_bias,
    conv_initial_states and ssm_initial_states (empty tensors for the absent ones), from g_out and the forward's
    y; the rest recomputed (module docstring)."""
    s = sizes(conv_weight, dt_bias, out_weight, headdim, ngroups)
    z0, x0, z, xBC, dt = split_zxbcdt(zxbcdt, s)
    g_z0 = g_x0 = z0  # (empty without the MLP part)

    def empty():  # the gradient of an absent input (a fresh one each: outputs must not alias)
        return g_out.new_empty((0,))

    # out_proj: the gradient of its input, and of its weight from its recomputed input (MLP part, norm output)
    g_in = g_out.matmul(out_weight).to(y.dtype)
    g2d = g_out.reshape(-1, g_out.shape[-1])
    yn, rstd = (y, None) if norm_weight is None else rms_norm_gated(y, norm_weight, None, z, eps, group_size,
                                                                    norm_before_gate)
    g_out_weight = g2d.t().mm(yn.reshape(-1, s.d_ssm).to(g2d.dtype))
    del yn
    if s.d_mlp:
        silu_z0 = F.silu(z0)
        g_out_weight = torch.cat([g2d.t().mm((silu_z0 * x0).reshape(-1, s.d_mlp).to(g2d.dtype)), g_out_weight], dim=1)
        g_mlp = g_in[..., :s.d_mlp]
        g_x0, g_z0 = g_mlp * silu_z0, torch.ops.aten.silu_backward(g_mlp * x0, z0)
        del silu_z0, g_mlp
    g_out_bias = g2d.sum(0) if out_bias is not None else empty()
    g_y = g_in[..., s.d_mlp:]

    # the gated norm
    g_norm_weight = empty()
    if norm_weight is not None:
        g_y, g_norm_weight, _, g_z = rms_norm_gated_bwd(g_y, y, norm_weight, None, z, rstd, eps, group_size,
                                                        norm_before_gate)
        del rstd
    del g_in

    # the scan, on the recomputed convolution output and dt tensors
    x, B, C = split_xbc(_conv(xBC, conv_weight, conv_bias, seq_idx, conv_initial_states), s)
    dt_out, dA_cumsum = chunk_cumsum(dt, A, dt_bias, chunk_size, True, dt_min, dt_max)
    g_final = dt_out.new_zeros((x.shape[0], s.nheads, s.headdim, s.d_state))
    g_ys = [g_y.unflatten(-1, (s.nheads, s.headdim))]  # (emptied by backward_with once read: freed early)
    del g_y
    g_x, g_dt_out, g_dA, g_B, g_C, g_ssm_init, g_D, g_zs, _ = backward_with(
        RegisteredOps, (x, dt_out, dA_cumsum, B, C, ssm_initial_states, D, _scan_gate(z, s, norm_weight), seq_idx),
        g_ys, g_final)
    del x, B, C, g_final
    if norm_weight is None:
        g_z = g_zs.flatten(-2)
    del g_zs
    g_dt, g_A, g_dt_bias = chunk_cumsum_bwd(g_dt_out, g_dA, dt, A, dt_bias, chunk_size, True, dt_min, dt_max)
    del g_dt_out, g_dA, dt_out, dA_cumsum

    # the convolution: its output's gradient gathered channel-last, the layout the op returns its output in
    g_conv = xBC.new_empty(xBC.shape)
    for dst, src in zip(split_xbc(g_conv, s), (g_x, g_B, g_C)):
        dst.copy_(src)
    del g_x, g_B, g_C
    g_xbc, g_conv_weight, g_conv_bias, g_conv_init = causal_conv1d_bwd(
        g_conv.transpose(1, 2), g_conv.new_zeros((xBC.shape[0], s.conv_dim, 0)), xBC.transpose(1, 2), conv_weight,
        conv_bias, seq_idx, conv_initial_states, True)
    del g_conv

    # zxbcdt's gradient: one buffer, allocated last (not held through the scan's backward), written by slices
    g_zx = zxbcdt.new_empty(zxbcdt.shape)
    for dst, src in zip(split_zxbcdt(g_zx, s), (g_z0, g_x0, g_z, g_xbc.transpose(1, 2), g_dt)):
        dst.copy_(src)
    return (g_zx, g_conv_weight, g_conv_bias, g_dt_bias, g_A, empty() if D is None else g_D, g_norm_weight,
            g_out_weight, g_out_bias, g_conv_init, empty() if ssm_initial_states is None else g_ssm_init)


mixer.register_fake(meta.mixer)
mixer_bwd.register_fake(meta.mixer_bwd)

# The tensors mixer_bwd reads besides g_out and y, in its order (zxbcdt and the parameters: mixer's inputs 0-11).
_N_TENSORS = 12


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:_N_TENSORS], output[1])
    ctx.options = inputs[_N_TENSORS:]
    ctx.mark_non_differentiable(output[1])
    # (y's gradient is never used: without this autograd would pass a zero-filled (b, L, d_ssm) tensor for it, a
    # fill kernel and one more y-sized buffer at the backward's peak)
    ctx.set_materialize_grads(False)


def _backward(ctx, g_out, _g_y):
    *saved, y = ctx.saved_tensors
    if g_out is None:  # (not materialised either: out took no part in what is differentiated)
        out_weight = saved[7]
        g_out = y.new_zeros((*y.shape[:-1], out_weight.shape[0]), dtype=out_weight.dtype)
    g = mixer_bwd(g_out, saved[0], y, *saved[1:], *ctx.options)
    present = saved[:9] + saved[10:]  # (no gradient for seq_idx)
    g = [gi if t is not None else None for gi, t in zip(g, present)]
    return (*g[:9], None, *g[9:], *(None,) * len(ctx.options))


mixer.register_autograd(_backward, setup_context=_setup)
