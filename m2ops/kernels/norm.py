"""Launchers of the gated RMSNorm (m2ops::rms_norm_gated and m2ops::rms_norm_gated_bwd): their tiles, their builds'
hints, their launches. Signatures and outputs are the reference's (m2ops/reference/gated_norm.py).

x, z and dy are read in place as (rows, ngroups, group_size) views: the leading dimensions must flatten to one row
stride and the channels must be contiguous (the layer's z, a slice of in_proj's output, is such a view); other
layouts are copied once. x and z (and dy) are read in their promoted dtype (converted when they differ; outputs
converted back), weight and bias in float32 (the forward: also in the activations' dtype, as they are,
runtime.param_dtype). No host synchronisation; nothing depends on tensor values.
Callers have decided that the kernels serve the call (ops.dispatch.kernels_serve, and group_size at most
KERNEL_NORM_MAX_GROUP).
"""

from __future__ import annotations

import functools

import torch

from ..meta.gated_norm import KERNEL_NORM_MAX_GROUP, norm_rstd_shape
from . import runtime
from .common import cdiv
from .runtime import as_dtype, common_dtype, dense, dummy, param_dtype
from .specialise import hinted

# Group tiles: the group size rounded up to a power of two, from 64 to NORM_TILE_ELEMS. Programs hold NORM_TILE_ELEMS
# elements of each tile (NORM_TILE_ELEMS // GS rows): memory-bound, so enough bytes per program, while every tile
# the backward holds stays in registers. Wider groups (up to KERNEL_NORM_MAX_GROUP) go to the column-tiled kernels.
NORM_TILE_ELEMS = 4096
NORM_GROUP_TILES = tuple(1 << k for k in range(6, NORM_TILE_ELEMS.bit_length()))

# Hints, from the sm_90 builds' resources (ptxas -v on tileiras 13.4's PTX, measure/kernel_resources.py; not yet
# timed on a GPU). Without hints tileiras builds 128 threads and the backward spills (bfloat16: 284-640 bytes a
# thread at 4096 elements). num_worker_warps=8 (256 threads) builds the forward at 71-94 registers and the backward
# at 194-238 without spills.
NORM_HINTS = (("num_worker_warps", 8),)
# Groups over NORM_TILE_ELEMS channels (gated_norm_wide.py, gated_norm_wide_bwd.py). The forward holds BR rows of a
# group as NC tiles of CS columns (one specialisation per NC up to KERNEL_NORM_MAX_GROUP / CS); measured at 32768
# rows x 5120 channels, bfloat16 (measure/norm_variants.py, H200, 2026-12-07): BR=4, CS=512 with NORM_HINTS 0.421 ms,
# BR=2, CS=1024 0.572, BR=1 or 2 with 4 warps 0.69; the former two-pass kernel 0.512-1.663 over its tilings (0.767 as
# it was used). A whole-group 8192 tile built as a CTA pair took 2.26 ms forward and 3.0 ms backward on an H100.
NORM_WIDE_FWD_ROWS = 4
NORM_WIDE_FWD_COLS = 512
# The backward walks the group in (NORM_WIDE_ROWS, NORM_WIDE_COLS) tiles, twice.
NORM_WIDE_ROWS = 4
NORM_WIDE_COLS = 1024
# Its backward (gated_norm_wide_bwd.py): programs per SM in all, spread over the groups' column tiles; (4, 1024)
# float32 tiles leave room for several per SM. Not yet timed.
NORM_WIDE_BWD_PROGRAMS_PER_SM = 4

# Backward programs: each walks row blocks and keeps its weight and bias sums in registers, one row of partial sums
# each in the end. One resident program per SM (the builds take 194-238 registers of 256 threads): enough to
# stream, and few partial rows to sum.
NORM_BWD_PROGRAMS_PER_SM = 1


def norm_group_tile(group_size: int) -> int:
    """GS: the group tile (group_size rounded up to a power of two, at least 64); over NORM_TILE_ELEMS the group
    goes to the column-tiled kernels."""
    return max(NORM_GROUP_TILES[0], 1 << (group_size - 1).bit_length())


