"""torch.compile (inductor, CPU) of code calling the public function: no graph break, eager's results and
gradients, one compilation for many sequence lengths."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

from conftest import Dims, make_inputs
from m2ops import mamba_chunk_scan_combined

pytestmark = pytest.mark.usefixtures("reset_dynamo")

TENSOR_ARGS = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states", "seq_idx", "cu_seqlens")


def make_fn(chunk_size, **flags):
    """A function of positional tensors (None where absent) that calls the public function."""
    def fn(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens):
        return mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                                         initial_states=initial_states, seq_idx=seq_idx, cu_seqlens=cu_seqlens,
                                         **flags)
    return fn


def args_of(inputs):
    return [inputs[k] for k in TENSOR_ARGS]


def as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


CASES = {
    "plain": (Dims(2, 37, 4, 8, 2, 16), dict(), dict()),
    "all_options": (Dims(2, 45, 4, 4, 2, 8),
                    dict(D="hp", z=True, dt_bias=True, initial_states=True, seq_idx=True, dt_softplus=True),
                    dict(dt_softplus=True, dt_limit=(0.05, 0.9), return_final_states=True)),
    "varlen": (Dims(1, 50, 4, 4, 2, 8), dict(D="h", cu_seqlens=True, nseqs=4, initial_states=True),
               dict(return_final_states=True, return_varlen_states=True)),
}


@pytest.mark.parametrize("case", CASES)
def test_fullgraph_matches_eager(case):
    dims, opts, flags = CASES[case]
    inputs = make_inputs(dims, dtype=torch.float32, seed=1, **opts)
    fn = make_fn(16, **flags)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    got = as_tuple(compiled(*args_of(inputs)))
    want = as_tuple(fn(*args_of(inputs)))
    assert counter.frame_count == 1
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_no_graph_break_reported():
    """torch._dynamo.explain: one graph, no break (the check fullgraph=True makes, with the reasons shown)."""
    dims, opts, flags = CASES["all_options"]
    inputs = make_inputs(dims, dtype=torch.float32, seed=2, **opts)
    explanation = torch._dynamo.explain(make_fn(16, **flags))(*args_of(inputs))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("case", ["all_options", "varlen"])
def test_backward_matches_eager(case):
    dims, opts, flags = CASES[case]
    inputs = make_inputs(dims, dtype=torch.float32, seed=3, **opts)
    fn = make_fn(16, **flags)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    leaves = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}

    def grads(f):
        fresh = {k: (v.detach().clone().requires_grad_(True) if k in leaves else v) for k, v in inputs.items()}
        outs = as_tuple(f(*args_of(fresh)))
        gen = torch.Generator().manual_seed(0)
        loss = sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() for o in outs)
        loss.backward()
        return {k: fresh[k].grad for k in leaves}

    want, got = grads(fn), grads(compiled)
    assert counter.frame_count == 1
    for k in leaves:
        assert got[k] is not None, k
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")


# Sequence lengths of two chunks and more: a single chunk is specialised (size-1 dimensions are guarded),
# which would compile once more.
SEQLENS = [40, 77, 64, 130, 33]


def _dynamic_inputs(seqlen, seed):
    return make_inputs(Dims(2, seqlen, 4, 4, 2, 8), dtype=torch.float32, seed=seed, D="h", z=True, dt_bias=True,
                       seq_idx=True, initial_states=True, dt_softplus=True)


def test_mark_dynamic_seqlen_compiles_once():
    fn = make_fn(16, dt_softplus=True, return_final_states=True)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    for i, seqlen in enumerate(SEQLENS):
        inputs = _dynamic_inputs(seqlen, i)
        for k in ("x", "dt", "B", "C", "z", "seq_idx"):
            torch._dynamo.mark_dynamic(inputs[k], 1)
        got, want = compiled(*args_of(inputs)), fn(*args_of(inputs))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    assert counter.frame_count == 1


def test_dynamic_true_no_recompile():
    """dynamic=True: after the first call, other sequence lengths reuse the graph. (The first compilation may
    trace twice: dynamo makes the float defaults of dt_limit symbolic, then restarts specialising them, since
    the ops take plain floats; each trace reaches the backend.)"""
    fn = make_fn(16, dt_softplus=True, return_final_states=True)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    after_first = None
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i, seqlen in enumerate(SEQLENS):
            inputs = _dynamic_inputs(seqlen, 10 + i)
            got, want = compiled(*args_of(inputs)), fn(*args_of(inputs))
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
            if after_first is None:
                after_first = counter.frame_count
    assert 1 <= after_first <= 2
    assert counter.frame_count == after_first


class _Scan(torch.nn.Module):
    """A layer-like module: A, D and dt_bias are parameters (dynamo keeps their shapes static)."""

    def __init__(self, nheads, headdim, chunk_size):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.A_log = torch.nn.Parameter(torch.rand(nheads, generator=g))
        self.D = torch.nn.Parameter(torch.randn(nheads, headdim, generator=g))
        self.dt_bias = torch.nn.Parameter(torch.randn(nheads, generator=g))
        self.chunk_size = chunk_size

    def forward(self, x, dt, B, C):
        return mamba_chunk_scan_combined(x, dt, -torch.exp(self.A_log), B, C, self.chunk_size, D=self.D,
                                         dt_bias=self.dt_bias, dt_softplus=True)


def test_module_with_parameters_dynamic():
    """Static parameter shapes against a dynamic seqlen: the shape checks hold symbolically (no false error,
    no graph break), results and parameter gradients equal eager's."""
    module = _Scan(4, 4, 16)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(module, backend=counter, fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i, seqlen in enumerate([40, 77]):
            inp = make_inputs(Dims(2, seqlen, 4, 4, 2, 8), dtype=torch.float32, seed=20 + i)
            args = (inp["x"], inp["dt"], inp["B"], inp["C"])
            got = compiled(*args)
            g_got = torch.autograd.grad(got.sum(), list(module.parameters()))
            want = module(*args)
            g_want = torch.autograd.grad(want.sum(), list(module.parameters()))
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            for a, w in zip(g_got, g_want):
                torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-5)
    assert counter.frame_count >= 1


