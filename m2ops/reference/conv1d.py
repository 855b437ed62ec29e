"""The causal depthwise convolution of the Mamba-2 layer, in plain PyTorch: the definition of m2ops::causal_conv1d,
its backward (explicit formulas) and m2ops::causal_conv1d_update (one decoding token).

Per batch row b, channel c and token t, with width W and the taps k = 0 .. W-1 (tap W-1 reads the token itself):

    u[t] = bias + sum_k weight[k] * x[t - (W-1) + k] * [id(t - (W-1) + k) == id(t)]
    y[t] = silu(u[t]) if silu else u[t]

Tokens before 0 are the W-1 entries of initial_states (zeros when absent), the "history", which counts as sequence
id 0; without seq_idx every id is 0. A tap therefore never reads a token of another packed sequence: the
convolution restarts at every change of seq_idx. The final states are the last state_len inputs (history
included, zeros before it), with those of an earlier sequence than the last token's set to zero: the
initial_states of a call that continues the sequence (state_len = W-1) or the decoding cache (state_len >= W-1).

Computed in float32 (float64 when an input is float64); y and the final states in x's dtype. y is laid out
channel-last (conv_out_layout): a (batch, channels, seqlen) view of a (batch, seqlen, channels) buffer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..meta.conv1d import conv_output


def _acc_dtype(*tensors):
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _padded(x, weight, seq_idx, initial_states, acc):
    """(xp, ids): x with the history in front, (b, c, W-1+L), and the sequence id of each of xp's tokens (None
    without seq_idx)."""
    b, c, _ = x.shape
    W = weight.shape[1]
    hist = x.new_zeros((b, c, W - 1), dtype=acc) if initial_states is None else initial_states.to(acc)
    xp = torch.cat([hist, x.to(acc)], dim=-1)
    ids = None if seq_idx is None else torch.cat([seq_idx.new_zeros(b, W - 1), seq_idx], dim=1)
    return xp, ids


def _tap_masks(ids, seq_idx, W, L):
    """masks[k] (b, 1, L): whether tap k of each token reads a token of its own sequence (None without seq_idx)."""
    if ids is None:
        return [None] * W
    return [(ids[:, k:k + L] == seq_idx).unsqueeze(1) for k in range(W)]


def _pre_activation(xp, ids, seq_idx, weight, bias, L, acc):
    W = weight.shape[1]
    w = weight.to(acc)
    u = None
    for k, m in enumerate(_tap_masks(ids, seq_idx, W, L)):
        tap = xp[..., k:k + L] * w[:, k, None]
        if m is not None:
            tap = tap * m
        u = tap if u is None else u + tap
    if bias is not None:
        u = u + bias.to(acc)[:, None]
    return u


def final_states(x, initial_states, seq_idx, state_len: int, width: int):
    """The last state_len inputs before the end of each row, (b, c, state_len) in x's dtype: history entries
    included, zeros before the history and where they belong to an earlier sequence than the last token."""
    b, c, L = x.shape
    hist = x.new_zeros(b, c, width - 1) if initial_states is None else initial_states.to(x.dtype)
    full = torch.cat([x.new_zeros(b, c, state_len), hist, x], dim=-1)[..., -state_len:]
    if seq_idx is None:
        return full.contiguous()
    ids = torch.cat([seq_idx.new_zeros(b, state_len + width - 1), seq_idx], dim=1)[:, -state_len:]
    return (full * (ids == seq_idx[:, -1:]).unsqueeze(1).to(x.dtype)).contiguous()


def causal_conv1d(x, weight, bias, seq_idx, initial_states, silu: bool, final_state_len: int):
    """x (b, c, L), weight (c, W), bias (c,), seq_idx (b, L), initial_states (b, c, W-1) -> (y (b, c, L) like x,
    channel-last; final states (b, c, final_state_len) in x's dtype, (b, c, 0) when final_state_len is 0)."""
    acc = _acc_dtype(x, weight, bias, initial_states)
    L = x.shape[-1]
    xp, ids = _padded(x, weight, seq_idx, initial_states, acc)
    u = _pre_activation(xp, ids, seq_idx, weight, bias, L, acc)
    y = F.silu(u) if silu else u
    out = conv_output(x)
    out.copy_(y)
    if final_state_len > 0:
        fin = final_states(x, initial_states, seq_idx, final_state_len, weight.shape[1])
    else:
        fin = x.new_empty((x.shape[0], x.shape[1], 0))
    return out, fin


def silu_grad(u):
    """d silu(u) / du = sigmoid(u) (1 + u (1 - sigmoid(u)))."""
    s = torch.sigmoid(u)
    return s * (1 + u * (1 - s))


def causal_conv1d_bwd(g_y, g_final, x, weight, bias, seq_idx, initial_states, silu: bool):
    """Gradients of x, weight, bias and initial_states (the last two empty when absent) from g_y (the gradient of
    y) and g_final (of the final states, (b, c, S); S may be 0).

    With du = g_y * silu'(u) (g_y without the activation) and m_k[t] tap k's same-sequence mask:

        g_xp[t - (W-1) + k] += weight[k] du[t] m_k[t]        (xp: history then x; its tail is g_x, its head g_init)
        g_weight[k] = sum_{b,t} du[t] xp[t - (W-1) + k] m_k[t]        g_bias = sum_{b,t} du[t]

    and the final states copy inputs: g_final goes back to the inputs they were copied from (where not masked).
    """
    acc = _acc_dtype(x, weight, bias, initial_states, g_y)
    b, c, L = x.shape
    W = weight.shape[1]
    xp, ids = _padded(x, weight, seq_idx, initial_states, acc)
    du = g_y.to(acc)
    if silu:
        du = du * silu_grad(_pre_activation(xp, ids, seq_idx, weight, bias, L, acc))
    w = weight.to(acc)
    g_xp = torch.zeros_like(xp)
    g_w = torch.empty((c, W), dtype=acc, device=x.device)
    for k, m in enumerate(_tap_masks(ids, seq_idx, W, L)):
        d = du if m is None else du * m
        g_xp[..., k:k + L] += d * w[:, k, None]
        g_w[:, k] = (d * xp[..., k:k + L]).sum(dim=(0, 2))
    S = g_final.shape[-1]
    if S > 0:
        g = g_final.to(acc)
        if seq_idx is not None:
            tail = torch.cat([seq_idx.new_zeros(b, S + W - 1), seq_idx], dim=1)[:, -S:]
            g = g * (tail == seq_idx[:, -1:]).unsqueeze(1)
        # The final states are the last S entries of (zeros, history, x); the zeros take no gradient.
        n = min(S, W - 1 + L)
        g_xp[..., W - 1 + L - n:] += g[..., S - n:]
    g_x = g_xp[..., W - 1:].to(x.dtype)
    out_x = conv_output(x)
    out_x.copy_(g_x)
    g_bias = du.sum(dim=(0, 2)).to(bias.dtype) if bias is not None else g_y.new_empty((0,))
    g_init = (g_xp[..., :W - 1].to(initial_states.dtype).contiguous() if initial_states is not None
              else g_y.new_empty((0,)))
    return out_x, g_w.to(weight.dtype), g_bias, g_init


def varlen_final_states(x, initial_states, cu_seqlens, state_len: int, width: int):
    """The final states of each sequence packed in batch row 0 by cu_seqlens: (num_sequences, c, state_len) in x's
    dtype, the last state_len inputs of the sequence, zeros before its start; sequence 0 continues the history.
    Plain indexing, so autograd differentiates it."""
    _, c, L = x.shape
    hist = x.new_zeros(1, c, width - 1) if initial_states is None else initial_states.to(x.dtype)
    full = torch.cat([x.new_zeros(1, c, state_len), hist, x], dim=-1)[0]  # token t at t + state_len + width - 1
    starts, ends = cu_seqlens[:-1].long(), cu_seqlens[1:].long()
    pos = ends[:, None] - state_len + torch.arange(state_len, device=x.device)  # (nseq, state_len) tokens
    keep = (pos >= starts[:, None]) | (starts[:, None] == 0)
    picked = full[:, pos + state_len + width - 1]  # (c, nseq, state_len)
    return (picked.permute(1, 0, 2) * keep[:, None, :].to(x.dtype)).contiguous()


def causal_conv1d_update(x, conv_state, weight, bias, silu: bool, conv_state_indices):
    """One token: x (b, c), conv_state (slots, c, S) with S >= W-1 holding the last S inputs of each slot, weight
    (c, W), bias (c,), conv_state_indices (b,) naming each row's slot (row i's slot is i when None; rows with a
    negative index are skipped: y 0, no slot written) -> y (b, c) like x. conv_state is updated in place: its
    entries move one place towards the front and x becomes the last one (in conv_state's dtype)."""
    acc = _acc_dtype(x, conv_state, weight, bias)
    b, c = x.shape
    S = conv_state.shape[-1]
    W = weight.shape[1]
    if conv_state_indices is None:
        rows = torch.arange(b, device=x.device)
    else:
        rows = conv_state_indices.long()
    keep = rows >= 0
    state = conv_state[rows.clamp_min(0)].to(acc)  # (b, c, S)
    xf = x.to(acc)
    window = torch.cat([state[..., S - (W - 1):], xf[..., None]], dim=-1)  # the last W inputs
    u = (window * weight.to(acc)).sum(-1)
    if bias is not None:
        u = u + bias.to(acc)
    y = F.silu(u) if silu else u
    y = torch.where(keep[:, None], y, torch.zeros_like(y)).to(x.dtype)
    new = torch.cat([state[..., 1:], xf[..., None]], dim=-1).to(conv_state.dtype)
    conv_state[rows[keep]] = new[keep]
    return y
