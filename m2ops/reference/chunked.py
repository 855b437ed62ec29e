"""The chunked SSD forward in plain PyTorch: the definition of the three ops' math.

Every backend is tested against these functions, and they are themselves tested against the token-by-token
recurrence in naive.py. They compute in float32 (float64 for float64 inputs), vectorised over batch, heads
and chunks; only the chunk-to-chunk state recurrence loops, over chunks.

Layouts shared with the kernels (b batch, t tokens, h heads, p headdim, g groups, n dstate, c chunks,
l chunk positions):
    dt_out, dA_cumsum  (b, h, c, l)     tail positions past seqlen hold dt = 0, so they change nothing
    states             (b, c, h, p, n)  the state entering each chunk
    final_states       (b, h, p, n)
    varlen_states      (num_sequences, h, p, n)

Sequence boundaries: the state restarts wherever seq_idx changes from one token to the next; the state before
token 0 (initial_states) belongs to seq_idx 0. seq_idx must not decrease along a row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..meta.shapes import compute_dtype, num_chunks


def to_chunks(t: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """(b, t, ...) -> (b, c, l, ...), zero-padded at the tail."""
    T = t.shape[1]
    pad = num_chunks(T, chunk_size) * chunk_size - T
    if pad:
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
    return t.reshape(t.shape[0], -1, chunk_size, *t.shape[2:])


def by_group(t: torch.Tensor, ngroups: int, dim: int) -> torch.Tensor:
    """Split the heads dimension into (ngroups, heads per group): head k reads group k // (h / g)."""
    return t.unflatten(dim, (ngroups, -1))


