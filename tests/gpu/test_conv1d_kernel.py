"""The causal convolution's cuTile kernels (m2ops/kernels/conv.py: forward, backward, decode update) against
m2ops.reference.conv1d run on the CPU on the same (already rounded) inputs.

    python -m pytest -q -m gpu tests/gpu/test_conv1d_kernel.py

Every test is marked gpu and skipped without a CUDA GPU or where the cuTile kernels cannot run (the reason is
shown). Both sides compute in float32, so what is measured is the kernels' own error: the summation order of the
taps and of the weight and bias gradients over tokens, the SiLU's ex2.approx and div.full, and for 16-bit outputs a
last-place rounding now and then. Tolerances (normwise relative error, gpu_cases.rel_err): outputs in x's dtype
2e-5 (float32), 1e-3 (float16), 8e-3 (bfloat16); the float32 gradient sums 5e-5. A wrong tap, halo, mask or
tile gives errors of order 1e-1; outputs the kernels fail to write are NaN (poisoned allocator) and give inf.

Layouts: the layer's x is a transposed view of a slice of the input projection's (batch, seqlen, d_in_proj)
output (channels contiguous, token stride d_in_proj, base offset inside the buffer): "slice" below; also a
plain channel-last tensor and a contiguous (batch, channels, seqlen) one (copied by the launcher).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_cases import captured, kernels_or_reason, poison_allocator, rel_err, sweep_settings  # noqa: E402

from m2ops.reference import conv1d as ref  # noqa: E402

_kernels, _reason = kernels_or_reason()
if _kernels is not None:
    from m2ops.kernels import conv
else:
    conv = None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(conv is None, reason=str(_reason))]

SWEEP = sweep_settings(30)
TOL = {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
SUM_TOL = 5e-5
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _layout(t, how):
    """t (batch, channels, seqlen) on the GPU in another layout with the same values."""
    if how == "contig":
        return t.contiguous()
    if how == "channel_last":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    b, c, L = t.shape  # "slice": columns [offset, offset + c) of a (batch, seqlen, 2c + 88) projection output
    big = torch.randn(b, L, 2 * c + 88, dtype=t.dtype, device=t.device)
    big[:, :, c + 40:2 * c + 40] = t.transpose(1, 2)
    return big[:, :, c + 40:2 * c + 40].transpose(1, 2)


def _inputs(*, dtype, W, b, c, L, how, bias, seq, init, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, c, L, generator=g).to(dtype)
    weight = torch.randn(c, W, generator=g) / W ** 0.5
    bb = torch.randn(c, generator=g) if bias else None
    sq = torch.cumsum((torch.rand(b, L, generator=g) < 0.05).long(), 1) if seq else None
    init_s = torch.randn(b, c, W - 1, generator=g) if init else None
    cpu = (x, weight, bb, sq, init_s)
    gpu = (_layout(x.cuda(), how), weight.cuda(), *(None if t is None else t.cuda() for t in (bb, sq, init_s)))
    return cpu, gpu


@st.composite
def cases(draw):
    W = draw(st.sampled_from([2, 3, 4]))
    return dict(dtype=draw(st.sampled_from(DTYPES)), W=W, b=draw(st.integers(1, 3)),
                c=draw(st.sampled_from([1, 100, 128, 1000, 2304])), L=draw(st.sampled_from([1, 3, 31, 32, 33, 500, 2049])),
                how=draw(st.sampled_from(["slice", "channel_last", "contig"])), bias=draw(st.booleans()),
                seq=draw(st.booleans()), init=draw(st.booleans()), silu=draw(st.booleans()),
                S=draw(st.sampled_from([0, W - 1, W, 6])), seed=draw(st.integers(0, 2 ** 16)))


def _case_inputs(case):
    keys = ("dtype", "W", "b", "c", "L", "how", "bias", "seq", "init", "seed")
    return _inputs(**{k: case[k] for k in keys})


@given(case=cases())
@SWEEP
def test_forward(case):
    cpu, gpu = _case_inputs(case)
    want_y, want_final = ref.causal_conv1d(*cpu, case["silu"], case["S"])
    poison_allocator()
    y, final = conv.causal_conv1d(*gpu, case["silu"], case["S"])
    torch.cuda.synchronize()
    assert y.transpose(1, 2).is_contiguous() and final.is_contiguous()
    assert rel_err(y.cpu(), want_y) <= TOL[case["dtype"]]
    assert torch.equal(final.cpu(), want_final)


@given(case=cases())
@SWEEP
def test_backward(case):
    cpu, gpu = _case_inputs(case)
    g = torch.Generator().manual_seed(case["seed"] + 1)
    b, c, L = cpu[0].shape
    g_y = torch.randn(b, c, L, generator=g).to(case["dtype"])
    g_final = torch.randn(b, c, case["S"], generator=g).to(case["dtype"])
    want = ref.causal_conv1d_bwd(g_y, g_final, *cpu, case["silu"])
    poison_allocator()
    got = conv.causal_conv1d_bwd(_layout(g_y.cuda(), case["how"]), g_final.cuda(), *gpu, case["silu"])
    torch.cuda.synchronize()
    for name, a, e, tol in zip(("g_x", "g_weight", "g_bias", "g_initial_states"), got, want,
                               (TOL[case["dtype"]], SUM_TOL, SUM_TOL, SUM_TOL)):
        assert a.shape == e.shape and a.dtype == e.dtype, name
        assert rel_err(a.cpu(), e) <= tol, (name, rel_err(a.cpu(), e))


@given(dtype=st.sampled_from(DTYPES), state_f32=st.booleans(), W=st.sampled_from([2, 3, 4]), extra=st.integers(0, 5),
       b=st.sampled_from([1, 2, 7, 64]), c=st.sampled_from([5, 128, 2304]), indexed=st.booleans(),
       bias=st.booleans(), silu=st.booleans(), seed=st.integers(0, 2 ** 16))
@SWEEP
def test_update(dtype, state_f32, W, extra, b, c, indexed, bias, silu, seed):
    g = torch.Generator().manual_seed(seed)
    S = min(W - 1 + extra, 8)
    state_dtype = torch.float32 if state_f32 else dtype
    slots = 2 * b + 1 if indexed else b
    x = torch.randn(b, c, generator=g).to(dtype)
    state = torch.randn(slots, c, S, generator=g).to(state_dtype)
    weight, bb = torch.randn(c, W, generator=g), torch.randn(c, generator=g) if bias else None
    idx = None
    if indexed:
        idx = torch.randperm(slots, generator=g)[:b].to(torch.int32)
        idx[::3] = -1  # skipped rows
    want_state = state.clone()
    want = ref.causal_conv1d_update(x, want_state, weight, bb, silu, idx)
    got_state = state.cuda()
    y = conv.causal_conv1d_update(x.cuda(), got_state, weight.cuda(), None if bb is None else bb.cuda(), silu,
                                  None if idx is None else idx.cuda())
    torch.cuda.synchronize()
    assert rel_err(y.cpu(), want) <= TOL[dtype]
    assert torch.equal(got_state.cpu(), want_state)  # named slots moved on, the others untouched


def test_layer_shape_through_the_public_function():
    """The Mamba-2 layer's call at a real size (d_model 2560: conv_dim 5376, width 4, SiLU, bfloat16, x a slice of
    the projection's output) forward and backward through m2ops.causal_conv1d_fn on CUDA, against the reference."""
    import m2ops
    cpu, gpu = _inputs(dtype=torch.bfloat16, W=4, b=2, c=5376, L=1024, how="slice", bias=True, seq=False, init=False,
                       seed=5)
    x = gpu[0].detach().requires_grad_(True)
    w, bb = gpu[1].clone().requires_grad_(True), gpu[2].clone().requires_grad_(True)
    y, final = m2ops.causal_conv1d_fn(x, w, bb, activation="silu", return_final_states=True, state_len=4)
    g = torch.Generator().manual_seed(6)
    g_y = torch.randn(y.shape, generator=g).to(y.dtype)
    y.backward(g_y.cuda())
    want_y, want_final = ref.causal_conv1d(*cpu, True, 4)
    want = ref.causal_conv1d_bwd(g_y, torch.zeros(2, 5376, 4, dtype=y.dtype), *cpu, True)
    assert rel_err(y.detach().cpu(), want_y) <= TOL[torch.bfloat16]
    assert torch.equal(final.cpu(), want_final)
    assert rel_err(x.grad.cpu(), want[0]) <= TOL[torch.bfloat16]
    assert rel_err(w.grad.cpu(), want[1]) <= SUM_TOL and rel_err(bb.grad.cpu(), want[2]) <= SUM_TOL


