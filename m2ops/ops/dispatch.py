"""Device dispatch: which implementation an op runs on a CUDA tensor.

The cuTile kernels run where they can; elsewhere (cuda.tile or tileiras missing, an architecture tileiras does
not support, or M2OPS_FORCE_REFERENCE=1) the PyTorch reference runs, after one warning that says why.
"""

from __future__ import annotations

import functools
import warnings

import torch

from .. import envvars

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


def kernel_chunk_size(chunk_size: int, seqlen: int, device) -> int:
    """The chunk size a call of the caller's chunk_size runs at on device: where the kernels serve it, chunks of
    launch.SUPER_CHUNK for a caller's 64 or 128 from launch.SUPER_CHUNK_DEFAULT_SEQLEN tokens (measured faster
    on an H200; y, the final state and the gradients depend on the chunk size only through rounding), else
    chunk_size. Decided once, before chunk_cumsum, so that every path (eager, torch.compile, CUDA graphs,
    training, whose backward reuses states kept at the forward's chunk size) runs at that size throughout."""
    if not _kernels_serve(device.type, device.index if device.index is not None else 0):
        return chunk_size
    from ..kernels import launch
    return launch.SUPER_CHUNK if launch.super_chunk_by_default(chunk_size, seqlen) else chunk_size


@functools.lru_cache(maxsize=None)
def _warn_no_kernel(name: str):
    warnings.warn(f"m2ops: op {name} has no cuTile kernel yet; running the PyTorch reference on CUDA",
                  RuntimeWarning, stacklevel=3)


def cuda_impl(name: str, reference):
    """The CUDA implementation of op `name`: m2ops.kernels.<name> when usable, else the reference (also
    when m2ops.kernels has no function of that name yet: ops may land before their kernels)."""
    def impl(*args):
        device = next(a.device for a in args if hasattr(a, "device"))
        if use_kernels(device):
            from .. import kernels
            kernel = getattr(kernels, name, None)
            # callable: a kernel module of the same name (imported, not exported) is not a launcher.
            if callable(kernel):
                return kernel(*args)
            _warn_no_kernel(name)
        return reference(*args)
    impl.__name__ = f"{name}_cuda"
    return impl
