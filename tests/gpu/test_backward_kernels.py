"""The backward kernels (m2ops/kernels/backward.py: chunk_cumsum_bwd, fwd_pass_state_bwd whole and in its two
stages, compute_out_bwd)
on a GPU against the reference backward formulas, and the public function's gradients on CUDA (autograd
through the *_bwd ops, whose CUDA implementations they are) against the reference's on the CPU:

    python -m pytest -q -m gpu tests/gpu/test_backward_kernels.py

Tolerances as the emulated tests' (BWD_TOL in tests/emulated_cases.py, CUMSUM_BWD_TOL in
tests/test_emulated_backward.py), where the same kernels run on the CPU emulator in CI. Expected values: the reference on the CPU, on the same (already rounded) inputs.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_cases import (STRIDE_CLASSES, kernels_or_reason, make_case, per_head_sum_err,  # noqa: E402
                       per_head_sum_scales, poison_allocator, reference_forward, rel_err, sweep_settings)

from m2ops.meta.shapes import g_local_dtype  # noqa: E402
from m2ops.reference import chunked_backward as ref_bwd  # noqa: E402

_kernels, _reason = kernels_or_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_kernels is None, reason=str(_reason))]

BWD_TOL = {torch.float32: 3e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}
CUMSUM_BWD_TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
SWEEP = sweep_settings(20)


def _cpu(t):
    return t.cpu() if isinstance(t, torch.Tensor) else t


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
    nheads = draw(st.sampled_from([1, 2, 4, 6]))
    return dict(
        dtype=dtype, chunk_size=draw(st.sampled_from([16, 32, 64, 128, 256])), batch=draw(st.integers(1, 2)),
        seqlen=draw(st.one_of(st.integers(1, 40), st.integers(41, 700))), nheads=nheads,
        ngroups=draw(st.sampled_from([g for g in (1, 2, 3, 6) if nheads % g == 0])),
        headdim=draw(st.sampled_from([4, 16, 64, 80, 128])), dstate=draw(st.sampled_from([8, 16, 64, 100, 256])),
        dt_softplus=draw(st.booleans()), dt_bias=draw(st.booleans()),
        dt_limit=draw(st.sampled_from([(0.0, float("inf")), (0.002, 0.3)])),
        initial_states=draw(st.booleans()), seq_idx=draw(st.booleans()), nseqs=draw(st.integers(1, 8)),
        noncontig=draw(st.booleans()), seed=draw(st.integers(0, 2 ** 16)),
        dt_dtype=draw(st.sampled_from([None, torch.float32])),
    )


@given(cases(), st.sampled_from([None, True, False]))
@SWEEP
def test_backward_kernels_match_reference(kw, separate_carry):
    """separate_carry: gcarry apart from state_passing_bwd's walk (state_carry_grad_kernel) or in it, forced,
    or by backward.separate_carry_grad's rule (None; at these sizes the walk block is the smallest, apart)."""
    from m2ops.kernels import backward, config
    case = make_case(**kw)
    _, fin_ref, _, mid = reference_forward(case)
    gen = torch.Generator().manual_seed(kw["seed"])

    def cot(t):
        return torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.device)

    lo, hi = case["dt_limit"]
    args = (cot(mid["dt_out"]), cot(mid["dA_cumsum"]), case["dt"], case["A"], case["dt_bias"], case["chunk_size"],
            case["dt_softplus"], float(lo), float(hi))
    poison_allocator()
    got = backward.chunk_cumsum_bwd(*args)
    want = ref_bwd.chunk_cumsum_bwd(*map(_cpu, args))
    for name, a, b, tol in zip(("g_dt", "g_A", "g_dt_bias"), got, want,
                               (CUMSUM_BWD_TOL[case["dt"].dtype], 1e-5, 1e-5)):
        assert a.shape == b.shape and a.dtype == b.dtype and a.is_cuda, name
        assert rel_err(a, b) <= tol, f"{name}: {rel_err(a, b):.3e}"

    args = (cot(mid["states"]), cot(fin_ref), fin_ref.new_zeros((0, *fin_ref.shape[1:])), case["x"], case["B"],
            mid["dt_out"], mid["dA_cumsum"], case["initial_states"], case["seq_idx"], None)
    poison_allocator()
    with config.override(separate_carry_grad=separate_carry):
        got = backward.fwd_pass_state_bwd(*args)
    want = ref_bwd.fwd_pass_state_bwd(*map(_cpu, args))
    dtype = case["x"].dtype
    for name, a, b in zip(("g_x", "g_B", "g_dt_out", "g_dA_cumsum", "g_init"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous(), name
        assert rel_err(a, b) <= BWD_TOL[dtype], f"{name}: {rel_err(a, b):.3e}"
    # in its two stages as the scan's backward calls them: from the entering states, the gradients added into
    # another op's in place
    bases = [cot(t).to(t.dtype) for t in (case["x"], case["B"], mid["dt_out"], mid["dA_cumsum"])]
    staged = [t.clone() for t in bases]
    with config.override(separate_carry_grad=separate_carry):
        g_local, g_carry, g_init = backward.state_passing_bwd(
            args[0], args[1], mid["states"], mid["dA_cumsum"], case["seq_idx"],
            g_local_dtype(case["x"].dtype, case["B"].dtype, mid["dA_cumsum"].dtype))
        backward.chunk_state_bwd(g_local, g_carry, case["x"], case["B"], mid["dt_out"], mid["dA_cumsum"],
                                 case["seq_idx"], *staged)
    for name, a, base, b in zip(("g_x", "g_B", "g_dt_out", "g_dA_cumsum"), staged, bases, want[:4]):
        assert a.dtype == base.dtype, name
        assert rel_err(a.float().cpu(), b.float().cpu() + base.float().cpu()) <= BWD_TOL[dtype], \
            f"{name} (in two stages): {rel_err(a.float().cpu(), b.float().cpu() + base.float().cpu()):.3e}"
    if case["initial_states"] is not None:
        assert rel_err(g_init.to(want[4].dtype), want[4]) <= BWD_TOL[dtype]


@given(cases(), st.sampled_from([None, "h", "hp"]), st.booleans())
@SWEEP
def test_compute_out_backward_kernels(kw, D, z):
    """compute_out_bwd (every gradient, D and z included) against the reference backward formulas."""
    from m2ops.kernels import backward
    from m2ops.reference import chunked_backward as ref_bwd
    case = make_case(**kw, D=D, z=z)
    y_ref, _, _, mid = reference_forward(case)
    gen = torch.Generator().manual_seed(kw["seed"])
    g_y = torch.randn(y_ref.shape, generator=gen).to(y_ref.dtype).to(y_ref.device)
    args = (g_y, case["x"], mid["dt_out"], mid["dA_cumsum"], case["C"], case["B"], mid["states"], case["D"],
            case["z"], case["seq_idx"])
    want = ref_bwd.compute_out_bwd(*(_cpu(a) for a in args))
    poison_allocator()
    got = backward.compute_out_bwd(*args)
    dtype = case["x"].dtype
    for name, a, b in zip(("g_x", "g_dt_out", "g_dA_cumsum", "g_C", "g_B", "g_states", "g_D", "g_z"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous(), name
        assert rel_err(a, b) <= BWD_TOL[dtype], f"{name}: {rel_err(a, b):.3e}"


GRAD_LEAVES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


@given(cases(), st.sampled_from([None, "h", "hp"]), st.booleans())
@sweep_settings(6)
def test_public_function_gradients(kw, D, z):
    """Every input's gradient through the ops' autograd on CUDA (the backward kernels) against the
    reference's autograd on the CPU in float32, from the same rounded inputs and cotangents. Tolerance: twice
    the kernel-level one (the forward's own rounding enters the gradients of dt, A and dt_bias); A's and
    dt_bias's errors relative to the magnitude of the per-token terms they sum (per_head_sum_scales)."""
    _check_public_gradients(kw, D, z)


# Each stride class of the backward's hinted builds (specialise._OCCUPANCY_ANY_CHUNK), named rather than left to the
# sweep's few examples (gpu_cases.STRIDE_CLASSES).
@pytest.mark.parametrize("headdim,dstate", STRIDE_CLASSES)
def test_gradients_in_each_stride_class(headdim, dstate):
    _check_public_gradients(dict(dtype=torch.bfloat16, chunk_size=256, batch=2, seqlen=600, nheads=4, ngroups=2,
                                 headdim=headdim, dstate=dstate, dt_softplus=True, dt_bias=True,
                                 initial_states=True, seed=headdim * 1000 + dstate), "hp", True)


def _check_public_gradients(kw, D, z):
    from m2ops import mamba_chunk_scan_combined
    case = make_case(**kw, D=D, z=z)
    gen = torch.Generator().manual_seed(kw["seed"])

    def run(c):
        leaves = {k: c[k].detach().requires_grad_() for k in GRAD_LEAVES if c[k] is not None}
        args = {**c, **leaves}
        y, fin = mamba_chunk_scan_combined(**args, return_final_states=True)
        return y, fin, leaves

    y, fin, leaves = run(case)
    g_y = torch.randn(y.shape, generator=gen)
    g_fin = torch.randn(fin.shape, generator=gen)
    torch.autograd.backward((y, fin), (g_y.to(y.device, y.dtype), g_fin.to(fin.device, fin.dtype)))
    cpu = {k: (v.detach().cpu().float() if isinstance(v, torch.Tensor) and v.is_floating_point()
               else v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    y_r, fin_r, leaves_r = run(cpu)
    torch.autograd.backward((y_r, fin_r), (g_y.to(y.dtype).float(), g_fin))
    tol = 2 * BWD_TOL[case["x"].dtype]
    scales = per_head_sum_scales(run, cpu, (g_y.to(y.dtype).float(), g_fin), leaves_r)
    for name, leaf in leaves.items():
        got, want = leaf.grad, leaves_r[name].grad
        assert got is not None and got.shape == leaf.shape and got.dtype == leaf.dtype, name
        err = rel_err(got.float().cpu(), want)
        if name in scales:  # per-head sums over every token: relative to their terms' magnitude
            err = per_head_sum_err(got, want, scales[name])
        assert err <= tol, f"grad of {name}: {err:.3e}"


@pytest.mark.parametrize("opts", [
    dict(dtype=torch.bfloat16, D="hp", z=True, initial_states=True, seqlen=700, chunk_size=256),
    dict(dtype=torch.float32, batch=2, seq_idx=True, nseqs=3, dt_limit=(0.002, 0.3), seqlen=300, chunk_size=64),
])
def test_eager_path_is_the_ops_path(monkeypatch, opts):
    """The public function's direct eager path (m2ops/ops/eager.py) and the custom ops give the same bits: y,
    final states and every gradient, since both run the same launchers in the same order; except where the
    forward's two-op path kept its bfloat16 entering states for the backward: then the gradients through the
    chunk-end carries (dt, A, dt_bias) differ by the states' rounding, the others are still the same bits."""
    from m2ops import mamba_chunk_scan_combined
    from m2ops.ops import eager
    case = make_case(nheads=8, ngroups=2, headdim=64, dstate=128, seed=3, **opts)
    gen = torch.Generator().manual_seed(3)
    calls = []

    def run():
        leaves = {k: case[k].detach().requires_grad_() for k in GRAD_LEAVES if case[k] is not None}
        y, fin = mamba_chunk_scan_combined(**{**case, **leaves}, return_final_states=True)
        torch.autograd.backward((y, fin), (g_y, g_fin))
        return {"y": y, "final": fin, **{k: leaves[k].grad for k in leaves}}

    y0, fin0 = mamba_chunk_scan_combined(**case, return_final_states=True)
    g_y = torch.randn(y0.shape, generator=gen).to(y0.device, y0.dtype)
    g_fin = torch.randn(fin0.shape, generator=gen).to(fin0.device)
    real = eager.scan_combined
    monkeypatch.setattr(eager, "scan_combined", lambda *a: calls.append(1) or real(*a))
    direct = run()
    assert calls, "the eager call did not take the direct path"
    monkeypatch.setattr(eager, "applies", lambda *t: False)
    through_ops = run()
    assert len(calls) == 1
    for name in direct:
        if name in ("dt", "A", "dt_bias"):
            assert rel_err(direct[name], through_ops[name]) <= 2e-3, name
        else:
            assert torch.equal(direct[name], through_ops[name]), name
