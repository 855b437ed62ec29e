"""Whether the cuTile kernels can run on a CUDA device, and if not, why (m2ops.ops.dispatch asks)."""

from __future__ import annotations

import functools
import io
from typing import Optional

import torch


@functools.lru_cache(maxsize=None)
def _probe_compile(arch: str) -> Optional[str]:
    """Compile a one-line kernel for arch: catches a missing tileiras, a tileiras that lacks the arch, and a
    broken toolchain (e.g. tileiras next to a ptxas or libnvvm of another CUDA version)."""
    import cuda.tile as ct
    from cuda.tile.compilation import (ArrayConstraint, CallingConvention, KernelSignature,
                                       export_kernel)

    @ct.kernel
    def probe(a):
        ct.store(a, (0,), ct.load(a, (0,), shape=(16,)) + 1.0)

    sig = KernelSignature([ArrayConstraint(ct.float32, 1, index_dtype=ct.int32, stride_lower_bound_incl=0,
                                           alias_groups=(), may_alias_internally=False)],
                          CallingConvention.cutile_python_v2())
    try:
        export_kernel(probe, [sig], io.BytesIO(), gpu_code=arch, output_format="cubin")
    except FileNotFoundError as e:
        return f"tileiras (the cuTile compiler) was not found ({e}); install cuda-tile[tileiras]"
    except Exception as e:  # noqa: BLE001 - any failure means the kernels cannot be built here
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"tileiras cannot compile for {arch}: {first}"
    return None


def unavailable_reason(device_index: int) -> Optional[str]:
    """None when the kernels can run on cuda:device_index, else a short reason."""
    try:
        import cuda.tile  # noqa: F401
    except ImportError as e:
        return f"cuda.tile is not importable ({e}); install m2ops[cuda]"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if device_index >= torch.cuda.device_count():
        return f"there is no cuda:{device_index}"
    major, minor = torch.cuda.get_device_capability(device_index)
    if major < 8:
        return f"cuTile needs compute capability 8.0 or newer; cuda:{device_index} has {major}.{minor}"
    return _probe_compile(f"sm_{major}{minor}")
