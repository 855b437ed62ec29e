"""States at block boundaries of packed sequences, for prefix caching.

A serving engine that caches prompt prefixes keeps, for each sequence, the state after every block_size tokens of
its whole prompt: a later request sharing the first P tokens starts from the state at P. In a batch of packed
pieces (chunked prefill), piece k holds tokens [c_k, c_k + len_k) of its prompt (c_k: the context before it), so its
boundaries are the multiples P of block_size with c_k < P <= c_k + len_k.

The state at boundary i of a piece is h_i = exp(a_i) h_{i-1} + u_i, with h_{-1} the piece's start state, a_i the
sum of dt·A over the tokens since the previous boundary (or the piece's start) and u_i those tokens' own
contribution from a zero state. Each u_i is one window of at most block_size tokens (a batched matrix product, like
a chunk state); the h_i of a piece then follow from a prefix scan over its boundaries: affine maps compose, so
log2(boundaries per piece) vectorised steps suffice, with no host loop over boundaries and no value read (the
windows are decided on the host by prepare_varlen, once per batch).

These are PyTorch operations on the inputs (on the GPU as well): their cost is about one chunk-state pass over the
tokens of the pieces that have boundaries. Autograd differentiates them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .reference.chunked import step_sizes


class BlockIndex(NamedTuple):
    """Where the boundaries of a batch are (prepare_varlen(..., block_size=...)), boundaries in sequence order
    and, within a sequence, in token order."""
    block_size: int
    sequence: torch.Tensor  # (num_blocks,) int64 the packed sequence each state belongs to
    position: torch.Tensor  # (num_blocks,) int64 tokens of that sequence's prompt up to the boundary (context included)
    window: torch.Tensor    # (num_blocks, block_size) packed token indices since the previous boundary, right-aligned
    inside: torch.Tensor    # (num_blocks, block_size) which window entries are tokens (the rest is padding)
    slot: torch.Tensor      # (num_blocks,) int64 sequence * per_sequence + boundary number within the sequence
    per_sequence: int       # the most boundaries of one sequence


def block_index(cu_seqlens: torch.Tensor, context_lens: torch.Tensor, block_size: int, device) -> BlockIndex:
    """cu_seqlens, context_lens: checked CPU int64 tensors ((num_sequences + 1,), (num_sequences,)). Host work,
    once per batch."""
    W = block_size
    seqs, positions, ends, starts, ranks = [], [], [], [], []
    for k in range(cu_seqlens.shape[0] - 1):
        s, e, c = int(cu_seqlens[k]), int(cu_seqlens[k + 1]), int(context_lens[k])
        first = (c // W + 1) * W  # the first multiple of W after the context
        for i, P in enumerate(range(first, c + (e - s) + 1, W)):
            end = s + (P - c) - 1  # the packed index of the boundary's last token
            seqs.append(k)
            positions.append(P)
            ends.append(end)
            starts.append(max(s, end - W + 1))
            ranks.append(i)
    n = len(seqs)
    end = torch.tensor(ends, dtype=torch.int64).reshape(n, 1)
    j = torch.arange(W, dtype=torch.int64) - (W - 1)  # right-aligned: the last entry is the boundary's token
    window = end + j
    inside = window >= torch.tensor(starts, dtype=torch.int64).reshape(n, 1)
    per_sequence = max(ranks, default=-1) + 1
    seq = torch.tensor(seqs, dtype=torch.int64)
    slot = seq * per_sequence + torch.tensor(ranks, dtype=torch.int64)
    return BlockIndex(W, seq.to(device), torch.tensor(positions, dtype=torch.int64).to(device),
                      window.clamp(min=0).to(device), inside.to(device), slot.to(device), per_sequence)


def block_states(x, dt, A, B, dt_bias, dt_softplus: bool, dt_min: float, dt_max: float, starts, num_sequences: int,
                 index: BlockIndex) -> torch.Tensor:
    """x (T, h, p), dt (T, h), B (T, g, n); starts: (num_sequences, h, p, n) or None (zero). Returns the states at
    index's boundaries, (num_blocks, h, p, n), in float32 (float64 for float64 dt)."""
    f = torch.float64 if dt.dtype == torch.float64 else torch.float32
    _, h, p = x.shape
    g, n = B.shape[1:]
    nb, W = index.window.shape
    if nb == 0:
        return x.new_zeros((0, h, p, n), dtype=f)
    tok = index.window
    d = step_sizes(dt[tok], dt_bias, dt_softplus, dt_min, dt_max, f) * index.inside[..., None].to(f)  # (nb, W, h)
    dA = d * A.to(f)
    # exp(sum of dA over the window's later tokens) carries token j's update to the boundary.
    later = torch.flip(torch.cumsum(torch.flip(dA, [1]), 1), [1]) - dA
    w = (torch.exp(later) * d).view(nb, W, g, h // g)
    local = torch.einsum("bwgc,bwgcp,bwgn->bgcpn", w, x[tok].to(f).view(nb, W, g, h // g, p), B[tok].to(f))
    local = local.reshape(nb, h, p, n)
    decay = dA.sum(1)  # (nb, h) log of the window's decay

    # Per sequence, padded to per_sequence boundaries (padding after a sequence's last boundary: identity maps).
    K = index.per_sequence
    logs = decay.new_zeros((num_sequences * K, h)).index_copy(0, index.slot, decay).view(num_sequences, K, h)
    u = local.new_zeros((num_sequences * K, h, p, n)).index_copy(0, index.slot, local).view(num_sequences, K, h, p, n)
    step = 1
    while step < K:  # inclusive prefix scan of the affine maps h -> exp(a) h + u
        u = torch.cat([u[:, :step], u[:, step:] + torch.exp(logs[:, step:])[..., None, None] * u[:, :-step]], 1)
        logs = torch.cat([logs[:, :step], logs[:, step:] + logs[:, :-step]], 1)
        step *= 2
    states = u
    if starts is not None:
        states = states + torch.exp(logs)[..., None, None] * starts.to(f)[:, None]
    return states.reshape(num_sequences * K, h, p, n).index_select(0, index.slot)
