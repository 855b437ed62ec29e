"""The cuTile kernels against the reference (m2ops.reference.chunked in float32 on the same inputs).

Every test is marked gpu and skipped without a CUDA GPU, or where the kernels cannot run (the reason is
shown). Tolerances are in gpu_cases.py with their derivation. Hypothesis sweeps are derandomized and do
not shrink (each new combination of dtype, chunk size, seq_idx and array alignment JIT-compiles kernels, a
few seconds each; a failure prints its example). M2OPS_GPU_EXAMPLES (default 20) sets the examples per sweep:
on an H200 the whole file took about 4.5 minutes with 8.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from knobs import knobs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_cases import (CHUNK_SIZES, DTYPES, STRIDE_CLASSES, TOL, captured, kernels_or_reason, make_case,  # noqa: E402
                       poison_allocator, public_call, reference_forward, rel_err, sweep_settings)

import m2ops  # noqa: E402


kernels, _reason = kernels_or_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(kernels is None, reason=str(_reason))]

SWEEP = sweep_settings(20)


def _check(out, expected, kind, dtype, what):
    err = rel_err(out, expected)
    assert err <= TOL[kind][dtype], f"{what}: relative error {err:.3e} > {TOL[kind][dtype]:.0e}"


@st.composite
def cases(draw, varlen_ok=False):
    dtype = draw(st.sampled_from(DTYPES))
    chunk = draw(st.sampled_from(CHUNK_SIZES))
    nheads = draw(st.sampled_from([1, 2, 4, 6]))
    ngroups = draw(st.sampled_from([g for g in (1, 2, 3, 6) if nheads % g == 0]))
    seqlen = draw(st.one_of(st.integers(1, 40), st.integers(41, 700)))
    varlen = varlen_ok and seqlen >= 2 and draw(st.booleans())
    batch = 1 if varlen else draw(st.integers(1, 2))
    kw = dict(
        dtype=dtype, chunk_size=chunk, batch=batch, seqlen=seqlen, nheads=nheads, ngroups=ngroups,
        headdim=draw(st.sampled_from([4, 16, 64, 80, 128])),
        dstate=draw(st.sampled_from([8, 16, 64, 100, 128, 256, 300, 512])),
        dt_softplus=draw(st.booleans()), dt_bias=draw(st.booleans()),
        dt_limit=draw(st.sampled_from([(0.0, float("inf")), (0.002, 0.3)])),
        D=draw(st.sampled_from([None, "h", "hp"])), z=draw(st.booleans()),
        initial_states=draw(st.booleans()),
        seq_idx=(not varlen) and draw(st.booleans()), cu_seqlens=varlen, nseqs=draw(st.integers(1, 8)),
        noncontig=draw(st.booleans()), seed=draw(st.integers(0, 2 ** 16)),
        dt_dtype=draw(st.sampled_from([None, torch.float32])),
    )
    return kw


# ---- unit tests: one op at a time, on the reference's intermediates ----

@given(cases())
@SWEEP
def test_chunk_cumsum(kw):
    case = make_case(**kw)
    y_ref, _, _, mid = reference_forward(case)
    lo, hi = case["dt_limit"]
    poison_allocator()
    dt_out, cs = kernels.chunk_cumsum(case["dt"], case["A"], case["dt_bias"], case["chunk_size"],
                                      case["dt_softplus"], float(lo), float(hi))
    assert dt_out.shape == mid["dt_out"].shape and dt_out.dtype == torch.float32
    _check(dt_out, mid["dt_out"], "cumsum", case["x"].dtype, "dt_out")
    _check(cs, mid["dA_cumsum"], "cumsum", case["x"].dtype, "dA_cumsum")


@given(cases(varlen_ok=True))
@SWEEP
def test_fwd_pass_state(kw):
    case = make_case(**kw)
    varlen = case["cu_seqlens"] is not None
    _, fin_ref, var_ref, mid = reference_forward(case, return_varlen=varlen)
    poison_allocator()
    st_, fin, var = kernels.fwd_pass_state(case["x"], case["B"], mid["dt_out"], mid["dA_cumsum"],
                                           case["initial_states"], case["seq_idx"],
                                           case["cu_seqlens"] if varlen else None)
    dtype = case["x"].dtype
    assert st_.shape == mid["states"].shape and var.shape == var_ref.shape
    _check(st_, mid["states"], "states", dtype, "states")
    _check(fin, fin_ref, "states", dtype, "final_states")
    _check(var, var_ref, "states", dtype, "varlen_states")


@given(cases())
@SWEEP
def test_compute_out(kw):
    case = make_case(**kw)
    y_ref, _, _, mid = reference_forward(case)
    poison_allocator()
    y = kernels.compute_out(case["x"], mid["dt_out"], mid["dA_cumsum"], case["C"], case["B"], mid["states"],
                            case["D"], case["z"], case["seq_idx"])
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype and y.is_contiguous()
    _check(y, y_ref, "y", case["x"].dtype, "y")


@given(cases(), st.sampled_from([None, True, False]))
@SWEEP
def test_chunk_scan(kw, path):
    """The chunk_scan op on the reference's intermediates, through the launcher's choice (None), the fused
    segment kernels forced where they can run (True; dstate <= 128, chunk >= 64) or the two-op kernels
    forced (False)."""
    from m2ops.kernels import config
    case = make_case(**kw)
    y_ref, fin_ref, _, mid = reference_forward(case)
    poison_allocator()
    with config.override(segments=path):
        y, fin = kernels.chunk_scan(case["x"], mid["dt_out"], mid["dA_cumsum"], case["B"], case["C"],
                                    case["initial_states"], case["D"], case["z"], case["seq_idx"])
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype and y.is_contiguous()
    _check(y, y_ref, "y", case["x"].dtype, "y")
    _check(fin, fin_ref, "states", case["x"].dtype, "final_states")


# ---- the public function end to end ----

@given(cases(varlen_ok=True))
@SWEEP
def test_public_function(kw):
    case = make_case(**kw)
    varlen = case["cu_seqlens"] is not None
    y_ref, fin_ref, var_ref, _ = reference_forward(case, return_varlen=varlen)
    poison_allocator()
    out = public_call(case, return_final_states=True, return_varlen_states=varlen)
    dtype = case["x"].dtype
    _check(out[0], y_ref, "y", dtype, "y")
    _check(out[1], fin_ref, "states", dtype, "final_states")
    if varlen:
        _check(out[2], var_ref, "states", dtype, "varlen_states")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk_size", [16, 64, 256])
@pytest.mark.parametrize("seed", [0, 1])
def test_varlen_random_boundaries(dtype, chunk_size, seed):
    """Many short and long packed sequences, boundaries anywhere (inside chunks, on chunk edges)."""
    case = make_case(dtype=dtype, chunk_size=chunk_size, seqlen=1000 + 37 * seed, nheads=4, ngroups=2,
                     headdim=64, dstate=64, cu_seqlens=True, nseqs=3 + 20 * seed, seed=seed, D="h", z=True,
                     initial_states=True)
    y_ref, fin_ref, var_ref, _ = reference_forward(case, return_varlen=True)
    poison_allocator()
    y, fin, var = public_call(case, return_final_states=True, return_varlen_states=True)
    _check(y, y_ref, "y", dtype, "y")
    _check(fin, fin_ref, "states", dtype, "final_states")
    _check(var, var_ref, "states", dtype, "varlen_states")
    # The last sequence's final state is the final state.
    assert rel_err(var[-1], fin[0]) < 1e-6


def test_mixed_dtypes_promote():
    """x bf16 with B, C float32 and z float16: computed in float32, y returned in bf16."""
    case = make_case(dtype=torch.bfloat16, chunk_size=64, seqlen=150, headdim=64, dstate=64, z=True, D="h")
    case["B"], case["C"], case["z"] = case["B"].float(), case["C"].float(), case["z"].half()
    y_ref, fin_ref, _, _ = reference_forward(case)
    y, fin = public_call(case)
    assert y.dtype == torch.bfloat16
    _check(y, y_ref, "y", torch.bfloat16, "y")
    _check(fin, fin_ref, "states", torch.float32, "final_states")


@pytest.mark.parametrize("kw", [dict(dtype=torch.float64), dict(chunk_size=48), dict(chunk_size=512)])
def test_reference_fallbacks(kw):
    """float64 inputs and chunk sizes without kernels run the reference: same values exactly."""
    case = make_case(seqlen=130, **kw)
    y_ref, fin_ref, _, _ = reference_forward(case)
    y, fin = public_call(case)
    assert torch.equal(y, y_ref) and torch.equal(fin, fin_ref)


# ---- each stride class of the hinted builds, named ----

# cuTile builds a kernel per divisibility class of its arrays' strides, and the launchers build some kernels with
# an occupancy hint (specialise._OCCUPANCY): one such build of state_update computed wrong values only where a
# partial row tile met 200-byte state rows (headdim 50, dstate 100; docs/history.md v28), a class the
# sweeps above reach only by chance at a few examples. These run each of gpu_cases.STRIDE_CLASSES through the
# public function in the dtypes and chunk sizes whose builds carry hints: bfloat16 at 256 (its own entries) and
# float16 at 64.


@pytest.mark.parametrize("dtype,chunk_size", [(torch.bfloat16, 256), (torch.float16, 64)])
@pytest.mark.parametrize("headdim,dstate", STRIDE_CLASSES)
def test_stride_classes_of_hinted_builds(dtype, chunk_size, headdim, dstate):
    case = make_case(dtype=dtype, chunk_size=chunk_size, batch=2, seqlen=600, nheads=4, ngroups=2, headdim=headdim,
                     dstate=dstate, D="hp", z=True, initial_states=True, dt_bias=True, seed=headdim * 1000 + dstate)
    y_ref, fin_ref, _, _ = reference_forward(case)
    poison_allocator()
    y, fin = public_call(case)
    _check(y, y_ref, "y", dtype, "y")
    _check(fin, fin_ref, "states", dtype, "final_states")


# ---- 64-bit offsets: the protocol's largest shape ----

def test_256k_tokens_dstate_512_split_in_halves():
    """B=1, T=256K, H=80, P=64, G=1, N=512, bf16: the chunk states alone hold 2.7e9 > 2^31 elements. The final
    state of the whole sequence must equal that of its second half seeded with the first half's final state,
    and the second half's y must equal the whole run's (the whole run reads states past 2^31 elements)."""
    T, H, P, N, L = 262144, 80, 64, 512, 256
    torch.manual_seed(0)
    dev = "cuda"
    x = torch.randn(1, T, H, P, device=dev, dtype=torch.bfloat16)
    dt = torch.rand(1, T, H, device=dev) * 2 - 3
    A = -torch.rand(H, device=dev) * 2 - 0.1
    Bm = (torch.randn(1, T, 1, N, device=dev) * N ** -0.25).to(torch.bfloat16)
    Cm = (torch.randn(1, T, 1, N, device=dev) * N ** -0.25).to(torch.bfloat16)
    D = torch.randn(H, device=dev)
    bias = torch.rand(H, device=dev) - 1
    kw = dict(chunk_size=L, D=D, dt_bias=bias, dt_softplus=True, return_final_states=True)
    assert 1 * (T // L) * H * P * N > 2 ** 31

    y, fin = m2ops.mamba_chunk_scan_combined(x, dt, A, Bm, Cm, **kw)
    h = T // 2
    y1, fin1 = m2ops.mamba_chunk_scan_combined(x[:, :h], dt[:, :h], A, Bm[:, :h], Cm[:, :h], **kw)
    y2, fin2 = m2ops.mamba_chunk_scan_combined(x[:, h:], dt[:, h:], A, Bm[:, h:], Cm[:, h:], **kw,
                                               initial_states=fin1)
    assert torch.isfinite(fin).all() and fin.abs().max() > 0
    assert rel_err(fin2, fin) < 1e-5, rel_err(fin2, fin)
    assert rel_err(y1, y[:, :h]) < 1e-5
    assert rel_err(y2, y[:, h:]) < 1e-3, rel_err(y2, y[:, h:])  # bf16 y; the states agree to fp32 rounding


# ---- CUDA graphs and torch.compile ----

def _graph_case(seed):
    return make_case(dtype=torch.bfloat16, chunk_size=64, batch=2, seqlen=300, nheads=4, ngroups=2, headdim=64,
                     dstate=64, D="hp", z=True, initial_states=True, seq_idx=True, seed=seed)


def test_cuda_graph_capture_matches_eager():
    case = _graph_case(0)
    eager = public_call(case)                     # also compiles the kernels, outside the capture
    torch.cuda.synchronize()
    g, static_out = captured(lambda: public_call(case))
    g.replay()
    torch.cuda.synchronize()
    for a, b in zip(static_out, eager):
        assert torch.equal(a, b)
    # New values in the captured inputs: the replay computes them.
    fresh = _graph_case(1)
    for k in ("x", "dt", "B", "C", "z", "initial_states"):
        case[k].copy_(fresh[k])
    g.replay()
    expected = public_call(case)
    torch.cuda.synchronize()
    for a, b in zip(static_out, expected):
        assert torch.equal(a, b)


def test_torch_compile_reduce_overhead_matches_eager():
    torch._dynamo.reset()
    case = _graph_case(2)
    args = {k: v for k, v in case.items()}

    def f(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx):
        return m2ops.mamba_chunk_scan_combined(x, dt, A, B, C, 64, D=D, z=z, dt_bias=dt_bias,
                                               initial_states=initial_states, seq_idx=seq_idx, dt_softplus=True,
                                               return_final_states=True)

    call_args = [args[k] for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states", "seq_idx")]
    eager = f(*call_args)
    compiled = torch.compile(f, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):                            # warm-up, recording, replay
        out = [t.clone() for t in compiled(*call_args)]
    torch.cuda.synchronize()
    for a, b in zip(out, eager):
        assert torch.equal(a, b)
    torch._dynamo.reset()


@pytest.mark.parametrize("seqlen,dstate,walk", [(4096, 64, False), (1024, 256, True), (300, 32, False),
                                                (1000, 128, True), (1024, 512, True)])
def test_fused_cumsum_gives_the_same_results(monkeypatch, seqlen, dstate, walk):
    """config.current().fused_cumsum (chunk_cb's programs and chunk_cumsum's work in chunk_state's launch), planned forward,
    against the separate launches, eager and replayed from a CUDA graph, ten calls each. A missing dependency
    between the fused launch and the kernels after it, or the next call's launch overwriting the scratch early,
    shows as calls that differ from each other or from the separate launches (tests/test_emulated_plans.py
    checks the arithmetic, not the ordering). The fused launch forms the same cumulative sums in another kernel,
    so its bits may differ in the last place."""
    from m2ops.kernels import planned
    knobs(monkeypatch, out_carry=False if walk else None)
    # against the separate launches, the fusion at any length (by default it serves short sequences only)
    knobs(monkeypatch, fused_cumsum=False)
    knobs(monkeypatch, fused_cumsum_max_chunks=1 << 30)
    case = make_case(seqlen=seqlen, nheads=8, headdim=64, ngroups=2, dstate=dstate, dtype=torch.bfloat16,
                     D="h", z=True, initial_states=True, chunk_size=256, seed=seqlen, dt_dtype=torch.float32)
    with torch.no_grad():
        want = public_call(case)
        knobs(monkeypatch, fused_cumsum=True)
        got = [public_call(case) for _ in range(10)]
        g, static_out = captured(lambda: public_call(case))
        replays = []
        for _ in range(10):
            g.replay()
            replays.append(tuple(t.clone() for t in static_out))
    torch.cuda.synchronize()
    assert any(fp.out is not None and fp.states.fused_cumsum for fp in planned.FORWARD_PLANS.values())
    for out in got + replays:
        for a, b, c in zip(out, want, got[0]):
            assert torch.equal(a, c)
            assert rel_err(a, b) <= 1e-5
