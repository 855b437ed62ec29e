"""32-bit indexing of the kernels' large arrays where their sizes allow it.

The kernels annotate activations and chunk states as `Big` (ct.IndexedWithInt64[ct.Array]) so that 262,144
tokens x 80 heads x dstate 512 (2.7e9 state elements) index correctly. tileiras 13.4 then lowers every tile
load of those arrays to per-thread LDG + shared-memory stores: with 64-bit indices it emits no TMA
(UTMALDG) at all, even for a plain tile matmul, while the same kernels with 32-bit indices load and store
through TMA (checked in the sm_90 disassembly: chunk_state 129 LDG / 0 UTMALDG with 64-bit indices,
1 LDG / 6 UTMALDG with 32-bit; compute_out 197 / 1 against 1 / 19; 2.8x and 1.6x fewer instructions).

narrow_twin(kernel) is the same kernel function with its Big parameters indexed in 32 bits (same compiler
hints); the launcher takes it when every tensor argument's extent fits in int32 (fits_int32) and
config.current().index32 is on (the default; M2OPS_INDEX32=0 turns it off). On the H200 the twins pass the same
checks and memcheck as the 64-bit kernels and cut compute_out's time by about a third (docs/history.md v6).
"""

from __future__ import annotations

import dataclasses
import types

import torch

import cuda.tile as ct

from . import config

_INT32_MAX = 2 ** 31 - 1


def fits_int32(args) -> bool:
    """Whether every element of every tensor in args sits at an offset (in elements) int32 can hold."""
    for a in args:
        if isinstance(a, torch.Tensor):
            n = a.numel()
            if n <= _INT32_MAX and a.is_contiguous():  # the common case, without a loop over dimensions
                continue
            if n > 0 and sum((s - 1) * abs(st) for s, st in zip(a.shape, a.stride())) > _INT32_MAX:
                return False
    return True


def _big_names(fn) -> set:
    big = {"Big", "ct.IndexedWithInt64[ct.Array]"}
    return {k for k, v in fn.__annotations__.items() if (v in big if isinstance(v, str) else
                                                         v == ct.IndexedWithInt64[ct.Array])}


def has_wide_arrays(kernel) -> bool:
    return bool(_big_names(kernel._pyfunc))


_TWINS: dict = {}


def narrow_twin(kernel):
    """kernel with its 64-bit-indexed (Big) array parameters indexed in 32 bits and the same compiler hints;
    kernel itself when it has none. One twin per kernel object (each has its own JIT cache)."""
    entry = _TWINS.get(id(kernel))
    if entry is None:
        fn = kernel._pyfunc
        big = _big_names(fn)
        twin = kernel
        if big:
            f = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
            f.__kwdefaults__, f.__qualname__, f.__module__ = fn.__kwdefaults__, fn.__qualname__, fn.__module__
            f.__annotations__ = {k: (ct.Array if k in big else v) for k, v in fn.__annotations__.items()}
            twin = ct.kernel(f, **dataclasses.asdict(kernel._compiler_options))
        entry = _TWINS[id(kernel)] = (kernel, twin)  # the kernel kept alive, so that its id stays its own
    return entry[1]


def for_args(kernel, args):
    """The kernel to launch with args: its 32-bit twin when the config's index32 is on and the arguments fit."""
    if config.current().index32 and fits_int32(args):
        return narrow_twin(kernel)
    return kernel