def seq_chunks(seq_idx: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """seq_idx (b, t) -> (seq (b, c, l), prev (b, c)): the tail repeats the last id; prev is the id owning
    the state entering each chunk (the last token of the chunk before, 0 for the first chunk)."""
    T = seq_idx.shape[1]
    pad = num_chunks(T, chunk_size) * chunk_size - T
    seq = torch.cat([seq_idx, seq_idx[:, -1:].expand(-1, pad)], dim=1) if pad else seq_idx
    seq = seq.reshape(seq.shape[0], -1, chunk_size)
    prev = torch.cat([torch.zeros_like(seq[:, :1, -1]), seq[:, :-1, -1]], dim=1)
    return seq, prev


def step_sizes(dt, dt_bias, dt_softplus: bool, dt_min: float, dt_max: float, acc):
    """The step sizes the recurrence uses, in acc: dt (+ dt_bias), softplus'd if asked, clamped to [dt_min, dt_max]
    (dt_bias broadcasts over dt's last dimension, the heads)."""
    d = dt.to(acc)
    if dt_bias is not None:
        d = d + dt_bias.to(acc)
    if dt_softplus:
        d = F.softplus(d, threshold=20.0)  # identity above 20, like the kernels
    return d.clamp(dt_min, dt_max)


def chunk_cumsum(dt, A, dt_bias, chunk_size: int, dt_softplus: bool, dt_min: float, dt_max: float):
    """dt (b, t, h) -> processed dt and the within-chunk cumulative sum of dt * A, both (b, h, c, l)."""
    acc = compute_dtype(dt.dtype)
    d = step_sizes(dt, dt_bias, dt_softplus, dt_min, dt_max, acc)
    d = to_chunks(d, chunk_size).permute(0, 3, 1, 2).contiguous()  # padding after the clamp: tail dt = 0
    return d, torch.cumsum(d * A.to(acc)[:, None, None], dim=-1)


def fwd_pass_state(x, B, dt_out, dA_cumsum, initial_states, seq_idx, cu_seqlens):
    """The state entering each chunk, the final state, and each varlen sequence's final state."""
    b, T, h, p = x.shape
    g, n = B.shape[2:]
    L = dt_out.shape[-1]
    acc = dt_out.dtype
    xc = by_group(to_chunks(x.to(acc), L), g, 3)  # b c l g r p  (r heads per group)
    Bc = to_chunks(B.to(acc), L)  # b c l g n
    last = dA_cumsum[..., -1:]  # b h c 1
    w = torch.exp(last - dA_cumsum) * dt_out  # weight of each token in its chunk's end state
    carry = torch.exp(last[..., 0])  # b h c: decay of the entering state across the chunk
    if seq_idx is not None:
        seq, prev = seq_chunks(seq_idx, L)
        w = w * (seq == seq[..., -1:]).unsqueeze(1)
        carry = carry * (seq[..., -1] == prev).unsqueeze(1)
    local = torch.einsum("bgrcl,bclgrp,bclgn->bcgrpn", by_group(w, g, 1), xc, Bc).flatten(2, 3)
    s = initial_states.to(acc) if initial_states is not None else x.new_zeros((b, h, p, n), dtype=acc)
    entering = []
    for c in range(local.shape[1]):
        entering.append(s)
        s = carry[:, :, c, None, None] * s + local[:, c]
    states = torch.stack(entering, dim=1)
    if cu_seqlens is None:
        return states, s, s.new_zeros((0, h, p, n))
    return states, s, varlen_states(xc, Bc, dt_out, dA_cumsum, states, cu_seqlens)


def varlen_states(xc, Bc, dt_out, dA_cumsum, states, cu_seqlens):
    """Final state of each packed sequence (batch 1): its last chunk's entering state, carried when the
    sequence began before that chunk, plus the sequence's tokens inside that chunk.

    xc (1, c, l, g, r, p) and Bc (1, c, l, g, n) are the chunked inputs of fwd_pass_state."""
    L = dt_out.shape[-1]
    starts, last_tok = cu_seqlens[:-1].long(), cu_seqlens[1:].long() - 1
    chunk = torch.div(last_tok, L, rounding_mode="floor")
    pos = chunk[:, None] * L + torch.arange(L, device=chunk.device)  # (s, l) padded token positions
    inside = (pos >= starts[:, None]) & (pos <= last_tok[:, None])
    h, g = dt_out.shape[1], Bc.shape[3]
    cs = dA_cumsum[0].permute(1, 2, 0).reshape(-1, h)  # (c*l, h)
    dt = dt_out[0].permute(1, 2, 0).reshape(-1, h)
    cs_end = cs[last_tok]  # (s, h)
    # Mask before exp: past a sequence's last token cs_end - cs > 0 can overflow, and inf * 0 is nan.
    w = torch.exp((cs_end[:, None] - cs[pos]).masked_fill(~inside[..., None], float("-inf"))) * dt[pos]
    w = by_group(w, g, 2)  # (s, l, g, r)
    x_tok = xc[0].flatten(0, 1)[pos]  # (s, l, g, r, p)
    B_tok = Bc[0].flatten(0, 1)[pos]  # (s, l, g, n)
    # The entering state belongs to this sequence when the token before the chunk does (or, for the
    # sequence starting at 0, when it is initial_states).
    owns = (starts < chunk * L) | (starts == 0)
    decay = torch.exp(cs_end) * owns[:, None]
    tokens = torch.einsum("slgr,slgrp,slgn->sgrpn", w, x_tok, B_tok).flatten(1, 2)
    return decay[..., None, None] * states[0, chunk] + tokens


def compute_out(x, dt_out, dA_cumsum, C, B, states, D, z, seq_idx):
    """y = intra-chunk (C_i . B_j) decay dt_j x_j  +  decay C_i . entering state  +  D x, then * silu(z)."""
    b, T, h, p = x.shape
    g = B.shape[2]
    L = dt_out.shape[-1]
    acc = dt_out.dtype
    xc = by_group(to_chunks(x.to(acc), L), g, 3)  # b c l g r p
    Bc = to_chunks(B.to(acc), L)  # b c l g n
    Cc = to_chunks(C.to(acc), L)
    cs = dA_cumsum
    mask = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    inter = torch.exp(cs)  # b h c l
    if seq_idx is not None:
        seq, prev = seq_chunks(seq_idx, L)
        mask = mask & (seq[..., :, None] == seq[..., None, :]).unsqueeze(1)  # b 1 c l s
        inter = inter * (seq == prev[..., None]).unsqueeze(1)
    decay = torch.exp((cs[..., :, None] - cs[..., None, :]).masked_fill(~mask, float("-inf")))
    cb = torch.einsum("bclgn,bcsgn->bgcls", Cc, Bc).unsqueeze(2)  # shared by the group's heads
    w = by_group(decay * dt_out[..., None, :], g, 1) * cb  # b g r c l s
    y = torch.einsum("bgrcls,bcsgrp->bclgrp", w, xc)
    y = y + torch.einsum("bclgn,bcgrpn,bgrcl->bclgrp", Cc, by_group(states.to(acc), g, 2), by_group(inter, g, 1))
    y = y.reshape(b, -1, h, p)[:, :T]
    if D is not None:
        y = y + x.to(acc) * (D.to(acc)[:, None] if D.dim() == 1 else D.to(acc))
    if z is not None:
        y = y * F.silu(z.to(acc))
    return y.to(x.dtype).contiguous()  # the einsums leave a permuted layout; the fake promises contiguous


def chunk_scan(x, dt_out, dA_cumsum, B, C, initial_states, D, z, seq_idx):
    """fwd_pass_state then compute_out, keeping only y and the final state: the math of the chunk_scan op."""
    states, final_states, _ = fwd_pass_state(x, B, dt_out, dA_cumsum, initial_states, seq_idx, None)
    return compute_out(x, dt_out, dA_cumsum, C, B, states, D, z, seq_idx), final_states
