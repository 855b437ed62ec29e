"""The kernel specialisations the launchers can launch compile ahead of time, without a GPU.

cuda.tile.compilation runs the cuTile front end (Python to Tile IR bytecode, the same bytecode for every
architecture) and tileiras (bytecode to a cubin for one architecture). tileiras takes about 3 s a
specialisation and there are over a thousand, so CI's 90 minutes cannot hold every one for every
architecture. What is built where:

- sm_90, the GPU the kernels are tuned and measured on: every specialisation with 64-bit indexing, to a cubin.
- Every 32-bit-indexed twin (Spec.narrow): through the front end, to bytecode; and those twins that cover
  every value of every dtype, constant and hint of their kernel, to an sm_90 cubin.
- sm_80 and sm_100: for each kernel, specialisations that cover every pair of values of its dtypes,
  constants and hints (larger tiles and wider dtypes first), to a cubin.

Skipped when cuda.tile (or tileiras) is not installed. A failing test names every specialisation that did
not build. Builds run in parallel processes (tileiras is single-threaded and cuTile serialises compiles
within a process); cuTile's disk cache makes repeated runs fast.
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import itertools
import math
import os
import traceback

import pytest

ct = pytest.importorskip("cuda.tile", reason="cuda.tile (cuda-tile) is not installed")

# Besides sm_90, whose every specialisation is built.
COVERED_ARCHS = ("sm_80", "sm_100")


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


def _build(index: int, arch: str | None):
    """Build all_specs()[index] in this (worker) process, to an arch cubin, or to bytecode when arch is None:
    None, or the error text."""
    from cuda.tile.compilation import export_kernel

    from m2ops.kernels.specs import all_specs
    spec = all_specs()[index]
    fmt = "tileir_bytecode" if arch is None else "cubin"
    try:
        export_kernel(spec.kernel, [spec.signature()], io.BytesIO(), gpu_code=arch, output_format=fmt)
    except Exception:  # noqa: BLE001 - reported by the test with the specialisation's name
        return f"{spec.name} on {arch or 'the front end'}:\n{traceback.format_exc(limit=3)}"
    return None


def _build_all(indices, arch):
    from m2ops.kernels.specs import all_specs
    assert indices
    workers = max(1, min(os.cpu_count() or 1, 16))
    with cf.ProcessPoolExecutor(max_workers=workers) as pool:
        errors = [e for e in pool.map(_build, indices, [arch] * len(indices)) if e is not None]
    assert not errors, (f"{len(errors)} of {len(indices)} specialisations failed to build:\n" + "\n".join(errors)
                        + f"\n({len(all_specs())} specialisations in all)")


def _features(spec) -> frozenset:
    """What tells spec apart from the other specialisations of its kernel, as (name, value) items."""
    items = [("dtype", spec.dtype), *spec.dtypes, *spec.constants.items(), *spec.hints]
    return frozenset((k, str(v)) for k, v in items)


def _size(spec) -> float:
    """Larger for larger tiles and wider dtypes: builds that need more registers and shared memory come first."""
    ints = [v for v in spec.constants.values() if isinstance(v, int) and not isinstance(v, bool)]
    wide = sum(d == "float32" for d in (spec.dtype, *(d for _, d in spec.dtypes)))
    return math.prod(ints) * 4 ** wide


def covering(indices, order: int) -> list[int]:
    """Greedily chosen indices of all_specs() among indices such that, for each kernel, every combination
    of `order` feature values that some specialisation has is had by a chosen one."""
    from m2ops.kernels.specs import all_specs
    specs = all_specs()
    chosen = []
    by_kernel = {}
    for i in indices:
        by_kernel.setdefault(specs[i].kernel_name, []).append(i)
    for members in by_kernel.values():
        members = sorted(members, key=lambda i: -_size(specs[i]))  # ties go to the larger build
        combos = {i: {frozenset(c) for r in range(1, order + 1)
                      for c in itertools.combinations(sorted(_features(specs[i])), r)} for i in members}
        need = set().union(*combos.values())
        while need:
            best = max(members, key=lambda i: len(combos[i] & need))
            chosen.append(best)
            need -= combos[best]
    return sorted(chosen)


def _wide():
    from m2ops.kernels.specs import all_specs
    return [i for i, s in enumerate(all_specs()) if not s.narrow]


def _narrow():
    from m2ops.kernels.specs import all_specs
    return [i for i, s in enumerate(all_specs()) if s.narrow]


def test_specialisations_are_enumerated():
    from m2ops.kernels.specs import all_specs
    specs = all_specs()
    names = [s.name for s in specs]
    assert len(names) == len(set(names))
    kinds = {s.kernel_name for s in specs}
    assert kinds == {"chunk_cumsum", "chunk_state", "chunk_state_cb", "chunk_state_cumsum_cb", "chunk_state_pass",
                     "state_passing",
                     "varlen_states", "chunk_cb", "compute_out",
                     "compute_out_carry",
                     "state_update", "segment_state", "segment_out", "chunk_cumsum_bwd", "state_passing_bwd", "state_carry_grad",
                     "chunk_state_bwd_x", "chunk_state_bwd_b", "out_bwd_dx", "out_bwd_dcbw",
                     "out_bwd_dcdb", "out_bwd_dstates"}
    for s in specs:
        s.signature()  # every signature is well formed for its kernel


def test_covering_sets_cover():
    """covering() leaves no value, or pair of values, of any kernel's features unbuilt."""
    from m2ops.kernels.specs import all_specs
    specs = all_specs()
    wide = _wide()
    for order in (1, 2):
        chosen = covering(wide, order)
        assert len(chosen) < len(wide)
        for name in {specs[i].kernel_name for i in wide}:
            def combos(idx):
                return {c for i in idx if specs[i].kernel_name == name
                        for c in itertools.combinations(sorted(_features(specs[i])), order)}
            assert combos(chosen) == combos(wide), name


def test_every_specialisation_compiles_for_sm_90():
    _build_all(_wide(), "sm_90")


def test_every_narrow_twin_lowers_and_a_covering_set_compiles_for_sm_90():
    _build_all(_narrow(), None)
    _build_all(covering(_narrow(), 1), "sm_90")


@pytest.mark.parametrize("arch", COVERED_ARCHS)
def test_covering_specialisations_compile(arch):
    _build_all(covering(_wide(), 2), arch)
