"""The context-parallel scan's math in one process: every rank simulated on a slice of one sequence.

m2ops.distributed.scan.summarise and scan_from are the code a rank runs before and after the gather; here the
gather is a torch.stack of every slice's summary (its backward, like the gather's reduce-scatter, sums the
gradients each simulated rank sends back to a summary). The slices are views of whole-sequence leaves, so the
gradients of all simulated ranks accumulate into the whole inputs' .grad: they must equal the plain one-process
call's, and the concatenated y its y. No process group, so hypothesis can draw many cuts, ids and options; the
spawned-process tests (test_distributed_scan.py) cover the collectives themselves.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import Dims, make_inputs, max_rel_err, seq_idx_from_starts
from m2ops import mamba_chunk_scan_combined
from m2ops.distributed.scan import scan_from, summarise

SLICED = ("x", "dt", "B", "C", "z", "seq_idx")
FLOAT_INPUTS = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


def simulated(inputs, cuts, chunk_size, **flags):
    """(y of the whole sequence, [final state as each simulated rank returns it])."""
    def piece(q):
        lo, hi = cuts[q], cuts[q + 1]
        return {k: (v[:, lo:hi] if k in SLICED and v is not None else v) for k, v in inputs.items()}

    ranks = range(len(cuts) - 1)
    rows = torch.stack([summarise(**{k: v for k, v in piece(q).items() if k not in ("D", "initial_states")},
                                  chunk_size=chunk_size, **flags) for q in ranks])
    ys, finals = [], []
    for r in ranks:
        y, final = scan_from(rows, r, **piece(r), chunk_size=chunk_size, **flags, return_final_states=True)
        ys.append(y)
        finals.append(final)
    return torch.cat(ys, dim=1), finals


def _leaves(inputs):
    return {k: (v.detach().clone().requires_grad_(k in FLOAT_INPUTS) if v is not None else None)
            for k, v in inputs.items()}


def _grads(inputs, y, final, seed=1):
    """Gradients of the float inputs for fixed random cotangents of y and the final state."""
    gen = torch.Generator().manual_seed(seed)
    g_y = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(y.device, y.dtype)
    g_f = torch.randn(final.shape, generator=gen, dtype=torch.float64).to(final.device, final.dtype)
    keys = [k for k in FLOAT_INPUTS if inputs.get(k) is not None]
    return dict(zip(keys, torch.autograd.grad((y * g_y).sum() + (final * g_f).sum(), [inputs[k] for k in keys])))


@st.composite
def split_calls(draw):
    """Whole-sequence inputs (float64), the cut points of 1-5 ranks (empty slices allowed) and the flags."""
    world = draw(st.integers(1, 5))
    T = draw(st.integers(max(world, 2), 40))
    cuts = [0] + sorted(draw(st.lists(st.integers(0, T), min_size=world - 1, max_size=world - 1))) + [T]
    g = draw(st.sampled_from((1, 2)))
    dims = Dims(batch=draw(st.integers(1, 2)), seqlen=T, nheads=2 * g, headdim=draw(st.sampled_from((3, 4))),
                ngroups=g, dstate=draw(st.sampled_from((5, 8))))
    flags = {}
    if draw(st.booleans()):
        flags["dt_softplus"] = True
    if draw(st.booleans()):
        flags["dt_limit"] = (0.01, 1.0)
    inputs = make_inputs(dims, seed=draw(st.integers(0, 999)), D=draw(st.sampled_from((None, "h", "hp"))),
                         z=draw(st.booleans()), dt_bias=draw(st.booleans()), initial_states=draw(st.booleans()),
                         dt_softplus=flags.get("dt_softplus", False))
    inputs.pop("cu_seqlens")
    if draw(st.booleans()):  # packed sequences, with starts drawn near the cuts too (boundaries on a rank edge)
        rng = random.Random(draw(st.integers(0, 999)))
        rows = []
        for _ in range(dims.batch):
            candidates = sorted({c for c in cuts[1:-1] if 0 < c < T} | {rng.randrange(1, T) for _ in range(3)})
            starts = [0] + sorted(rng.sample(candidates, rng.randint(0, len(candidates))))
            ids = [rng.choice((0, 0, 1))]
            for _ in starts[1:]:
                ids.append(ids[-1] + rng.choice((1, 2)))
            rows.append(seq_idx_from_starts(starts, T, ids))
        inputs["seq_idx"] = torch.stack(rows)
    return inputs, cuts, draw(st.sampled_from((4, 8, 16))), flags


@settings(max_examples=60)
@given(split_calls())
def test_simulated_ranks_equal_the_plain_call(call):
    inputs, cuts, chunk, flags = call
    full, split = _leaves(inputs), _leaves(inputs)
    y, final = mamba_chunk_scan_combined(**full, chunk_size=chunk, **flags, return_final_states=True)
    y_cp, finals = simulated(split, cuts, chunk, **flags)
    assert max_rel_err(y_cp, y) <= 1e-10
    for f in finals:
        assert torch.equal(f, finals[0]), "ranks fold to different final states"
    assert max_rel_err(finals[0], final) <= 1e-10
    want = _grads(full, y, final)
    # Each simulated rank returns the final state: its gradient enters through one of them (the last).
    got = _grads(split, y_cp, finals[-1])
    for k in want:
        assert max_rel_err(got[k], want[k]) <= 1e-10, k


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_simulated_ranks_on_the_gpu(dtype):
    """On an H100 with the kernels: each rank's summary through the ops' CUDA implementations, the scan from the
    entering state through the plain call. The split call must be as close to a float64 reference as the plain
    GPU call is (both against the plain call in float64 on the CPU, on the same rounded inputs)."""
    T = 8192
    cuts = (0, 1000, 4096, 4097, 6000, T)
    inputs = make_inputs(Dims(batch=1, seqlen=T, nheads=16, headdim=64, ngroups=2, dstate=128), dtype=dtype,
                         param_dtype=torch.float32, D="h", z=True, dt_bias=True, initial_states=True,
                         dt_softplus=True, seq_idx=True, nseqs=6, device="cuda")
    inputs.pop("cu_seqlens")
    flags = dict(dt_softplus=True)
    ref = _leaves({k: (v.detach().cpu().double() if v is not None and v.is_floating_point() else
                       (v.cpu() if v is not None else None)) for k, v in inputs.items()})
    y_ref, f_ref = mamba_chunk_scan_combined(**ref, chunk_size=256, **flags, return_final_states=True)
    g_ref = _grads(ref, y_ref, f_ref)

    plain = _leaves(inputs)
    y_p, f_p = mamba_chunk_scan_combined(**plain, chunk_size=256, **flags, return_final_states=True)
    g_p = _grads(plain, y_p, f_p)
    split = _leaves(inputs)
    y_s, finals = simulated(split, cuts, 256, **flags)
    g_s = _grads(split, y_s, finals[-1])

    def err(a, b):
        return ((a.detach().double().cpu() - b.detach()).norm() / b.detach().norm()).item()

    floor = {torch.bfloat16: 5e-3, torch.float32: 1e-4}[dtype]
    for name, got, plain_out, expected in [("y", y_s, y_p, y_ref), ("final", finals[-1], f_p, f_ref)] + [
            (f"grad {k}", g_s[k], g_p[k], g_ref[k]) for k in g_ref]:
        assert err(got, expected) <= 2 * err(plain_out, expected) + floor, (
            f"{name}: split {err(got, expected):.2e}, plain {err(plain_out, expected):.2e}")
