"""Per-sequence initial states for packed sequences (cu_seqlens): sequence k restarts from its own state h_k
instead of zero (a continued prompt of chunked prefill starts from the state its previous piece left).

The scan is linear in its starting states, so the scan with per-sequence starts is the scan from zero starts plus
each start's decayed contribution. With P_t the cumulative sum of dt·A along the packed row (P_{-1} = 0) and
sequence k spanning tokens [s_k, e_k), h_k reaches its token t as exp(P_t - P_{s_k - 1}) h_k. That adds:

- to the state entering chunk c, which belongs to the sequence k of token cL - 1 (sequence 0 for c = 0):
  exp(P_{cL-1} - P_{s_k-1}) h_k. compute_out then carries it to the rest of that sequence's tokens in chunk c;
- to the tokens of sequence k >= 1 in the chunk where it starts (no entering state reaches them):
  exp(P_t - P_{s_k-1}) C_t · h_k, gated by silu(z_t) like the rest of y;
- to the final state of sequence k: exp(P_{e_k-1} - P_{s_k-1}) h_k.

The chunk states and the output come from the ops (cuTile kernels on CUDA, the reference elsewhere), unchanged;
the second correction is an op of its own (m2ops::start_state_out: a kernel on CUDA, one program per sequence, head
and headdim tile), the other two PyTorch operations. Their sizes come from the shapes alone, so a call makes no host
synchronisation and can be captured in a CUDA graph, and autograd differentiates them (the gradient of h_k and of
dt, A through the decays). The extra work is one pass over the entering states, a copy of y and a (sequences x
chunk_size) window of tokens per call; the default path (no per-sequence states) does not come here.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import ops
from .meta.shapes import num_chunks


def is_per_sequence(initial_states, cu_seqlens) -> bool:
    """initial_states in the per-sequence form (num_sequences, ...) with more than one packed sequence (with one,
    the batch form (1, ...) is the same thing and takes the ordinary path)."""
    return (initial_states is not None and cu_seqlens is not None and cu_seqlens.shape[0] > 2
            and initial_states.shape[0] == cu_seqlens.shape[0] - 1)


class SequenceIndex(NamedTuple):
    """Where each sequence's start state acts, for a packed row of seqlen tokens in chunks of chunk_size: device
    tensors computed from cu_seqlens without reading its values on the host."""
    chunk_size: int
    start: torch.Tensor   # (num_sequences,) s_k
    end: torch.Tensor     # (num_sequences,) e_k
    owner: torch.Tensor   # (nchunks,) the sequence whose state enters chunk c


def sequence_index(cu_seqlens, seq_idx, seqlen: int, chunk_size: int) -> SequenceIndex:
    """seq_idx: (1, seqlen) sequence number of every token (seq_idx_from_cu_seqlens)."""
    L = chunk_size
    cu = cu_seqlens.long()
    start, end = cu[:-1], cu[1:]
    nchunks = num_chunks(seqlen, L)
    last_of_chunk = seq_idx[0, L - 1::L][:nchunks - 1].long()  # the sequence of token cL - 1, c >= 1
    owner = torch.cat([last_of_chunk.new_zeros(1), last_of_chunk])
    return SequenceIndex(L, start, end, owner)


def _log_decay(dA_cumsum):
    """(1, h, c, L) within-chunk cumulative sums -> Pz (h, c*L + 1) in float64, Pz[:, t] = P_{t-1}: the chunk
    totals summed in float64, so that differences over long rows keep float32's accuracy of the chunk sums."""
    cs = dA_cumsum[0].double()
    total = cs[:, :, -1]
    before = torch.cumsum(total, dim=1) - total
    return F.pad((before[..., None] + cs).flatten(1), (1, 0))


def add_entering(states, init, Pz, index: SequenceIndex):
    """states (1, c, h, p, n) from zero starts -> with each chunk's owner's start state carried in."""
    L = index.chunk_size
    c = states.shape[1]
    at = torch.arange(c, device=Pz.device) * L  # Pz index of P_{cL-1}
    decay = torch.exp(Pz[:, at] - Pz[:, index.start[index.owner]]).t().to(states.dtype)  # (c, h)
    # (one pass: addcmul, not a product then a sum)
    return torch.addcmul(states, decay[None, :, :, None, None], init.to(states.dtype)[index.owner][None])


def add_final(varlen, init, Pz, index: SequenceIndex):
    """Per-sequence final states from zero starts -> with each sequence's start state carried to its end."""
    decay = torch.exp(Pz[:, index.end] - Pz[:, index.start]).t().to(varlen.dtype)  # (s, h)
    return torch.addcmul(varlen, decay[..., None, None], init.to(varlen.dtype))


def scan(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus, dt_min,
         dt_max, index: SequenceIndex | None = None):
    """(y, final_states, varlen_states) of the packed scan (batch 1) in which sequence k starts from
    initial_states[k]. chunk_size: the size the call runs at (dispatch.run_chunk_size); seq_idx: derived from
    cu_seqlens; index: sequence_index(...) for that chunk size when the caller has it (else computed here, on the
    device)."""
    T = x.shape[1]
    if index is None or index.chunk_size != chunk_size:
        index = sequence_index(cu_seqlens, seq_idx, T, chunk_size)
    dt_out, dA_cumsum = ops.chunk_cumsum(dt, A, dt_bias, chunk_size, dt_softplus, dt_min, dt_max)
    states, _, varlen = ops.fwd_pass_state(x, B, dt_out, dA_cumsum, None, seq_idx, cu_seqlens)
    Pz = _log_decay(dA_cumsum)
    states = add_entering(states, initial_states, Pz, index)
    y = ops.compute_out(x, dt_out, dA_cumsum, C, B, states, D, z, seq_idx)
    y = ops.start_state_out(y, C, z, initial_states, dA_cumsum, cu_seqlens)
    varlen = add_final(varlen, initial_states, Pz, index)
    return y, varlen[-1:], varlen
