"""One public call under the profiler's start/stop markers, for Nsight Compute, as a script:

    ncu --clock-control none --profile-from-start off --set full -o OUT/scan \
        python tests/gpu/ncu_scan.py --shape 16K:128 --chunk 256

Warm-up calls (JIT compiles, allocator) run before cudaProfilerStart, so only the timed call's kernels are
profiled. Shape as profile_scan.py: B=1, H=80, P=64, G=1, bf16 x/B/C, fp32 dt, D, initial and final states.
--backward profiles forward and backward together (the gradients of x, dt, A, B, C, D and the initial state, as
backward_scan.py takes them); `-k regex:out_bwd|chunk_state` keeps ncu to the kernels of interest.
--peer profiles one of the benchmark's peers instead, on the benchmark's inputs (m2ops.bench.peers: e.g.
`--peer tilegym-tuned -k regex:compute_out` for TileGym's output kernel after its own search, which the warm-up
calls run before profiling starts).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_cases import forward_and_backward, scan_case  # noqa: E402

from m2ops.bench.shapes import parse_sizes  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="16K:128")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--backward", action="store_true", help="profile forward + backward")
    ap.add_argument("--peer", default=None, help="a peer of m2ops.bench (e.g. tilegym-tuned, mamba_ssm-c256)")
    args = ap.parse_args()
    t_s, n_s = args.shape.split(":")
    seqlen, dstate = parse_sizes(t_s)[0], int(n_s)
    if args.peer:
        from m2ops.bench import peers
        from m2ops.bench.shapes import Shape
        call = peers.build(args.peer, peers.make_inputs(Shape(seqlen, dstate), "cuda"), args.chunk, args.backward)
    else:
        forward, both = forward_and_backward(scan_case(seqlen, dstate, args.chunk))
        call = both if args.backward else forward
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
