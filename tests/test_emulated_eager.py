"""The public function's direct path (m2ops/ops/eager.py: the launchers from one autograd.Function) on the
emulator: forward and gradients against the reference, kept or recomputed states, super-chunks, its profiler
names, and where it yields to the custom ops.

The kernels' own code on the CPU through tests/tile_emulator.py, against the reference: what that catches and
misses, and the tolerances, in tests/emulated_cases.py (the helpers shared by tests/test_emulated_*.py). Skipped
when cuda.tile is not installed (the kernels cannot even be imported then).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cuda.tile", reason="cuda.tile (cuda-tile) is not installed")
pytestmark = pytest.mark.slow  # minutes on a 2-core machine: outside the quick subset (-m "not slow")

from emulated_cases import BWD_TOL  # noqa: E402  (puts tests/gpu on sys.path)
from gpu_cases import TOL, make_case, per_head_sum_err, per_head_sum_scales, reference_forward, rel_err  # noqa: E402
from knobs import knobs  # noqa: E402
from tile_emulator import emulated_kernels  # noqa: E402

from m2ops.kernels import forward, scan, specialise  # noqa: E402


EAGER_LEAVES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
@pytest.mark.parametrize("opts", [
    dict(dtype=torch.bfloat16, D="hp", z=True, initial_states=True, seqlen=150),
    dict(dtype=torch.bfloat16, seq_idx=True, nseqs=3, seqlen=200, batch=2),
    dict(dtype=torch.float16, D="h", seq_idx=True, nseqs=3, dt_limit=(0.002, 0.3), dt_softplus=False, seqlen=97),
    dict(dtype=torch.float32, batch=2, dt_bias=False, z=True, seqlen=64),
])
def test_eager_path_matches_reference(opts, split, monkeypatch):
    """The public function's direct path (m2ops/ops/eager.py: the launchers from one autograd.Function, no
    custom-op layers) on the emulator: y, the final states and every input's gradient against the reference's
    autograd in float32, through the fused scan and through the two-op path (whose bfloat16 entering states
    the backward reuses for bfloat16 inputs instead of recomputing them). Tolerances: the forward's, and twice
    the backward kernels' (A's and dt_bias's relative to their per-token terms, as
    tests/gpu/test_backward_kernels.py)."""
    from m2ops import mamba_chunk_scan_combined
    from m2ops.ops import eager
    knobs(monkeypatch, segments=not split)
    case = make_case(nheads=4, ngroups=2, headdim=16, dstate=32, chunk_size=64, device="cpu", seed=11, **opts)
    gen = torch.Generator().manual_seed(11)
    recomputes = []
    real_fps = forward.fwd_pass_state

    def counted(*a, **k):
        recomputes.append(1)
        return real_fps(*a, **k)
    from m2ops import kernels
    monkeypatch.setattr(scan, "fwd_pass_state", counted)  # the forward's two-op path
    monkeypatch.setattr(kernels, "fwd_pass_state", counted)  # the eager backward's recompute

    def direct(a):
        with emulated_kernels():
            return eager.scan_combined(a["x"], a["dt"], a["A"], a["B"], a["C"], case["chunk_size"], a["D"], a["z"],
                                       a["dt_bias"], a["initial_states"], case["seq_idx"], case["dt_softplus"],
                                       *map(float, case["dt_limit"]))

    leaves = {k: case[k].detach().requires_grad_() for k in EAGER_LEAVES if case[k] is not None}
    args = {**case, **leaves}
    y, fin = direct(args)
    with emulated_kernels():
        g_y, g_fin = torch.randn(y.shape, generator=gen).to(y.dtype), torch.randn(fin.shape, generator=gen)
        forward_calls = len(recomputes)
        torch.autograd.backward((y, fin), (g_y, g_fin))
    # the backward recomputes the entering states unless the forward kept its bfloat16 copy
    assert forward_calls == int(split)
    kept = split and case["x"].dtype == torch.bfloat16
    assert len(recomputes) - forward_calls == (0 if kept else 1)
    if kept:
        # Against the recompute: out_bwd_dcdb rounds float32 states to bfloat16 itself, so every gradient but
        # those through the chunk-end carries (dt, A, dt_bias: <g_S, S> with S rounded) is the same bits.
        monkeypatch.setattr(eager, "KEEP_STATES", False)
        again = {k: case[k].detach().requires_grad_() for k in leaves}
        y2, fin2 = direct({**case, **again})
        with emulated_kernels():
            torch.autograd.backward((y2, fin2), (g_y, g_fin))
        assert torch.equal(y, y2) and torch.equal(fin, fin2)
        for name in leaves:
            if name in ("dt", "A", "dt_bias"):
                assert rel_err(leaves[name].grad, again[name].grad) <= 2e-3, name
            else:
                assert torch.equal(leaves[name].grad, again[name].grad), name
    with torch.no_grad():  # no gradient wanted: nothing kept, y the same
        y3, fin3 = direct(args)
    assert torch.equal(y3, y) and torch.equal(fin3, fin)

    cpu = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in case.items()}

    def run(c):
        lv = {k: c[k].detach().requires_grad_() for k in EAGER_LEAVES if c[k] is not None}
        yr, finr = mamba_chunk_scan_combined(**{**c, **lv}, return_final_states=True)
        return yr, finr, lv

    y_r, fin_r, leaves_r = run(cpu)
    cot = (g_y.float(), g_fin)
    torch.autograd.backward((y_r, fin_r), cot)
    dtype = case["x"].dtype
    assert y.dtype == dtype and fin.dtype == torch.float32
    assert rel_err(y, y_r) <= TOL["y"][dtype] and rel_err(fin, fin_r) <= TOL["states"][dtype]
    scales = per_head_sum_scales(run, cpu, cot, leaves_r)
    for name, leaf in leaves.items():
        got, want = leaf.grad, leaves_r[name].grad
        assert got is not None and got.dtype == leaf.dtype and got.shape == leaf.shape, name
        err = rel_err(got, want)
        if name in scales:
            err = per_head_sum_err(got, want, scales[name])
        assert err <= 2 * BWD_TOL[dtype], f"grad of {name}: {err:.3e}"


def test_eager_training_on_super_chunks(monkeypatch):
    """A training call whose chunk_scan configuration runs on chunks of 256 for the caller's 64 (the tuning
    candidate scan.SUPER_CHUNK): y and the final state within rounding of the caller's chunking, and the
    backward, which cannot reuse states kept at another chunk size, recomputes them at the caller's: every
    gradient is bit for bit that of the default configuration without kept states."""
    from m2ops.ops import eager
    case = make_case(nheads=4, ngroups=2, headdim=16, dstate=32, chunk_size=64, device="cpu", seed=5,
                     dtype=torch.bfloat16, D="h", z=True, initial_states=True, seqlen=300)
    gen = torch.Generator().manual_seed(5)
    blk = specialise.forward_state_block()
    real_configs = scan.kept_scan_configs
    cot = (torch.randn(case["x"].shape, generator=gen).to(torch.bfloat16),
           torch.randn(case["initial_states"].shape, generator=gen))

    def run(config, keep):
        monkeypatch.setattr(eager, "KEEP_STATES", keep)
        monkeypatch.setattr(scan, "kept_scan_configs",
                            (lambda *a: (config, [])) if config else real_configs)
        leaves = {k: case[k].detach().requires_grad_() for k in EAGER_LEAVES if case[k] is not None}
        a = {**case, **leaves}
        with emulated_kernels():
            y, fin = eager.scan_combined(a["x"], a["dt"], a["A"], a["B"], a["C"], 64, a["D"], a["z"], a["dt_bias"],
                                         a["initial_states"], None, True, 0.0, float("inf"))
            torch.autograd.backward((y, fin), cot)
        return y, fin, leaves

    chunks = []
    real_rechunk = scan.rechunk
    monkeypatch.setattr(scan, "rechunk", lambda dt, cs, chunk, T: chunks.append(chunk) or real_rechunk(dt, cs,
                                                                                                       chunk, T))
    y, fin, leaves = run({"path": "split", "state_block": blk, "chunk": scan.SUPER_CHUNK}, True)
    assert chunks == [scan.SUPER_CHUNK]
    y0, fin0, leaves0 = run(None, False)
    assert chunks == [scan.SUPER_CHUNK]
    assert rel_err(y, y0) <= 2e-2 and rel_err(fin, fin0) <= 2e-2  # another chunking: rounding apart
    for name in leaves:
        assert torch.equal(leaves[name].grad, leaves0[name].grad), name


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_public_call_runs_long_sequences_on_super_chunks(monkeypatch, train):
    """The public function, where the kernels serve it, runs a caller's chunk of 64 on long sequences at
    scan.SUPER_CHUNK from chunk_cumsum on (ops.dispatch.kernel_chunk_size): the same bits, y, final state and
    every gradient, as the eager path called at that chunk size, and nothing re-cut (scan.rechunk unused);
    within rounding of the reference at the caller's chunk. The threshold is lowered to this test's 300
    tokens; the CUDA path runs on CPU tensors through the emulator."""
    from m2ops import mamba_chunk_scan_combined
    from m2ops.ops import dispatch, eager
    case = make_case(nheads=4, ngroups=2, headdim=16, dstate=32, chunk_size=64, device="cpu", seed=7,
                     dtype=torch.bfloat16, D="h", z=True, initial_states=True, seqlen=300)
    knobs(monkeypatch, super_chunk_min_seqlen=300)
    monkeypatch.setattr(dispatch, "_kernels_serve", lambda device_type, index: True)
    monkeypatch.setattr(eager, "applies",  # the CUDA path on CPU tensors
                        lambda serve, x, tensors: serve and eager.context_allows(tensors))
    monkeypatch.setattr(scan, "rechunk", lambda *a: pytest.fail("rechunk ran"))
    assert dispatch.kernel_chunk_size(64, 300, case["x"].device) == scan.SUPER_CHUNK
    gen = torch.Generator().manual_seed(7)
    cot = (torch.randn(case["x"].shape, generator=gen).to(torch.bfloat16),
           torch.randn(case["initial_states"].shape, generator=gen))

    def run(public):
        leaves = {k: case[k].detach().requires_grad_(train) for k in EAGER_LEAVES if case[k] is not None}
        a = {**case, **leaves}
        with emulated_kernels():
            if public:
                y, fin = mamba_chunk_scan_combined(a["x"], a["dt"], a["A"], a["B"], a["C"], 64, D=a["D"], z=a["z"],
                                                   dt_bias=a["dt_bias"], initial_states=a["initial_states"],
                                                   dt_softplus=True, return_final_states=True)
            else:
                y, fin = eager.scan_combined(a["x"], a["dt"], a["A"], a["B"], a["C"], scan.SUPER_CHUNK, a["D"],
                                             a["z"], a["dt_bias"], a["initial_states"], None, True, 0.0,
                                             float("inf"))
            if train:
                torch.autograd.backward((y, fin), cot)
        return y, fin, leaves

    chunks = []
    real_scan = eager.scan_combined
    monkeypatch.setattr(eager, "scan_combined", lambda *a: chunks.append(a[5]) or real_scan(*a))
    y, fin, leaves = run(True)
    assert chunks == [scan.SUPER_CHUNK]  # the eager path, given the chunk size it runs at
    y1, fin1, leaves1 = run(False)
    assert torch.equal(y, y1) and torch.equal(fin, fin1)
    for name in leaves:
        assert (leaves[name].grad is None) == (not train), name
        if train:
            assert torch.equal(leaves[name].grad, leaves1[name].grad), name
    y_r, fin_r, _, _ = reference_forward(case)
    assert rel_err(y, y_r) <= TOL["y"][torch.bfloat16] and rel_err(fin, fin_r) <= TOL["states"][torch.bfloat16]


def test_eager_path_names_its_steps_in_the_profiler():
    """Under the profiler the direct path runs each launcher inside a record_function of its op's name, so a
    trace shows the same m2ops:: steps as through the custom ops (forward and backward)."""
    from m2ops.ops import eager
    case = make_case(nheads=2, headdim=16, dstate=16, chunk_size=64, seqlen=80, device="cpu", seed=1)
    leaves = {k: case[k].detach().requires_grad_() for k in ("x", "dt", "A", "B", "C")}
    a = {**case, **leaves}
    with torch.profiler.profile() as prof, emulated_kernels():
        y, fin = eager.scan_combined(a["x"], a["dt"], a["A"], a["B"], a["C"], 64, None, None, a["dt_bias"], None,
                                     None, case["dt_softplus"], *map(float, case["dt_limit"]))
        (y.float().sum() + fin.sum()).backward()
    names = {e.name for e in prof.events() if e.name.startswith("m2ops::")}
    assert {"m2ops::chunk_cumsum", "m2ops::chunk_scan", "m2ops::compute_out_bwd", "m2ops::state_passing_bwd",
            "m2ops::chunk_state_bwd", "m2ops::chunk_cumsum_bwd"} <= names, names


def test_eager_path_yields_to_compile_modes_and_subclasses():
    """The direct path serves plain eager calls only: under a dispatch or function mode, a functorch
    transform, or for a tensor subclass, the custom ops must run (they are what those see)."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from m2ops.ops import eager
    x = torch.randn(2, 3)
    assert eager.context_allows((x, None, torch.nn.Parameter(torch.randn(3))))
    assert not eager.applies(True, x, (x,))  # a CPU tensor: the ops (reference) serve it

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Sub(torch.Tensor):
        pass

    with Passthrough():
        assert not eager.context_allows((x,))
    with TorchFunctionMode():
        assert not eager.context_allows((x,))
    with torch.autograd.profiler.profile():  # the direct path names its steps itself (next test)
        assert eager.context_allows((x,))
    assert not eager.context_allows((x, x.as_subclass(Sub)))
    seen = []
    torch.func.vmap(lambda t: seen.append(eager.context_allows((t,))) or t)(x)
    assert seen == [False]
