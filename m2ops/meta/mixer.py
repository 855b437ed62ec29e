"""Shapes of m2ops::mixer (the Mamba-2 layer after in_proj, ops/mixer.py) and its backward: the sizes its
parameters give, the splits of in_proj's output and of the convolution's output, the checks of those sizes
(m2ops.mixer_fn), and the fake implementations.

zxbcdt, in_proj's output, is (batch, seqlen, 2*d_mlp + d_ssm + conv_dim + nheads): z0 and x0 (the gated MLP beside
the SSM, d_mlp = d_inner - d_ssm channels each, often none), z (the gate), xBC (the convolution's input, conv_dim =
d_ssm + 2*ngroups*d_state), dt. The op returns out (batch, seqlen, d_model) in out_weight's dtype and y, the scan's
output, (batch, seqlen, d_ssm) in zxbcdt's; its backward one gradient per tensor input (empty for absent ones).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

WHERE = "m2ops.mixer_fn"


class Sizes(NamedTuple):
    """The mixer's sizes, read from the parameters' shapes (d_mlp: the gated MLP's channels beside the SSM)."""
    d_mlp: int
    d_ssm: int
    conv_dim: int
    nheads: int
    headdim: int
    ngroups: int
    d_state: int


def sizes(conv_weight, dt_bias, out_weight, headdim: int, ngroups: int) -> Sizes:
    """conv_weight (conv_dim, d_conv), dt_bias (nheads,), out_weight (d_model, d_inner); works on SymInts."""
    nheads = dt_bias.shape[0]
    d_ssm = nheads * headdim
    conv_dim = conv_weight.shape[0]
    return Sizes(out_weight.shape[1] - d_ssm, d_ssm, conv_dim, nheads, headdim, ngroups,
                 (conv_dim - d_ssm) // (2 * ngroups))


def split_zxbcdt(zxbcdt, s: Sizes):
    """in_proj's output (..., 2*d_mlp + d_ssm + conv_dim + nheads) as its views z0, x0, z, xBC, dt."""
    return torch.split(zxbcdt, [s.d_mlp, s.d_mlp, s.d_ssm, s.conv_dim, s.nheads], dim=-1)


def split_xbc(xBC, s: Sizes):
    """The convolution's output (b, L, conv_dim) as the scan's x (b, L, h, p), B and C (b, L, g, n)."""
    gn = s.ngroups * s.d_state
    x, B, C = torch.split(xBC, [s.d_ssm, gn, gn], dim=-1)
    return (x.unflatten(-1, (s.nheads, s.headdim)), B.unflatten(-1, (s.ngroups, s.d_state)),
            C.unflatten(-1, (s.ngroups, s.d_state)))


def _fail(kind, name, expected, got):
    raise kind(f"{WHERE}: {name} must be {expected}; got {got}")


def check_sizes(zxbcdt, conv_weight, dt_bias, out_weight, headdim, ngroups) -> Sizes:
    """The sizes the parameters' shapes give, checked against each other and against zxbcdt's last dimension."""
    for name, t in (("zxbcdt", zxbcdt), ("conv_weight", conv_weight), ("dt_bias", dt_bias),
                    ("out_weight", out_weight)):
        if not isinstance(t, torch.Tensor):
            _fail(TypeError, name, "a torch.Tensor", type(t).__name__)
    if zxbcdt.dim() != 3:
        _fail(ValueError, "zxbcdt", "3-dimensional (batch, seqlen, channels)", tuple(zxbcdt.shape))
    for name, v in (("headdim", headdim), ("ngroups", ngroups)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            _fail(ValueError, name, "a positive int", repr(v))
    if dt_bias.dim() != 1 or dt_bias.shape[0] % ngroups:
        _fail(ValueError, "dt_bias", f"of shape (nheads,) with ngroups={ngroups} dividing nheads",
              tuple(dt_bias.shape))
    d_ssm = dt_bias.shape[0] * headdim
    if conv_weight.dim() != 2 or conv_weight.shape[0] <= d_ssm or (conv_weight.shape[0] - d_ssm) % (2 * ngroups):
        _fail(ValueError, "conv_weight", f"of shape (d_ssm + 2*ngroups*d_state, d_conv) with d_ssm={d_ssm}, "
              f"ngroups={ngroups}", tuple(conv_weight.shape))
    if out_weight.dim() != 2 or out_weight.shape[1] < d_ssm:
        _fail(ValueError, "out_weight", f"of shape (d_model, d_inner) with d_inner >= d_ssm={d_ssm}",
              tuple(out_weight.shape))
    s = sizes(conv_weight, dt_bias, out_weight, headdim, ngroups)
    width = 2 * s.d_mlp + s.d_ssm + s.conv_dim + s.nheads
    if zxbcdt.shape[-1] != width:
        _fail(ValueError, "zxbcdt", f"of last dimension 2*d_mlp + d_ssm + conv_dim + nheads = {width}",
              tuple(zxbcdt.shape))
    return s


def mixer(zxbcdt, conv_weight, conv_bias, dt_bias, A, D, norm_weight, out_weight, out_bias, seq_idx,
          conv_initial_states, ssm_initial_states, headdim, ngroups, *_):
    """The fake of m2ops::mixer: (out, y)."""
    b, L, _ = zxbcdt.shape
    d_ssm = dt_bias.shape[0] * headdim
    return out_weight.new_empty((b, L, out_weight.shape[0])), zxbcdt.new_empty((b, L, d_ssm))


def _like(t, ref):
    """The gradient of an optional input: its shape, or an empty tensor like ref when it is absent."""
    return ref.new_empty((0,)) if t is None else t.new_empty(t.shape)


def mixer_bwd(g_out, zxbcdt, y, conv_weight, conv_bias, dt_bias, A, D, norm_weight, out_weight, out_bias,
              seq_idx, conv_initial_states, ssm_initial_states, *_):
    """The fake of m2ops::mixer_bwd: a gradient per tensor input but seq_idx."""
    return (zxbcdt.new_empty(zxbcdt.shape), conv_weight.new_empty(conv_weight.shape), _like(conv_bias, g_out),
            dt_bias.new_empty(dt_bias.shape), A.new_empty(A.shape), _like(D, g_out), _like(norm_weight, g_out),
            out_weight.new_empty(out_weight.shape), _like(out_bias, g_out), _like(conv_initial_states, g_out),
            _like(ssm_initial_states, g_out))
