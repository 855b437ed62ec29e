"""States at block boundaries for prefix caching (prepare_varlen(..., block_size, context_lens) and
mamba_chunk_scan_combined_varlen(..., return_block_states=True)) on the CPU: against a float64 token loop, against
the scan's own final state of each prefix, and the validation of the new arguments."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import TOL, Dims, assert_close_rel, make_inputs
from m2ops import mamba_chunk_scan_combined_varlen, prepare_varlen


def packed(seed, T, nseqs, dtype=torch.float64, **kw):
    inp = make_inputs(Dims(1, T, 4, 3, 2, 5), dtype=dtype, seed=seed, cu_seqlens=True, nseqs=nseqs,
                      index_dtype=torch.int32, D="h", dt_bias=True,
                      param_dtype=torch.float32 if dtype == torch.bfloat16 else dtype, **kw)
    for k in ("x", "dt", "B", "C"):
        inp[k] = inp[k][0]
    return inp


def token_loop(inp, starts, context, block, dt_softplus=True):
    """{(sequence, position): state} at every multiple of block in float64, token by token."""
    f = torch.float64
    x, dt, A, B = (inp[k].to(f) for k in ("x", "dt", "A", "B"))
    dt = dt + inp["dt_bias"].to(f)
    if dt_softplus:
        dt = torch.where(dt <= 20.0, F.softplus(dt), dt)
    h = x.shape[1]
    heads_of = torch.arange(h) // (h // B.shape[1])
    cu = inp["cu_seqlens"].tolist()
    out = {}
    for k in range(len(cu) - 1):
        state = starts[k].to(f).clone() if starts is not None else torch.zeros(h, x.shape[2], B.shape[2], dtype=f)
        for i, t in enumerate(range(cu[k], cu[k + 1])):
            state = torch.exp(dt[t] * A)[:, None, None] * state + (dt[t, :, None] * x[t])[..., None] * B[t, heads_of][:, None]
            if (context[k] + i + 1) % block == 0:
                out[(k, context[k] + i + 1)] = state.clone()
    return out


def call(inp, chunk, meta, **kw):
    return mamba_chunk_scan_combined_varlen(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk, inp["cu_seqlens"],
                                            D=inp["D"], dt_bias=inp["dt_bias"], dt_softplus=True, meta=meta,
                                            return_block_states=True, **kw)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 70), st.integers(1, 6), st.sampled_from([1, 3, 8, 16]), st.sampled_from([8, 16]),
       st.booleans(), st.sampled_from([torch.float64, torch.float32, torch.bfloat16]), st.data())
def test_against_token_loop(T, nseqs, block, chunk, with_starts, dtype, data):
    inp = packed(data.draw(st.integers(0, 2**31 - 1)), T, nseqs, dtype)
    n = inp["cu_seqlens"].shape[0] - 1
    context = data.draw(st.lists(st.integers(0, 40), min_size=n, max_size=n))
    g = torch.Generator().manual_seed(3)
    starts = torch.randn(n, 4, 3, 5, generator=g, dtype=torch.float64).to(dtype) if with_starts else None
    meta = prepare_varlen(inp["cu_seqlens"], chunk, block_size=block, context_lens=context)
    y, final, blocks = call(inp, chunk, meta, initial_states=starts)
    want = token_loop(inp, starts, context, block)
    got = {(int(k), int(p)): s for k, p, s in zip(meta.blocks.sequence, meta.blocks.position, blocks)}
    assert sorted(got) == sorted(want)
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    assert blocks.dtype == sdt and blocks.shape[1:] == (4, 3, 5)
    for key in want:
        assert_close_rel(got[key], want[key], TOL[sdt], f"block state {key}")


def test_equals_final_state_of_the_prefix():
    """A boundary's state is what a later request sharing that prefix starts from: the final state of the scan
    over the prefix alone."""
    inp = packed(5, 60, 3)
    cu = inp["cu_seqlens"].tolist()
    starts = torch.randn(3, 4, 3, 5, dtype=torch.float64)
    meta = prepare_varlen(inp["cu_seqlens"], 16, block_size=8, context_lens=[3, 0, 11])
    _, _, blocks = call(inp, 16, meta, initial_states=starts)
    assert blocks.shape[0] == meta.blocks.sequence.shape[0] > 0
    for k, P, state in zip(meta.blocks.sequence.tolist(), meta.blocks.position.tolist(), blocks):
        c = [3, 0, 11][k]
        lo, hi = cu[k], cu[k] + (P - c)
        sub = {key: inp[key][lo:hi] for key in ("x", "dt", "B", "C")}
        _, final = mamba_chunk_scan_combined_varlen(sub["x"], sub["dt"], inp["A"], sub["B"], sub["C"], 16,
                                                    torch.tensor([0, hi - lo], dtype=torch.int32), D=inp["D"],
                                                    dt_bias=inp["dt_bias"], dt_softplus=True,
                                                    initial_states=starts[k:k + 1])
        assert_close_rel(state, final[0], 1e-10, f"sequence {k} at {P}")


def test_state_dtype_cache_start_and_gradients():
    inp = packed(2, 40, 2, dtype=torch.float32)
    cache = torch.randn(5, 4, 3, 5)
    slots = torch.tensor([4, 1])
    meta = prepare_varlen(inp["cu_seqlens"], 16, block_size=5)
    x = inp["x"].clone().requires_grad_()
    _, _, blocks = mamba_chunk_scan_combined_varlen(
        x, inp["dt"], inp["A"], inp["B"], inp["C"], 16, inp["cu_seqlens"], dt_bias=inp["dt_bias"],
        dt_softplus=True, state_cache=cache.clone(), state_slots=slots, has_initial_state=torch.tensor([True, False]),
        state_dtype=torch.bfloat16, meta=meta, return_block_states=True)
    assert blocks.dtype == torch.bfloat16
    starts = torch.stack([cache[4], torch.zeros(4, 3, 5)])
    want = token_loop(inp, starts, [0, 0], 5)
    got = {(int(k), int(p)): s for k, p, s in zip(meta.blocks.sequence, meta.blocks.position, blocks)}
    for key in want:
        assert_close_rel(got[key].float(), want[key], 1e-2, f"block state {key}")
    blocks.float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_no_boundaries():
    inp = packed(1, 12, 2)
    meta = prepare_varlen(inp["cu_seqlens"], 16, block_size=64)
    _, _, blocks = call(inp, 16, meta)
    assert blocks.shape == (0, 4, 3, 5) and meta.blocks.sequence.numel() == 0


@pytest.mark.parametrize("kw, kind, words", [
    (dict(block_size=0), ValueError, "block_size must be None or a positive int"),
    (dict(block_size=True), ValueError, "block_size must be None or a positive int"),
    (dict(context_lens=[0, 0]), ValueError, "context_lens needs block_size"),
    (dict(block_size=4, context_lens=[0]), ValueError, "context_lens must be of shape (num_sequences,) = (2,)"),
    (dict(block_size=4, context_lens=[0, -1]), ValueError, "context_lens must be >= 0"),
    (dict(block_size=4, context_lens=[0.5, 1.0]), TypeError, "context_lens must hold integers"),
])
def test_prepare_errors(kw, kind, words):
    with pytest.raises(kind, match=words.replace("(", r"\(").replace(")", r"\)")):
        prepare_varlen(torch.tensor([0, 5, 9], dtype=torch.int32), 8, **kw)


def test_return_block_states_needs_blocks():
    inp = packed(1, 12, 2)
    out = torch.full_like(inp["x"], float("nan"))
    for meta in (None, prepare_varlen(inp["cu_seqlens"], 16)):
        with pytest.raises(ValueError, match="return_block_states needs meta"):
            call(inp, 16, meta, out=out)
        assert torch.isnan(out).all()  # nothing written
