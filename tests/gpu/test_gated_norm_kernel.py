"""The gated RMSNorm's cuTile kernels (m2ops.kernels.norm: rms_norm_gated, rms_norm_gated_bwd) against
m2ops.reference.gated_norm, forward and backward.

    python -m pytest -q -m gpu tests/gpu/test_gated_norm_kernel.py

Every test is marked gpu and skipped without a CUDA GPU or where the cuTile kernels cannot run (the reason is
shown). Expected values come from the reference on the CPU on the same (already rounded) inputs; both compute in
float32, so what is measured is the kernels' own error.

Tolerances: normwise relative error (gpu_cases.rel_err). Both sides differ by the order of the group sums, the
gate's ex2.approx (relative error about 2^-22) and division, a few float32 ulps (~1e-6 normwise); 16-bit outputs
add their final rounding, where one side can land an ulp off. By the output's dtype: 1e-5 (float32: rstd, and
dweight and dbias, sums over rows in another order, for float32 parameters), 1e-3 (float16), 8e-3 (bfloat16). A
wrong index, group or row block gives errors of order 1e-1; an unwritten output is NaN (poisoned allocator), inf.

Hypothesis sweeps are derandomized and do not shrink (each dtype / tile / stride class JIT-compiles a kernel);
M2OPS_GPU_EXAMPLES (default 25) sets the examples per sweep.
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
from gpu_cases import captured, kernels_or_reason, poison_allocator, rel_err, sweep_settings  # noqa: E402

import m2ops  # noqa: E402
from m2ops.meta.gated_norm import KERNEL_NORM_MAX_GROUP  # noqa: E402
from m2ops.reference import gated_norm as ref  # noqa: E402

_kernels, _reason = kernels_or_reason()
if _kernels is not None:
    from m2ops.kernels import norm
else:
    norm = None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(norm is None, reason=str(_reason))]

SWEEP = sweep_settings(25)

TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}  # by the output's dtype
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OPTIONS = {  # name: (z given, bias given, norm_before_gate)
    "plain": (False, False, True),
    "bias": (False, True, True),
    "gate_after": (True, False, True),
    "gate_after_bias": (True, True, True),
    "gate_before": (True, False, False),
    "gate_before_bias": (True, True, False),
}


# ---- inputs ----

def make_inputs(*, lead=(2, 64), ngroups=1, group_size=256, dtype=torch.bfloat16, option="gate_before",
                layout="layer", param_dtype=torch.float32, seed=0, device="cuda"):
    """Keyword arguments of the launchers (the reference's signature) plus dy, drawn on the CPU and moved.
    layout: "layer" (x contiguous, z a slice of a wider in_proj-like output, rows strided), "contig",
    "transposed" (leading dimensions that do not flatten to one row stride: copied by the launcher),
    "strided" (channels strided by 2: copied), "expanded" (z broadcast over the first dimension: copied)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = ngroups * group_size
    z_on, bias_on, nbg = OPTIONS[option]

    def randn(*s, scale=1.0):
        return torch.randn(*s, generator=gen, dtype=torch.float64) * scale

    x = randn(*lead, hidden).to(dtype).to(device)
    z = (randn(*lead, hidden) * 2).to(dtype).to(device) if z_on else None
    if layout == "layer" and z is not None:
        big = torch.zeros(*lead, 2 * hidden + 2 * 128 + 80, dtype=dtype, device=device)
        z = big[..., hidden:2 * hidden].copy_(z)
    elif layout == "transposed" and len(lead) >= 2:
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
        if z is not None:
            z = z.transpose(0, 1).contiguous().transpose(0, 1)
    elif layout == "strided":
        x = torch.zeros(*lead, 2 * hidden, dtype=dtype, device=device)[..., ::2].copy_(x)
    elif layout == "expanded" and z is not None:
        z = z[:1].expand_as(x)
    return dict(
        x=x, weight=(1 + randn(hidden, scale=0.5)).to(param_dtype).to(device),
        bias=(randn(hidden, scale=0.3)).to(param_dtype).to(device) if bias_on else None, z=z,
        eps=1e-5, group_size=group_size, norm_before_gate=nbg,
        dy=randn(*lead, hidden).to(dtype).to(device),
    )


def _cpu(t):
    return t.cpu() if isinstance(t, torch.Tensor) else t


def _check(kw, what=""):
    """Forward and backward launchers (poisoned allocator) against the reference on the CPU; inputs unchanged."""
    kw = dict(kw)
    dy = kw.pop("dy")
    args = (kw["x"], kw["weight"], kw["bias"], kw["z"], kw["eps"], kw["group_size"], kw["norm_before_gate"])
    before = [a.clone() for a in (*args[:4], dy) if isinstance(a, torch.Tensor)]
    poison_allocator()
    y, rstd = norm.rms_norm_gated(*args)
    grads = norm.rms_norm_gated_bwd(dy, *args[:4], rstd, *args[4:])
    cargs = tuple(_cpu(a) for a in args)
    ey, er = ref.rms_norm_gated(*cargs)
    egrads = ref.rms_norm_gated_bwd(dy.cpu(), *cargs[:4], er, *cargs[4:])
    torch.cuda.synchronize()
    names = ("y", "rstd", "dx", "dweight", "dbias", "dz")
    for name, out, exp in zip(names, (y, rstd, *grads), (ey, er, *egrads)):
        assert out.shape == exp.shape and out.dtype == exp.dtype and out.is_contiguous(), (what, name)
        assert out.device == kw["x"].device, (what, name)
        err = rel_err(out, exp)
        assert err <= TOL[exp.dtype], f"{what} {name}: relative error {err:.3e} > {TOL[exp.dtype]:.0e}"
    for a, b in zip((a for a in (*args[:4], dy) if isinstance(a, torch.Tensor)), before):
        assert torch.equal(a, b), f"{what}: an input was written"


# ---- sweeps ----

@st.composite
def cases(draw):
    return dict(
        lead=tuple(draw(st.lists(st.sampled_from([1, 2, 3, 7, 64, 333]), min_size=1, max_size=3))
                   if draw(st.booleans()) else [draw(st.sampled_from([1, 5, 1000, 4097]))]),
        ngroups=draw(st.sampled_from([1, 2, 3, 8])),
        group_size=draw(st.sampled_from([1, 8, 50, 64, 100, 128, 640, 1024, 3072, 4096, 5120, 8192])),
        dtype=draw(st.sampled_from(DTYPES)),
        option=draw(st.sampled_from(sorted(OPTIONS))),
        layout=draw(st.sampled_from(["layer", "layer", "contig", "transposed", "strided", "expanded"])),
        param_dtype=draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16])),
        seed=draw(st.integers(0, 2 ** 16)),
    )


