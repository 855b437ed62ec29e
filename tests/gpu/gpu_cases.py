"""Inputs, expected values and tolerances for the kernel tests (test_kernels.py and check_kernels.py).

Expected values come from m2ops.reference.chunked run on the same (already rounded) inputs; it computes in
float32 for every non-float64 input. What the tolerances measure is therefore the kernels' own error.

Tolerances (TOL): normwise relative error ||out - ref|| / ||ref||, per output and input dtype.
- chunk_cumsum: float32 throughout, only the summation order and exp/log ulps differ: 2e-6.
- states, final and varlen states (float32 outputs): the token products w_j * B_j are rounded to the input
  dtype before the tensor-core product (as Triton implementations do), u = 2^-11 (fp16), 2^-8 (bf16);
  float32 inputs use a float32 mma. Errors average over a chunk: 2e-4 (fp32), 2e-3 (fp16), 1e-2 (bf16).
- y: also rounded to x's dtype at the end (as the reference is), and the inter-chunk product runs in tf32
  (u = 2^-11): 3e-3 (fp32, fp16), 2e-2 (bf16).
Largest errors seen on an H200 (check_kernels.py, 10 cases): cumsum 8e-8; states 7e-8 (fp32), 2.1e-4
(fp16), 1.7e-3 (bf16); y 1.4e-4 (fp32), 3.5e-4 (fp16), 2.6e-3 (bf16). A wrong index or mask gives errors
of order 1e-1 and more.
"""

from __future__ import annotations

import math
import os
import random

import torch

# The GPU tests check the launchers' default configurations and the forced paths, not a tuned choice; a tuning
# search per new shape class (and the compiles of every candidate) would multiply their run time.
os.environ.setdefault("M2OPS_AUTOTUNE", "0")

from m2ops.reference import chunked as ref

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CHUNK_SIZES = (16, 32, 64, 128, 256)
# headdim x dstate pairs that give the arrays different stride classes (cuTile builds a kernel per class): a partial
# row tile (headdim 50) or not, rows of a bfloat16 array that are whole 16-byte multiples (dstate 128) or not (100).
# The GPU tests run each by name: the sweeps reach them only by chance at a few examples (docs/history.md v28).
STRIDE_CLASSES = tuple((p, n) for p in (50, 64) for n in (100, 128))

TOL = {
    "cumsum": {torch.float16: 2e-6, torch.bfloat16: 2e-6, torch.float32: 2e-6},
    "states": {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 2e-4},
    "y": {torch.float16: 3e-3, torch.bfloat16: 2e-2, torch.float32: 3e-3},
}


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    """||out - expected|| / ||expected|| in float64 (0 for empty tensors); inf when out is not finite."""
    if expected.numel() == 0:
        return 0.0
    o = out.detach().double()
    e = expected.detach().double().to(o.device)
    if not torch.isfinite(o).all():
        return math.inf
    return ((o - e).norm() / e.norm().clamp_min(1e-30)).item()


