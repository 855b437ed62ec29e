"""What a rank's slice does to the state that enters it, and how the ranks' summaries combine.

A slice maps the state h entering it (owned by sequence id `owner`) to the state after its last token:

    h_out = carry · h + local,    carry = decay · [first id == owner]   (per batch row and head)

where `local` is the slice's final state from a zero start (with its own restarts at seq_idx changes) and
`decay` the product of exp(dt·A) over the slice, 0 where the slice holds a restart (the entering state does not
survive it). The state after the slice belongs to the slice's last id. An empty slice passes h and owner on.
Maps of this form compose (the composition of two is again one), so every rank can fold the summaries of the
ranks before it, in rank order, into the state entering its own slice: no chain of messages from rank to rank.

The summary travels as one flat vector in the state dtype, (b·h·p·n) local state, (b·h) decay, (b·6) first and
last ids, 1 non-empty flag: one gather moves it, and autograd runs back through that gather. Ids are int64,
sent as three pieces of at most 22 bits each, which float32 holds exactly.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import ops

_PIECE = 21  # bits per id piece: |piece| < 2^22 fits float32's 24-bit significand


class Summary(NamedTuple):
    local: torch.Tensor     # (b, h, p, n) final state from a zero start
    decay: torch.Tensor     # (b, h) decay of the entering state across the slice (0 after a restart)
    first: torch.Tensor     # (b,) int64 id of the first token (0 without seq_idx)
    last: torch.Tensor      # (b,) int64 id of the last token
    nonempty: torch.Tensor  # () bool


def local_summary(x, dt, A, B, dt_bias, seq_idx, chunk_size, dt_softplus, dt_min, dt_max) -> Summary:
    """This rank's summary, from its chunk cumulative sums and the state pass (the ops: cuTile kernels on CUDA,
    the reference elsewhere). seq_idx: the slice's ids, or None. An empty slice (seqlen 0) summarises to the
    identity map."""
    b, T, h, p = x.shape
    n = B.shape[-1]
    acc = torch.float64 if dt.dtype == torch.float64 else torch.float32
    if T == 0:
        zero_ids = torch.zeros(b, dtype=torch.int64, device=x.device)
        # Tied to the inputs by zero-sized sums, so that autograd keeps this rank in the backward exchange.
        tie = sum(t.flatten()[:0].sum() for t in (x, dt, A, B, dt_bias) if t is not None)
        return Summary(x.new_zeros((b, h, p, n), dtype=acc) + tie, x.new_ones((b, h), dtype=acc), zero_ids, zero_ids,
                       torch.tensor(False, device=x.device))
    dt_out, dA_cumsum = ops.chunk_cumsum(dt, A, dt_bias, chunk_size, dt_softplus, dt_min, dt_max)
    _, local, _ = ops.fwd_pass_state(x, B, dt_out, dA_cumsum, None, rebased(seq_idx), None)
    decay = torch.exp(dA_cumsum[..., -1].sum(-1))  # tail positions hold dt = 0: the chunk totals are the slice's
    if seq_idx is None:
        first = last = torch.zeros(b, dtype=torch.int64, device=x.device)
    else:
        first, last = seq_idx[:, 0].long(), seq_idx[:, -1].long()
        decay = decay * (first == last).to(acc)[:, None]  # ids never decrease: first == last means no restart
    return Summary(local, decay, first, last, torch.tensor(True, device=x.device))


def rebased(seq_idx):
    """The slice's ids shifted to start at 0: the public scan gives initial_states to sequence id 0, and here the
    state entering the slice belongs to the slice's first sequence (or is zeroed before, where it does not)."""
    return None if seq_idx is None else seq_idx - seq_idx[:, :1]


def ids_as_floats(ids: torch.Tensor, dtype) -> torch.Tensor:
    """int ids (...) -> (..., 3) exact pieces in dtype (float32 or float64), for a gather of float data."""
    ids = ids.long()
    mask = (1 << _PIECE) - 1
    return torch.stack([ids >> (2 * _PIECE), (ids >> _PIECE) & mask, ids & mask], dim=-1).to(dtype)


def ids_from_floats(pieces: torch.Tensor) -> torch.Tensor:
    """ids_as_floats's inverse: (..., 3) -> (...) int64 (no gradient)."""
    p = pieces.detach().round().long()
    return (p[..., 0] << (2 * _PIECE)) + (p[..., 1] << _PIECE) + p[..., 2]


def pack(s: Summary) -> torch.Tensor:
    dtype = s.local.dtype
    ids = ids_as_floats(torch.stack([s.first, s.last], dim=1), dtype)  # (b, 2, 3)
    return torch.cat([s.local.flatten(), s.decay.flatten(), ids.flatten(), s.nonempty.to(dtype)[None]])


def unpack(rows: torch.Tensor, b: int, h: int, p: int, n: int) -> Summary:
    """(world, size) gathered summaries -> every rank's Summary, stacked on a leading world dimension."""
    world = rows.shape[0]
    local, decay, pieces, nonempty = rows.split((b * h * p * n, b * h, b * 6, 1), dim=1)
    ids = ids_from_floats(pieces.view(world, b, 2, 3))
    return Summary(local.view(world, b, h, p, n), decay.view(world, b, h), ids[..., 0], ids[..., 1],
                   nonempty.detach()[:, 0] > 0.5)


def fold(rows: torch.Tensor, rank: int, initial_states, shape, need_final: bool):
    """rows: (world, size) gathered summaries. Returns (the state entering this rank's slice, already zeroed
    in the batch rows whose slice begins another sequence; the state after the whole sequence or None).

    Every rank folds the same rows in the same order, so the final state has the same bits on every rank."""
    s = unpack(rows, *shape)
    world = rows.shape[0]
    # The id owning the state that enters each slice: the last id of the nearest non-empty slice before it, or 0
    # (initial_states belongs to sequence 0).
    order = torch.arange(world, device=rows.device)
    latest = torch.cummax(torch.where(s.nonempty, order, -1), dim=0).values  # nearest non-empty at or before q
    before = torch.cat([latest.new_full((1,), -1), latest[:-1]])
    owner = torch.where((before >= 0)[:, None], s.last[before.clamp(min=0)], 0)  # (world, b)
    joins = ((s.first == owner) | ~s.nonempty[:, None]).to(rows.dtype)  # the slice continues that sequence
    carry = s.decay * joins[..., None]  # (world, b, h)

    state = rows.new_zeros(shape) if initial_states is None else initial_states.to(rows.dtype)
    # A zero-sized sum ties the result to the gathered rows: every rank's backward then reaches the gather's
    # backward exchange, also rank 0, whose entering state comes from no other rank.
    state = state + rows[:, :0].sum()
    for q in range(rank):
        state = carry[q][..., None, None] * state + s.local[q]
    entering = state * joins[rank][:, None, None, None]
    if not need_final:
        return entering, None
    for q in range(rank, world):
        state = carry[q][..., None, None] * state + s.local[q]
    return entering, state