def test_kernel_chunk_size_is_a_trace_constant():
    """The public function's choice of the chunk size the kernels run at (ops.dispatch.kernel_chunk_size) traces
    in fullgraph mode with a symbolic sequence length: whether the kernels serve the device is a constant of the
    trace, and for a chunk size of 128 the sequence length is guarded on. (On this machine the kernels serve no
    CUDA device, so the answer is the caller's chunk size either way.)"""
    import warnings

    from m2ops.ops import dispatch

    def fn(x):
        return x * dispatch.kernel_chunk_size(128, x.shape[1], torch.device("cuda", 0))

    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (use_kernels says once why the reference runs)
        for T in (40, 77, 130):
            x = torch.ones(1, T)
            torch.testing.assert_close(compiled(x), fn(x))
    assert counter.frame_count == 1


def test_constant_mark_matches_torch():
    """ops.dispatch marks _kernels_serve constant for dynamo by hand (the decorator would import torch._dynamo at
    m2ops's import): the mark must be the one torch.compiler.assume_constant_result sets, and set."""
    from m2ops.ops import dispatch

    def probe():
        return True
    marked = torch.compiler.assume_constant_result(probe)
    assert marked is probe and probe.__dict__ == {"_dynamo_marked_constant": True}
    assert dispatch._kernels_serve._dynamo_marked_constant is True


def test_import_does_not_load_dynamo():
    """`import m2ops` stays cheap: torch._dynamo (about 2 s on the CPU) is not imported by it."""
    import subprocess
    import sys
    code = "import sys, torch; before = 'torch._dynamo' in sys.modules; import m2ops; " \
           "print(before, 'torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
