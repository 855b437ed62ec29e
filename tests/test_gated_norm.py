"""The gated RMSNorm (m2ops.rms_norm_gated, m2ops::rms_norm_gated and its backward op) on the CPU: the reference
against a float64 loop, its backward formulas against autograd, property tests over shapes, dtypes, layouts and
options, the ops' registrations (opcheck), gradcheck, torch.compile, and input errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import m2ops
from conftest import TOL, assert_close_rel
from m2ops.meta.gated_norm import KERNEL_NORM_MAX_GROUP
from m2ops.reference import gated_norm as ref

OPTIONS = {  # name: (z given, bias given, norm_before_gate)
    "plain": (False, False, True),
    "bias": (False, True, True),
    "gate_after": (True, False, True),
    "gate_after_bias": (True, True, True),
    "gate_before": (True, False, False),
    "gate_before_bias": (True, True, False),
}


def naive(x, weight, bias, z, eps, group_size, norm_before_gate):
    """Row by row, group by group, in float64: the definition written as plainly as possible."""
    xs = x.detach().double().reshape(-1, x.shape[-1])
    zs = None if z is None else z.detach().double().reshape(-1, x.shape[-1])
    w = weight.detach().double()
    b = None if bias is None else bias.detach().double()
    out = torch.empty_like(xs)
    for i in range(xs.shape[0]):
        for g0 in range(0, xs.shape[1], group_size):
            sl = slice(g0, g0 + group_size)
            h = xs[i, sl]
            s = None if zs is None else zs[i, sl] / (1 + torch.exp(-zs[i, sl]))
            if s is not None and not norm_before_gate:
                h = h * s
            o = h / math.sqrt(float((h * h).sum()) / group_size + eps) * w[sl]
            if b is not None:
                o = o + b[sl]
            if s is not None and norm_before_gate:
                o = o * s
            out[i, sl] = o
    return out.reshape(x.shape)


def inputs(shape=(3, 5, 24), group_size=8, dtype=torch.float32, z=True, bias=True, seed=0, z_layout="contig",
           param_dtype=torch.float32, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)

    def randn(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    hidden = shape[-1]
    x = randn(*shape).to(dtype)
    zt = None
    if z:
        zt = (randn(*shape) * 2).to(dtype)
        if z_layout == "slice":  # a slice of a wider projection output, as the layer's z
            big = torch.zeros(*shape[:-1], 2 * hidden + 5, dtype=dtype)
            zt = big[..., 3:3 + hidden].copy_(zt)
        elif z_layout == "transposed" and len(shape) >= 2:
            zt = zt.transpose(-1, -2).contiguous().transpose(-1, -2)
    w = (1 + 0.5 * randn(hidden)).to(param_dtype)
    b = (0.3 * randn(hidden)).to(param_dtype) if bias else None
    out = dict(x=x, weight=w, z=zt, bias=b)
    if requires_grad:
        for k, v in out.items():
            if v is not None:
                out[k] = v.detach().requires_grad_(True)
    return out


def call(inp, eps=1e-5, group_size=8, norm_before_gate=True):
    return m2ops.rms_norm_gated(inp["x"], inp["weight"], z=inp["z"], bias=inp["bias"], eps=eps,
                                group_size=group_size, norm_before_gate=norm_before_gate)


# ---- the reference against the float64 loop ----

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("opt", OPTIONS)
def test_matches_naive(opt, dtype):
    z, bias, nbg = OPTIONS[opt]
    inp = inputs(dtype=dtype, z=z, bias=bias)
    y = call(inp, norm_before_gate=nbg)
    assert y.dtype == dtype and y.shape == inp["x"].shape and y.is_contiguous()
    assert_close_rel(y, naive(inp["x"], inp["weight"], inp["bias"], inp["z"], 1e-5, 8, nbg), TOL[dtype], "y")


def test_rstd_and_one_group_default():
    inp = inputs(shape=(4, 12), z=False, bias=False)
    y, rstd = torch.ops.m2ops.rms_norm_gated(inp["x"], inp["weight"], None, None, 1e-3, 4, True)
    assert rstd.shape == (3, 4) and rstd.dtype == torch.float32
    want = torch.rsqrt(inp["x"].view(4, 3, 4).square().mean(-1) + 1e-3).t()
    torch.testing.assert_close(rstd, want)
    # group_size None is one group of hidden
    torch.testing.assert_close(m2ops.rms_norm_gated(inp["x"], inp["weight"]), call(inp, group_size=12))


def test_equals_the_layers_norm():
    """What m2ops.Mamba2 computes today (layer.RMSNormGated), bit for bit, in both gate positions."""
    from m2ops.layer import RMSNormGated
    for nbg in (True, False):
        norm = RMSNormGated(24, eps=1e-5, group_size=8, norm_before_gate=nbg)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(24))
        inp = inputs(dtype=torch.bfloat16, bias=False)
        torch.testing.assert_close(call({**inp, "weight": norm.weight}, norm_before_gate=nbg),
                                   norm(inp["x"], inp["z"]), rtol=0, atol=0)


# ---- backward formulas ----

@pytest.mark.parametrize("opt", OPTIONS)
@pytest.mark.parametrize("group_size", [1, 8, 24])
def test_backward_formulas_match_autograd(opt, group_size):
    z, bias, nbg = OPTIONS[opt]
    inp = inputs(dtype=torch.float64, z=z, bias=bias, requires_grad=True, seed=group_size)
    y, rstd = ref.rms_norm_gated(inp["x"], inp["weight"], inp["bias"], inp["z"], 1e-5, group_size, nbg)
    dy = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    leaves = [inp[k] for k in ("x", "weight", "bias", "z") if inp[k] is not None]
    want = torch.autograd.grad(y, leaves, dy)
    got = ref.rms_norm_gated_bwd(dy, *(inp[k].detach() if inp[k] is not None else None
                                       for k in ("x", "weight", "bias", "z")), rstd.detach(), 1e-5, group_size, nbg)
    got = [g for g, k in zip(got, ("x", "weight", "bias", "z")) if inp[k] is not None]
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert_close_rel(g, w, 1e-12, "gradient")


@pytest.mark.parametrize("opt", OPTIONS)
def test_gradcheck_float64(opt):
    z, bias, nbg = OPTIONS[opt]
    inp = inputs(shape=(2, 3, 8), dtype=torch.float64, z=z, bias=bias, param_dtype=torch.float64,
                 requires_grad=True, z_layout="slice" if z else "contig")
    names = [k for k, v in inp.items() if v is not None]

    def fn(*tensors):
        kw = dict(zip(names, tensors))
        return m2ops.rms_norm_gated(kw["x"], kw["weight"], z=kw.get("z"), bias=kw.get("bias"), group_size=4,
                                    norm_before_gate=nbg)

    assert torch.autograd.gradcheck(fn, tuple(inp[k] for k in names))


def test_backward_through_the_op_float32():
    """Autograd of the public function: the gradients of the explicit formulas, in the inputs' dtypes (a float32
    weight with bfloat16 activations, as under autocast)."""
    inp = inputs(dtype=torch.bfloat16, requires_grad=True, z_layout="slice")
    y = call(inp, norm_before_gate=False)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(y.dtype)
    y.backward(dy)
    _, rstd = ref.rms_norm_gated(inp["x"], inp["weight"], inp["bias"], inp["z"], 1e-5, 8, False)
    want = ref.rms_norm_gated_bwd(dy, *(inp[k].detach() for k in ("x", "weight", "bias", "z")), rstd, 1e-5, 8, False)
    for k, w in zip(("x", "weight", "bias", "z"), want):
        assert inp[k].grad.dtype == inp[k].dtype
        torch.testing.assert_close(inp[k].grad, w, rtol=0, atol=0)


# ---- properties over shapes, dtypes, layouts and options ----

@st.composite
def problems(draw):
    ngroups = draw(st.integers(1, 4))
    group_size = draw(st.sampled_from([1, 2, 3, 8, 17, 64]))
    lead = draw(st.lists(st.integers(0, 4), min_size=0, max_size=3))
    return dict(
        shape=(*lead, ngroups * group_size), group_size=group_size,
        dtype=draw(st.sampled_from([torch.float64, torch.float32, torch.float16, torch.bfloat16])),
        param_dtype=draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16])),
        z=draw(st.booleans()), bias=draw(st.booleans()), norm_before_gate=draw(st.booleans()),
        z_layout=draw(st.sampled_from(["contig", "slice", "transposed"])),
        x_strided=draw(st.booleans()), eps=draw(st.sampled_from([1e-6, 1e-5, 0.1])),
        seed=draw(st.integers(0, 2 ** 16)),
    )


@given(problems())
def test_property_matches_naive(p):
    nbg, gs, eps = p.pop("norm_before_gate"), p["group_size"], p.pop("eps")
    strided = p.pop("x_strided")
    inp = inputs(**{k: v for k, v in p.items() if k != "group_size"}, group_size=gs)
    if strided:  # every other element of a wider buffer: copied once by the launchers, read as is by the reference
        big = torch.zeros(*inp["x"].shape[:-1], 2 * inp["x"].shape[-1], dtype=inp["x"].dtype)
        inp["x"] = big[..., ::2].copy_(inp["x"])
    before = {k: v.clone() for k, v in inp.items() if v is not None}
    y = call(inp, eps=eps, group_size=gs, norm_before_gate=nbg)
    assert y.shape == inp["x"].shape and y.dtype == inp["x"].dtype and y.is_contiguous()
    assert_close_rel(y, naive(inp["x"], inp["weight"], inp["bias"], inp["z"], eps, gs, nbg), TOL[p["dtype"]], "y")
    for k, v in before.items():
        assert torch.equal(inp[k], v), f"{k} was written"


# ---- registrations ----

def _op_args(opt, dtype=torch.float32, requires_grad=False, shape=(2, 3, 16)):
    z, bias, nbg = OPTIONS[opt]
    inp = inputs(shape=shape, dtype=dtype, z=z, bias=bias, requires_grad=requires_grad,
                 z_layout="slice" if z else "contig")
    return (inp["x"], inp["weight"], inp["bias"], inp["z"], 1e-5, 8, nbg)


@pytest.mark.parametrize("opt", OPTIONS)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(opt, requires_grad):
    args = _op_args(opt, requires_grad=requires_grad)
    torch.library.opcheck(torch.ops.m2ops.rms_norm_gated.default, args)
    plain = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    y, rstd = torch.ops.m2ops.rms_norm_gated(*plain)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(0))
    torch.library.opcheck(torch.ops.m2ops.rms_norm_gated_bwd.default, (dy, *plain[:4], rstd, *plain[4:]))


def test_opcheck_bfloat16_and_empty_rows():
    torch.library.opcheck(torch.ops.m2ops.rms_norm_gated.default, _op_args("gate_before_bias", torch.bfloat16))
    args = _op_args("gate_after_bias", shape=(0, 16))
    y, rstd = torch.ops.m2ops.rms_norm_gated(*args)
    assert y.shape == (0, 16) and rstd.shape == (2, 0)
    g = torch.ops.m2ops.rms_norm_gated_bwd(y, *args[:4], rstd, *args[4:])
    assert g[0].shape == (0, 16) and torch.equal(g[1], torch.zeros(16)) and torch.equal(g[2], torch.zeros(16))


def test_bwd_op_returns_empty_for_absent_options():
    args = _op_args("plain")
    y, rstd = torch.ops.m2ops.rms_norm_gated(*args)
    g = torch.ops.m2ops.rms_norm_gated_bwd(y, *args[:4], rstd, *args[4:])
    assert g[2].numel() == 0 and g[3].numel() == 0


def test_compile_fullgraph_forward_and_backward(reset_dynamo):
    inp = inputs(requires_grad=True, z_layout="slice")

    def fn(x, weight, z, bias):
        return m2ops.rms_norm_gated(x, weight, z=z, bias=bias, group_size=8, norm_before_gate=False)

    args = (inp["x"], inp["weight"], inp["z"], inp["bias"])
    got = torch.compile(fn, fullgraph=True)(*args)
    want = fn(*args)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    g_got = torch.autograd.grad(got.square().sum(), args)
    g_want = torch.autograd.grad(want.square().sum(), args)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_large_groups_run_the_reference():
    """Groups wider than the kernels' largest tile are not offered to the kernels (ops.dispatch.cuda_impl's
    "covered")."""
    from m2ops.ops import gated_norm as op
    x = torch.zeros(1, 2 * KERNEL_NORM_MAX_GROUP)
    assert op._decides(x, None, None, None, 1e-5, KERNEL_NORM_MAX_GROUP, True)[2]
    assert not op._decides(x, None, None, None, 1e-5, 2 * KERNEL_NORM_MAX_GROUP, True)[2]
    assert not op._decides_bwd(x, x, None, None, None, None, 1e-5, 2 * KERNEL_NORM_MAX_GROUP, True)[2]


# ---- input errors ----

@pytest.mark.parametrize("name,changes,kind", [
    ("x", dict(x="x"), TypeError),
    ("x", dict(x=torch.zeros(3, 24, dtype=torch.int32)), TypeError),
    ("x", dict(x=torch.zeros(())), ValueError),
    ("x", dict(x=torch.zeros(3, 0)), ValueError),
    ("weight", dict(weight=torch.ones(23)), ValueError),
    ("weight", dict(weight=torch.ones(24, dtype=torch.int64)), TypeError),
    ("z", dict(z=torch.randn(3, 5, 23)), ValueError),
    ("z", dict(z=[1.0]), TypeError),
    ("bias", dict(bias=torch.ones(2, 12)), ValueError),
    ("bias", dict(bias=torch.ones(24, dtype=torch.bool)), TypeError),
    ("eps", dict(eps=-1.0), ValueError),
    ("eps", dict(eps=float("nan")), ValueError),
    ("eps", dict(eps="small"), TypeError),
    ("group_size", dict(group_size=5), ValueError),
    ("group_size", dict(group_size=0), ValueError),
    ("group_size", dict(group_size=8.0), TypeError),
    ("group_size", dict(group_size=True), TypeError),
    ("norm_before_gate", dict(norm_before_gate=1), TypeError),
])
def test_bad_inputs_name_the_argument(name, changes, kind):
    inp = inputs()
    kw = dict(eps=1e-5, group_size=8, norm_before_gate=True)
    for k, v in changes.items():
        (inp if k in inp else kw)[k] = v
    with pytest.raises(kind, match=rf"m2ops.rms_norm_gated: {name} must"):
        m2ops.rms_norm_gated(inp["x"], inp["weight"], z=inp["z"], bias=inp["bias"], **kw)


def test_device_mismatch_names_the_argument():
    inp = inputs()
    for name in ("weight", "z", "bias"):
        kw = dict(inp)
        kw[name] = torch.empty(inp[name].shape, device="meta")
        with pytest.raises(ValueError, match=rf"m2ops.rms_norm_gated: {name} must be on the same device as x"):
            m2ops.rms_norm_gated(kw["x"], kw["weight"], z=kw["z"], bias=kw["bias"], group_size=8)

