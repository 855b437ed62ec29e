"""The decode step's launchers (one token): m2ops::state_update (functional, a fresh new state) and
m2ops::state_update_inplace (the state cache updated in place, rows picked by index); their tiles, their builds'
hints, their launches. Both kernels take the same tiles and the same hint rule."""

from __future__ import annotations

import torch

from . import runtime
from .common import cdiv
from .runtime import as_dtype, common_dtype, d_arg, dense, dtype_name
from .specialise import hinted, hinted_kernel, kernel_hints


# state_update: dstate tiles (dstate rounded up to a power of two, at least 32; dstate above 256 loops over
# 256-wide tiles) and headdim rows per program, TP = STATE_UPDATE_TILE_ELEMS // TN within [8, 64]: 8 KB of
# float32 state per tile, and 4-8 programs per (batch row, head) at headdim 64 for dstate 128-256, so that a
# batch-1 decode step of a large model (80 heads) still runs a few hundred programs.
STATE_UPDATE_TILE_NS = (32, 64, 128, 256)


STATE_UPDATE_TILE_ELEMS = 2048


def state_update_tile_n(dstate: int) -> int:
    for tn in STATE_UPDATE_TILE_NS:
        if dstate <= tn:
            return tn
    return STATE_UPDATE_TILE_NS[-1]


