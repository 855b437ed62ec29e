"""The CUDA ops inside graphs: no host synchronisation in the ops, no recompilation across calls of a shape."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_cases import make_case, public_call  # noqa: E402

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