def norm_constants(group_tile: int) -> dict:
    return dict(BR=max(1, NORM_TILE_ELEMS // group_tile), GS=group_tile)


def norm_wide_constants() -> dict:
    """The wide backward's tiles."""
    return dict(BR=NORM_WIDE_ROWS, CS=NORM_WIDE_COLS)


def norm_wide_fwd_tile_counts() -> tuple:
    """NC of the wide forward's specialisations: every tile count of a group over NORM_TILE_ELEMS channels."""
    return tuple(range(cdiv(NORM_TILE_ELEMS + 1, NORM_WIDE_FWD_COLS),
                       cdiv(KERNEL_NORM_MAX_GROUP, NORM_WIDE_FWD_COLS) + 1))


def norm_wide_fwd_constants(group_size: int) -> dict:
    return dict(BR=NORM_WIDE_FWD_ROWS, CS=NORM_WIDE_FWD_COLS, NC=cdiv(group_size, NORM_WIDE_FWD_COLS))


def _as_rows(t, hidden, dtype):
    """t (..., hidden) as a (rows, hidden) view with unit channel stride, in dtype: copied only where its leading
    dimensions do not flatten to one row stride, or its channels are not contiguous."""
    t = t if t.dtype == dtype else t.to(dtype)
    if t.stride(-1) != 1 and hidden > 1:
        t = t.contiguous()
    try:
        v = t.view(-1, hidden)
    except RuntimeError:
        v = t.reshape(-1, hidden)
    return dense(v)


def _grouped(t2, group_size):
    """A (rows, hidden) view as (rows, ngroups, group_size)."""
    return t2.view(t2.shape[0], t2.shape[1] // group_size, group_size)


@functools.lru_cache(maxsize=None)
def _plan(group_size: int):
    gt = norm_group_tile(group_size)
    k = norm_constants(gt)
    return k, hinted("gated_norm", NORM_HINTS), hinted("gated_norm_bwd", NORM_HINTS)


@functools.lru_cache(maxsize=None)
def _wide_kernel():
    return hinted("gated_norm_wide", NORM_HINTS)


@functools.lru_cache(maxsize=None)
def _wide_bwd_kernels():
    return hinted("gated_norm_wide_rows", NORM_HINTS), hinted("gated_norm_wide_bwd", NORM_HINTS)


def rms_norm_gated(x, weight, bias, z, eps: float, group_size: int, norm_before_gate: bool):
    """m2ops::rms_norm_gated on the GPU: (y like x, rstd (ngroups, rows) float32). One launch."""
    hidden = x.shape[-1]
    act = common_dtype(x, z)
    x2 = _as_rows(x, hidden, act)
    rows, ngroups = x2.shape[0], hidden // group_size
    y = torch.empty((rows, hidden), dtype=act, device=x.device)
    rstd = torch.empty(norm_rstd_shape(x.shape, group_size), dtype=torch.float32, device=x.device)
    if rows > 0:
        k, kernel, _ = _plan(group_size)
        z3 = _grouped(_as_rows(z, hidden, act), group_size) if z is not None else dummy(x, act, 3)
        pd = param_dtype(act, weight, bias)
        w = as_dtype(weight, pd).view(ngroups, group_size)
        b = as_dtype(bias, pd).view(ngroups, group_size) if bias is not None else dummy(x, pd, 2)
        flags = (1.0 / group_size, float(eps), int(z is not None), int(bias is not None),
                 int(z is not None and not norm_before_gate))
        arrays = (_grouped(x2, group_size), z3, w, b, _grouped(y, group_size), rstd)
        if k["GS"] > NORM_TILE_ELEMS:  # wider than one tile: the column-tiled kernel
            wk = norm_wide_fwd_constants(group_size)
            runtime.launch((cdiv(rows, wk["BR"]), ngroups, 1), _wide_kernel(),
                           (*arrays, *flags, wk["BR"], wk["CS"], wk["NC"]))
        else:
            runtime.launch((cdiv(rows, k["BR"]), ngroups, 1), kernel, (*arrays, *flags, k["BR"], k["GS"]))
    y = y.view(x.shape)
    return (y if y.dtype == x.dtype else y.to(x.dtype)), rstd


def norm_bwd_programs(n_row_blocks: int, tiles: int, per_sm: int, device) -> int:
    """Programs per tile of the backward (a group, or a wide group's column tile): per_sm on every SM in all, at
    most one per row block."""
    return max(1, min(n_row_blocks, cdiv(per_sm * runtime.sm_count(device), tiles)))


def rms_norm_gated_bwd(dy, x, weight, bias, z, rstd, eps: float, group_size: int, norm_before_gate: bool):
    """m2ops::rms_norm_gated_bwd on the GPU: (dx like x, dweight like weight, dbias like bias, dz like z), each
    contiguous; empty for an absent bias or z. One launch (two for groups wider than a tile), and the sums of the
    programs' partial rows."""
    hidden = x.shape[-1]
    act = common_dtype(x, z)
    x2 = _as_rows(x, hidden, act)
    rows, ngroups = x2.shape[0], hidden // group_size
    dev = x.device
    dx = torch.empty((rows, hidden), dtype=act, device=dev)
    dz = torch.empty((rows, hidden), dtype=act, device=dev) if z is not None else None
    k, _, kernel = _plan(group_size)
    wide = k["GS"] > NORM_TILE_ELEMS
    BR = NORM_WIDE_ROWS if wide else k["BR"]
    n_row_blocks = cdiv(rows, BR)
    n_chunks = cdiv(group_size, NORM_WIDE_COLS)
    tiles, per_sm = (ngroups * n_chunks, NORM_WIDE_BWD_PROGRAMS_PER_SM) if wide else (ngroups, NORM_BWD_PROGRAMS_PER_SM)
    programs = norm_bwd_programs(n_row_blocks, tiles, per_sm, dev) if rows > 0 else 0
    dw_part = torch.empty((programs, ngroups, group_size), dtype=torch.float32, device=dev)
    db_part = torch.empty((programs, ngroups, group_size), dtype=torch.float32, device=dev) if bias is not None \
        else None
    if rows > 0:
        z3 = _grouped(_as_rows(z, hidden, act), group_size) if z is not None else dummy(x, act, 3)
        w = as_dtype(weight, torch.float32).view(ngroups, group_size)
        b = as_dtype(bias, torch.float32).view(ngroups, group_size) if bias is not None else dummy(x, torch.float32, 2)
        f32_3 = dummy(x, torch.float32, 3)
        dy3, x3, r32 = _grouped(_as_rows(dy, hidden, act), group_size), _grouped(x2, group_size), as_dtype(
            rstd, torch.float32)
        dx3, dz3 = _grouped(dx, group_size), _grouped(dz, group_size) if dz is not None else dummy(x, act, 3)
        db3 = db_part if db_part is not None else f32_3
        has_z, has_bias = int(z is not None), int(bias is not None)
        gate_first = int(z is not None and not norm_before_gate)
        if wide:
            msum = torch.empty((ngroups, rows), dtype=torch.float32, device=dev)
            runtime.launch((n_row_blocks, ngroups, 1), _wide_bwd_kernels()[0],
                           (dy3, x3, z3, w, r32, msum, 1.0 / group_size, has_z, gate_first, n_chunks,
                            NORM_WIDE_ROWS, NORM_WIDE_COLS))
            runtime.launch((programs, ngroups, n_chunks), _wide_bwd_kernels()[1],
                           (dy3, x3, z3, w, b, r32, msum, dx3, dz3, dw_part, db3, n_row_blocks, programs,
                            has_z, has_bias, gate_first, NORM_WIDE_ROWS, NORM_WIDE_COLS))
        else:
            runtime.launch((programs, ngroups, 1), kernel,
                           (dy3, x3, z3, w, b, r32, dx3, dz3, dw_part, db3, n_row_blocks, programs, 1.0 / group_size,
                            has_z, has_bias, gate_first, k["BR"], k["GS"]))
    dweight = dw_part.sum(0).view(weight.shape).to(weight.dtype)
    dbias = db_part.sum(0).view(bias.shape).to(bias.dtype) if bias is not None else dy.new_empty((0,))
    dx = dx.view(x.shape)
    dz = dz.view(z.shape) if dz is not None else dy.new_empty((0,))
    return ((dx if dx.dtype == x.dtype else dx.to(x.dtype)), dweight, dbias,
            (dz if z is None or dz.dtype == z.dtype else dz.to(z.dtype)))

