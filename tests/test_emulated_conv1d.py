"""The causal convolution's kernels (m2ops/kernels/conv.py: forward, backward, decode update) on the emulator
against the reference (m2ops/reference/conv1d.py).

The kernels' own code on the CPU through tests/tile_emulator.py: what that catches and misses, in
tests/emulated_cases.py. Skipped when cuda.tile is not installed. Tolerances: normwise relative error (rel_err),
as the GPU tests (tests/gpu/test_conv1d_kernel.py): both sides compute in float32, so outputs in x's dtype differ
by the summation order and, for 16-bit outputs, by a last-place rounding now and then; the weight and bias
gradients are float32 sums over every token in another order.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("cuda.tile", reason="cuda.tile (cuda-tile) is not installed")
pytestmark = pytest.mark.slow  # outside the quick subset (-m "not slow")

from emulated_cases import SWEEP, rel_err  # noqa: E402  (puts tests/gpu on sys.path)
from tile_emulator import emulated_kernels  # noqa: E402

from m2ops.kernels import conv  # noqa: E402
from m2ops.reference import conv1d as ref  # noqa: E402

TOL = {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
SUM_TOL = 5e-5  # float32 sums over tokens (g_weight, g_bias, g_initial_states)
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def same_layout(a, b):
    """Equal strides over the dimensions longer than one (the others' strides do not matter)."""
    return a.shape == b.shape and all(sa == sb for sa, sb, n in zip(a.stride(), b.stride(), a.shape) if n > 1)


def _layout(t, how):
    if how == "contig":
        return t.contiguous()
    if how == "channel_last":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    b, c, L = t.shape  # "slice": channel-last inside a wider buffer (the input projection's output)
    big = torch.zeros(b, L, c + 16, dtype=t.dtype)
    big[:, :, 8:8 + c] = t.transpose(1, 2)
    return big[:, :, 8:8 + c].transpose(1, 2)


@st.composite
def conv_cases(draw):
    W = draw(st.sampled_from([2, 3, 4]))
    return dict(dtype=draw(st.sampled_from(DTYPES)), W=W, b=draw(st.integers(1, 2)),
                c=draw(st.sampled_from([1, 7, 128, 130, 260])), L=draw(st.one_of(st.integers(1, 40), st.integers(41, 150))),
                how=draw(st.sampled_from(["channel_last", "slice", "contig"])), bias=draw(st.booleans()),
                seq=draw(st.booleans()), init=draw(st.booleans()), silu=draw(st.booleans()),
                S=draw(st.sampled_from([0, W - 1, W, 7])), sms=draw(st.sampled_from([1, 3, 132])),
                seed=draw(st.integers(0, 2 ** 16)))


def make(case):
    g = torch.Generator().manual_seed(case["seed"])
    b, c, L, W, dtype = case["b"], case["c"], case["L"], case["W"], case["dtype"]
    x = _layout(torch.randn(b, c, L, generator=g).to(dtype), case["how"])
    weight = torch.randn(c, W, generator=g) / W ** 0.5
    bias = torch.randn(c, generator=g) if case["bias"] else None
    seq = None
    if case["seq"]:
        seq = torch.cumsum((torch.rand(b, L, generator=g) < 0.08).long(), 1) + torch.randint(0, 2, (b, 1), generator=g)
    init = torch.randn(b, c, W - 1, generator=g) if case["init"] else None
    return x, weight, bias, seq, init


@given(case=conv_cases())
@SWEEP
def test_forward(case):
    x, weight, bias, seq, init = make(case)
    args = (x, weight, bias, seq, init, case["silu"], case["S"])
    want_y, want_final = ref.causal_conv1d(*args)
    with emulated_kernels(sm_count=case["sms"]):
        y, final = conv.causal_conv1d(*args)
    assert y.dtype == x.dtype and same_layout(y, want_y)
    assert final.shape == want_final.shape and final.dtype == x.dtype and final.is_contiguous()
    assert rel_err(y, want_y) <= TOL[x.dtype]
    assert torch.equal(final, want_final)  # copies of the inputs


@given(case=conv_cases())
@SWEEP
def test_backward(case):
    x, weight, bias, seq, init = make(case)
    g = torch.Generator().manual_seed(case["seed"] + 1)
    b, c, L = x.shape
    g_y = _layout(torch.randn(b, c, L, generator=g).to(x.dtype), case["how"])
    g_final = torch.randn(b, c, case["S"], generator=g).to(x.dtype)
    args = (g_y, g_final, x, weight, bias, seq, init, case["silu"])
    want = ref.causal_conv1d_bwd(*args)
    with emulated_kernels(sm_count=case["sms"]):
        got = conv.causal_conv1d_bwd(*args)
    for name, a, e, tol in zip(("g_x", "g_weight", "g_bias", "g_initial_states"), got, want,
                               (TOL[x.dtype], SUM_TOL, SUM_TOL, SUM_TOL)):
        assert a.dtype == e.dtype and same_layout(a, e), name
        assert rel_err(a, e) <= tol, (name, rel_err(a, e))


@given(dtype=st.sampled_from(DTYPES), state_f32=st.booleans(), W=st.sampled_from([2, 3, 4]), extra=st.integers(0, 4),
       b=st.integers(1, 3), c=st.sampled_from([5, 128, 200]), indexed=st.booleans(), bias=st.booleans(),
       silu=st.booleans(), params_like_x=st.booleans(), seed=st.integers(0, 2 ** 16))
@SWEEP
def test_update(dtype, state_f32, W, extra, b, c, indexed, bias, silu, params_like_x, seed):
    """params_like_x: weight and bias in x's dtype, which the kernel reads as they are (no conversion)."""
    g = torch.Generator().manual_seed(seed)
    S = min(W - 1 + extra, 8)
    state_dtype = torch.float32 if state_f32 else dtype
    slots = b + 2 if indexed else b
    x = torch.randn(b, c, generator=g).to(dtype)
    state = torch.randn(slots, c, S, generator=g).to(state_dtype)
    weight, bb = torch.randn(c, W, generator=g), torch.randn(c, generator=g) if bias else None
    if params_like_x:
        weight, bb = weight.to(dtype), (bb.to(dtype) if bb is not None else None)
    idx = None
    if indexed:
        idx = torch.randperm(slots, generator=g)[:b].to(torch.int32)
        idx[-1] = -1
    want_state, got_state = state.clone(), state.clone()
    want = ref.causal_conv1d_update(x, want_state, weight, bb, silu, idx)
    with emulated_kernels():
        got = conv.causal_conv1d_update(x, got_state, weight, bb, silu, idx)
    assert got.dtype == dtype and rel_err(got, want) <= TOL[dtype]
    assert torch.equal(got_state, want_state)
