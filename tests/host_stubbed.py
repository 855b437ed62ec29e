"""The host's cost of one public forward call with the kernel launches stubbed out, on the CPU, as a script:

    python tests/host_stubbed.py [--seqlen 64] [--dstate 64] [--profile]

The public function takes its CUDA path (m2ops/ops/eager.py) on CPU tensors of the benchmark's other sizes
(B=1, H=80, P=64, G=1, bf16 x/B/C, float32 dt, D and initial states, chunk 256), with every launch replaced by a
no-op. What remains is m2ops's own Python, PyTorch's tensor creation and autograd: the part of the host time
(tests/gpu/host_scan.py) that does not depend on the GPU or on cuTile's launch. A short seqlen keeps the CPU's
allocations small. Each line gives microseconds per call; --profile adds cProfile's table by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import m2ops
from m2ops.kernels import launch
from m2ops.ops import eager


def _us(fn, n=2000):
    for _ in range(20):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=64)
    ap.add_argument("--dstate", type=int, default=64)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    launch._launch = lambda grid, kernel, kargs, *_: None
    launch._sm_count = lambda device: 132  # an H200's
    eager.applies = lambda *t: eager.context_allows(t)  # the CUDA path on CPU tensors
    T, N, b, h, p, L = args.seqlen, args.dstate, 1, 80, 64, 256
    x = torch.randn(b, T, h, p, dtype=torch.bfloat16)
    B = torch.randn(b, T, 1, N, dtype=torch.bfloat16)
    C = torch.randn_like(B)
    dt, A, D, init = torch.rand(b, T, h), -torch.rand(h), torch.rand(h), torch.randn(b, h, p, N)
    dt_out, cs = launch.chunk_cumsum(dt, A, None, L, True, 0.0, float("inf"))
    states, _, _ = launch.fwd_pass_state(x, B, dt_out, cs, init, None, None, entering_dtype=torch.bfloat16)
    rows = {
        "public call": lambda: m2ops.mamba_chunk_scan_combined(x, dt, A, B, C, L, D=D, initial_states=init,
                                                               return_final_states=True),
        "chunk_cumsum": lambda: launch.chunk_cumsum(dt, A, None, L, True, 0.0, float("inf")),
        "chunk_scan": lambda: launch.chunk_scan(x, dt_out, cs, B, C, init, D, None, None, keep_states=True),
        "  fwd_pass_state": lambda: launch.fwd_pass_state(x, B, dt_out, cs, init, None, None,
                                                          entering_dtype=torch.bfloat16),
        "  compute_out": lambda: launch.compute_out(x, dt_out, cs, C, B, states, D, None, None),
        "  chunk_scan_configs": lambda: launch.chunk_scan_configs(b, T, h, p, N, L, x.device),
    }
    for name, fn in rows.items():
        print(f"{name:24s} {_us(fn, 500 if name == 'public call' else 2000):8.1f} us")
    if args.profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            rows["public call"]()
        pr.disable()
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue())


if __name__ == "__main__":
    main()
