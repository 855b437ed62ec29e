"""Helpers of the emulated-kernel tests (tests/test_emulated_*.py): hypothesis cases at the emulator's sizes,
the tolerance check, a recorder of launches, and the backward kernels' tolerances.

The cuTile kernels' own code run on the CPU (tests/tile_emulator.py) against the reference, in CI.

The same launchers, grids, index arithmetic, masks, tails and specialisation choices as on a GPU; only the
tile primitives are emulated in PyTorch. What this catches: wrong indices, masks, tails, strides, groups and
launch grids, before a GPU run. What it does not: compiler failures (tests/test_kernels_compile.py), races,
speed. The tolerances are the GPU tests' (tests/gpu/gpu_cases.py TOL): the emulator rounds the tile
products' inputs as the kernels ask (dtype casts, tf32), so it errs the same way.

Importing this module puts tests/gpu on sys.path (gpu_cases). It imports cuda.tile (through tile_emulator): the
test modules skip first when it is not installed.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
from hypothesis import settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))
from gpu_cases import TOL, rel_err  # noqa: E402
from tile_emulator import emulated_kernels  # noqa: E402

from m2ops.kernels import runtime  # noqa: E402


EXAMPLES = int(os.environ.get("M2OPS_EMULATED_EXAMPLES", "80"))

SWEEP = settings(max_examples=EXAMPLES, deadline=None, derandomize=True)


def check(out, expected, kind, dtype, what):
    err = rel_err(out, expected)
    assert err <= TOL[kind][dtype], f"{what}: relative error {err:.3e} > {TOL[kind][dtype]:.0e}"


@contextlib.contextmanager
def emulated_launches():
    """emulated_kernels(), recording every launch as (kernel name, grid, arguments)."""
    launches = []
    with emulated_kernels():
        emulated = runtime.launch

        def spy(grid, kernel, args, *rest):
            launches.append((kernel._pyfunc.__name__, grid, args))
            return emulated(grid, kernel, args, *rest)

        runtime.launch = spy  # emulated_kernels puts the real launcher back on exit
        yield launches


@st.composite
def cases(draw, varlen_ok=False):
    """Like the GPU sweep's cases, at sizes the emulator runs in about a second."""
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
    nheads = draw(st.sampled_from([1, 2, 4]))
    seqlen = draw(st.one_of(st.integers(1, 40), st.integers(41, 300)))
    varlen = varlen_ok and seqlen >= 2 and draw(st.booleans())
    return dict(
        dtype=dtype, chunk_size=draw(st.sampled_from([16, 32, 64, 128, 256])),
        batch=1 if varlen else draw(st.integers(1, 2)), seqlen=seqlen, nheads=nheads,
        ngroups=draw(st.sampled_from([g for g in (1, 2, 4) if nheads % g == 0])),
        headdim=draw(st.sampled_from([4, 16, 64, 80])),
        dstate=draw(st.sampled_from([8, 16, 64, 100, 128, 256, 512])),
        dt_softplus=draw(st.booleans()), dt_bias=draw(st.booleans()),
        dt_limit=draw(st.sampled_from([(0.0, float("inf")), (0.002, 0.3)])),
        D=draw(st.sampled_from([None, "h", "hp"])), z=draw(st.booleans()),
        initial_states=draw(st.booleans()),
        seq_idx=(not varlen) and draw(st.booleans()), cu_seqlens=varlen, nseqs=draw(st.integers(1, 6)),
        noncontig=draw(st.booleans()), seed=draw(st.integers(0, 2 ** 16)),
        dt_dtype=draw(st.sampled_from([None, torch.float32])), device="cpu",
    )


# Gradients: products with the float32 cotangents run in tf32 (u = 2^-11), for bfloat16 inputs in bfloat16 with
# the weighted operands rounded (u = 2^-8, backward.py's LOWP), and g_x / g_B / g_dt are rounded to their inputs'
# dtypes (2^-11 float16, 2^-8 bfloat16): normwise errors average below those.
BWD_TOL = {torch.float32: 3e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}
