"""The cuTile decode kernel (m2ops.kernels.decode.state_update) against m2ops.reference.state_update.

m2ops/kernels/__init__.py exports it (dispatch runs it for m2ops::state_update on CUDA) since these tests
passed on an H200 (23 passed, 2026-11-29):

    python -m pytest -q -m gpu tests/gpu/test_state_update_kernel.py

Every test is marked gpu and skipped without a CUDA GPU or where the cuTile kernels cannot run (the reason
is shown). The expected values come from the reference run on the CPU on the same (already rounded)
inputs: it computes in float32 for every non-float64 input, as the kernel does, so what is measured is the
kernel's own error.

Tolerances (TOL): normwise relative error ||out - ref|| / ||ref|| (gpu_cases.rel_err), by output dtype.
Both sides compute in float32 and differ only by the order of the dstate sum of y, fused multiply-adds and
exp/log ulps (a few float32 ulps of the largest terms: ~1e-6 normwise), plus, for 16-bit outputs, the final
rounding: where the float32 values differ by an ulp, the rounding can land one 16-bit ulp apart, at most
u = 2^-10 (float16) or 2^-7 (bfloat16) relative per element, less normwise. Hence 2e-5 (float32),
1e-3 (float16), 8e-3 (bfloat16), for y (x's dtype) and for the new state (state's dtype). A wrong index, a
missing tile or a wrong group gives errors of order 1e-1 and more; outputs the kernel fails to write are NaN
(poisoned allocator) and give inf.

Hypothesis sweeps are derandomized and do not shrink (each new dtype / dstate tile / stride combination
JIT-compiles a kernel, a second or two); M2OPS_GPU_EXAMPLES (default 25) sets the examples per sweep.
"""

from __future__ import annotations

import math
import os
import sys
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_cases import (STRIDE_CLASSES, captured, kernels_or_reason, poison_allocator, rel_err,  # noqa: E402
                       sweep_settings)

from m2ops.reference import state_update as ref  # noqa: E402

INF = float("inf")


_kernels, _reason = kernels_or_reason()
if _kernels is not None:
    from m2ops.kernels import decode
else:
    decode = None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(decode is None, reason=str(_reason))]

SWEEP = sweep_settings(25)

TOL = {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_OTHER_HALF = {torch.float16: torch.bfloat16, torch.bfloat16: torch.float16, torch.float32: torch.float16}


# ---- inputs ----

def _layout(t, how):
    """Same values in another memory layout: "contig"; "strided" (every dimension strided by 2, a view into
    a larger buffer, like a slice of a fused projection); "transposed" (last two dimensions swapped in
    memory, so the last stride is not 1; 1-d tensors strided)."""
    if t is None or how == "contig":
        return t
    if how == "transposed" and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    big = torch.zeros(*(2 * s for s in t.shape), dtype=t.dtype, device=t.device)
    view = big[tuple(slice(None, None, 2) for _ in t.shape)]
    view.copy_(t)
    return view


def make_inputs(*, batch=2, nheads=4, ngroups=2, headdim=16, dstate=16, dtype=torch.bfloat16,
                bc_dtype=None, state_dtype=torch.float32, dt_dtype=None, param_dtype=torch.float32,
                dt_softplus=True, dt_bias=True, dt_limit=(0.0, INF), dt_large=False, D=None, z=False,
                layout="contig", state_layout="contig", seed=0, device="cuda"):
    """Keyword arguments of state_update (the reference's signature), values drawn in float64 on the CPU
    and rounded to their dtypes. bc_dtype: B and C (default dtype); dt_dtype: dt (default dtype);
    param_dtype: A, dt_bias, D. dt as in tests/gpu/gpu_cases.make_case: for softplus raw values in
    [-4, 1.5]; otherwise [-0.5, 1], a third negative (zeroed by the default clamp); dt_large: about a sixth
    of the entries 20.5..30 after dt_bias (softplus is the identity there)."""
    b, h, g, p, n = batch, nheads, ngroups, headdim, dstate
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, lo=0.0, hi=1.0):
        return torch.rand(*shape, generator=gen, dtype=torch.float64) * (hi - lo) + lo

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    bias = rand(h, lo=-1.0, hi=0.5) if dt_bias else None
    dt = rand(b, h, lo=-4.0, hi=1.5) if dt_softplus else rand(b, h, lo=-0.5, hi=1.0)
    if dt_large:
        big = rand(b, h, lo=20.5, hi=30.0) - (bias if bias is not None else 0.0)
        dt = torch.where(rand(b, h) < 1 / 6, big, dt)
    bc_dtype = dtype if bc_dtype is None else bc_dtype
    dt_dtype = dtype if dt_dtype is None else dt_dtype
    out = dict(
        state=randn(b, h, p, n).to(state_dtype),
        x=randn(b, h, p).to(dtype),
        dt=dt.to(dt_dtype),
        A=-torch.exp(rand(h, lo=math.log(0.05), hi=math.log(2.0))).to(param_dtype),
        B=randn(b, g, n, scale=n ** -0.25).to(bc_dtype),
        C=randn(b, g, n, scale=n ** -0.25).to(bc_dtype),
        D={None: None, "h": randn(h), "hp": randn(h, p)}[D],
        z=randn(b, h, p).to(dtype) if z else None,
        dt_bias=bias.to(param_dtype) if bias is not None else None,
        dt_softplus=bool(dt_softplus), dt_min=float(dt_limit[0]), dt_max=float(dt_limit[1]),
    )
    if out["D"] is not None:
        out["D"] = out["D"].to(param_dtype)
    for k, v in out.items():
        if isinstance(v, torch.Tensor):
            v = v.to(device)
            out[k] = _layout(v, state_layout if k == "state" else layout)
    return out


