"""m2ops.mamba_chunk_scan_combined_varlen (packed 3-D serving form) on the CPU: against the float64 token loop,
out=, state_dtype, the state cache (scatter by slot, start states gathered by has_initial_state), prepare_varlen
(no value reads in the call), validation (errors name the argument, nothing written), and docs/serving.md's
worked example."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import m2ops
from conftest import TOL, Dims, assert_close_rel, make_inputs
from m2ops import mamba_chunk_scan_combined_varlen, prepare_varlen
from m2ops.meta import validate
from m2ops.reference.naive import naive_scan

ROOT = pathlib.Path(__file__).resolve().parents[1]


def packed(seed=0, T=29, nseqs=4, dims=Dims(1, 29, 4, 3, 2, 5), dtype=torch.float64, **kw):
    """make_inputs for batch 1 with the batch dimension dropped (the packed form), plus cu_seqlens."""
    inp = make_inputs(dims.but(seqlen=T), dtype=dtype, seed=seed, cu_seqlens=True, nseqs=nseqs,
                      index_dtype=torch.int32, **kw)
    for k in ("x", "dt", "B", "C", "z"):
        if inp[k] is not None:
            inp[k] = inp[k][0]
    inp.pop("seq_idx")
    inp.pop("initial_states")
    return inp


def naive(inp, starts=None, **flags):
    """naive_scan on packed inputs: (y (T, h, p), varlen states)."""
    kw = {k: (v[None] if k in ("x", "dt", "B", "C", "z") and v is not None else v) for k, v in inp.items()}
    y, _, varlen = naive_scan(**kw, initial_states=starts, **flags)
    return y[0], varlen


def call(inp, chunk_size=8, **kw):
    args = {k: v for k, v in inp.items() if k not in ("x", "dt", "A", "B", "C", "cu_seqlens")}
    return mamba_chunk_scan_combined_varlen(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk_size,
                                            inp["cu_seqlens"], **args, **kw)


def random_starts(inp, seed=9, dtype=None):
    nseq = inp["cu_seqlens"].shape[0] - 1
    _, h, p = inp["x"].shape
    n = inp["B"].shape[-1]
    g = torch.Generator().manual_seed(seed)
    return torch.randn(nseq, h, p, n, generator=g, dtype=torch.float64).to(dtype or inp["dt"].dtype)


@settings(max_examples=40)
@given(st.integers(1, 60), st.integers(1, 8), st.sampled_from([4, 8, 16]), st.booleans(), st.booleans(),
       st.sampled_from([torch.float64, torch.float32, torch.bfloat16]), st.integers(0, 2**31 - 1))
def test_against_naive(T, nseqs, chunk, with_starts, z, dtype, seed):
    inp = packed(seed, T, nseqs, dtype=dtype, z=z, D="h", dt_bias=True, param_dtype=torch.float32
                 if dtype == torch.bfloat16 else dtype)
    starts = random_starts(inp, seed) if with_starts else None
    y, varlen = call(inp, chunk, initial_states=starts, dt_softplus=True)
    y_ref, varlen_ref = naive(inp, starts, dt_softplus=True)
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    assert y.shape == inp["x"].shape and y.dtype == dtype and varlen.dtype == sdt
    assert_close_rel(y, y_ref, TOL[dtype], "y")
    assert_close_rel(varlen, varlen_ref, TOL[sdt], "varlen_states")


def test_out_and_state_dtype():
    inp = packed(1, dtype=torch.float32)
    starts = random_starts(inp)
    out = torch.full_like(inp["x"], float("nan"))
    y, varlen = call(inp, initial_states=starts, out=out, state_dtype=torch.bfloat16)
    assert y is out and varlen.dtype == torch.bfloat16
    y_ref, varlen_ref = naive(inp, starts)
    assert_close_rel(out, y_ref, TOL[torch.float32], "out")
    assert_close_rel(varlen, varlen_ref, TOL[torch.bfloat16], "varlen_states")


def test_state_cache_scatter_and_gather():
    """Final states land in their slots (other rows untouched); has_initial_state reads the start states from the
    same slots, zero where False."""
    inp = packed(2)
    nseq = inp["cu_seqlens"].shape[0] - 1
    cache = torch.randn(nseq + 3, *random_starts(inp).shape[1:], dtype=torch.float32)
    before = cache.clone()
    slots = torch.randperm(nseq + 3)[:nseq]
    has = torch.arange(nseq) % 2 == 0
    y, varlen = call(inp, state_cache=cache, state_slots=slots, has_initial_state=has)
    starts = before[slots].double() * has[:, None, None, None]
    y_ref, varlen_ref = naive(inp, starts)
    assert_close_rel(y, y_ref, TOL[torch.float64], "y")
    assert_close_rel(varlen, varlen_ref, TOL[torch.float64], "varlen_states")
    torch.testing.assert_close(cache[slots], varlen.float())
    others = torch.ones(nseq + 3, dtype=torch.bool)
    others[slots] = False
    assert torch.equal(cache[others], before[others])


def test_has_initial_state_masks_given_states():
    inp = packed(3)
    starts = random_starts(inp)
    has = torch.zeros(starts.shape[0], dtype=torch.bool)
    has[-1] = True
    y, varlen = call(inp, initial_states=starts, has_initial_state=has)
    y_ref, varlen_ref = naive(inp, starts * has[:, None, None, None])
    assert_close_rel(y, y_ref, TOL[torch.float64], "y")
    assert_close_rel(varlen, varlen_ref, TOL[torch.float64], "varlen_states")


def test_meta_call_reads_no_values(monkeypatch):
    """With a VarlenMeta the call checks no values (those read tensors on the host) and gives the same results."""
    inp = packed(4, dtype=torch.float32)
    starts = random_starts(inp)
    meta = prepare_varlen(inp["cu_seqlens"], 8)
    assert meta.num_sequences == inp["cu_seqlens"].shape[0] - 1 and meta.total_tokens == inp["x"].shape[0]
    want = call(inp, initial_states=starts)

    def no_reads(*args, **kwargs):
        raise AssertionError("a value check ran")
    from m2ops import scan_varlen
    monkeypatch.setattr(scan_varlen, "check_cu_seqlens_values", no_reads)
    monkeypatch.setattr(validate, "check_values", no_reads)
    got = call(inp, initial_states=starts, meta=meta)
    got_without_cu = mamba_chunk_scan_combined_varlen(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 8, None,
                                                      initial_states=starts, meta=meta)
    for a, b in zip(want, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(want, got_without_cu):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_prepare_varlen_checks_values():
    with pytest.raises(ValueError, match="cu_seqlens.*strictly increasing"):
        prepare_varlen(torch.tensor([0, 5, 5, 9]), 8)
    with pytest.raises(ValueError, match="cu_seqlens.*strictly increasing"):
        prepare_varlen([1, 5], 8)
    with pytest.raises(ValueError, match="chunk_size"):
        prepare_varlen([0, 5], 0)


def test_matches_the_batch_form():
    """The packed call is mamba_chunk_scan_combined on the batch-1 views with return_varlen_states."""
    inp = packed(5, z=True, D="hp")
    starts = random_starts(inp)
    y, varlen = call(inp, initial_states=starts)
    y4, varlen4 = m2ops.mamba_chunk_scan_combined(inp["x"][None], inp["dt"][None], inp["A"], inp["B"][None],
                                                  inp["C"][None], 8, D=inp["D"], z=inp["z"][None],
                                                  initial_states=starts, cu_seqlens=inp["cu_seqlens"],
                                                  return_varlen_states=True)
    torch.testing.assert_close(y, y4[0], rtol=0, atol=0)
    torch.testing.assert_close(varlen, varlen4, rtol=0, atol=0)


def test_gradcheck_start_states():
    inp = packed(6, T=11, nseqs=3, dims=Dims(1, 11, 2, 2, 1, 3))
    starts = random_starts(inp).requires_grad_(True)
    x = inp["x"].clone().requires_grad_(True)

    def fn(x, s):
        return call({**inp, "x": x}, 4, initial_states=s)
    assert torch.autograd.gradcheck(fn, (x, starts), eps=1e-6, atol=1e-6, rtol=1e-5)


# ---- validation: the error names the argument, and nothing is written ----

def _bad_cases(inp, nseq, cache, slots, h, p, n):
    T = inp["x"].shape[0]
    f64 = torch.float64
    return {
        "x": dict(x=inp["x"][None]),
        "dt": dict(dt=inp["dt"][:-1]),
        "B": dict(B=inp["B"][None]),
        "C": dict(C=inp["C"][:, :1]),
        "z": dict(z=torch.zeros(T, h, p + 1, dtype=f64)),
        "cu_seqlens": dict(cu_seqlens=torch.tensor([0, 3, T + 1], dtype=torch.int32)),
        "cu_seqlens ": dict(cu_seqlens=inp["cu_seqlens"].float()),
        "initial_states": dict(initial_states=torch.zeros(nseq + 1, h, p, n, dtype=f64)),
        "initial_states ": dict(initial_states=torch.zeros(nseq, h, p, n, dtype=torch.int32)),
        "out": dict(out=torch.zeros(T, h, p + 1, dtype=f64)),
        "out ": dict(out=torch.zeros(T, h, p, dtype=torch.float32)),
        "out  ": dict(out=torch.zeros(1, 1, 1, dtype=f64).expand(T, h, p)),
        "state_dtype": dict(state_dtype=torch.int8),
        "state_slots": dict(state_cache=cache, state_slots=torch.tensor([0] * (nseq - 1) + [cache.shape[0]])),
        "state_slots ": dict(state_cache=cache, state_slots=torch.tensor([-1] + list(slots[1:]))),
        "state_slots  ": dict(state_cache=cache, state_slots=torch.zeros(nseq, dtype=torch.int64)),
        "state_slots   ": dict(state_cache=cache, state_slots=slots[:-1]),
        "state_slots    ": dict(state_cache=cache, state_slots=slots.float()),
        "state_slots     ": dict(state_cache=cache),
        "state_cache": dict(state_cache=cache[:, :, :, :-1], state_slots=slots),
        "state_cache ": dict(state_slots=slots),
        "has_initial_state": dict(has_initial_state=torch.ones(nseq, dtype=torch.bool)),
        "has_initial_state ": dict(state_cache=cache, state_slots=slots, has_initial_state=torch.ones(nseq)),
        "meta": dict(meta=prepare_varlen([0, T - 1], 8)),
        "meta ": dict(meta=object()),
        "A": dict(A=inp["A"][:-1]),
        "dt_limit": dict(dt_limit=(1.0, 0.5)),
    }


def test_validation_names_the_argument_and_writes_nothing():
    inp = packed(7)
    T, h, p = inp["x"].shape
    n = inp["B"].shape[-1]
    nseq = inp["cu_seqlens"].shape[0] - 1
    cache = torch.randn(nseq + 2, h, p, n)
    slots = torch.arange(nseq)
    out = torch.full_like(inp["x"], 7.0)
    for name, bad in _bad_cases(inp, nseq, cache, slots, h, p, n).items():
        before = cache.clone()
        kw = {"out": out, **bad} if name.strip() != "out" else bad
        with pytest.raises((TypeError, ValueError), match=name.strip()) as info:
            call({**inp, **{k: v for k, v in kw.items() if k in inp}}, **{k: v for k, v in kw.items()
                                                                           if k not in inp})
        assert name.strip() in str(info.value), (name, info.value)
        assert torch.equal(cache, before), name
        assert bool((out == 7.0).all()), name


def test_device_mismatch_is_named():
    inp = packed(8)
    meta_dev = torch.device("meta")
    with pytest.raises(ValueError, match="initial_states"):
        call(inp, initial_states=random_starts(inp).to(meta_dev))


# ---- docs/serving.md's worked example runs ----

def test_serving_example_runs():
    text = (ROOT / "docs" / "serving.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "docs/serving.md has no python example"
    exec(compile(blocks[0], "docs/serving.md", "exec"), {"__name__": "serving_example"})
