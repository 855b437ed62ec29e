"""One public call under the profiler's start/stop markers, for Nsight Compute, as a script:

    ncu --clock-control none --profile-from-start off --set full -o OUT/scan \
        python tests/gpu/ncu_scan.py --shape 16K:128 --chunk 256

Warm-up calls (JIT compiles, allocator) run before cudaProfilerStart, so only the timed call's kernels are
profiled. Shape as profile_scan.py: B=1, H=80, P=64, G=1, bf16 x/B/C, fp32 dt, D, initial and final states.
--backward profiles forward and backward together (the gradients of x, dt, A, B, C, D and the initial state, as
backward_scan.py takes them); `-k regex:out_bwd|chunk_state` keeps ncu to the kernels of interest.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_cases import make_case, public_call  # noqa: E402

from m2ops.bench.shapes import parse_sizes  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="16K:128")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--backward", action="store_true", help="profile forward + backward")
    args = ap.parse_args()
    t_s, n_s = args.shape.split(":")
    case = make_case(seqlen=parse_sizes(t_s)[0], nheads=80, headdim=64, ngroups=1, dstate=int(n_s),
                     dtype=torch.bfloat16, D="h", initial_states=True, chunk_size=args.chunk)
    case["dt"] = case["dt"].float()

    def forward():
        return public_call(case, return_final_states=True)

    call = forward
    if args.backward:
        leaves = [case[k].requires_grad_() for k in ("x", "dt", "A", "B", "C", "D", "initial_states")]
        seeds = tuple(torch.randn_like(t) for t in forward())

        def both():
            return torch.autograd.grad(forward(), leaves, seeds)
        call = both
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
