"""Every kernel specialisation the launchers can launch compiles for sm_80, sm_90 and sm_100, without a GPU.

cuda.tile.compilation.export_kernel runs the cuTile front end and tileiras ahead of time. Skipped when
cuda.tile (or tileiras) is not installed; a kernel that does not compile fails its architecture's test,
which names every failing specialisation. Compiles run in parallel processes (tileiras is single-threaded
and cuTile serialises compiles within a process); cuTile's disk cache makes repeated runs fast.
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import os
import traceback

import pytest

ct = pytest.importorskip("cuda.tile", reason="cuda.tile (cuda-tile) is not installed")

ARCHS = ("sm_80", "sm_90", "sm_100")


def _tileiras_missing():
    try:
        from cuda.tile._compile import _find_compiler_bin
        _find_compiler_bin()
    except Exception as e:  # noqa: BLE001 - private helper; any failure means we cannot compile here
        return str(e)
    return None


_missing = _tileiras_missing()
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(_missing is not None, reason=f"tileiras not available: {_missing}")]


def _compile(index: int, arch: str):
    """Compile all_specs()[index] for arch in this (worker) process: None, or the error text."""
    from cuda.tile.compilation import export_kernel

    from m2ops.kernels.specs import all_specs
    spec = all_specs()[index]
    try:
        export_kernel(spec.kernel, [spec.signature()], io.BytesIO(), gpu_code=arch, output_format="cubin")
    except Exception:  # noqa: BLE001 - reported by the test with the specialisation's name
        return f"{spec.name} on {arch}:\n{traceback.format_exc(limit=3)}"
    return None


def test_specialisations_are_enumerated():
    from m2ops.kernels.specs import all_specs
    specs = all_specs()
    names = [s.name for s in specs]
    assert len(names) == len(set(names))
    kinds = {s.kernel_name for s in specs}
    assert kinds == {"chunk_cumsum", "chunk_state", "state_passing", "varlen_states", "chunk_cb", "compute_out",
                     "state_update", "segment_state", "segment_out", "chunk_cumsum_bwd", "state_passing_bwd", "state_carry_grad",
                     "chunk_state_bwd_x", "chunk_state_bwd_b", "out_bwd_dx", "out_bwd_dcbw",
                     "out_bwd_dcdb", "out_bwd_dstates"}
    for s in specs:
        s.signature()  # every signature is well formed for its kernel


# The 32-bit-indexed twins (Spec.narrow) are compiled for sm_90 only: the same code as their 64-bit
# originals, compiled for every architecture; this keeps CI's compile time in bounds.
TWIN_ARCHS = ("sm_90",)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_specialisation_compiles(arch):
    from m2ops.kernels.specs import all_specs
    todo = [i for i, s in enumerate(all_specs()) if not s.narrow or arch in TWIN_ARCHS]
    workers = max(1, min(os.cpu_count() or 1, 16))
    with cf.ProcessPoolExecutor(max_workers=workers) as pool:
        errors = [e for e in pool.map(_compile, todo, [arch] * len(todo)) if e is not None]
    assert not errors, f"{len(errors)} of {len(todo)} specialisations failed to compile:\n" + "\n".join(errors)
