"""Launchers of the forward kernels: each picks the specialisation, allocates the outputs, computes the grid
and the arguments, and launches on the current stream. No host synchronisation and no branching on tensor
values, so they run under CUDA-graph capture and inside torch.compile graphs.

What runs the reference instead (same results, slower):
- float64 inputs (x, B, C, dt or the float32 intermediates given as float64): the reference computes in
  float64, which the kernels do not;
- chunk sizes other than 16, 32, 64, 128, 256.

Inputs are read in place through their strides (any layout, no padding copies), with these exceptions, each
one copy of a small or rare tensor:
- A, dt_bias, D and initial_states are converted to float32 when they are not (D is also expanded to
  (nheads, headdim)); seq_idx and cu_seqlens to int32 when they are int64;
- when x, B, C (and z) differ in dtype, they are converted to their promoted dtype and y is converted back;
- a tensor with a zero stride over a dimension longer than one (an expanded view) is made contiguous,
  because the kernels assume distinct indices address distinct elements.
"""

from __future__ import annotations

import torch

import cuda.tile as ct

from ..meta.shapes import cumsum_shape, final_states_shape, num_chunks, states_shape, varlen_states_shape
from ..reference import chunked as ref
from .chunk_cumsum import chunk_cumsum_kernel
from .common import TILE_H, TILE_N, TILE_P, cdiv, sub_block, supported_chunk_size
from .compute_out import compute_out_kernel
from .fwd_pass_state import fwd_pass_state_kernel
from .varlen_states import varlen_states_kernel

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---- specialisation choices (specs.py enumerates the domain of these functions) ----

def chunk_cumsum_constants(chunk_size: int) -> dict:
    return dict(L=chunk_size, BH=TILE_H)


def fwd_pass_state_constants(chunk_size: int, has_seq: bool) -> dict:
    return dict(L=chunk_size, BL=sub_block(chunk_size), TP=TILE_P, TN=TILE_N, HAS_SEQ=bool(has_seq))


def varlen_states_constants(chunk_size: int) -> dict:
    return dict(L=chunk_size, BL=sub_block(chunk_size), TP=TILE_P, TN=TILE_N)


def compute_out_constants(chunk_size: int, has_seq: bool) -> dict:
    return dict(L=chunk_size, BL=sub_block(chunk_size), TP=TILE_P, TN=TILE_N, HAS_SEQ=bool(has_seq))


# ---- helpers ----

def _dense(t):
    """t itself unless a dimension longer than one has stride 0 (an expanded view)."""
    if any(st == 0 and sz > 1 for st, sz in zip(t.stride(), t.shape)):
        return t.contiguous()
    return t


def _as(t, dtype):
    return _dense(t if t.dtype == dtype else t.to(dtype))


def _dummy(ref_tensor, dtype, ndim):
    """A one-element array for a parameter whose input is absent; the kernel never reads it."""
    return torch.empty((1,) * ndim, dtype=dtype, device=ref_tensor.device)


def _kernel_dtype(*tensors) -> bool:
    return all(t.dtype in _KERNEL_DTYPES for t in tensors if t is not None)


def _launch(grid, kernel, args):
    ct.launch(torch.cuda.current_stream(), grid, kernel, args)


# ---- the three ops ----

def chunk_cumsum(dt, A, dt_bias, chunk_size: int, dt_softplus: bool, dt_min: float, dt_max: float):
    if dt.dtype not in _KERNEL_DTYPES or not supported_chunk_size(chunk_size):
        return ref.chunk_cumsum(dt, A, dt_bias, chunk_size, dt_softplus, dt_min, dt_max)
    b, T, h = dt.shape
    shape = cumsum_shape(b, T, h, chunk_size)
    dt_out = torch.empty(shape, dtype=torch.float32, device=dt.device)
    dA_cumsum = torch.empty(shape, dtype=torch.float32, device=dt.device)
    A32 = _as(A, torch.float32)
    bias = _as(dt_bias, torch.float32) if dt_bias is not None else A32
    n_hblocks = cdiv(h, TILE_H)
    k = chunk_cumsum_constants(chunk_size)
    _launch((shape[2] * n_hblocks, b, 1), chunk_cumsum_kernel,
            (_dense(dt), A32, bias, dt_out, dA_cumsum,
             T, n_hblocks, int(dt_bias is not None), int(bool(dt_softplus)), float(dt_min), float(dt_max),
             k["L"], k["BH"]))
    return dt_out, dA_cumsum


