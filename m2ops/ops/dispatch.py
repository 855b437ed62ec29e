"""Device dispatch: which implementation an op runs on a CUDA tensor.

The cuTile kernels run where they can; elsewhere (cuda.tile or tileiras missing, an architecture tileiras does
not support, or M2OPS_FORCE_REFERENCE=1) the PyTorch reference runs, after one warning that says why.
"""

from __future__ import annotations

import functools
import warnings

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
