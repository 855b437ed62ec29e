"""The decode kernels (selective state update, functional and in place; m2ops/kernels/decode.py) on the emulator
against the reference.

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


_OTHER_HALF = {torch.float16: torch.bfloat16, torch.bfloat16: torch.float16, torch.float32: torch.bfloat16}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dstate", [16, 100, 300])
@pytest.mark.parametrize("opts", [
    dict(rows="int32"),
    dict(D="hp", z=True, dt_bias=True, softplus=True, limit=(0.01, 0.5), rows="int64", out=True),
    dict(D="h", state_dtype="act", transposed=True),
    dict(D="h_expanded", rows="int32", out=True),  # mamba_ssm's (nheads, headdim) broadcast of one D per head
    # through conversions: a state of another dtype (a float32 copy written back), B and C in float32 (y through a
    # float32 copy of out)
    dict(rows="int32", state_dtype="other", bc32=True, out=True),
])
def test_state_update_inplace(dtype, dstate, opts):
    """decode.state_update_inplace (the kernel that reads and writes the cache rows in place) against
    reference.state_update_inplace: used rows within the tolerance, padding slots (negative indices, and int64 values
    beyond int32 on either side, which the launcher clamps) and rows no index names untouched, y of a padding slot
    left as out had it."""
    g = torch.Generator().manual_seed(dstate + 7)
    b, h, G, p, rows_n = 4, 4, 2, 24, 6
    state_dtype = {"act": dtype, "other": _OTHER_HALF[dtype]}.get(opts.get("state_dtype"), torch.float32)
    bc_dtype = torch.float32 if opts.get("bc32") else dtype
    cache = torch.randn(rows_n, h, p, dstate, generator=g).to(state_dtype)
    if opts.get("transposed"):
        cache = cache.transpose(-1, -2).contiguous().transpose(-1, -2)
    rows = {None: None, "int32": torch.tensor([4, -1, 0, 2], dtype=torch.int32),
            "int64": torch.tensor([4, -2 ** 40, 2 ** 40, 1], dtype=torch.int64)}[opts.get("rows")]
    if rows is None:
        cache = cache[:b]
    kw = dict(
        x=torch.randn(b, h, p, generator=g).to(dtype),
        dt=torch.rand(b, h, generator=g).to(dtype),
        A=-torch.exp(torch.rand(h, generator=g) * math.log(8.0)),
        B=torch.randn(b, G, dstate, generator=g).to(bc_dtype),
        C=torch.randn(b, G, dstate, generator=g).to(bc_dtype),
        D={None: None, "h": torch.randn(h, generator=g), "hp": torch.randn(h, p, generator=g),
           "h_expanded": torch.randn(h, 1, generator=g).expand(h, p)}[opts.get("D")],
        z=torch.randn(b, h, p, generator=g).to(dtype) if opts.get("z") else None,
        dt_bias=torch.randn(h, generator=g) if opts.get("dt_bias") else None,
        state_batch_indices=rows,
        dt_softplus=bool(opts.get("softplus")),
        dt_min=float(opts.get("limit", (0.0, math.inf))[0]), dt_max=float(opts.get("limit", (0.0, math.inf))[1]),
    )
    out0 = torch.full((b, h, p), 3.0, dtype=dtype) if opts.get("out") else torch.zeros(b, h, p, dtype=dtype)
    want_cache, want_out = cache.clone(), out0.clone()
    ref_su.state_update_inplace(want_cache, **kw, out=want_out)
    got_cache, got_out = cache.clone(), out0.clone()
    with emulated_kernels():
        decode.state_update_inplace(got_cache, **kw, out=got_out)
    used = list(range(b)) if rows is None else [i for i in range(b) if 0 <= int(rows[i]) < rows_n]
    target = used if rows is None else [int(rows[i]) for i in used]
    others = [r for r in range(cache.shape[0]) if r not in target]
    assert got_cache.dtype == state_dtype and got_out.dtype == dtype
    assert rel_err(got_out[used], want_out[used]) <= DECODE_TOL[dtype]
    assert rel_err(got_cache[target], want_cache[target]) <= DECODE_TOL.get(state_dtype, DECODE_TOL[torch.float32])
    assert torch.equal(got_cache[others], cache[others])
    skipped = [i for i in range(b) if i not in used]
    assert torch.equal(got_out[skipped], out0[skipped])


@pytest.mark.parametrize("a_dtype", [torch.float32, torch.bfloat16])
def test_state_update_inplace_from_a_log(a_dtype):
    """A_is_log (the layer's decode step): the kernel given A_log forms -exp(A_log) itself; the same cache and y
    as the reference given -exp(A_log) (A_log and dt_bias in float32, or in bfloat16 as in a bfloat16 layer, then
    read as they are)."""
    g = torch.Generator().manual_seed(3)
    b, h, G, p, n = 3, 4, 2, 24, 64
    a_log = (torch.rand(h, generator=g) * 3.0).to(a_dtype)
    bf = torch.bfloat16
    kw = dict(x=torch.randn(b, h, p, generator=g).to(bf), dt=torch.rand(b, h, generator=g).to(bf),
              B=torch.randn(b, G, n, generator=g).to(bf), C=torch.randn(b, G, n, generator=g).to(bf),
              D=torch.randn(h, generator=g), z=None, dt_bias=torch.randn(h, generator=g).to(a_dtype),
              state_batch_indices=None,
              dt_softplus=True, dt_min=0.0, dt_max=math.inf)
    cache = torch.randn(b, h, p, n, generator=g)
    want_cache, want_out = cache.clone(), torch.zeros(b, h, p, dtype=torch.bfloat16)
    ref_su.state_update_inplace(want_cache, A=-torch.exp(a_log.float()), **kw, out=want_out)
    got_cache, got_out = cache.clone(), torch.zeros(b, h, p, dtype=torch.bfloat16)
    converted = []
    real_to = torch.Tensor.to
    with emulated_kernels(), pytest.MonkeyPatch.context() as m:
        m.setattr(torch.Tensor, "to", lambda t, *a, **k: converted.append(t.shape) or real_to(t, *a, **k))
        decode.state_update_inplace(got_cache, A=a_log, **kw, out=got_out, A_is_log=True)
    assert (h,) not in converted  # A_log and dt_bias read in their own dtype
    assert rel_err(got_out, want_out) <= DECODE_TOL[torch.bfloat16]
    assert rel_err(got_cache, want_cache) <= DECODE_TOL[torch.float32]
    ref_cache, ref_out = cache.clone(), torch.zeros(b, h, p, dtype=torch.bfloat16)
    ref_su.state_update_inplace(ref_cache, A=a_log, **kw, out=ref_out, A_is_log=True)
    assert torch.equal(ref_cache, want_cache) and torch.equal(ref_out, want_out)


def test_d_broadcast_per_head_is_read_without_a_copy():
    """D as mamba_ssm's decode callers pass it, (nheads, headdim) expanded from one value per head, reaches the
    kernels as a per-head view of the caller's storage (a copy would be one more kernel per decoded token)."""
    from m2ops.kernels.runtime import d_arg
    per_head = torch.randn(4, 1)
    Dk, has_d = d_arg(per_head.expand(4, 24), torch.empty(1))
    assert has_d == 1 and Dk.data_ptr() == per_head.data_ptr() and torch.equal(Dk[:, 0], per_head[:, 0])
    full = torch.randn(4, 24)
    Dk, has_d = d_arg(full, torch.empty(1))
    assert has_d == 2 and Dk.data_ptr() == full.data_ptr()