def _common_dtype(*tensors):
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def fwd_pass_state(x, B, dt_out, dA_cumsum, initial_states, seq_idx, cu_seqlens):
    L = dt_out.shape[-1]
    if (not _kernel_dtype(x, B, dt_out, dA_cumsum) or dt_out.dtype == torch.float64
            or not supported_chunk_size(L)):
        return ref.fwd_pass_state(x, B, dt_out, dA_cumsum, initial_states, seq_idx, cu_seqlens)
    b, T, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    nchunks = num_chunks(T, L)
    dev = x.device
    mma_dtype = _common_dtype(x, B)
    xk, Bk = _as(x, mma_dtype), _as(B, mma_dtype)
    dtk, csk = _as(dt_out, torch.float32), _as(dA_cumsum, torch.float32)

    states = torch.empty(states_shape(b, nchunks, h, p, n), dtype=torch.float32, device=dev)
    final_states = torch.empty(final_states_shape(b, h, p, n), dtype=torch.float32, device=dev)
    init = (_as(initial_states, torch.float32) if initial_states is not None
            else _dummy(x, torch.float32, 4))
    seq = _as(seq_idx, torch.int32) if seq_idx is not None else _dummy(x, torch.int32, 2)
    n_ptiles, n_ntiles = cdiv(p, TILE_P), cdiv(n, TILE_N)
    k = fwd_pass_state_constants(L, seq_idx is not None)
    _launch((h * n_ptiles * n_ntiles, b, 1), fwd_pass_state_kernel,
            (xk, Bk, dtk, csk, init, seq, states, final_states,
             T, nchunks, h, h // g, n_ntiles, n_ptiles, int(initial_states is not None),
             k["L"], k["BL"], k["TP"], k["TN"], k["HAS_SEQ"]))

    varlen = torch.empty(varlen_states_shape(cu_seqlens, h, p, n), dtype=torch.float32, device=dev)
    if cu_seqlens is not None:
        nseq = cu_seqlens.shape[0] - 1
        kv = varlen_states_constants(L)
        _launch((nseq, h, n_ptiles * n_ntiles), varlen_states_kernel,
                (xk, Bk, dtk, csk, states, _as(cu_seqlens, torch.int32), varlen,
                 h // g, n_ntiles, kv["L"], kv["BL"], kv["TP"], kv["TN"]))
    return states, final_states, varlen


def compute_out(x, dt_out, dA_cumsum, C, B, states, D, z, seq_idx):
    L = dt_out.shape[-1]
    if (not _kernel_dtype(x, C, B, z, dt_out, dA_cumsum, states) or dt_out.dtype == torch.float64
            or not supported_chunk_size(L)):
        return ref.compute_out(x, dt_out, dA_cumsum, C, B, states, D, z, seq_idx)
    b, T, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    dev = x.device
    mma_dtype = _common_dtype(x, B, C, z)
    xk, Bk, Ck = _as(x, mma_dtype), _as(B, mma_dtype), _as(C, mma_dtype)
    zk = _as(z, mma_dtype) if z is not None else xk
    if D is not None:
        Dk = _as(D, torch.float32)
        Dk = (Dk[:, None] if Dk.dim() == 1 else Dk).expand(h, p).contiguous()
    else:
        Dk = _dummy(x, torch.float32, 2)
    seq = _as(seq_idx, torch.int32) if seq_idx is not None else _dummy(x, torch.int32, 2)
    y = torch.empty(x.shape, dtype=mma_dtype, device=dev)
    BL = sub_block(L)
    n_ptiles = cdiv(p, TILE_P)
    k = compute_out_constants(L, seq_idx is not None)
    _launch((cdiv(T, BL) * h * n_ptiles, b, 1), compute_out_kernel,
            (xk, _as(dt_out, torch.float32), _as(dA_cumsum, torch.float32), Ck, Bk,
             _as(states, torch.float32), Dk, zk, seq, y,
             T, h, h // g, n, n_ptiles, int(D is not None), int(z is not None),
             k["L"], k["BL"], k["TP"], k["TN"], k["HAS_SEQ"]))
    return y if y.dtype == x.dtype else y.to(x.dtype)
