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
