"""The CUDA ops inside graphs: no host synchronisation in the ops, no recompilation across calls of a shape."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_cases import captured, make_case, public_call  # noqa: E402

import m2ops  # noqa: E402
from m2ops.ops import dispatch  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or not dispatch.use_kernels(torch.device("cuda")),
                                 reason="needs a CUDA GPU where the cuTile kernels run")]


def _case(seed):
    return make_case(dtype=torch.bfloat16, chunk_size=64, batch=1, seqlen=333, nheads=8, ngroups=2, headdim=64,
                     dstate=64, D="h", z=True, initial_states=True, cu_seqlens=True, nseqs=3, seed=seed)


def test_ops_never_synchronise_the_host(monkeypatch):
    """Every op of a full call (seq_idx, cu_seqlens, varlen states) runs without a device-to-host wait; the
    eager value checks of seq_idx/cu_seqlens are the only ones that read tensors, and they are off here."""
    monkeypatch.setenv("M2OPS_CHECK_VALUES", "0")
    case = _case(0)
    public_call(case, return_varlen_states=True)  # compiles the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        public_call(case, return_varlen_states=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_compiled_call_does_not_recompile_for_new_data():
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")

    @torch.compile(backend=counter, fullgraph=True)
    def f(case):
        return m2ops.mamba_chunk_scan_combined(**case, return_final_states=True, return_varlen_states=True)

    outs = [f(_case(seed)) for seed in range(3)]
    torch.cuda.synchronize()
    assert counter.frame_count == 1
    expected = public_call(_case(2), return_varlen_states=True)
    for a, b in zip(outs[-1], expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch._dynamo.reset()


def test_long_sequences_at_chunk_128_run_on_chunks_of_256(monkeypatch):
    """From config.current().super_chunk_min_seqlen tokens a call at chunk 128 runs at 256 from chunk_cumsum on
    (ops.dispatch.kernel_chunk_size), on every path: eager, torch.compile (fullgraph), a CUDA graph's replay
    and training give the bits of the same call at chunk 256, and y stays within tolerance of the reference at
    128."""
    from gpu_cases import TOL, reference_forward, rel_err
    from m2ops.kernels import config
    monkeypatch.setenv("M2OPS_AUTOTUNE", "0")
    T = config.current().super_chunk_min_seqlen
    case = make_case(dtype=torch.bfloat16, chunk_size=128, seqlen=T, nheads=8, ngroups=2, headdim=64, dstate=64,
                     D="h", z=True, initial_states=True, seed=4)
    at256 = {**case, "chunk_size": 256}
    assert dispatch.kernel_chunk_size(128, T, case["x"].device) == 256
    want = public_call(at256)
    for got in (public_call(case), public_call(case)):  # (the second through the remembered plan)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    torch._dynamo.reset()
    compiled = torch.compile(lambda c: m2ops.mamba_chunk_scan_combined(**c, return_final_states=True),
                             fullgraph=True)
    for a, b in zip(compiled(case), want):
        assert torch.equal(a, b)
    torch._dynamo.reset()
    graph, out = captured(lambda: public_call(case))
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(out, want):
        assert torch.equal(a, b)

    def grads(c):
        leaves = {k: c[k].detach().requires_grad_() for k in ("x", "dt", "A", "B", "C", "D", "z", "initial_states")}
        y, fin = public_call({**c, **leaves})
        gen = torch.Generator(device="cuda").manual_seed(0)
        (y.float() * torch.randn(y.shape, device="cuda", generator=gen)).sum().add(fin.sum()).backward()
        return {k: v.grad for k, v in leaves.items()}
    g128, g256 = grads(case), grads(at256)
    for k in g128:
        assert torch.equal(g128[k], g256[k]), k
    y_r, fin_r, _, _ = reference_forward({**case, "x": case["x"].float(), "B": case["B"].float(),
                                          "C": case["C"].float(), "z": case["z"].float()})
    assert rel_err(want[0], y_r) <= TOL["y"][torch.bfloat16]
    assert rel_err(want[1], fin_r) <= TOL["states"][torch.bfloat16]


def test_kept_scratch_under_streams_threads_and_graphs(monkeypatch):
    """The planned path keeps each call's scratch for the next call on the same stream and thread
    (planned.planned_scratch). Calls issued back to back without a sync, on two streams at once, from two threads
    on one stream, and eager calls between replays of a graph captured after scratch was kept, all give the bits
    of the same calls made one at a time with nothing kept."""
    import threading

    from m2ops.kernels import planned, runtime
    monkeypatch.setenv("M2OPS_AUTOTUNE", "0")
    cases = [make_case(dtype=torch.bfloat16, chunk_size=256, seqlen=1024, nheads=8, headdim=64, dstate=64, D="h",
                       z=True, initial_states=True, dt_bias=True, seed=s) for s in range(4)]
    with torch.no_grad():
        monkeypatch.setattr(planned, "SCRATCH_KEEP_BYTES", 0)
        runtime.clear_plans()
        want = []
        for c in cases:
            want.append(public_call(c))
            torch.cuda.synchronize()
        monkeypatch.setattr(planned, "SCRATCH_KEEP_BYTES", 64 << 20)
        runtime.clear_plans()

        def same(got, k):
            for a, b in zip(got, want[k]):
                assert torch.equal(a, b), k

        outs = [public_call(cases[k % 4]) for k in range(12)]  # back to back on one stream
        assert planned.kept_scratch_bytes() > 0
        torch.cuda.synchronize()
        for k, o in enumerate(outs):
            same(o, k % 4)
        streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
        got = {0: [], 1: []}
        for k in range(6):
            for i, s in enumerate(streams):
                with torch.cuda.stream(s):
                    got[i].append(public_call(cases[i]))
        torch.cuda.synchronize()
        for i in (0, 1):
            for o in got[i]:
                same(o, i)
        results, errors = {2: [], 3: []}, []

        def worker(i):
            try:
                for _ in range(6):
                    results[i].append(public_call(cases[i]))
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
        threads = [threading.Thread(target=worker, args=(i,)) for i in (2, 3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        torch.cuda.synchronize()
        assert not errors
        for i in (2, 3):
            for o in results[i]:
                same(o, i)
        # A graph captured on a stream whose eager calls keep scratch, replayed on another stream while eager calls
        # continue on the first: the graph must own its scratch.
        s = streams[0]
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            public_call(cases[0])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            out = public_call(cases[0])
        torch.cuda.synchronize()
        eager = []
        for _ in range(6):
            graph.replay()  # on the current stream
            with torch.cuda.stream(s):
                eager.append(public_call(cases[1]))
        torch.cuda.synchronize()
        same(out, 0)
        for o in eager:
            same(o, 1)
