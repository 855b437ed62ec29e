"""The decode kernel (selective state update, m2ops/kernels/decode.py) on the emulator against the reference.

The kernels' own code on the CPU through tests/tile_emulator.py, against the reference: what that catches and
misses, and the tolerances, in tests/emulated_cases.py (the helpers shared by tests/test_emulated_*.py). Skipped
when cuda.tile is not installed (the kernels cannot even be imported then).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("cuda.tile", reason="cuda.tile (cuda-tile) is not installed")
pytestmark = pytest.mark.slow  # minutes on a 2-core machine: outside the quick subset (-m "not slow")

from emulated_cases import rel_err  # noqa: E402  (gpu_cases's)
from tile_emulator import emulated_kernels  # noqa: E402

from m2ops.kernels import decode  # noqa: E402
from m2ops.reference import state_update as ref_su  # noqa: E402


DECODE_TOL = {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}  # as the GPU decode tests


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dstate", [16, 100, 256, 300])
@pytest.mark.parametrize("opts", [dict(), dict(D="hp", z=True, dt_bias=True, softplus=True, limit=(0.01, 0.5)),
                                  dict(D="h", state_dtype="act")])
def test_state_update(dtype, dstate, opts):
    g = torch.Generator().manual_seed(dstate)
    b, h, G, p = 2, 4, 2, 24
    state_dtype = dtype if opts.get("state_dtype") == "act" else torch.float32
    kw = dict(
        state=torch.randn(b, h, p, dstate, generator=g).to(state_dtype),
        x=torch.randn(b, h, p, generator=g).to(dtype),
        dt=torch.rand(b, h, generator=g).to(dtype),
        A=-torch.exp(torch.rand(h, generator=g) * math.log(8.0)),
        B=torch.randn(b, G, dstate, generator=g).to(dtype),
        C=torch.randn(b, G, dstate, generator=g).to(dtype),
        D={None: None, "h": torch.randn(h, generator=g), "hp": torch.randn(h, p, generator=g)}[opts.get("D")],
        z=torch.randn(b, h, p, generator=g).to(dtype) if opts.get("z") else None,
        dt_bias=torch.randn(h, generator=g) if opts.get("dt_bias") else None,
        dt_softplus=bool(opts.get("softplus")),
        dt_min=float(opts.get("limit", (0.0, math.inf))[0]), dt_max=float(opts.get("limit", (0.0, math.inf))[1]),
    )
    ey, enew = ref_su.state_update(**kw)
    with emulated_kernels():
        y, new = decode.state_update(**kw)
    assert y.dtype == ey.dtype and new.dtype == enew.dtype
    assert rel_err(y, ey) <= DECODE_TOL[dtype]
    assert rel_err(new, enew) <= DECODE_TOL[state_dtype]