def state_update_constants(tile_n: int) -> dict:
    return dict(TP=max(8, min(64, STATE_UPDATE_TILE_ELEMS // tile_n)), TN=tile_n)


# Occupancy where every array the kernel reads or writes as tiles has 16-byte rows (rows_of_16_bytes): those
# builds copy by TMA and build at 64 registers without spills at headdim 64 x dstate 64-256. On the H200 0.684 ->
# 0.465 ms per decode step at batch 256 N=128, 1.443 -> 0.965 at N=256, bit-identical outputs, every GPU suite
# passing (docs/history.md v29). Elsewhere the table's occupancy: at headdim 50 x dstate 100 with a
# bfloat16 state, occupancy 4 spilled, made no TMA copy and wrote wrong values.
STATE_UPDATE_ALIGNED_OCCUPANCY = 4


_ALIGNED_HINTS = (("occupancy", STATE_UPDATE_ALIGNED_OCCUPANCY),)


def rows_of_16_bytes(*tensors) -> bool:
    """Whether each tensor starts on a 16-byte boundary, has a unit last stride (or a last dimension of one)
    and every other stride a multiple of 16 bytes: the stride class in which cuTile's builds copy tiles by TMA."""
    # Runs on every decode step: plain loops over the strides (5 us for seven arrays on the CPU, 12 with any()).
    for t in tensors:
        if t.data_ptr() & 15:
            return False
        st = t.stride()
        if st[-1] != 1 and t.shape[-1] > 1:
            return False
        per16 = 16 // t.element_size()
        for s in st[:-1]:
            if s % per16:
                return False
    return True


def state_update_hints(dtype: str, aligned: bool) -> dict:
    """The hints of state_update's build for activations of dtype: the table's, or occupancy
    STATE_UPDATE_ALIGNED_OCCUPANCY where every tiled array has 16-byte rows (aligned)."""
    if aligned:
        return dict(_ALIGNED_HINTS)
    return kernel_hints("state_update", dtype, 0)


def state_update_kernel_for(dtype: str, aligned: bool):
    """The kernel object state_update launches, with state_update_hints' hints (kept per hints, as
    hinted_kernel's; nothing built per decode step)."""
    if aligned:
        return hinted("state_update", _ALIGNED_HINTS)
    return hinted_kernel("state_update", dtype, 0)


def state_update_inplace_hints(dtype: str, aligned: bool) -> dict:
    """state_update_hints' rule for the in-place kernel (its table entries are state_update's)."""
    if aligned:
        return dict(_ALIGNED_HINTS)
    return kernel_hints("state_update_inplace", dtype, 0)


def state_update_inplace_kernel_for(dtype: str, aligned: bool):
    """The kernel object state_update_inplace launches, with state_update_inplace_hints' hints."""
    if aligned:
        return hinted("state_update_inplace", _ALIGNED_HINTS)
    return hinted_kernel("state_update_inplace", dtype, 0)


def state_update_dtypes(act_dtype: str) -> tuple:
    """The dtypes of dt and of the state (each) that the kernel is built for, given the activations' dtype:
    that dtype or float32 (a layer's dt is its activations' dtype; states are float32, or the activations'
    dtype in caches kept in it). Other combinations are converted by the launcher."""
    return (act_dtype,) if act_dtype == "float32" else (act_dtype, "float32")


def state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus: bool, dt_min: float, dt_max: float):
    """m2ops::state_update on the GPU: (y like x, new_state of state's dtype), inputs never written.

    x, B, C and z are read
    in their promoted dtype (converted when they differ; y converted back to x's dtype); dt and state in that
    dtype or float32 (others converted to float32; the new state is then converted back to state's dtype);
    A, dt_bias and D in float32 (converted when not). One launch otherwise: the outputs are fresh tensors,
    there is no host synchronisation and nothing depends on tensor values (CUDA-graph capturable)."""
    b, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    dev = x.device
    act = common_dtype(x, B, C, z)
    xk, Bk, Ck = as_dtype(x, act), as_dtype(B, act), as_dtype(C, act)
    zk = as_dtype(z, act) if z is not None else xk
    dtk = dense(dt) if dt.dtype in (act, torch.float32) else as_dtype(dt, torch.float32)
    state_k = dense(state) if state.dtype in (act, torch.float32) else as_dtype(state, torch.float32)
    A32 = as_dtype(A, torch.float32)
    bias = as_dtype(dt_bias, torch.float32) if dt_bias is not None else A32
    Dk, has_d = d_arg(D, x)

    y = torch.empty((b, h, p), dtype=act, device=dev)
    new_state = torch.empty((b, h, p, n), dtype=state_k.dtype, device=dev)
    k = state_update_constants(state_update_tile_n(n))
    n_ptiles = cdiv(p, k["TP"])
    tiled = (state_k, xk, Bk, Ck, new_state, y) + ((zk,) if z is not None else ()) + ((Dk,) if has_d == 2 else ())
    kernel = state_update_kernel_for(dtype_name(act), rows_of_16_bytes(*tiled))
    runtime.launch((h * n_ptiles, b, 1), kernel,
            (state_k, xk, dtk, A32, Bk, Ck, Dk, zk, bias, new_state, y,
             h, h // g, n, n_ptiles, has_d, int(z is not None), int(dt_bias is not None),
             int(bool(dt_softplus)), float(dt_min), float(dt_max),
             k["TP"], k["TN"]))
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    if new_state.dtype != state.dtype:
        new_state = new_state.to(state.dtype)
    return y, new_state


def state_update_inplace(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices, dt_softplus: bool,
                         dt_min: float, dt_max: float, out, A_is_log: bool = False) -> None:
    """m2ops::state_update_inplace on the GPU: the cache rows of state updated in place (row b, or
    state_batch_indices[b]; a row outside [0, cache_rows) skipped), y written into out (its skipped rows left
    as they are). Returns nothing.

    Inputs are read as state_update reads them, but for A and dt_bias, read in the activations' dtype where both
    are in it (runtime.param_dtype). state is read and written where it is: in its own dtype when that
    is the activations' or float32 (the kernel's builds); in another dtype through a float32 copy that is written
    back (a state-sized copy each way, only for such a mix). y goes straight into out when out is in the
    activations' dtype, else through a copy of out in that dtype. int64 indices are clamped to [-1, cache_rows]
    and converted to int32 (one small copy). One launch otherwise; no host synchronisation, nothing depends on
    tensor values (CUDA-graph capturable)."""
    b, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    cache_rows = state.shape[0]
    act = common_dtype(x, B, C, z)
    xk, Bk, Ck = as_dtype(x, act), as_dtype(B, act), as_dtype(C, act)
    zk = as_dtype(z, act) if z is not None else xk
    dtk = dense(dt) if dt.dtype in (act, torch.float32) else as_dtype(dt, torch.float32)
    state_k = state if state.dtype in (act, torch.float32) else state.to(torch.float32)
    # A and dt_bias read as they are where both are in the activations' dtype (a bfloat16 layer's): no
    # conversion launched per token
    pd = runtime.param_dtype(act, A, dt_bias)
    Ak = as_dtype(A, pd)
    bias = as_dtype(dt_bias, pd) if dt_bias is not None else Ak
    Dk, has_d = d_arg(D, x)
    if state_batch_indices is None:
        rows = runtime.dummy(x, torch.int32, 1)
    elif state_batch_indices.dtype == torch.int32:
        rows = dense(state_batch_indices)
    else:  # (clamped first: a value beyond int32 must not wrap into the cache's range)
        rows = state_batch_indices.clamp(-1, cache_rows).to(torch.int32)
    y = out if out.dtype == act else out.to(act)

    k = state_update_constants(state_update_tile_n(n))
    n_ptiles = cdiv(p, k["TP"])
    tiled = (state_k, xk, Bk, Ck, y) + ((zk,) if z is not None else ()) + ((Dk,) if has_d == 2 else ())
    kernel = state_update_inplace_kernel_for(dtype_name(act), rows_of_16_bytes(*tiled))
    runtime.launch((h * n_ptiles, b, 1), kernel,
            (state_k, xk, dtk, Ak, Bk, Ck, Dk, zk, bias, rows, y,
             h, h // g, n, n_ptiles, cache_rows, has_d, int(z is not None), int(dt_bias is not None),
             int(bool(dt_softplus)), int(state_batch_indices is not None), int(bool(A_is_log)), float(dt_min),
             float(dt_max),
             k["TP"], k["TN"]))
    if y is not out:
        out.copy_(y)
    if state_k is not state:
        state.copy_(state_k)