@given(cases())
@SWEEP
def test_kernels_match_reference(kw):
    hidden = kw["ngroups"] * kw["group_size"]
    if math.prod(kw["lead"]) * hidden > 2 ** 22:  # at most 4M elements: the CPU reference stays quick
        kw["lead"] = (max(1, 2 ** 22 // hidden),)
    _check(make_inputs(**kw), what=str(kw))


# ---- explicit cases ----

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [64, 100, 256, 512, 1024, 2048, 4096, 5120, 8192])
def test_every_group_tile(dtype, group_size):
    """Every group tile (64 ... 4096; 5120 and 8192 take the column-tiled kernels), both gate positions, the layer's
    layout, rows that leave a partial row block."""
    for option in ("gate_before_bias", "gate_after"):
        _check(make_inputs(lead=(3, 67), ngroups=2, group_size=group_size, dtype=dtype, option=option),
               what=f"{dtype} group {group_size} {option}")


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_every_option(option):
    _check(make_inputs(lead=(2, 300), ngroups=4, group_size=256, option=option), what=option)


@pytest.mark.parametrize("ngroups,d_ssm", [(1, 5120), (8, 8192), (1, 3072)])
def test_model_sized(ngroups, d_ssm):
    """Mamba-2 2.7B (d_ssm 5120, one group), an 8-group model (d_ssm 8192: groups of 1024) and d_ssm 3072, at
    batch 2 x 2048 tokens: thousands of row blocks, many per backward program."""
    _check(make_inputs(lead=(2, 2048), ngroups=ngroups, group_size=d_ssm // ngroups, dtype=torch.bfloat16,
                       option="gate_before"), what=f"d_ssm {d_ssm} ngroups {ngroups}")


def test_groups_are_separate():
    """Groups of very different scale: a program reading another group's channels or weights would be far off."""
    kw = make_inputs(lead=(4, 33), ngroups=4, group_size=128, dtype=torch.float32, option="gate_after_bias")
    kw["x"][..., :128] *= 100.0
    kw["weight"][256:384] *= -7.0
    _check(kw, what="groups")


# ---- the ops: dispatch, autograd, fallbacks ----

def test_dispatch_runs_the_kernels(monkeypatch):
    """m2ops::rms_norm_gated and its backward op on CUDA call the launchers in m2ops.kernels (not the
    reference), through the public function's autograd."""
    from m2ops import kernels
    from m2ops.ops import dispatch
    assert kernels.rms_norm_gated is norm.rms_norm_gated and kernels.rms_norm_gated_bwd is norm.rms_norm_gated_bwd
    if not dispatch.use_kernels(torch.device("cuda")):
        pytest.fail("dispatch does not use the cuTile kernels on this device (M2OPS_FORCE_REFERENCE set?)")
    calls = []
    for name in ("rms_norm_gated", "rms_norm_gated_bwd"):
        real = getattr(norm, name)
        monkeypatch.setattr(kernels, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    kw = make_inputs(option="gate_before_bias")
    leaves = {k: kw[k].detach().clone().requires_grad_(True) for k in ("x", "weight", "bias", "z")}
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        y = m2ops.rms_norm_gated(leaves["x"], leaves["weight"], z=leaves["z"], bias=leaves["bias"],
                                 group_size=kw["group_size"], norm_before_gate=False)
        y.backward(kw["dy"])
    assert calls == ["rms_norm_gated", "rms_norm_gated_bwd"], calls
    cpu = {k: v.detach().cpu() for k, v in leaves.items()}
    ey, er = ref.rms_norm_gated(cpu["x"], cpu["weight"], cpu["bias"], cpu["z"], 1e-5, kw["group_size"], False)
    eg = ref.rms_norm_gated_bwd(kw["dy"].cpu(), cpu["x"], cpu["weight"], cpu["bias"], cpu["z"], er, 1e-5,
                                kw["group_size"], False)
    assert rel_err(y, ey) <= TOL[y.dtype]
    for k, want in zip(("x", "weight", "bias", "z"), eg):
        assert leaves[k].grad.dtype == leaves[k].dtype and rel_err(leaves[k].grad, want) <= TOL[want.dtype], k


def test_reference_for_float64_and_large_groups():
    """float64 inputs and groups above KERNEL_NORM_MAX_GROUP run the reference on CUDA (bit for bit)."""
    for dtype, group_size in ((torch.float64, 64), (torch.bfloat16, 2 * KERNEL_NORM_MAX_GROUP)):
        kw = make_inputs(lead=(3,), group_size=group_size, dtype=dtype, option="gate_after_bias")
        y = m2ops.rms_norm_gated(kw["x"], kw["weight"], z=kw["z"], bias=kw["bias"], group_size=group_size)
        ey, _ = ref.rms_norm_gated(kw["x"], kw["weight"], kw["bias"], kw["z"], 1e-5, group_size, True)
        torch.testing.assert_close(y, ey, rtol=0, atol=0)


def test_no_host_synchronisation():
    """The launchers never wait on the device, also on their conversion paths (16-bit weight, transposed x)."""
    for kw in (make_inputs(option="gate_before_bias"),
               make_inputs(option="gate_after", layout="transposed", param_dtype=torch.bfloat16)):
        dy = kw.pop("dy")
        args = tuple(kw.values())
        y, rstd = norm.rms_norm_gated(*args)  # JIT compile first
        norm.rms_norm_gated_bwd(dy, *args[:4], rstd, *args[4:])
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            y, rstd = norm.rms_norm_gated(*args)
            norm.rms_norm_gated_bwd(dy, *args[:4], rstd, *args[4:])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


def test_cuda_graph_forward_and_backward():
    """Both launchers captured once in a CUDA graph and replayed on new data: the reference's results."""
    kw = make_inputs(lead=(2, 128), ngroups=2, group_size=512, option="gate_before_bias")
    bufs = {k: kw[k].clone() for k in ("x", "z", "dy")}

    def both():
        y, rstd = norm.rms_norm_gated(bufs["x"], kw["weight"], kw["bias"], bufs["z"], 1e-5, 512, False)
        return (y, *norm.rms_norm_gated_bwd(bufs["dy"], bufs["x"], kw["weight"], kw["bias"], bufs["z"], rstd,
                                            1e-5, 512, False))

    graph, outs = captured(both)
    for seed in (1, 2):
        new = make_inputs(lead=(2, 128), ngroups=2, group_size=512, option="gate_before_bias", seed=seed)
        for k in bufs:
            bufs[k].copy_(new[k])
        graph.replay()
        torch.cuda.synchronize()
        c = {k: _cpu(new[k]) for k in ("x", "z", "dy")}
        w, b = kw["weight"].cpu(), kw["bias"].cpu()
        ey, er = ref.rms_norm_gated(c["x"], w, b, c["z"], 1e-5, 512, False)
        want = (ey, *ref.rms_norm_gated_bwd(c["dy"], c["x"], w, b, c["z"], er, 1e-5, 512, False))
        for name, got, exp in zip(("y", "dx", "dweight", "dbias", "dz"), outs, want):
            assert rel_err(got, exp) <= TOL[exp.dtype], f"replay {seed} {name}: {rel_err(got, exp):.3e}"


def test_compile_fullgraph():
    """torch.compile(fullgraph=True) of the public function, forward and backward, on the kernels."""
    kw = make_inputs(option="gate_after_bias")
    leaves = [kw[k].detach().clone().requires_grad_(True) for k in ("x", "weight", "z", "bias")]

    def fn(x, weight, z, bias):
        return m2ops.rms_norm_gated(x, weight, z=z, bias=bias, group_size=kw["group_size"])

    got = torch.compile(fn, fullgraph=True)(*leaves)
    want = fn(*leaves)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    g_got = torch.autograd.grad(got, leaves, kw["dy"])
    g_want = torch.autograd.grad(want, leaves, kw["dy"])
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
