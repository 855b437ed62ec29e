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


def group_to_heads(t: torch.Tensor, nheads: int) -> torch.Tensor:
    """(..., g, n) -> (..., h, n): head k reads group k // (h / g)."""
    g = t.shape[-2]
    return t.unsqueeze(-2).expand(*t.shape[:-1], nheads // g, t.shape[-1]).reshape(*t.shape[:-2], nheads, t.shape[-1])


def seq_chunks(seq_idx: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """seq_idx (b, t) -> (seq (b, c, l), prev (b, c)): the tail repeats the last id; prev is the id owning
    the state entering each chunk (the last token of the chunk before, 0 for the first chunk)."""
    T = seq_idx.shape[1]
    pad = num_chunks(T, chunk_size) * chunk_size - T
    seq = torch.cat([seq_idx, seq_idx[:, -1:].expand(-1, pad)], dim=1) if pad else seq_idx
    seq = seq.reshape(seq.shape[0], -1, chunk_size)
    prev = torch.cat([torch.zeros_like(seq[:, :1, -1]), seq[:, :-1, -1]], dim=1)
    return seq, prev


def chunk_cumsum(dt, A, dt_bias, chunk_size: int, dt_softplus: bool, dt_min: float, dt_max: float):
    """dt (b, t, h) -> processed dt and the within-chunk cumulative sum of dt * A, both (b, h, c, l)."""
    acc = compute_dtype(dt.dtype)
    d = dt.to(acc)
    if dt_bias is not None:
        d = d + dt_bias.to(acc)
    if dt_softplus:
        d = F.softplus(d, threshold=20.0)  # identity above 20, like the kernels
    d = d.clamp(dt_min, dt_max)
    d = to_chunks(d, chunk_size).permute(0, 3, 1, 2).contiguous()  # padding after the clamp: tail dt = 0
    return d, torch.cumsum(d * A.to(acc)[:, None, None], dim=-1)


def fwd_pass_state(x, B, dt_out, dA_cumsum, initial_states, seq_idx, cu_seqlens):
    """The state entering each chunk, the final state, and each varlen sequence's final state."""
    b, T, h, p = x.shape
    n = B.shape[-1]
    L = dt_out.shape[-1]
    acc = dt_out.dtype
    xc = to_chunks(x.to(acc), L)  # b c l h p
    Bc = group_to_heads(to_chunks(B.to(acc), L), h)  # b c l h n
    last = dA_cumsum[..., -1:]  # b h c 1
    w = torch.exp(last - dA_cumsum) * dt_out  # weight of each token in its chunk's end state
    carry = torch.exp(last[..., 0])  # b h c: decay of the entering state across the chunk
    if seq_idx is not None:
        seq, prev = seq_chunks(seq_idx, L)
        w = w * (seq == seq[..., -1:]).unsqueeze(1)
        carry = carry * (seq[..., -1] == prev).unsqueeze(1)
    local = torch.einsum("bhcl,bclhp,bclhn->bchpn", w, xc, Bc)
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
    sequence began before that chunk, plus the sequence's tokens inside that chunk."""
    L = dt_out.shape[-1]
    starts, last_tok = cu_seqlens[:-1].long(), cu_seqlens[1:].long() - 1
    chunk = torch.div(last_tok, L, rounding_mode="floor")
    pos = chunk[:, None] * L + torch.arange(L, device=chunk.device)  # (s, l) padded token positions
    inside = (pos >= starts[:, None]) & (pos <= last_tok[:, None])
    h = dt_out.shape[1]
    cs = dA_cumsum[0].permute(1, 2, 0).reshape(-1, h)  # (c*l, h)
    dt = dt_out[0].permute(1, 2, 0).reshape(-1, h)
    cs_end = cs[last_tok]  # (s, h)
    w = torch.exp(cs_end[:, None] - cs[pos]) * dt[pos] * inside[..., None]
    x_tok = xc[0].reshape(-1, *xc.shape[3:])[pos]  # (s, l, h, p)
    B_tok = Bc[0].reshape(-1, *Bc.shape[3:])[pos]  # (s, l, h, n)
    # The entering state belongs to this sequence when the token before the chunk does (or, for the
    # sequence starting at 0, when it is initial_states).
    owns = (starts < chunk * L) | (starts == 0)
    decay = torch.exp(cs_end) * owns[:, None]
    return decay[..., None, None] * states[0, chunk] + torch.einsum("slh,slhp,slhn->shpn", w, x_tok, B_tok)


def compute_out(x, dt_out, dA_cumsum, C, B, states, D, z, seq_idx):
    """y = intra-chunk (C_i . B_j) decay dt_j x_j  +  decay C_i . entering state  +  D x, then * silu(z)."""
    b, T, h, p = x.shape
    L = dt_out.shape[-1]
    acc = dt_out.dtype
    xc = to_chunks(x.to(acc), L)
    Bc = group_to_heads(to_chunks(B.to(acc), L), h)
    Cc = group_to_heads(to_chunks(C.to(acc), L), h)
    cs = dA_cumsum
    mask = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    inter = torch.exp(cs)  # b h c l
    if seq_idx is not None:
        seq, prev = seq_chunks(seq_idx, L)
        mask = mask & (seq[..., :, None] == seq[..., None, :]).unsqueeze(1)  # b 1 c l s
        inter = inter * (seq == prev[..., None]).unsqueeze(1)
    decay = torch.exp((cs[..., :, None] - cs[..., None, :]).masked_fill(~mask, float("-inf")))
    cb = torch.einsum("bclhn,bcshn->bhcls", Cc, Bc)
    y = torch.einsum("bhcls,bhcs,bcshp->bclhp", cb * decay, dt_out, xc)
    y = y + torch.einsum("bclhn,bchpn,bhcl->bclhp", Cc, states.to(acc), inter)
    y = y.reshape(b, -1, h, p)[:, :T]
    if D is not None:
        y = y + x.to(acc) * (D.to(acc)[:, None] if D.dim() == 1 else D.to(acc))
    if z is not None:
        y = y * F.silu(z.to(acc))
    return y.to(x.dtype)
