"""Runs m2ops's cuTile kernels on the CPU, program by program, with torch tensors as tiles.

cuTile has no CPU execution, so without this a kernel's index arithmetic, masks and tails are only tested
on a GPU. Here a kernel's Python body runs as written, with the `ct` it calls replaced by the small subset of
cuda.tile the kernels use, implemented in PyTorch:

- ct.load(array, index, shape=..., padding_mode=...) reads the tile whose element origin is index[i] *
  shape[i] (shape () reads the element at index); elements outside the array read as zero under
  PaddingMode.ZERO and as NaN (integers: INT_POISON) otherwise, so that a kernel relying on an unpadded
  out-of-bounds load shows up as NaN in its outputs instead of passing by luck.
  A load with check_bounds=False that reaches outside the array raises (undefined behaviour on a GPU).
- ct.store writes the in-bounds part of the tile (like cuTile, which clips).
- ct.mma(a, b, acc) = acc + a @ b in float32 (inputs already rounded to their dtype; tf32 rounding is
  applied where the kernel converts to ct.tfloat32).
- tile.astype(dtype) is added to torch.Tensor while emulating.

What it cannot find: compiler problems (those are the AOT compile test's job), races between programs (the
programs run one after another, in grid order), and speed.
The result of a correct kernel matches the GPU's up to floating-point summation order.

Use: `with emulated_kernels(): ...` runs every launch of the launchers (m2ops.kernels.runtime.launch) on the CPU
tensors it is given.
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch

import cuda.tile as real_ct

INT_POISON = -(2 ** 30)
_TF32 = object()  # marker dtype: float32 rounded to tf32 (10 mantissa bits)


def _round_tf32(t: torch.Tensor) -> torch.Tensor:
    bits = t.float().contiguous().view(torch.int32)
    bits = (bits + 0x1000) & ~0x1FFF  # round half up on the 13 dropped mantissa bits
    return bits.view(torch.float32)


def _astype(self: torch.Tensor, dtype):
    if dtype is _TF32:
        return _round_tf32(self)
    return self.to(dtype)


class _Emu:
    """The `ct` seen by kernels under emulation."""

    float16, bfloat16, float32, float64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
    int32, int64, int16, int8, bool_ = torch.int32, torch.int64, torch.int16, torch.int8, torch.bool
    tfloat32 = _TF32
    PaddingMode = real_ct.PaddingMode
    RoundingMode = real_ct.RoundingMode

    def __init__(self):
        self.bids = (0, 0, 0)

    # ---- program ids ----
    def bid(self, axis):
        return self.bids[axis]

    # ---- memory ----
    @staticmethod
    def _origin(index, shape):
        index = tuple(int(i) for i in index)
        if len(shape) == 0:
            return index, (1,) * len(index)
        return tuple(i * s for i, s in zip(index, shape)), shape

    def load(self, array, index, shape, padding_mode=None, latency=None, check_bounds=True, **_):
        origin, ext = self._origin(index, tuple(shape))
        if len(origin) != array.dim():
            raise IndexError(f"load: index {index} for a {array.dim()}-d array")
        if not check_bounds and any(o < 0 or o + e > n for o, e, n in zip(origin, ext, array.shape)):
            # Undefined on a GPU (no bounds check): the launcher promised the tile is inside.
            raise IndexError(f"load with check_bounds=False outside the array: index {index}, tile {tuple(shape)}, "
                             f"array {tuple(array.shape)}")
        fill = 0 if padding_mode == real_ct.PaddingMode.ZERO else (
            float("nan") if array.is_floating_point() else INT_POISON)
        out = torch.full(ext, fill, dtype=array.dtype)
        src, dst = [], []
        for o, e, n in zip(origin, ext, array.shape):
            lo, hi = max(o, 0), min(o + e, n)
            if hi <= lo:
                return out.reshape(tuple(shape))
            src.append(slice(lo, hi))
            dst.append(slice(lo - o, hi - o))
        out[tuple(dst)] = array[tuple(src)]
        return out.reshape(tuple(shape))

    def store(self, array, index, tile, **_):
        tile = torch.as_tensor(tile)
        shape = tuple(tile.shape)
        origin, ext = self._origin(index, shape)
        if len(origin) != array.dim():
            raise IndexError(f"store: index {index} for a {array.dim()}-d array")
        tile = tile.reshape(ext)
        src, dst = [], []
        for o, e, n in zip(origin, ext, array.shape):
            lo, hi = max(o, 0), min(o + e, n)
            if hi <= lo:
                return
            dst.append(slice(lo, hi))
            src.append(slice(lo - o, hi - o))
        array[tuple(dst)] = tile[tuple(src)].to(array.dtype)

    # Programmatic dependent launch: programs run one launch at a time here, so both are no-ops.
    @staticmethod
    def grid_dependency_control_wait():
        pass

    @staticmethod
    def grid_dependency_control_launch_dependents():
        pass

    # ---- tiles ----
    @staticmethod
    def zeros(shape, dtype):
        return torch.zeros(tuple(shape), dtype=dtype)

    @staticmethod
    def full(shape, value, dtype):
        return torch.full(tuple(shape), value, dtype=dtype)

    @staticmethod
    def arange(n, dtype=torch.int32):
        return torch.arange(n, dtype=dtype)

    @staticmethod
    def transpose(t, axis0=-2, axis1=-1):
        return t.transpose(axis0, axis1)

    @staticmethod
    def truediv(x, y, rounding_mode=None, flush_to_zero=False):
        return x / y  # correctly rounded here; the GPU's approximate modes differ by an ulp or two

    @staticmethod
    def broadcast_to(t, shape):
        return torch.broadcast_to(t, tuple(shape))

    @staticmethod
    def mma(a, b, acc):
        return acc + a.float() @ b.float()

    @staticmethod
    def _t(v):
        return v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.float32)

    def exp(self, v):
        return torch.exp(self._t(v))

    def exp2(self, v, flush_to_zero=False):
        r = torch.exp2(self._t(v))
        if flush_to_zero and r.dtype == torch.float32:
            r = torch.where(r < torch.finfo(torch.float32).tiny, torch.zeros_like(r), r)
        return r

    @staticmethod
    def extract(t, index, shape):
        return t[tuple(slice(i * n, (i + 1) * n) for i, n in zip(index, shape))]

    def log(self, v):
        return torch.log(self._t(v))

    def rsqrt(self, v, flush_to_zero=False):
        return torch.rsqrt(self._t(v))

    @staticmethod
    def where(cond, a, b):
        cond = cond if isinstance(cond, torch.Tensor) else torch.tensor(bool(cond))
        return torch.where(cond, a, b)

    @staticmethod
    def minimum(a, b):
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return torch.minimum(torch.as_tensor(a), torch.as_tensor(b))
        return min(a, b)

    @staticmethod
    def maximum(a, b):
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return torch.maximum(torch.as_tensor(a), torch.as_tensor(b))
        return max(a, b)

    @staticmethod
    def sum(t, axis=None):
        return t.sum() if axis is None else t.sum(dim=axis)

    @staticmethod
    def cumsum(t, axis=0):
        return torch.cumsum(t, dim=axis)

    @staticmethod
    def cdiv(a, b):
        return (a + b - 1) // b

    # ---- compile-time iteration, concatenation and gathers (the causal convolution's kernels) ----
    @staticmethod
    def static_iter(iterable):
        return list(iterable)  # the body runs once per item, as cuTile inlines it

    @staticmethod
    def cat(tiles, axis):
        a, b = tiles
        if a.shape != b.shape:  # cuTile's rule (power-of-two shapes)
            raise ValueError(f"cat: tiles of different shapes {tuple(a.shape)} and {tuple(b.shape)}")
        return torch.cat((a, b), dim=axis)

    @staticmethod
    def gather(array, indices, mask=None, padding_value=0, check_bounds=True, latency=None):
        """array[indices] with the indices broadcast together; out-of-bounds (negative included) and masked-off
        elements read padding_value. check_bounds=False with an index outside raises (undefined on a GPU)."""
        idx, keep = _indexed(array, indices, mask, check_bounds, "gather")
        pad = torch.as_tensor(padding_value, dtype=array.dtype)
        if array.numel() == 0:
            return pad.expand(keep.shape).clone()
        vals = array[tuple(i.clamp(0, n - 1) for i, n in zip(idx, array.shape))]
        return torch.where(keep, vals, pad)

    @staticmethod
    def scatter(array, indices, value, mask=None, check_bounds=True, latency=None):
        """array[indices] = value with the indices broadcast together; out-of-bounds and masked-off elements are not
        written. check_bounds=False with an index outside raises (undefined on a GPU)."""
        idx, keep = _indexed(array, indices, mask, check_bounds, "scatter")
        vals = torch.as_tensor(value).to(array.dtype).expand(keep.shape)
        array[tuple(i[keep] for i in idx)] = vals[keep]


def _indexed(array, indices, mask, check_bounds, what):
    """gather's and scatter's indices broadcast together, and which elements they touch: inside the array and
    where mask (if any) holds."""
    idx = torch.broadcast_tensors(*(torch.as_tensor(i).long() for i in
                                    (indices if isinstance(indices, tuple) else (indices,))))
    inside = torch.ones(idx[0].shape, dtype=torch.bool)
    for i, n in zip(idx, array.shape):
        inside &= (i >= 0) & (i < n)
    if not check_bounds and not bool(inside.all()):
        raise IndexError(f"{what} with check_bounds=False outside the array")
    return idx, (inside if mask is None else inside & torch.as_tensor(mask))


def run(kernel, grid, args, emu: _Emu):
    """Every program of grid (x, y, z) on the kernel's Python body, in grid order."""
    fn = kernel._pyfunc
    gx, gy, gz = (tuple(grid) + (1, 1))[:3]
    for emu.bids in [(x, y, z) for z in range(gz) for y in range(gy) for x in range(gx)]:
        fn(*args)


