"""The output term of per-sequence start states in a packed row (m2ops::start_state_out, m2ops/sequence_states.py):
sequence k >= 1, spanning tokens [s_k, e_k), starts from its own state h_k; the chunked scan from zero starts
misses, at the tokens of k in the chunk c where it starts (t < min(e_k, (c + 1) L)), the term

    dy_t = exp(cs_t - cs_{s_k - 1}) (C_t . h_k) silu(z_t)      (silu(z_t) only with z)

where cs is dA_cumsum within chunk c (cs_{s_k - 1} = 0 when s_k starts the chunk). Later chunks receive h_k through
their entering states. Sequence 0's state is the row's initial state, which the scan itself takes. The windows of
different sequences are disjoint. Computed in dA_cumsum's dtype (float32, or float64), added to y, returned in y's
dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def windows(cu_seqlens, seqlen: int, chunk_size: int):
    """(tok (k, L) the tokens s_k + j of sequences k >= 1, clamped into the row; inside (k, L) whether s_k + j is in
    sequence k and in its first chunk; c (k,) that chunk; j0 (k,) s_k's place in it)."""
    L = chunk_size
    cu = cu_seqlens.long()
    s, e = cu[1:-1], cu[2:]
    c = torch.div(s, L, rounding_mode="floor")
    j = torch.arange(L, device=cu.device)
    tok = s[:, None] + j
    inside = tok < torch.minimum(e, c * L + L)[:, None]
    return tok.clamp(max=max(seqlen - 1, 0)), inside, c, s - c * L


def log_decays(dA_cumsum, c, j0, inside):
    """cs_t - cs_{s_k - 1} at each window position, -inf outside the windows: (k, L, h)."""
    L = dA_cumsum.shape[-1]
    cs = dA_cumsum[0]  # (h, nchunks, L)
    j = (j0[:, None] + torch.arange(L, device=cs.device)).clamp(max=L - 1)
    at = cs[:, c[:, None], j]  # (h, k, L)
    before = torch.where(j0 > 0, cs[:, c, (j0 - 1).clamp(min=0)], torch.zeros_like(cs[:, c, 0]))  # (h, k)
    return (at - before[..., None]).masked_fill(~inside, float("-inf")).permute(1, 2, 0)


def start_state_out(y, C, z, initial_states, dA_cumsum, cu_seqlens):
    """y (1, T, h, p) plus the start states' term at the first-chunk tokens of sequences 1.. (module docstring);
    C (1, T, g, n), z like y or None, initial_states (num_sequences, h, p, n), cu_seqlens (num_sequences + 1,)."""
    acc = dA_cumsum.dtype
    T, h = y.shape[1], y.shape[2]
    g = C.shape[2]
    tok, inside, c, j0 = windows(cu_seqlens, T, dA_cumsum.shape[-1])
    decay = torch.exp(log_decays(dA_cumsum.to(acc), c, j0, inside))  # (k, L, h)
    start = initial_states[1:].to(acc).unflatten(1, (g, h // g))  # (k, g, r, p, n)
    dy = torch.einsum("kjgn,kgrpn->kjgrp", C[0, tok].to(acc), start).flatten(2, 3) * decay[..., None]
    if z is not None:
        dy = dy * F.silu(z[0, tok].to(acc))
    # positions outside the windows add zero (their decay is 0), wherever their clamped index points
    out = y.to(acc).index_add(1, tok.flatten(), dy.flatten(0, 1).unsqueeze(0))
    return out.to(y.dtype)


def start_state_out_bwd(g_out, C, z, initial_states, dA_cumsum, cu_seqlens):
    """Gradients of C, z (empty when None), initial_states and dA_cumsum of start_state_out (y's is g_out), in
    their inputs' dtypes. With G = g_out at the window tokens, s = silu(z) (or 1), m = C . h_k:
        g_h_k = sum_t decay_t (s_t G_t) (x) C_t,  g_C_t = decay_t sum_{r,p} s_t G_t h_k,
        g_z_t = decay_t G_t m_t silu'(z_t),  g_cs_t += w_t,  g_cs_{s_k - 1} -= sum_t w_t  (w_t = decay_t <G_t, s_t m_t>)."""
    acc = dA_cumsum.dtype
    T, h, p = g_out.shape[1], g_out.shape[2], g_out.shape[3]
    g, n = C.shape[2], C.shape[3]
    L = dA_cumsum.shape[-1]
    tok, inside, c, j0 = windows(cu_seqlens, T, L)
    decay = torch.exp(log_decays(dA_cumsum.to(acc), c, j0, inside))  # (k, L, h)
    start = initial_states[1:].to(acc).unflatten(1, (g, h // g))  # (k, g, r, p, n)
    Ct = C[0, tok].to(acc)  # (k, L, g, n)
    m = torch.einsum("kjgn,kgrpn->kjgrp", Ct, start).flatten(2, 3)  # (k, L, h, p)
    G = g_out[0, tok].to(acc) * inside[..., None, None]
    if z is not None:
        zt = z[0, tok].to(acc)
        sig = torch.sigmoid(zt)
        s = zt * sig
        g_zt = G * decay[..., None] * m * sig * (1 + zt * (1 - sig))
        g_z = torch.zeros(z.shape[1:], dtype=acc, device=z.device).index_add(0, tok.flatten(), g_zt.flatten(0, 1))
        g_z = g_z.unsqueeze(0).to(z.dtype)
    else:
        s = torch.ones((), dtype=acc, device=g_out.device)
        g_z = g_out.new_empty((0,))
    Gs = (G * s * decay[..., None]).unflatten(2, (g, h // g))  # (k, L, g, r, p)
    g_start = torch.einsum("kjgrp,kjgn->kgrpn", Gs, Ct).flatten(1, 2)  # (k, h, p, n)
    g_init = torch.cat([g_start.new_zeros((1, *g_start.shape[1:])), g_start]).to(initial_states.dtype)
    g_Ct = torch.einsum("kjgrp,kgrpn->kjgn", Gs, start)
    g_C = torch.zeros(C.shape[1:], dtype=acc, device=C.device).index_add(0, tok.flatten(), g_Ct.flatten(0, 1))
    w = (G * s * m).sum(-1) * decay  # (k, L, h)
    g_cs = torch.zeros(dA_cumsum.shape[1:], dtype=acc, device=dA_cumsum.device)  # (h, nchunks, L)
    j = (j0[:, None] + torch.arange(L, device=w.device)).clamp(max=L - 1)
    flat = (c[:, None] * L + j).flatten()
    g_cs = g_cs.flatten(1).index_add(1, flat, w.flatten(0, 1).t())
    has_before = j0 > 0
    before = (c * L + (j0 - 1).clamp(min=0))[has_before]
    g_cs = g_cs.index_add(1, before, -w.sum(1)[has_before].t())
    return g_C.unsqueeze(0).to(C.dtype), g_z, g_init, g_cs.view(dA_cumsum.shape).to(dA_cumsum.dtype)