def poison_allocator(device="cuda", nbytes=1 << 28):
    """Fill a large block with NaN and free it: the caching allocator hands it out next, so an output element
    that a kernel fails to write shows up as NaN."""
    t = torch.full((nbytes // 4,), float("nan"), dtype=torch.float32, device=device)
    del t


def make_case(*, batch=1, seqlen=100, nheads=4, headdim=16, ngroups=1, dstate=16, dtype=torch.bfloat16,
              chunk_size=64, seed=0, dt_softplus=True, dt_bias=True, dt_limit=(0.0, float("inf")),
              D=None, z=False, initial_states=False, seq_idx=False, cu_seqlens=False, nseqs=4,
              noncontig=False, dt_dtype=None, device="cuda"):
    """Keyword inputs of mamba_chunk_scan_combined plus the call flags, as one dict.

    D: None, "h" or "hp". seq_idx: random non-decreasing ids per row. cu_seqlens (batch 1): nseqs packed
    sequences at random boundaries (seq_idx then numbers them). noncontig: x, z, B, C and dt are
    transposed views (seqlen not the outer-most stride) with the same values.
    """
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    b, T, h, p, G, n = batch, seqlen, nheads, headdim, ngroups, dstate

    def randn(*s, scale=1.0):
        return torch.randn(*s, generator=g) * scale

    def rand(*s, lo=0.0, hi=1.0):
        return torch.rand(*s, generator=g) * (hi - lo) + lo

    kw = {}
    kw["x"] = randn(b, T, h, p).to(dtype)
    kw["dt"] = (rand(b, T, h, lo=-3.0, hi=1.0) if dt_softplus else rand(b, T, h, lo=0.001, hi=0.2))
    kw["dt"] = kw["dt"].to(dt_dtype or dtype)
    kw["A"] = -torch.exp(rand(h, lo=math.log(0.5), hi=math.log(8.0)))
    kw["B"] = randn(b, T, G, n, scale=n ** -0.25).to(dtype)
    kw["C"] = randn(b, T, G, n, scale=n ** -0.25).to(dtype)
    kw["D"] = {None: None, "h": randn(h), "hp": randn(h, p)}[D]
    kw["z"] = randn(b, T, h, p).to(dtype) if z else None
    kw["dt_bias"] = rand(h, lo=-2.0, hi=0.0) if dt_bias else None
    kw["initial_states"] = randn(b, h, p, n) if initial_states else None
    kw["seq_idx"] = None
    kw["cu_seqlens"] = None
    if cu_seqlens:
        assert b == 1
        k = max(1, min(nseqs, T))
        starts = [0] + sorted(rng.sample(range(1, T), k - 1))
        kw["cu_seqlens"] = torch.tensor(starts + [T], dtype=torch.int32)
        kw["seq_idx"] = ids_from_starts(starts, T)[None].to(torch.int32)
    elif seq_idx:
        rows = []
        for _ in range(b):
            k = rng.randint(1, max(1, min(nseqs, T)))
            starts = [0] + sorted(rng.sample(range(1, T), k - 1))
            first = rng.choice((0, 0, 1))  # a row may start past id 0: initial_states then never applies
            rows.append(ids_from_starts(starts, T) + first)
        kw["seq_idx"] = torch.stack(rows).to(torch.int32)
    kw = {k: (v.to(device) if v is not None else None) for k, v in kw.items()}
    if noncontig:
        for k in ("x", "z", "B", "C", "dt"):
            if kw[k] is not None:
                kw[k] = kw[k].transpose(0, 1).contiguous().transpose(0, 1)
    kw["chunk_size"] = chunk_size
    kw["dt_softplus"] = dt_softplus
    kw["dt_limit"] = dt_limit
    return kw


def ids_from_starts(starts, T):
    out = torch.empty(T, dtype=torch.int64)
    for k, s in enumerate(starts):
        out[s:(starts[k + 1] if k + 1 < len(starts) else T)] = k
    return out


def reference_forward(case, return_varlen=False):
    """The reference chain on the same inputs: (y, final_states, varlen_states, intermediates dict)."""
    dt_min, dt_max = case["dt_limit"]
    dt_out, cs = ref.chunk_cumsum(case["dt"], case["A"], case["dt_bias"], case["chunk_size"], case["dt_softplus"],
                                  float(dt_min), float(dt_max))
    states, final, varlen = ref.fwd_pass_state(case["x"], case["B"], dt_out, cs, case["initial_states"],
                                               case["seq_idx"], case["cu_seqlens"] if return_varlen else None)
    y = ref.compute_out(case["x"], dt_out, cs, case["C"], case["B"], states, case["D"], case["z"], case["seq_idx"])
    return y, final, varlen, dict(dt_out=dt_out, dA_cumsum=cs, states=states)


def captured(fn, warmup=1):
    """(graph, out): fn captured in a CUDA graph, after warmup calls on a side stream (kernels compiled and the
    allocator warmed outside the capture); out holds the graph's outputs, which each graph.replay() rewrites."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def public_call(case, return_final_states=True, return_varlen_states=False):
    from m2ops import mamba_chunk_scan_combined
    return mamba_chunk_scan_combined(**case, return_final_states=return_final_states,
                                     return_varlen_states=return_varlen_states)


def scan_case(seqlen, dstate, chunk_size, device="cuda", nheads=80):
    """The measurement scripts' case (measure/: profile_scan, variants_scan, backward_scan, host_scan, ncu_scan, ...):
    B=1, H=80 (or nheads), P=64, G=1, bfloat16 x/B/C, float32 dt, D per head, initial states."""
    case = make_case(seqlen=seqlen, nheads=nheads, headdim=64, ngroups=1, dstate=dstate, dtype=torch.bfloat16, D="h",
                     initial_states=True, chunk_size=chunk_size, device=device)
    case["dt"] = case["dt"].float()
    return case


def forward_and_backward(case):
    """(forward, both) for a case: the public call (y and the final state) without autograd, and the public call
    with the gradients of x, dt, A, B, C, D and the initial state against fixed random cotangents."""
    leaves = [case[k].requires_grad_() for k in ("x", "dt", "A", "B", "C", "D", "initial_states")]
    seeds = tuple(torch.randn_like(t) for t in public_call(case, return_final_states=True))

    def forward():
        with torch.no_grad():
            return public_call(case, return_final_states=True)

    def both():
        return torch.autograd.grad(public_call(case, return_final_states=True), leaves, seeds)

    return forward, both


def per_head_sum_scales(run, cpu_case, cotangents, leaves_r):
    """The scale against which the gradients of A and dt_bias are judged: per head, the sum of the absolute
    values of the per-token terms they add up (dt times the reverse within-chunk cumsum of g_dA_cumsum for A,
    dt's gradient for dt_bias). Where those terms cancel, the sum is far smaller than its terms, and a normwise
    error within the kernel-level tolerance in g_dA_cumsum becomes a large relative error of the sum (a float32
    case: 3e-4 in g_dA_cumsum, 9e-3 in A's gradient, alike on the H200 and the CPU emulator). The terms come
    from the reference's own chunk_cumsum_bwd, captured on a second run of the reference."""
    from m2ops.reference import chunked as ref
    from m2ops.reference import chunked_backward as ref_bwd
    exact, terms_A = ref_bwd.chunk_cumsum_bwd, []

    def capture(g_dt_out, g_dA_cumsum, dt, A, dt_bias, chunk_size, dt_softplus, dt_min, dt_max):
        d, _ = ref.chunk_cumsum(dt, A, dt_bias, chunk_size, dt_softplus, dt_min, dt_max)
        rev = g_dA_cumsum.float().flip(-1).cumsum(-1).flip(-1)
        terms_A.append((rev * d.float()).abs().sum((0, 2, 3)))
        return exact(g_dt_out, g_dA_cumsum, dt, A, dt_bias, chunk_size, dt_softplus, dt_min, dt_max)

    ref_bwd.chunk_cumsum_bwd = capture
    try:
        y, fin, _ = run(cpu_case)
        torch.autograd.backward((y, fin), cotangents)
    finally:
        ref_bwd.chunk_cumsum_bwd = exact
    scales = {"A": sum(terms_A)}
    if "dt_bias" in leaves_r:
        scales["dt_bias"] = leaves_r["dt"].grad.float().abs().sum((0, 1))
    return scales


def per_head_sum_err(got, want, scale) -> float:
    """Normwise error of a per-head sum (A's or dt_bias's gradient) relative to the larger of the sum and the
    magnitude of its terms (per_head_sum_scales); 0 when both are zero and got is too."""
    err = (got.detach().float().cpu() - want.detach().float().cpu()).norm().item()
    return err / max(want.norm().item(), scale.norm().item(), 1e-30)


def kernels_or_reason():
    """(m2ops.kernels, None) where the cuTile kernels run on the current GPU, else (None, why not)."""
    if not torch.cuda.is_available():
        return None, "needs a CUDA GPU"
    try:
        from m2ops import kernels
    except ImportError as e:
        return None, f"cuTile kernels not importable: {e}"
    reason = kernels.unavailable_reason(torch.cuda.current_device())
    return (kernels, None) if reason is None else (None, reason)


def sweep_settings(default_examples: int):
    """Hypothesis settings of the GPU sweeps: derandomized, no shrinking (each new combination of dtypes and
    alignments JIT-compiles kernels); M2OPS_GPU_EXAMPLES overrides the number of examples."""
    from hypothesis import HealthCheck, Phase, settings
    return settings(max_examples=int(os.environ.get("M2OPS_GPU_EXAMPLES", str(default_examples))), deadline=None,
                    derandomize=True, phases=[Phase.explicit, Phase.generate], print_blob=True,
                    suppress_health_check=list(HealthCheck))