# specs.launch_key of every launch run here (unless the config forces chunk_state's heads):
# tests/test_emulated_plans.py (the last emulated file) checks that each is a specialisation the compile test builds.
LAUNCHED: set = set()


def _record(kernel, args):
    from m2ops.kernels import config, specs
    if config.current().chunk_state_heads is None:  # (a forced head count may launch builds the table has not)
        LAUNCHED.add(specs.launch_key(kernel, args))


@contextlib.contextmanager
def emulated_kernels(sm_count: int = 132):
    """Within the block, every launch (m2ops.kernels.runtime.launch) runs on the CPU through the emulator, and
    runtime.sm_count says sm_count (the launchers size some grids by it)."""
    from m2ops.kernels import runtime
    emu = _Emu()
    mods = [m for name, m in list(sys.modules.items())
            if name.startswith("m2ops.kernels.") and isinstance(m, types.ModuleType) and hasattr(m, "ct")]
    saved = {m: m.ct for m in mods}
    saved_launch, saved_sm = runtime.launch, runtime.sm_count
    had_astype = hasattr(torch.Tensor, "astype")
    try:
        for m in mods:
            m.ct = emu
        runtime.launch = lambda grid, kernel, args, *_: (_record(kernel, args), run(kernel, grid, args, emu))
        runtime.sm_count = lambda device: sm_count
        runtime.clear_plans()  # (plans depend on the SM count)
        if not had_astype:
            torch.Tensor.astype = _astype
        yield emu
    finally:
        for m, v in saved.items():
            m.ct = v
        runtime.launch, runtime.sm_count = saved_launch, saved_sm
        runtime.clear_plans()
        if not had_astype:
            del torch.Tensor.astype
