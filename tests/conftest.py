"""Shared test helpers: random valid inputs, tolerances, hypothesis profiles and the `gpu` marker skip.

Everything here builds inputs or compares results; nothing computes the expected answer except through
m2ops.reference.naive.naive_scan (the token-by-token float64 recurrence) or an eager run.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import HealthCheck, settings

from m2ops import mamba_chunk_scan_combined
from m2ops.reference.naive import naive_scan

# ---------------------------------------------------------------------------------------------------------
# hypothesis profiles: HYPOTHESIS_PROFILE=ci|dev|thorough (ci when $CI is set, else dev)
# ---------------------------------------------------------------------------------------------------------

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
               print_blob=True)
settings.register_profile("ci", max_examples=200, derandomize=True, **_common)
settings.register_profile("dev", max_examples=300, **_common)
settings.register_profile("thorough", max_examples=3000, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


# ---------------------------------------------------------------------------------------------------------
# markers
# ---------------------------------------------------------------------------------------------------------

def pytest_collection_modifyitems(config, items):
    """Tests marked @pytest.mark.gpu are skipped where torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def reset_dynamo():
    """A clean dynamo state before and after the test (compile caches and counters)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------------------
# tolerances against the float64 naive recurrence
# ---------------------------------------------------------------------------------------------------------

# Maximum error allowed, relative to the largest magnitude of the expected tensor (max-norm relative error).
# The naive recurrence gets exactly the same (already rounded) input values in float64, so what is measured is
# the implementation's own error: float32 accumulation for every non-float64 input, plus the final rounding of
# y to x's dtype, whose unit roundoff is u = 2^-11 (fp16) and 2^-8 (bf16) of |y|. Bounds are about 2u for
# fp16/bf16 (observed over 600 generated cases: 4.6e-4 and 3.8e-3) and ~10x the worst float32 error observed
# (5.7e-6, long chunks with strong decay, where exp of differences of within-chunk cumulative sums loses
# float32 ulps of |cumsum|). States are float32 for every non-float64 input and use the float32 bound.
# float64: observed 1.7e-13; 1e-10 leaves room for cumulative sums of a few thousand.
TOL = {
    torch.float64: 1e-10,
    torch.float32: 5e-5,
    torch.float16: 1e-3,
    torch.bfloat16: 8e-3,
}


def printed_with_env(code: str, name: str, value: str | None) -> str:
    """What `python -c code` prints in a fresh interpreter whose environment has `name` set to value (unset for
    None): for settings read at import."""
    env = {k: v for k, v in os.environ.items() if k != name}
    if value is not None:
        env[name] = value
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def state_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def max_rel_err(actual, expected):
    """max |actual - expected| / max(max |expected|, 1), in float64 on the CPU."""
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    assert a.shape == e.shape, (a.shape, e.shape)
    if e.numel() == 0:
        return 0.0
    scale = max(e.abs().max().item(), 1.0)
    return (a - e).abs().max().item() / scale


def assert_close_rel(actual, expected, tol, what=""):
    assert torch.isfinite(actual.detach()).all(), f"{what}: non-finite values"
    err = max_rel_err(actual, expected)
    assert err <= tol, f"{what}: max relative error {err:.3e} > {tol:.1e}"


# ---------------------------------------------------------------------------------------------------------
# input factory
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Dims:
    batch: int = 2
    seqlen: int = 37
    nheads: int = 4
    headdim: int = 8
    ngroups: int = 2
    dstate: int = 16

    def but(self, **kw):
        return replace(self, **kw)


def random_boundaries(rng: random.Random, seqlen: int, nseqs: int) -> list[int]:
    """Sorted start positions 0 = s_0 < s_1 < ... < s_{k-1} < seqlen of nseqs (capped at seqlen) sequences."""
    nseqs = max(1, min(nseqs, seqlen))
    return [0] + sorted(rng.sample(range(1, seqlen), nseqs - 1))


def seq_idx_from_starts(starts: list[int], seqlen: int, ids: list[int] | None = None) -> torch.Tensor:
    """(seqlen,) int64: token t gets ids[k] for the sequence k it falls in (default ids 0, 1, 2, ...)."""
    ids = list(range(len(starts))) if ids is None else ids
    out = torch.empty(seqlen, dtype=torch.int64)
    for k, s in enumerate(starts):
        e = starts[k + 1] if k + 1 < len(starts) else seqlen
        out[s:e] = ids[k]
    return out


def make_inputs(dims: Dims = Dims(), *, dtype=torch.float64, param_dtype=None, seed=0, D=None, z=False,
                dt_bias=False, initial_states=False, seq_idx=False, seq_start=0, cu_seqlens=False, nseqs=3,
                index_dtype=torch.int64, dt_softplus=False, dt_large=False, decay=(0.05, 2.0),
                requires_grad=False, device="cpu"):
    """Random valid keyword inputs of mamba_chunk_scan_combined (and naive_scan), chunk_size and flags aside.

    dtype: x, B, C, z. param_dtype (default dtype): dt, A, D, dt_bias, initial_states.
    D: None, "h" for shape (nheads,) or "hp" for (nheads, headdim).
    dt: for dt_softplus, raw values in [-4, 1.5] (softplus to ~0.02..1.7); otherwise in [-0.5, 1]: a third of
        them negative, so that the default dt_limit=(0, inf) clamp zeroes them. dt_large: about a sixth of
        the entries become 20.5..30 after dt_bias (softplus is the identity there).
    A: -exp(uniform(log decay[0], log decay[1])).
    seq_idx: random sequence starts (nseqs sequences at most) per row, ids seq_start, +1 or +2, ...
    cu_seqlens (batch 1): random boundaries of nseqs sequences; with seq_idx as well, seq_idx numbers them.
    """
    b, T, h, p, g, n = dims.batch, dims.seqlen, dims.nheads, dims.headdim, dims.ngroups, dims.dstate
    param_dtype = dtype if param_dtype is None else param_dtype
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)

    def rand(*shape, lo=0.0, hi=1.0):
        return torch.rand(*shape, generator=gen, dtype=torch.float64) * (hi - lo) + lo

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    out = {}
    out["x"] = randn(b, T, h, p)
    bias = rand(h, lo=-1.0, hi=0.5) if dt_bias else None
    dt = rand(b, T, h, lo=-4.0, hi=1.5) if dt_softplus else rand(b, T, h, lo=-0.5, hi=1.0)
    if dt_large:
        big = rand(b, T, h, lo=20.5, hi=30.0) - (bias if bias is not None else 0.0)
        dt = torch.where(rand(b, T, h) < 1 / 6, big, dt)
    out["dt"] = dt
    out["A"] = -torch.exp(rand(h, lo=math.log(decay[0]), hi=math.log(decay[1])))
    out["B"] = randn(b, T, g, n, scale=n ** -0.25)
    out["C"] = randn(b, T, g, n, scale=n ** -0.25)
    out["D"] = {None: None, "h": randn(h), "hp": randn(h, p)}[D]
    out["z"] = randn(b, T, h, p) if z else None
    out["dt_bias"] = bias
    out["initial_states"] = randn(b, h, p, n) if initial_states else None

    out["seq_idx"] = None
    out["cu_seqlens"] = None
    if cu_seqlens:
        if b != 1:
            raise ValueError("cu_seqlens needs batch 1")
        starts = random_boundaries(rng, T, nseqs)
        out["cu_seqlens"] = torch.tensor(starts + [T], dtype=index_dtype)
        if seq_idx:
            out["seq_idx"] = seq_idx_from_starts(starts, T)[None].to(index_dtype)
    elif seq_idx:
        rows = []
        for _ in range(b):
            starts = random_boundaries(rng, T, rng.randint(1, nseqs))
            ids = [seq_start]
            for _ in starts[1:]:
                ids.append(ids[-1] + rng.choice((1, 1, 2)))
            rows.append(seq_idx_from_starts(starts, T, ids))
        out["seq_idx"] = torch.stack(rows).to(index_dtype)

    for k in ("x", "B", "C", "z"):
        if out[k] is not None:
            out[k] = out[k].to(dtype)
    for k in ("dt", "A", "D", "dt_bias", "initial_states"):
        if out[k] is not None:
            out[k] = out[k].to(param_dtype)
    for k, v in out.items():
        if v is not None:
            v = v.to(device)
            if requires_grad and v.is_floating_point():
                v.requires_grad_(True)
            out[k] = v
    return out


def derived_seq_idx(cu_seqlens: torch.Tensor, seqlen: int) -> torch.Tensor:
    """(1, seqlen) sequence number of every token under cu_seqlens, computed independently of m2ops."""
    starts = [int(v) for v in cu_seqlens[:-1]]
    return seq_idx_from_starts(starts, seqlen)[None]


def run_scan(inputs, chunk_size, **flags):
    """The public function on make_inputs() output."""
    return mamba_chunk_scan_combined(chunk_size=chunk_size, **inputs, **flags)


def run_naive(inputs, dt_softplus=False, dt_limit=(0.0, float("inf"))):
    """naive_scan on the same inputs: (y float64, final state, varlen states or None). With cu_seqlens and no
    seq_idx, the ids are derived here (the public function restarts the state at cu_seqlens boundaries)."""
    kw = dict(inputs)
    if kw.get("cu_seqlens") is not None and kw.get("seq_idx") is None:
        kw["seq_idx"] = derived_seq_idx(kw["cu_seqlens"], kw["x"].shape[1])
    kw = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    return naive_scan(**kw, dt_softplus=dt_softplus, dt_limit=dt_limit)


# ---------------------------------------------------------------------------------------------------------
# non-contiguous copies
# ---------------------------------------------------------------------------------------------------------

def strided_copy(t: torch.Tensor) -> torch.Tensor:
    """Same values, every dimension strided by 2 (a view into a buffer twice as large in each dimension)."""
    if t is None:
        return None
    big = torch.zeros(*(2 * s for s in t.shape), dtype=t.dtype, device=t.device)
    view = big[tuple(slice(None, None, 2) for _ in t.shape)]
    view.copy_(t)
    return view


def transposed_copy(t: torch.Tensor) -> torch.Tensor:
    """Same values, stored with the last two dimensions swapped (a transposed view); 1-d: strided_copy."""
    if t is None:
        return None
    if t.dim() < 2:
        return strided_copy(t)
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def seq_major_copy(t: torch.Tensor) -> torch.Tensor:
    """Same values, stored with dimensions 1 and 2 swapped (x as a (batch, nheads, seqlen, headdim) buffer,
    dt as (batch, nheads, seqlen)); tensors of fewer than 3 dimensions: strided_copy."""
    if t is None:
        return None
    if t.dim() < 3:
        return strided_copy(t)
    return t.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.fixture(scope="session")
def cp_results():
    """The 4 spawned CPU ranks (gloo) of test_distributed_scan.py, which also run test_distributed_layer.py's and
    test_tensor_parallel.py's cases: one spawn for the three files. Their results by rank."""
    from test_distributed_scan import WORLD, _worker, spawn_world
    return spawn_world(_worker, WORLD)
