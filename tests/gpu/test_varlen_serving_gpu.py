"""The serving interface on a GPU: mamba_chunk_scan_combined_varlen with per-sequence start states (the kernels for
the chunk states and y, start_state_out's kernel for the start states' output term, sequence_states.py's entering
and final states' corrections in PyTorch), the state cache, out=, and the call with a VarlenMeta under a CUDA graph
and torch.compile (no host synchronisation); start_state_out's kernel alone against its reference.

    python -m pytest -q -m gpu tests/gpu/test_varlen_serving_gpu.py

Expected values: the same function on the CPU (the reference ops, float32 for non-float64 inputs) on the same
rounded inputs, so the kernels' own error is measured; tolerances are gpu_cases.TOL's (normwise), as for the
plain varlen call: the corrections add one rounding of y to x's dtype at the tokens of each sequence's first chunk.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_cases import DTYPES, TOL, captured, kernels_or_reason, poison_allocator, rel_err  # noqa: E402

import m2ops  # noqa: E402

_kernels, _reason = kernels_or_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_kernels is None, reason=str(_reason))]


def _lengths(seed, total, nseq):
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(total - 1, generator=g)[:nseq - 1].sort().values + 1
    return torch.cat([torch.tensor([0]), cuts, torch.tensor([total])]).to(torch.int32)


def _case(dtype, seed=0, total=1000, nseq=12, h=8, p=64, g=2, n=64):
    gen = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return torch.randn(*s, generator=gen) * scale
    c = dict(x=r(total, h, p).to(dtype), dt=(r(total, h) * 0.5 - 1.0), A=-torch.rand(h, generator=gen) - 0.1,
             B=r(total, g, n, scale=n ** -0.25).to(dtype), C=r(total, g, n, scale=n ** -0.25).to(dtype),
             z=r(total, h, p).to(dtype), D=r(h), dt_bias=r(h) * 0.1)
    cu = _lengths(seed, total, nseq)
    starts = r(nseq, h, p, n)
    return c, cu, starts


def _call(c, cu, chunk, **kw):
    return m2ops.mamba_chunk_scan_combined_varlen(c["x"], c["dt"], c["A"], c["B"], c["C"], chunk, cu, D=c["D"],
                                                  z=c["z"], dt_bias=c["dt_bias"], dt_softplus=True, **kw)


def _to(c, device):
    return {k: v.to(device) for k, v in c.items()}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", [64, 256])
@pytest.mark.parametrize("seed", [0, 1])
def test_start_states_against_cpu(dtype, chunk, seed):
    c, cu, starts = _case(dtype, seed, total=1000 + 300 * seed, nseq=5 + 20 * seed)
    y_ref, v_ref = _call(c, cu, chunk, initial_states=starts)
    poison_allocator()
    y, v = _call(_to(c, "cuda"), cu.cuda(), chunk, initial_states=starts.cuda())
    assert y.dtype == dtype and v.dtype == torch.float32
    assert rel_err(y, y_ref) <= TOL["y"][dtype], rel_err(y, y_ref)
    assert rel_err(v, v_ref) <= TOL["states"][dtype], rel_err(v, v_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,chunk,z", [([10, 3, 30, 1, 56, 300, 2], 64, True), ([256, 256, 1, 511], 256, False),
                                          ([70, 100, 1, 129, 64], 64, True)])
def test_start_state_out_kernel(dtype, lens, chunk, z):
    """m2ops::start_state_out's kernel (ct.gather and ct.scatter of the window's rows) against its reference on the
    CPU: sequences starting inside chunks and on their boundaries, one-token sequences, longer than a chunk."""
    from m2ops.kernels import forward
    from m2ops.reference import start_states
    gen = torch.Generator().manual_seed(len(lens))
    T, h, g, p, n = sum(lens), 8, 2, 64, 128
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    y = torch.randn(1, T, h, p, generator=gen).to(dtype)
    C = (torch.randn(1, T, g, n, generator=gen) * n ** -0.25).to(dtype)
    zt = torch.randn(1, T, h, p, generator=gen).to(dtype) if z else None
    init = torch.randn(len(lens), h, p, n, generator=gen)
    cs = (-torch.rand(1, h, -(-T // chunk), chunk, generator=gen) * 0.05).cumsum(-1)
    want = start_states.start_state_out(y, C, zt, init, cs, cu)
    poison_allocator()
    got = forward.start_state_out(*(t.cuda() if t is not None else None for t in (y, C, zt, init, cs, cu)))
    assert got.dtype == dtype and got.is_cuda
    assert rel_err(got, want) <= TOL["y"][dtype], rel_err(got, want)
    tok, inside, _, _ = start_states.windows(cu, T, chunk)
    outside = torch.ones(T, dtype=torch.bool)
    outside[tok[inside]] = False
    assert torch.equal(got.cpu()[0, outside], y[0, outside])  # nothing written outside the windows


def test_long_sequences_chunk_128_run_at_256():
    """4K+ tokens at chunk 128 run on chunks of 256 on the GPU (dispatch.run_chunk_size): the corrections follow."""
    c, cu, starts = _case(torch.bfloat16, 2, total=5000, nseq=9)
    y_ref, v_ref = _call(c, cu, 128, initial_states=starts)
    y, v = _call(_to(c, "cuda"), cu.cuda(), 128, initial_states=starts.cuda(),
                 meta=m2ops.prepare_varlen(cu, 128, device="cuda"))
    assert rel_err(y, y_ref) <= TOL["y"][torch.bfloat16]
    assert rel_err(v, v_ref) <= TOL["states"][torch.bfloat16]


def test_cache_and_out():
    c, cu, starts = _case(torch.bfloat16, 3)
    nseq = cu.shape[0] - 1
    cache = torch.randn(nseq + 4, *starts.shape[1:])
    slots = torch.randperm(nseq + 4)[:nseq]
    has = torch.arange(nseq) % 3 != 0
    cache_ref = cache.clone()
    y_ref, v_ref = _call(c, cu, 64, state_cache=cache_ref, state_slots=slots, has_initial_state=has)
    cache_gpu = cache.cuda()
    out = torch.full_like(c["x"], float("nan")).cuda()
    y, v = _call(_to(c, "cuda"), cu.cuda(), 64, state_cache=cache_gpu, state_slots=slots.cuda(),
                 has_initial_state=has.cuda(), out=out, state_dtype=torch.bfloat16)
    assert y is out and v.dtype == torch.bfloat16
    assert rel_err(out, y_ref) <= TOL["y"][torch.bfloat16]
    assert rel_err(cache_gpu, cache_ref) <= TOL["states"][torch.bfloat16]


def test_meta_call_never_synchronises_and_replays_in_a_graph():
    c, cu, starts = _case(torch.bfloat16, 4)
    nseq = cu.shape[0] - 1
    gc, cu_gpu, starts_gpu = _to(c, "cuda"), cu.cuda(), starts.cuda()
    meta = m2ops.prepare_varlen(cu, 64, device="cuda")
    cache = torch.zeros(nseq + 1, *starts.shape[1:], device="cuda")
    slots = torch.arange(1, nseq + 1, device="cuda")
    has = torch.ones(nseq, dtype=torch.bool, device="cuda")
    cache[1:] = starts_gpu
    out = torch.empty_like(gc["x"])

    def step():
        return _call(gc, cu_gpu, 64, out=out, state_cache=cache, state_slots=slots, has_initial_state=has, meta=meta)
    y_want, v_want = (t.clone() for t in step())
    cache[1:] = starts_gpu
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cache[1:] = starts_gpu
    graph, (y, v) = captured(step, warmup=1)
    cache[1:] = starts_gpu
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, y_want) and torch.equal(v, v_want)
    assert torch.equal(cache[1:], v_want)


def test_compiled_fullgraph():
    c, cu, starts = _case(torch.bfloat16, 5)
    gc, cu_gpu = _to(c, "cuda"), cu.cuda()
    meta = m2ops.prepare_varlen(cu, 64, device="cuda")
    want = _call(gc, cu_gpu, 64, initial_states=starts.cuda(), meta=meta)
    torch._dynamo.reset()
    f = torch.compile(lambda s: _call(gc, cu_gpu, 64, initial_states=s, meta=meta), fullgraph=True)
    got = f(starts.cuda())
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 1e-3


@pytest.mark.parametrize("block", [64, 100])
def test_block_states_against_cpu(block):
    """Prefix caching on the GPU (its PyTorch windows and prefix scan beside the kernels' scan) against the same
    call on the CPU, with per-sequence context before each piece, under a CUDA graph."""
    c, cu, starts = _case(torch.bfloat16, seed=3)
    context = list(range(0, 12 * 37, 37))
    meta_cpu = m2ops.prepare_varlen(cu, 64, block_size=block, context_lens=context)
    want = _call(c, cu, 64, initial_states=starts, meta=meta_cpu, return_block_states=True)
    meta = m2ops.prepare_varlen(cu, 64, "cuda", block_size=block, context_lens=context)
    g, cu_g, starts_g = _to(c, "cuda"), cu.cuda(), starts.cuda()
    got = _call(g, cu_g, 64, initial_states=starts_g, meta=meta, return_block_states=True)
    # (the case crosses many block boundaries: 10 states at block 100, more at 64)
    assert got[2].shape == want[2].shape and got[2].shape[0] >= 10
    assert rel_err(got[2], want[2]) <= TOL["states"][torch.bfloat16], rel_err(got[2], want[2])
    graph, out = captured(lambda: _call(g, cu_g, 64, initial_states=starts_g, meta=meta, return_block_states=True))
    out[2].zero_()
    graph.replay()
    assert torch.equal(out[2], got[2])