def test_cuda_graph_capture():
    """Forward and decode update replay under CUDA graphs (no host synchronisation, nothing tensor-valued on the
    host), the update writing its cache on every replay."""
    cpu, gpu = _inputs(dtype=torch.bfloat16, W=4, b=2, c=300, L=70, how="slice", bias=True, seq=True, init=True,
                       seed=7)
    state = torch.randn(4, 300, 4, device="cuda")
    idx = torch.tensor([3, 1], dtype=torch.int32, device="cuda")
    x1 = torch.randn(2, 300, device="cuda", dtype=torch.bfloat16)
    start = state.clone()

    def step():
        y, final = conv.causal_conv1d(*gpu, True, 4)
        return y, final, conv.causal_conv1d_update(x1, state, gpu[1], gpu[2], True, idx)

    graph, out = captured(step)
    state.copy_(start)
    graph.replay()
    torch.cuda.synchronize()
    want_y, want_final = ref.causal_conv1d(*cpu, True, 4)
    want_state = start.cpu()
    want_u = ref.causal_conv1d_update(x1.cpu(), want_state, cpu[1], cpu[2], True, idx.cpu())
    assert rel_err(out[0].cpu(), want_y) <= TOL[torch.bfloat16]
    assert torch.equal(out[1].cpu(), want_final)
    assert rel_err(out[2].cpu(), want_u) <= TOL[torch.bfloat16]
    assert torch.equal(state.cpu(), want_state)
