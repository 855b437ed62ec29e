"""Shape and dtype rules of the ops, written once: the fake implementations, the reference and the kernel
launchers all take their output shapes from here."""

from __future__ import annotations

import torch

# What the cuTile kernels are built for: other chunk sizes and float64 run the reference (ops.dispatch.kernels_serve
# decides; kernels/specs.py compiles every specialisation of these).
KERNEL_CHUNK_SIZES = (16, 32, 64, 128, 256)
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def num_chunks(seqlen, chunk_size):
    """Chunks covering seqlen tokens; the last one may be partial. Works on SymInts (dynamic seqlen)."""
    return (seqlen + chunk_size - 1) // chunk_size


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation and state dtype: float64 inputs stay float64 (for gradcheck), all others use float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def g_local_dtype(x_dtype: torch.dtype, B_dtype: torch.dtype, acc: torch.dtype) -> torch.dtype:
    """dtype of the chunks' local-state gradients between the two stages of fwd_pass_state's backward: bfloat16
    for bfloat16 x and B, whose products with it round it to bfloat16 anyway (half the bytes of the stage's
    largest array), else the accumulation dtype acc."""
    return torch.bfloat16 if torch.promote_types(x_dtype, B_dtype) == torch.bfloat16 else acc


def cumsum_shape(batch, seqlen, nheads, chunk_size):
    """dt_out and dA_cumsum: (batch, nheads, nchunks, chunk_size)."""
    return (batch, nheads, num_chunks(seqlen, chunk_size), chunk_size)


def states_shape(batch, nchunks, nheads, headdim, dstate):
    """The state entering each chunk: (batch, nchunks, nheads, headdim, dstate)."""
    return (batch, nchunks, nheads, headdim, dstate)


def cb_shape(batch, seqlen, ngroups, chunk_size):
    """C . B^T per chunk and group (the scratch chunk_cb writes): (batch, nchunks, ngroups, chunk_size, chunk_size)."""
    return (batch, num_chunks(seqlen, chunk_size), ngroups, chunk_size, chunk_size)


def final_states_shape(batch, nheads, headdim, dstate):
    return (batch, nheads, headdim, dstate)


def varlen_states_shape(cu_seqlens, nheads, headdim, dstate):
    """One final state per packed sequence; none when cu_seqlens is not given."""
    nseq = 0 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return (nseq, nheads, headdim, dstate)


def decode_state_shape(batch, nheads, headdim, dstate):
    """The recurrent state of one-token decoding (state_update's input and output): (batch, nheads, headdim,
    dstate), the layout of final_states, so that a prefill's final state seeds decoding directly."""
    return final_states_shape(batch, nheads, headdim, dstate)
