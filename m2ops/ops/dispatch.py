"""The one decision "cuTile kernels or PyTorch reference" (kernels_serve), and what follows from it: the chunk
size a call runs at (run_chunk_size, kernel_chunk_size) and each op's CUDA implementation (cuda_impl).

The kernels serve a call when its device is a CUDA GPU they run on (cuda.tile and tileiras present, an
architecture tileiras supports, M2OPS_FORCE_REFERENCE unset; otherwise one warning says why), its chunk size is
one they are built for and its tensors are in their dtypes (meta.shapes.KERNEL_CHUNK_SIZES, KERNEL_DTYPES: float64
runs the reference). The launchers in m2ops.kernels take that as given.
"""

from __future__ import annotations

import functools
import warnings

import torch

from .. import envvars
from ..meta.shapes import KERNEL_CHUNK_SIZES, KERNEL_DTYPES

FORCE_REFERENCE_ENV = "M2OPS_FORCE_REFERENCE"


@functools.lru_cache(maxsize=None)
def _reason_for_reference(device_index: int):
    if envvars.switch(FORCE_REFERENCE_ENV, False):
        return f"{FORCE_REFERENCE_ENV} is set"
    try:
        from .. import kernels
    except ImportError as e:  # cuda.tile missing or broken
        return f"the cuTile kernels cannot be imported ({e}); install m2ops[cuda]"
    return kernels.unavailable_reason(device_index)


@functools.lru_cache(maxsize=None)
def _warn_once(device_index: int, reason: str):
    warnings.warn(f"m2ops: running the PyTorch reference on cuda:{device_index}: {reason}", RuntimeWarning,
                  stacklevel=3)


def use_kernels(device) -> bool:
    """True when the cuTile kernels serve this CUDA device; otherwise warns once and returns False."""
    index = device.index if device.index is not None else 0
    reason = _reason_for_reference(index)
    if reason is None:
        return True
    _warn_once(index, reason)
    return False


def _kernels_serve(device_type: str, device_index: int) -> bool:
    """Whether the kernels serve the device (use_kernels, on CUDA only), as a constant of a torch.compile trace
    (dynamo would otherwise trace into the cached lookup and warn about it); the answer cannot change within a
    process."""
    return device_type == "cuda" and use_kernels(torch.device("cuda", device_index))


# The mark torch.compiler.assume_constant_result sets, set here without calling it: the call imports
# torch._dynamo, which took 2.2 s of `import m2ops` on the CPU. tests/test_compile.py checks that the decorator
# still sets exactly this mark.
_kernels_serve._dynamo_marked_constant = True


def kernels_serve(device, chunk_size, tensors) -> bool:
    """Whether the cuTile kernels serve a call on device at chunk_size (None: an op without chunks) on tensors
    (None entries are absent options): else the reference runs."""
    if not _kernels_serve(device.type, device.index if device.index is not None else 0):
        return False
    if chunk_size is not None and chunk_size not in KERNEL_CHUNK_SIZES:
        return False
    return all(t is None or t.dtype in KERNEL_DTYPES for t in tensors)


def kernel_chunk_size(chunk_size: int, seqlen: int, device, tensors=()) -> int:
    """The chunk size a call of the caller's chunk_size runs at on device (run_chunk_size, with kernels_serve's
    answer on tensors)."""
    return run_chunk_size(chunk_size, seqlen, kernels_serve(device, chunk_size, tensors))


def run_chunk_size(chunk_size: int, seqlen: int, serve: bool) -> int:
    """The chunk size a call of the caller's chunk_size runs at, given whether the kernels serve it (serve, from
    kernels_serve): there, chunks of scan.SUPER_CHUNK for a caller's 64 or 128 from the config's
    super_chunk_min_seqlen tokens (measured faster on an H200; y, the final state and the gradients depend on the
    chunk size only through rounding), else chunk_size. Decided once, before chunk_cumsum, so that every path
    (eager, torch.compile, CUDA graphs, training, whose backward reuses states kept at the forward's chunk size)
    runs at that size throughout. (SUPER_CHUNK is a kernel chunk size: the kernels serve the call at either.)"""
    if not serve:
        return chunk_size
    from ..kernels import scan
    return scan.SUPER_CHUNK if scan.super_chunk_by_default(chunk_size, seqlen) else chunk_size


def cuda_impl(name: str, reference, decides):
    """The CUDA implementation of op `name`: the launcher m2ops.kernels.<name> where kernels_serve says so, else
    the reference. decides(*args) gives the call's (chunk size or None, tensors that must be in the kernels'
    dtypes, whether the launcher covers the call's options at all)."""
    def impl(*args):
        device = next(a.device for a in args if hasattr(a, "device"))
        chunk_size, tensors, covered = decides(*args)
        if covered and kernels_serve(device, chunk_size, tensors):
            from .. import kernels
            return getattr(kernels, name)(*args)
        return reference(*args)
    impl.__name__ = f"{name}_cuda"
    return impl
