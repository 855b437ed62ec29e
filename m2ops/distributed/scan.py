"""mamba_chunk_scan_combined across the ranks of a group: context parallelism by summaries.

Each rank holds a contiguous slice of the sequence. The route of a call:

1. the group, and the checks: this rank's slice locally, then one small exchange in which every rank learns
   whether all slices passed and agree (so that a bad slice raises on every rank rather than hanging the rest);
2. this rank's summary: its final state from a zero start and the decay of an entering state across it
   (chunk_cumsum and the state pass, summary.py);
3. one gather of every rank's summary, which every rank folds in rank order into the state entering its slice
   (and, when asked, the state after the whole sequence);
4. the ordinary scan of the slice from that entering state.

Autograd runs back through all four; the backward's only exchange is the gather's (a reduce-scatter of the
summaries' gradients).
"""

from __future__ import annotations

import torch

from ..meta.validate import check_inputs, check_values, should_check_values
from ..ops import dispatch
from ..scan_combined import mamba_chunk_scan_combined as _scan
from . import group as ranks
from .summary import fold, local_summary, pack, rebased

_PLAIN = "m2ops.mamba_chunk_scan_combined"  # the prefix of the plain call's check errors


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, group=None):
    """The Mamba-2 SSD scan of a sequence split across the ranks of `group`, each rank holding one slice.

    Every rank calls it with its own contiguous slice of the sequence, the slices in rank order (rank 0 holds
    the first tokens); slices may have any length, different on each rank, 0 included. Arguments are those of
    m2ops.mamba_chunk_scan_combined, with these meanings:

        x, dt, B, C, z: this rank's slice, (batch, slice_len, ...).
        seq_idx: this rank's slice of the whole sequence's ids (batch, slice_len); a packed sequence may run
            across any number of ranks: the state carries over a rank boundary where the ids on both sides
            are equal.
        A, D, dt_bias: the same on every rank (replicated parameters).
        initial_states: the state before the whole sequence's first token (of sequence id 0), the same on
            every rank (or None on every rank).
        group: the ranks sharing the sequence: None (the default group), a ProcessGroup, a 1-D DeviceMesh or
            (DeviceMesh, dim). Its backend must serve x's device (NCCL for CUDA, gloo for the CPU).

    Returns this rank's slice of y; with return_final_states also the state after the whole sequence's last
    token (float32, float64 for float64 dt), the same on every rank.

    Communication: one gather of (batch, nheads, headdim, dstate) states per rank in forward, its reduce-scatter
    in backward, and (while checking, see below) one gather of a few integers per rank before. A group of one
    rank exchanges nothing and runs the plain call.

    Gradients: those of the slice's inputs (x, dt, B, C, z) are this rank's slice of the whole
    gradient; those of the replicated inputs (A, D, dt_bias, initial_states) are this rank's part, which sum
    over the group's ranks to the whole: all-reduce them over the group, as data parallelism does (a
    data-parallel wrapper over a group that includes the context-parallel ranks does it already). Every rank
    must run backward when one does, as with any collective.

    Checks: each rank's slice as the plain call checks it; then, unless torch.compile is tracing, a CUDA graph
    capturing or M2OPS_CHECK_VALUES=0, every rank's sizes, dtypes and options are compared across the group
    (one device-to-host copy), and any failure raises on every rank. The values of A, D, dt_bias and
    initial_states are not compared.
    """
    pg, rank, world = ranks.resolve(group)
    if world == 1:  # nothing to exchange
        return _scan(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
                     seq_idx=seq_idx, dt_softplus=dt_softplus, dt_limit=dt_limit,
                     return_final_states=return_final_states)
    return across(pg, rank, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus,
                  dt_limit, return_final_states)


def across(pg, rank, x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
           dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False):
    """Steps 1-4 of the module docstring on process group pg, whatever its size (a group of one included, which
    measure/cp_overhead.py times against the plain call)."""
    _check(pg, rank, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus, dt_limit,
           return_final_states)
    rows = ranks.gather(summarise(x, dt, A, B, C, chunk_size, z, dt_bias, seq_idx, dt_softplus, dt_limit), pg)
    return scan_from(rows, rank, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus,
                     dt_limit, return_final_states)


def summarise(x, dt, A, B, C, chunk_size, z=None, dt_bias=None, seq_idx=None, dt_softplus=False,
              dt_limit=(0.0, float("inf"))) -> torch.Tensor:
    """Step 2: this rank's summary, packed for the gather (summary.pack), at the chunk size the plain call
    would run (C and z only take part in that choice)."""
    T = x.shape[1]
    run_chunk = dispatch.kernel_chunk_size(chunk_size, T, x.device, (x, dt, B, C, z)) if T else chunk_size
    return pack(local_summary(x, dt, A, B, dt_bias, seq_idx, run_chunk, dt_softplus, float(dt_limit[0]),
                              float(dt_limit[1])))


def scan_from(rows, rank, x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
              seq_idx=None, dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False):
    """Steps 3-4 after the gather: rows (world, size) holds every rank's summary in rank order; this rank's y
    (and the final state) from the state the ranks before it leave."""
    b, T, h, p = x.shape
    entering, final = fold(rows, rank, initial_states, (b, h, p, B.shape[-1]), return_final_states)
    if T == 0:  # tied to the exchange (and to C, D, z: zero gradients, not None), for this rank's backward
        y = x + sum(t.flatten()[:0].sum() for t in (entering, C, D, z) if t is not None).to(x.dtype)
    else:
        y = _scan(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, initial_states=entering,
                  seq_idx=rebased(seq_idx), dt_softplus=dt_softplus, dt_limit=dt_limit)
    return (y, final) if return_final_states else y


def _check(pg, rank, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus, dt_limit,
           return_final_states):
    """This rank's slice as the plain call checks it, then (unless tracing, capturing or switched off) every
    rank's agreement; raises on every rank if any rank's slice fails."""
    error = _local_error(rank, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus,
                         dt_limit, return_final_states)

    def describe():
        needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                     for t in (x, dt, A, B, dt_bias))
        return ranks.describe(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus,
                              dt_limit, return_final_states, needs_grad)
    device = x.device if isinstance(x, torch.Tensor) else torch.device("cpu")
    ranks.agree(pg, rank, error, describe, device, ranks.checks_exchanged(x))


def _local_error(rank, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus, dt_limit,
                 return_final_states):
    """The exception the plain call's checks raise for this slice (saying which rank), or None. An empty slice
    is checked as one token of the same shapes."""
    def one_token(t):
        empty = isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == 0
        return t.new_zeros((t.shape[0], 1, *t.shape[2:])) if empty else t

    try:
        T = x.shape[1] if isinstance(x, torch.Tensor) and x.dim() == 4 else None
        if T == 0:
            x, dt, B, C, z, seq_idx = (one_token(t) for t in (x, dt, B, C, z, seq_idx))
        check_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, None, dt_softplus,
                     dt_limit, return_final_states, False)
        if T and should_check_values(seq_idx):
            check_values(seq_idx, None, T)
    except (TypeError, ValueError) as e:
        message = str(e).removeprefix(_PLAIN + ": ")
        return type(e)(f"{ranks.WHERE} (rank {rank} of the group): {message}")
    return None