def _cpu(kw):
    return {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


def _check(kw, what=""):
    """Run the kernel (on a poisoned allocator) and the reference (CPU); compare within TOL; inputs
    unchanged."""
    before = {k: v.clone() for k, v in kw.items() if isinstance(v, torch.Tensor)}
    poison_allocator()
    y, new = decode.state_update(**kw)
    ey, enew = ref.state_update(**_cpu(kw))
    torch.cuda.synchronize()
    assert y.shape == ey.shape and y.dtype == ey.dtype and y.is_contiguous(), (y.shape, y.dtype)
    assert new.shape == enew.shape and new.dtype == enew.dtype and new.is_contiguous(), (new.shape, new.dtype)
    assert y.device == kw["x"].device and new.device == kw["x"].device
    for name, out, exp in (("y", y, ey), ("new_state", new, enew)):
        err = rel_err(out, exp)
        assert err <= TOL[exp.dtype], f"{what} {name}: relative error {err:.3e} > {TOL[exp.dtype]:.0e}"
    for k, v in before.items():
        assert torch.equal(kw[k], v), f"{what}: input {k} was written"
    return y, new


# ---- sweeps ----

@st.composite
def cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    nheads = draw(st.sampled_from([1, 2, 4, 6, 8, 24]))
    return dict(
        dtype=dtype,
        batch=draw(st.sampled_from([1, 2, 3, 5])),
        nheads=nheads,
        ngroups=draw(st.sampled_from([g for g in (1, 2, 3, 6, 8) if nheads % g == 0])),
        headdim=draw(st.sampled_from([1, 4, 16, 50, 64, 80, 128])),
        # every dstate tile (32..256), partial tiles, and the loop over tiles above 256
        dstate=draw(st.sampled_from([1, 8, 16, 33, 64, 100, 128, 200, 256, 300, 512])),
        # B, C in float32 with 16-bit x: promoted activations, y converted back
        bc_dtype=draw(st.sampled_from([None, None, None, torch.float32])),
        # float32 (usual), the activations' dtype (caches kept in it), the other 16-bit dtype (converted)
        state_dtype=draw(st.sampled_from([torch.float32, torch.float32, dtype, _OTHER_HALF[dtype]])),
        dt_dtype=draw(st.sampled_from([None, torch.float32, _OTHER_HALF[dtype]])),
        param_dtype=draw(st.sampled_from([torch.float32, torch.float32, dtype])),
        dt_softplus=draw(st.booleans()), dt_bias=draw(st.booleans()), dt_large=draw(st.booleans()),
        dt_limit=draw(st.sampled_from([(0.0, INF), (0.002, 0.3)])),
        D=draw(st.sampled_from([None, "h", "hp"])), z=draw(st.booleans()),
        layout=draw(st.sampled_from(["contig", "contig", "strided", "transposed"])),
        state_layout=draw(st.sampled_from(["contig", "contig", "strided", "transposed"])),
        seed=draw(st.integers(0, 2 ** 16)),
    )


@given(cases())
@SWEEP
def test_state_update_matches_reference(kw):
    _check(make_inputs(**kw), what=str(kw))


# ---- explicit cases ----

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dstate", [16, 64, 128, 256, 300])
def test_every_tile_and_dtype(dtype, dstate):
    _check(make_inputs(dtype=dtype, dstate=dstate, headdim=64, nheads=8, ngroups=2, D="hp", z=True),
           what=f"{dtype} dstate={dstate}")


# The example on which occupancy 4 and 8 gave wrong outputs (docs/history.md v26, v28; measure/decode_scan.py
# runs it at each occupancy).
ODD_CASE = dict(dtype=torch.bfloat16, batch=3, nheads=8, ngroups=1, headdim=50, dstate=100, state_dtype=torch.bfloat16,
                param_dtype=torch.bfloat16, dt_softplus=True, dt_bias=False, dt_limit=(0.002, 0.3), D="hp", seed=4162)


# That example in each stride class (gpu_cases.STRIDE_CLASSES), with a bfloat16 and a float32 state: each a
# separate build, so that every build of the table's hint runs on the GPU, not only the sweep's.
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("headdim,dstate", STRIDE_CLASSES)
def test_stride_classes(headdim, dstate, state_dtype):
    _check(make_inputs(**{**ODD_CASE, "headdim": headdim, "dstate": dstate, "state_dtype": state_dtype}),
           f"headdim {headdim} dstate {dstate}")


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_model_sized(state_dtype):
    """Mamba-2 2.7B decode shapes (80 heads of 64, dstate 128, one group), batch 1 and 16: thousands of
    programs, every headdim tile full."""
    for batch in (1, 16):
        _check(make_inputs(dtype=torch.bfloat16, batch=batch, nheads=80, ngroups=1, headdim=64, dstate=128,
                           state_dtype=state_dtype, D="h", z=True, dt_limit=(0.0, INF)),
               what=f"batch={batch} state={state_dtype}")


def test_heads_read_their_group():
    """B and C differ per group only: a head that read another group's B or C would be far off."""
    kw = make_inputs(dtype=torch.float32, nheads=8, ngroups=4, headdim=16, dstate=32, seed=3)
    kw["B"][:, 1:] *= 10.0
    kw["C"][:, ::2] *= -3.0
    _check(kw, what="groups")


def test_float64_runs_the_reference():
    """float64 inputs: the op's CUDA implementation runs the reference (ops.dispatch.kernels_serve decides)."""
    import m2ops.ops
    kw = make_inputs(dtype=torch.float64, state_dtype=torch.float64, param_dtype=torch.float64, D="hp", z=True)
    y, new = m2ops.ops.state_update(**kw)
    ey, enew = ref.state_update(**kw)
    torch.testing.assert_close(y, ey, rtol=0, atol=0)
    torch.testing.assert_close(new, enew, rtol=0, atol=0)


def test_no_host_synchronisation():
    """The launcher never waits on the device, also on its conversion paths (16-bit parameters, dt of the
    other 16-bit dtype, bfloat16 state with float16 x, D per head)."""
    for kw in (make_inputs(D="h", z=True),
               make_inputs(dtype=torch.float16, state_dtype=torch.bfloat16, dt_dtype=torch.bfloat16,
                           param_dtype=torch.float16, D="hp")):
        decode.state_update(**kw)  # JIT compile first
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            decode.state_update(**kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


# ---- CUDA graphs ----

def test_cuda_graph_decode_steps():
    """A few decode steps (state_update, then the cache update state.copy_(new)) captured once and replayed
    on new data: the same results as the reference stepping eagerly on the CPU."""
    steps, b, h, g, p, n = 4, 2, 8, 2, 64, 128
    dtype = torch.bfloat16

    def fresh(seed):
        per_step = [make_inputs(batch=b, nheads=h, ngroups=g, headdim=p, dstate=n, dtype=dtype, D="h", z=True,
                                seed=seed * 100 + i) for i in range(steps)]
        return per_step[0]["state"], {k: torch.stack([s[k] for s in per_step])
                                      for k in ("x", "dt", "B", "C", "z")}, per_step[0]

    state0, seq0, fixed = fresh(0)
    state_buf = state0.clone()
    bufs = {k: v.clone() for k, v in seq0.items()}
    A, D, dt_bias = fixed["A"], fixed["D"], fixed["dt_bias"]

    def steps_through_buffers():
        ys = []
        for i in range(steps):
            y, new = decode.state_update(state_buf, bufs["x"][i], bufs["dt"][i], A, bufs["B"][i], bufs["C"][i],
                                         D, bufs["z"][i], dt_bias, True, 0.0, INF)
            state_buf.copy_(new)
            ys.append(y)
        return torch.stack(ys)

    graph, ys_out = captured(steps_through_buffers)  # (compiled before the capture)

    for seed in (1, 2):
        state, seq, _ = fresh(seed)
        state_buf.copy_(state)
        for k, v in seq.items():
            bufs[k].copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        s = state.cpu()
        for i in range(steps):
            ey, s = ref.state_update(s, seq["x"][i].cpu(), seq["dt"][i].cpu(), A.cpu(), seq["B"][i].cpu(),
                                     seq["C"][i].cpu(), D.cpu(), seq["z"][i].cpu(), dt_bias.cpu(), True, 0.0, INF)
            err = rel_err(ys_out[i], ey)
            assert err <= TOL[dtype], f"replay {seed} step {i} y: {err:.3e}"
        err = rel_err(state_buf, s)
        # the state carries float32 rounding differences over the steps: allow a few steps' worth
        assert err <= steps * TOL[torch.float32], f"replay {seed} state: {err:.3e}"


# ---- dispatch ----

def test_dispatch_runs_the_kernel(monkeypatch):
    """m2ops::state_update on CUDA calls the launcher m2ops.kernels.state_update (not the kernel module of
    the same name, and not the reference)."""
    from m2ops import kernels
    from m2ops.ops import dispatch
    assert kernels.state_update is decode.state_update
    if not dispatch.use_kernels(torch.device("cuda")):
        pytest.fail("dispatch does not use the cuTile kernels on this device (M2OPS_FORCE_REFERENCE set?)")
    calls = []

    def counting(*args):
        calls.append(1)
        return decode.state_update(*args)

    monkeypatch.setattr(kernels, "state_update", counting)
    kw = make_inputs(D="hp", z=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # "no cuTile kernel yet" would be an error
        y, new = torch.ops.m2ops.state_update(*kw.values())
    assert len(calls) == 1, "m2ops::state_update did not run the kernel"
    ey, enew = ref.state_update(**_cpu(kw))
    assert rel_err(y, ey) <= TOL[ey.dtype] and rel_err(new, enew) <= TOL[enew.dtype]


# ---- in place: m2ops::state_update_inplace (decode.state_update_inplace) ----

def _cache_case(kw, cache_extra, indexed, index_dtype, pad_every, seed, layout="contig"):
    """(cache, rows): kw's state rows placed in a cache of batch + cache_extra rows (in `layout`, see _layout), at
    rows of a seeded permutation, every pad_every-th batch row a padding slot (-1); rows None when not indexed
    (the cache is then kw's state itself)."""
    state = kw["state"]
    b = state.shape[0]
    if not indexed:
        return state, None
    gen = torch.Generator().manual_seed(seed)
    n_rows = b + cache_extra
    perm = torch.randperm(n_rows, generator=gen)[:b]
    rows = torch.where(torch.arange(b) % pad_every == pad_every - 1, -1, perm) if pad_every else perm
    dense = torch.randn(n_rows, *state.shape[1:], generator=gen, dtype=torch.float64).to(state.dtype)
    used = rows >= 0
    dense[rows[used]] = state.cpu()[used]
    return _layout(dense.to(state.device), layout), rows.to(index_dtype).to(state.device)


def _check_inplace(kw, *, indexed=True, index_dtype=torch.int32, cache_extra=3, pad_every=3, with_out=False,
                   seed=0, layout="contig", what=""):
    """Run the in-place launcher on a cache (poisoned allocator) and the reference on CPU copies: used rows within
    TOL, every other cache row and every skipped output row bit for bit as before; inputs unchanged."""
    cache, rows = _cache_case(kw, cache_extra, indexed, index_dtype, pad_every, seed, layout)
    args = {k: v for k, v in kw.items() if k != "state"}
    x = kw["x"]
    out = torch.full(x.shape, 3.0, dtype=x.dtype, device=x.device) if with_out else torch.zeros_like(x)
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    cache_before, out_before = cache.cpu().clone(), out.cpu().clone()
    want_cache, want_out = cache.cpu().clone(), out.cpu().clone()
    ref.state_update_inplace(want_cache, **_cpu(args), state_batch_indices=None if rows is None else rows.cpu(),
                             out=want_out)
    poison_allocator()
    ptr = cache.data_ptr()
    assert decode.state_update_inplace(cache, **args, state_batch_indices=rows, out=out) is None
    torch.cuda.synchronize()
    assert cache.data_ptr() == ptr
    b = x.shape[0]
    used = list(range(b)) if rows is None else [i for i in range(b) if 0 <= int(rows[i]) < cache.shape[0]]
    target = used if rows is None else [int(rows[i]) for i in used]
    got_cache, got_out = cache.cpu(), out.cpu()
    for name, o, e in (("y", got_out[used], want_out[used]), ("state", got_cache[target], want_cache[target])):
        err = rel_err(o, e)
        assert err <= TOL[e.dtype], f"{what} {name}: relative error {err:.3e} > {TOL[e.dtype]:.0e}"
    others = [r for r in range(cache.shape[0]) if r not in target]
    assert torch.equal(got_cache[others], cache_before[others]), f"{what}: a cache row no index names was written"
    skipped = [i for i in range(b) if i not in used]
    assert torch.equal(got_out[skipped], out_before[skipped]), f"{what}: a padding slot's output row was written"
    for k, v in before.items():
        assert torch.equal(args[k], v), f"{what}: input {k} was written"
    return cache, out


@st.composite
def inplace_cases(draw):
    case = draw(cases())
    return case, dict(indexed=draw(st.booleans()), index_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
                      cache_extra=draw(st.sampled_from([0, 1, 5])), pad_every=draw(st.sampled_from([0, 2, 3])),
                      with_out=draw(st.booleans()), seed=draw(st.integers(0, 2 ** 16)))


@given(inplace_cases())
@SWEEP
def test_inplace_matches_reference(c):
    case, opts = c
    _check_inplace(make_inputs(**case), **opts, layout=case["state_layout"], what=str(c))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dstate", [16, 64, 128, 256, 300])
def test_inplace_every_tile_and_dtype(dtype, dstate):
    _check_inplace(make_inputs(dtype=dtype, dstate=dstate, headdim=64, nheads=8, ngroups=2, D="hp", z=True),
                   with_out=True, what=f"{dtype} dstate={dstate}")


# Each stride class with a bfloat16 and a float32 state (the table's build where rows are not 16-byte multiples,
# the occupancy-4 build where they are), on the example occupancy 4 once got wrong.
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("headdim,dstate", STRIDE_CLASSES)
def test_inplace_stride_classes(headdim, dstate, state_dtype):
    _check_inplace(make_inputs(**{**ODD_CASE, "headdim": headdim, "dstate": dstate, "state_dtype": state_dtype}),
                   what=f"headdim {headdim} dstate {dstate}")


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_inplace_model_sized(state_dtype):
    """Mamba-2 2.7B decode shapes into a cache of 64 rows, batch 1 and 16, with and without indices."""
    for batch in (1, 16):
        for indexed in (False, True):
            _check_inplace(make_inputs(dtype=torch.bfloat16, batch=batch, nheads=80, ngroups=1, headdim=64,
                                       dstate=128, state_dtype=state_dtype, D="h", z=True),
                           indexed=indexed, cache_extra=64 - batch, pad_every=5,
                           what=f"batch={batch} indexed={indexed} state={state_dtype}")


def test_inplace_int64_indices_beyond_int32_are_skipped():
    """int64 indices far outside int32 (either sign) are clamped by the launcher, not wrapped into the cache."""
    kw = make_inputs(batch=4, D="h")
    args = {k: v for k, v in kw.items() if k != "state"}
    cache = torch.randn(6, *kw["state"].shape[1:], device="cuda")
    before = cache.clone()
    rows = torch.tensor([2 ** 32 + 1, -(2 ** 32) + 2, 2 ** 40, 5], dtype=torch.int64, device="cuda")
    out = torch.full_like(kw["x"], 3.0)
    decode.state_update_inplace(cache, **args, state_batch_indices=rows, out=out)
    torch.cuda.synchronize()
    assert torch.equal(cache[:5], before[:5]) and not torch.equal(cache[5], before[5])
    assert torch.equal(out[:3], torch.full_like(out[:3], 3.0))


def test_inplace_no_host_synchronisation():
    """The in-place launcher never waits on the device: int64 indices, conversions (a state of the other 16-bit
    dtype, y through a copy of out), and the public function with its checks (indices on the GPU: not read)."""
    import m2ops
    cases_ = ((make_inputs(D="h", z=True), torch.int64, False),
              (make_inputs(dtype=torch.float16, bc_dtype=torch.float32, state_dtype=torch.bfloat16, D="hp"),
               torch.int32, True))
    for kw, index_dtype, with_out in cases_:
        cache, rows = _cache_case(kw, 3, True, index_dtype, 2, 0)
        args = {k: v for k, v in kw.items() if k != "state"}  # the launcher's keywords
        pub = {k: v for k, v in args.items() if k not in ("dt_min", "dt_max")}
        pub["dt_limit"] = (args["dt_min"], args["dt_max"])
        out = torch.zeros_like(kw["x"])

        def both():
            decode.state_update_inplace(cache, **args, state_batch_indices=rows, out=out)
            m2ops.selective_state_update(cache, **pub, state_batch_indices=rows, out=out if with_out else None)

        both()  # JIT compile first
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            both()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


def test_inplace_cuda_graph_decode_steps():
    """Decode steps of the public in-place function into a cache, rows picked by indices with a padding slot,
    captured once and replayed on new data (the cache itself the graph's state): the reference's results."""
    import m2ops
    steps, b, h, g, p, n, n_rows = 4, 3, 8, 2, 64, 128, 5
    dtype = torch.bfloat16
    rows = torch.tensor([3, -1, 0], dtype=torch.int32, device="cuda")

    def fresh(seed):
        per_step = [make_inputs(batch=b, nheads=h, ngroups=g, headdim=p, dstate=n, dtype=dtype, D="h", z=True,
                                seed=seed * 100 + i) for i in range(steps)]
        cache = torch.randn(n_rows, h, p, n, generator=torch.Generator().manual_seed(seed)).cuda()
        return cache, {k: torch.stack([s[k] for s in per_step]) for k in ("x", "dt", "B", "C", "z")}, per_step[0]

    cache0, seq0, fixed = fresh(0)
    cache_buf = cache0.clone()
    bufs = {k: v.clone() for k, v in seq0.items()}
    ys = torch.zeros(steps, b, h, p, dtype=dtype, device="cuda")
    A, D, dt_bias = fixed["A"], fixed["D"], fixed["dt_bias"]

    def steps_into_the_cache():
        for i in range(steps):
            m2ops.selective_state_update(cache_buf, bufs["x"][i], bufs["dt"][i], A, bufs["B"][i], bufs["C"][i], D=D,
                                         z=bufs["z"][i], dt_bias=dt_bias, dt_softplus=True,
                                         state_batch_indices=rows, out=ys[i])
        return ys

    graph, _ = captured(steps_into_the_cache)  # (compiled before the capture; the warm-up moved the cache on)

    for seed in (1, 2):
        cache, seq, _ = fresh(seed)
        cache_buf.copy_(cache)
        for k, v in seq.items():
            bufs[k].copy_(v)
        ys.fill_(5.0)
        graph.replay()
        torch.cuda.synchronize()
        want = cache.cpu()
        for i in range(steps):
            want_y = torch.full((b, h, p), 5.0, dtype=dtype)
            ref.state_update_inplace(want, seq["x"][i].cpu(), seq["dt"][i].cpu(), A.cpu(), seq["B"][i].cpu(),
                                     seq["C"][i].cpu(), D.cpu(), seq["z"][i].cpu(), dt_bias.cpu(), rows.cpu(), True,
                                     0.0, INF, want_y)
            err = rel_err(ys[i][[0, 2]], want_y[[0, 2]])
            assert err <= TOL[dtype], f"replay {seed} step {i} y: {err:.3e}"
            assert torch.equal(ys[i][1].cpu(), want_y[1]), f"replay {seed} step {i}: the padding slot's y written"
        err = rel_err(cache_buf[[3, 0]], want[[3, 0]])
        assert err <= steps * TOL[torch.float32], f"replay {seed} cache: {err:.3e}"
        assert torch.equal(cache_buf[[1, 2, 4]].cpu(), cache.cpu()[[1, 2, 4]]), "rows no index names were written"


def test_inplace_compiles_fullgraph_on_cuda():
    """torch.compile(fullgraph=True) of the public in-place function on the GPU: the eager call's results and
    cache writes (the op is functionalised and written back; its kernel runs either way)."""
    import m2ops
    torch._dynamo.reset()
    kw = make_inputs(batch=3, D="h", z=True)
    args = {k: v for k, v in kw.items() if k not in ("state", "dt_min", "dt_max")}
    cache, rows = _cache_case(kw, 2, True, torch.int64, 3, 1)

    def fn(cache, rows):
        return m2ops.selective_state_update(cache, **args, state_batch_indices=rows)

    c1, c2 = cache.clone(), cache.clone()
    got = torch.compile(fn, fullgraph=True)(c1, rows)
    want = fn(c2, rows)
    torch.cuda.synchronize()
    torch._dynamo.reset()
    assert torch.equal(got, want) and torch.equal(c1, c2)


def test_inplace_dispatch_runs_the_kernel(monkeypatch):
    """m2ops::state_update_inplace on CUDA calls the launcher m2ops.kernels.state_update_inplace (not the kernel
    module of the same name, and not the reference)."""
    from m2ops import kernels
    from m2ops.ops import dispatch
    assert kernels.state_update_inplace is decode.state_update_inplace
    if not dispatch.use_kernels(torch.device("cuda")):
        pytest.fail("dispatch does not use the cuTile kernels on this device (M2OPS_FORCE_REFERENCE set?)")
    calls = []

    def counting(*args):
        calls.append(1)
        return decode.state_update_inplace(*args)

    monkeypatch.setattr(kernels, "state_update_inplace", counting)
    kw = make_inputs(D="hp", z=True)
    cache, rows = _cache_case(kw, 2, True, torch.int32, 2, 0)
    want_cache, want_out = cache.cpu().clone(), torch.zeros(kw["x"].shape, dtype=kw["x"].dtype)
    args = {k: v for k, v in kw.items() if k != "state"}
    ref.state_update_inplace(want_cache, **_cpu(args), state_batch_indices=rows.cpu(), out=want_out)
    out = torch.zeros_like(kw["x"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        torch.ops.m2ops.state_update_inplace(cache, args["x"], args["dt"], args["A"], args["B"], args["C"], args["D"],
                                             args["z"], args["dt_bias"], rows, args["dt_softplus"], args["dt_min"],
                                             args["dt_max"], out)
    assert len(calls) == 1, "m2ops::state_update_inplace did not run the kernel"
    assert rel_err(out, want_out) <= TOL[want_out.dtype] and rel_err(cache, want_cache) <= TOL[want_cache.dtype]
